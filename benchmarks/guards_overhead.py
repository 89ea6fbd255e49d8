"""What the guards (issue 31) cost per training step, part by part, on this machine.

- the driver's checks after each step (alarms, group metrics, memory reports): `timing_s/guards` against
  `timing_s/step`, read from a finished run's metrics (`--run`, a run directory or its metrics.jsonl);
- the within-step memory watchdog: one poll of `--pids` processes' resident memory, timed here, as a share of one
  core at `trainer.guards.memory.poll_interval_s` (0.5 s);
- the weight-delivery fingerprints: the sums of the 8 sampled tensors of `--model`, one side of a hand-over (the
  sender and the rollout each compute them once per hand-over).

    python benchmarks/guards_overhead.py --run outputs/demo/run      # after `make demo` (or demo-moe)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from hybridflow.models import build_causal_lm, resolve_model_path
from hybridflow.trainer.plot import metrics_by_step
from hybridflow.utils.host import write_results
from hybridflow.utils.memory_watchdog import MemoryWatchdog
from hybridflow.engines.rollout.base import tensor_sum
from hybridflow.workers.weight_check import pick_sample


def time_watchdog_poll(num_pids: int, repeats: int = 2000) -> float:
    """Seconds of one watchdog poll over `num_pids` live processes (this one and its parent, repeated)."""
    pids = [os.getpid(), os.getppid()] * max(1, num_pids // 2)
    watchdog = MemoryWatchdog(1e15, pids[:num_pids], 0.5)
    start = time.perf_counter()
    for _ in range(repeats):
        watchdog.check_once()
    return (time.perf_counter() - start) / repeats


def time_fingerprints(model_name: str, repeats: int = 5) -> tuple[float, list[str]]:
    """Seconds to fingerprint the sampled tensors of `model_name` once (float32), and their names."""
    params = dict(build_causal_lm(resolve_model_path(model_name), dtype="float32").named_parameters())
    names = pick_sample(sorted(params))
    start = time.perf_counter()
    for _ in range(repeats):
        [tensor_sum(params[name], torch.float32) for name in names]
    return (time.perf_counter() - start) / repeats, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", required=True, help="a finished run's directory (or its metrics.jsonl)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--pids", type=int, default=2, help="worker processes on the node the watchdog sums")
    parser.add_argument("--poll-interval-s", type=float, default=0.5)
    args = parser.parse_args()
    load_before = list(os.getloadavg())
    run = Path(args.run)
    steps = metrics_by_step(run.parent if run.suffix == ".jsonl" else run)
    rows = [{"step": step, "guards_s": record["timing_s/guards"], "step_s": record["timing_s/step"]}
            for step, record in sorted(steps.items()) if "timing_s/guards" in record and "timing_s/step" in record]
    if not rows:
        raise SystemExit(f"{args.run} has no step with timing_s/guards and timing_s/step")
    poll_s = time_watchdog_poll(args.pids)
    fingerprint_s, names = time_fingerprints(args.model)
    step_s = statistics.median(row["step_s"] for row in rows)
    checks = statistics.median(row["guards_s"] / row["step_s"] for row in rows)
    print(f"run {args.run}: {len(rows)} steps, median step {step_s:.1f} s")
    print("| guard part | cost | share of the median step |")
    print("|---|---|---|")
    print(f"| driver checks after each step | {statistics.median(r['guards_s'] for r in rows) * 1e3:.1f} ms | "
          f"{checks:.4%} |")
    print(f"| memory watchdog, one poll of {args.pids} processes every {args.poll_interval_s} s | "
          f"{poll_s * 1e6:.0f} us | {poll_s / args.poll_interval_s:.4%} of one core |")
    print(f"| weight fingerprints, both sides of one hand-over ({args.model}, {len(names)} tensors) | "
          f"{2 * fingerprint_s * 1e3:.1f} ms | {2 * fingerprint_s / step_s:.4%} |")
    config = {**vars(args), "median_step_s": step_s, "watchdog_poll_s": poll_s, "fingerprint_one_side_s": fingerprint_s,
              "fingerprinted": names}
    print(f"raw results: {write_results('guards_overhead', config, rows, load_before)}")


if __name__ == "__main__":
    main()
