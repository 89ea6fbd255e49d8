"""The native rollout at tensor-parallel size 1 vs k on the same ranks: hand-over time and decode tokens/s.

`WORLD` gloo ranks (one intra-op thread each) form WORLD / TP rollout replicas of TP ranks each. Every rank hosts an
FSDP2 engine sharded over all ranks (the actor, as in the hybrid-engine worker) and a native rollout; the hand-over
is `rollout.update_weights(engine.named_full_params())` (each parameter gathered to its full tensor, collective,
then copied whole at TP=1 or sliced to this rank's block at TP>1), timed as the median of 3 after a warm-up, beside
the gather alone (the same iteration without the rollout). Generation: PROMPTS chat prompts split over the
replicas, TOKENS new tokens each at temperature 1.0 with eos ignored, so every layout does the same work; tok/s is
PROMPTS x TOKENS over the slowest rank's wall time. `--check` first compares greedy tokens of 4 prompts x 24 tokens
with a single-process TP=1 rollout on rank 0 (token for token).

    python benchmarks/rollout_tensor_parallel.py --model tiny --tp 1 2
    python benchmarks/rollout_tensor_parallel.py --model smollm2-135m-instruct --tp 1 2 --workload 16x64
    python benchmarks/rollout_tensor_parallel.py --model smollm2-135m-instruct --world 3 --tp 3 --check --workload 6x16

One JSON line per layout on stdout; the 1-minute load average is in each line (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout import NoEosTokenizer, build_prompts  # noqa: E402
from hybridflow.engines.rollout import NativeRollout, SamplingParams  # noqa: E402
from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine  # noqa: E402
from hybridflow.models import build_causal_lm, load_tokenizer, resolve_model_path  # noqa: E402
from hybridflow.utils.host import write_results  # noqa: E402
from tests.engines.helpers import run_distributed  # noqa: E402


def _tiny_model_dir() -> str:
    from hybridflow.models import save_tiny_model

    return str(save_tiny_model(Path(tempfile.mkdtemp()) / "tiny", num_layers=2, hidden=64, seed=0))


def _check_greedy(rank: int, model_dir: str, tokenizer, tp_mesh) -> bool | None:
    params = SamplingParams(max_new_tokens=24, do_sample=False)
    prompts = build_prompts(tokenizer, 4)
    out = NativeRollout(model_dir, tokenizer, params, tp_mesh=tp_mesh).generate_sequences(prompts)
    if rank != 0:
        return None
    expected = NativeRollout(build_causal_lm(model_dir), tokenizer, params).generate_sequences(prompts)
    return bool(torch.equal(out.batch["responses"], expected.batch["responses"]))


def _layout(rank: int, world: int, model_dir: str, tp: int, num_prompts: int, num_tokens: int, check: bool,
            records_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // tp
    tp_mesh = None
    if tp > 1:
        tp_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("rollout_dp", "rollout_tp"))["rollout_tp"]
    tokenizer = load_tokenizer(model_dir)
    record = {"world": world, "tp": tp, "dp": dp, "threads_per_rank": torch.get_num_threads()}
    if check:
        record["greedy_equals_tp1"] = _check_greedy(rank, model_dir, tokenizer, tp_mesh)

    engine = build_fsdp_engine(model_dir, FSDPEngineConfig(micro_batch_size_per_gpu=1))
    params = SamplingParams(temperature=1.0, max_new_tokens=num_tokens)
    rollout = NativeRollout(model_dir, NoEosTokenizer(tokenizer), params, tp_mesh=tp_mesh)
    record["rollout_param_mb_per_rank"] = sum(p.numel() * p.element_size() for p in rollout.model.parameters()) / 2**20

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def gather_only() -> None:
        for _ in engine.named_full_params():
            pass

    rollout.update_weights(engine.named_full_params())  # warm-up
    record["handover_s"] = statistics.median(timed(lambda: rollout.update_weights(engine.named_full_params())) for _ in range(3))
    record["gather_only_s"] = statistics.median(timed(gather_only) for _ in range(3))

    prompts = build_prompts(tokenizer, num_prompts)
    replica = rank // tp
    share = prompts[replica * num_prompts // dp : (replica + 1) * num_prompts // dp]
    warm_up = share[:1]
    warm_up.meta_info = {"max_new_tokens": 2}  # kernels packed, cache allocated
    rollout.generate_sequences(warm_up)
    torch.manual_seed(replica)
    wall = timed(lambda: rollout.generate_sequences(share))
    record.update(workload=f"{num_prompts}x{num_tokens}", generate_s=wall, tok_per_s=num_prompts * num_tokens / wall,
                  load=os.getloadavg()[0])
    if rank == 0:
        print(json.dumps(record), flush=True)
        with open(records_file, "a") as records:
            records.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' or a catalogue name / model directory")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workload", default="16x64", help="PROMPTSxTOKENS")
    parser.add_argument("--check", action="store_true", help="greedy tokens vs a single-process TP=1 rollout")
    args = parser.parse_args()
    model_dir = _tiny_model_dir() if args.model == "tiny" else resolve_model_path(args.model)
    num_prompts, num_tokens = (int(x) for x in args.workload.split("x"))
    load_before = list(os.getloadavg())
    records_file = Path(tempfile.mkdtemp()) / "records.jsonl"
    for tp in args.tp:
        run_distributed(_layout, args.world, model_dir, tp, num_prompts, num_tokens, args.check, str(records_file))
    rows = [json.loads(line) for line in records_file.read_text().splitlines()]
    print(f"raw results: {write_results('rollout_tensor_parallel', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
