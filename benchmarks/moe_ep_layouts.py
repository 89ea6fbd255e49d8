"""Time one MoE training step on this CPU in three layouts of the 2 cores, and count the expert-parallel all-to-alls,
for `benchmarks/moe_cost_model.py --measured` to check its terms against.

Layouts: `1 worker` (1 process, 2 torch threads), `2 workers, FSDP` (FSDP2 over 2 processes, every rank holds all
experts, 1 thread each) and `2 workers, EP=2` (each rank holds half the experts of every layer, tokens reach them
by all-to-all; FSDP2 over the rest). Every layout runs the same global work: ROWS rows of SEQ_LEN tokens (the last
half is the response), packed, `--micro-rows` rows per micro-batch, fp32, on a small Qwen3-MoE built here
(`--hidden`, also each expert's width, `--layers`, `--experts`, `--top-k`; the tiny local tokenizer's vocabulary,
so that the layers hold the FLOPs). A step is `engine.train_batch` (forward, backward, AdamW), timed `--repeats`
times after a warm-up as the slowest rank's wall time; the median is kept. The forward all-to-alls are counted
and their bytes summed by wrapping the function transformers' EP dispatch calls (the backward runs as many again).

    python benchmarks/moe_ep_layouts.py     # ~1 minute; raw results: benchmarks/results/moe_ep_layouts_<UTC>.json
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
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's test launcher

from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine  # noqa: E402
from hybridflow.models import build_local_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.models.moe import save_tiny_moe_model
from hybridflow.protocol import DataProto
from hybridflow.utils.host import write_results
from tests.engines.helpers import run_distributed  # noqa: E402

LAYOUTS = {"1 worker": (1, 1), "2 workers, FSDP": (2, 1), "2 workers, EP=2": (2, 2)}  # processes, ep


def make_rows(vocab: int, rows: int, seq_len: int, seed: int = 0) -> DataProto:
    """`rows` full rows of random tokens; the last half of each is the response."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (rows, seq_len), generator=generator)
    response = seq_len // 2
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(seq_len).expand(rows, -1).contiguous(),
        "responses": input_ids[:, -response:], "response_mask": torch.ones(rows, response, dtype=torch.long),
    })


def nll(outputs: dict[str, torch.Tensor], micro_batch: DataProto):
    mask = micro_batch.batch["response_mask"].float()
    loss = -(outputs["log_probs"] * mask).sum() / mask.sum()
    return loss, {}


class AllToAllCounter:
    """Counts the EP dispatch's forward all-to-alls and the bytes each sends (its input)."""

    def __init__(self) -> None:
        import transformers.distributed.expert_parallel as ep_module

        self.calls, self.bytes = 0, 0
        original = ep_module.all_to_all_single_autograd

        def counted(tensor, *args, **kwargs):
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        ep_module.all_to_all_single_autograd = counted


def _rank(rank: int, world: int, ep: int, model_dir: str, args: argparse.Namespace, out: str) -> None:
    """One rank's timed steps; with world > 1 inside `run_distributed`'s gloo group."""
    torch.set_num_threads(2 // world)
    counter = AllToAllCounter() if ep > 1 else None
    config = FSDPEngineConfig(
        micro_batch_size_per_gpu=args.micro_rows, optim=OptimConfig(lr=1e-5),
        fsdp=FSDPConfig(expert_parallel_size=ep), model=ModelConfig(use_remove_padding=True),
    )
    engine = build_fsdp_engine(model_dir, config)
    batch = make_rows(args.vocab, args.rows, args.seq_len)
    local = batch.chunk(world)[rank] if world > 1 else batch
    engine.train_batch(local, nll)  # warm-up
    times = []
    for _ in range(args.repeats):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        engine.train_batch(local, nll)
        elapsed = torch.tensor([time.perf_counter() - start])
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    if rank == 0:
        calls = counter.calls // (args.repeats + 1) if counter else 0
        sent = counter.bytes / (args.repeats + 1) if counter else 0
        Path(out).write_text(json.dumps({
            "step_s": statistics.median(times), "times": times, "all_to_all_calls": calls,
            "all_to_all_bytes": sent * (ep - 1) / ep if ep > 1 else 0,  # what leaves the rank
        }))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    tokenizer = build_local_tokenizer()
    args.vocab = len(tokenizer)
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = str(save_tiny_moe_model(
            Path(workdir) / "moe", "qwen3_moe", tokenizer=tokenizer, num_layers=args.layers, hidden=args.hidden,
            num_experts=args.experts, top_k=args.top_k,
        ))
        config = json.loads((Path(model_dir) / "config.json").read_text())
        runs = []
        for name, (processes, ep) in LAYOUTS.items():
            out = str(Path(workdir) / "run.json")
            if processes == 1:  # a process of its own without a process group: the engine runs unsharded
                mp.spawn(_rank, args=(1, ep, model_dir, args, out), nprocs=1, join=True)
            else:
                run_distributed(_rank, processes, ep, model_dir, args, out)
            result = json.loads(Path(out).read_text())
            micro_batches = args.rows // processes // args.micro_rows
            runs.append({"name": name, "ep": ep, "tokens": args.rows * args.seq_len, "seq_len": args.seq_len,
                         "response_tokens": args.rows * (args.seq_len // 2), "micro_batches": micro_batches,
                         "micro_tokens": args.micro_rows * args.seq_len, **result})
            print(f"{name}: {result['step_s']:.2f} s/step, all-to-alls {result['all_to_all_calls']} "
                  f"({result['all_to_all_bytes'] / 1e6:.2f} MB sent)", flush=True)
    model = {"hidden": args.hidden, "layers": args.layers, "heads": config["num_attention_heads"],
             "kv_heads": config["num_key_value_heads"], "head_dim": config["head_dim"], "experts": args.experts,
             "top_k": args.top_k, "moe_intermediate": config["moe_intermediate_size"], "vocab": args.vocab}
    path = write_results("moe_ep_layouts", {**vars(args), "model": model}, runs, load_before)
    print(f"raw results: {path}")

if __name__ == "__main__":
    main()
