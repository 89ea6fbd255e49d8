"""Peak memory and time of the vocabulary projection: the plain head against the fused, chunked one.

On SmolLM2-135M-Instruct (vocabulary 49,152, fp32, packed rows) one micro-batch of `--rows` sequences of
`--prompt-len` + `--response-len` tokens goes through:
- a log-prob pass (no grad, log-probs and entropy), as the old-log-prob and reference passes run;
- `--repeats` update micro-batches (forward with log-probs and entropy, backward of a loss that uses both), as
  the actor update runs, after one warm-up that allocates the gradients.

Each mode runs in a fresh process, and the modes alternate round by round (`--rounds`), so that a noisy machine
hurts them alike. Peak memory is the process's peak resident set (VmHWM, reset before each phase through
/proc/self/clear_refs), shown as its rise over the resident set just before the phase. Times are medians. MFU
divides the model FLOPs (`hybridflow.utils.flops`) by this CPU's measured matmul peak (`hybridflow doctor`).

    python benchmarks/vocab_projection.py --modes plain,512,1024,2048 --rounds 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_smollm2 import make_batch, timed  # noqa: E402

from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine  # noqa: E402
from hybridflow.models import load_tokenizer, resolve_model_path  # noqa: E402
from hybridflow.models.config import FusedKernelOptions, ModelConfig  # noqa: E402
from hybridflow.utils.flops import compute_mfu, compute_model_flops, model_flops_shape, sequence_attention_pairs  # noqa: E402
from hybridflow.utils.peak_flops import cpu_peak_flops  # noqa: E402


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _measure_phase(fn):
    """(seconds, peak RSS rise over the RSS before, GiB) of `fn()`."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    seconds, _ = timed(fn)
    return seconds, (_status_kib("VmHWM") - before) / 2**20


def loss_fn(outputs, data):
    mask = data["response_mask"].float()
    return (-(outputs["log_probs"] * mask).sum() - 0.001 * (outputs["entropy"] * mask).sum()) / mask.sum()


def worker(args: argparse.Namespace) -> dict:
    """One mode in this process: build the engine, time and measure the phases."""
    torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    fused = args.worker != "plain"
    model = ModelConfig(use_remove_padding=True, use_fused_kernels=fused,
                        fused_kernel_options=FusedKernelOptions(chunk_size=int(args.worker) if fused else 1024))
    config = FSDPEngineConfig(model=model, micro_batch_size_per_gpu=args.rows, fsdp=FSDPConfig(dtype="float32"),
                              optim=OptimConfig(lr=1e-6))
    engine = build_fsdp_engine(path, config)
    seq_len = args.prompt_len + args.response_len
    batch = make_batch(len(load_tokenizer(path)), args.rows, seq_len, args.response_len)
    data = {key: value for key, value in batch.batch.items()}
    result = {"mode": args.worker, "rss_model_gib": _status_kib("VmRSS") / 2**20}
    engine.compute_log_prob(batch, calculate_entropy=True)  # warm-up: thread pool, allocator
    logprob = [_measure_phase(lambda: engine.compute_log_prob(batch, calculate_entropy=True))
               for _ in range(args.repeats)]
    engine.module.train()

    def update():
        engine.optimizer.zero_grad(set_to_none=False)
        loss_fn(engine.forward_micro_batch(data, calculate_entropy=True), data).backward()

    update()  # warm-up: allocates the gradients
    updates = [_measure_phase(update) for _ in range(args.repeats)]
    shape = model_flops_shape(engine.module)
    num_tokens, projected = seq_len * args.rows, args.rows * args.response_len
    pairs = sequence_attention_pairs([seq_len] * args.rows)
    result.update(
        logprob_s=statistics.median(s for s, _ in logprob), logprob_peak_gib=max(m for _, m in logprob),
        update_s=statistics.median(s for s, _ in updates), update_peak_gib=max(m for _, m in updates),
        logprob_flops=compute_model_flops(shape, num_tokens, pairs, projected, backward=False),
        update_flops=compute_model_flops(shape, num_tokens, pairs, projected, backward=True),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--modes", default="plain,1024", help="plain and/or chunk sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes of each phase per process")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    load_before = list(os.getloadavg())
    peak = cpu_peak_flops(args.threads)
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    loads = [os.getloadavg()[0]]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for _ in range(args.rounds):
        for mode in modes:
            command = [sys.executable, __file__, "--worker", mode] + [
                f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                if key not in ("worker", "modes", "rounds") and value is not None
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])

    print(f"SmolLM2-135M fp32, packed, {args.rows} x ({args.prompt_len} prompt + {args.response_len} response) "
          f"tokens, {args.threads} threads, {args.rounds} rounds; started {started}; load (1 min) "
          f"{min(loads):.1f}-{max(loads):.1f}; matmul peak {peak / 1e9:.0f} GFLOP/s")
    print("| head | log-prob pass s | its peak RSS rise GiB | update micro-batch s | its peak RSS rise GiB | "
          "update MFU | update vs plain |")
    print("|---|---|---|---|---|---|---|")
    plain_update = statistics.median(r["update_s"] for r in runs[modes[0]])
    for mode in modes:
        rows = runs[mode]
        logprob_s = statistics.median(r["logprob_s"] for r in rows)
        update_s = statistics.median(r["update_s"] for r in rows)
        name = "plain (all positions at once)" if mode == "plain" else f"fused, chunks of {mode} rows"
        print(f"| {name} | {logprob_s:.2f} | {max(r['logprob_peak_gib'] for r in rows):.2f} | {update_s:.2f} | "
              f"{max(r['update_peak_gib'] for r in rows):.2f} | "
              f"{compute_mfu(rows[0]['update_flops'], update_s, peak):.0%} | {plain_update / update_s:.2f}x |")
    from hybridflow.utils.host import write_results

    raw = [{"mode": mode, **run} for mode, mode_runs in runs.items() for run in mode_runs]
    print(f"raw results: {write_results('vocab_projection', {**vars(args), 'peak_flops': peak}, raw, load_before)}")


if __name__ == "__main__":
    main()
