"""Workers x threads on a CPU host: the demo's GRPO step with 2 workers of 1 thread against 1 worker of 2 threads.

Each layout runs `--steps` steps of the demo config (SmolLM2, 8 prompts x 8 samples, <= 48 new tokens, native
rollout) from the same seed; the layouts alternate for `--rounds` rounds so that a noisy machine hurts them
alike. The table shows the means over the steps after the first (warm-up) of the step, generation and update
seconds, tokens per second over the whole step, and the update's MFU:

    python benchmarks/workers_threads.py --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from demo_steps import run_steps  # benchmarks/ is on the path when run as a script
from hybridflow.utils.host import write_results

LAYOUTS = {"2 workers x 1 thread": (2, 1), "1 worker x 2 threads": (1, 2)}
COLUMNS = (("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("update s", "timing_s/update_actor"),
           ("tokens/s", "tokens_per_s"), ("update MFU", "perf/mfu/actor"), ("response length", "response_length/mean"))


def run(workers: int, threads: int, steps: int, run_dir: Path) -> list[dict]:
    """The demo config with `workers` processes of `threads` torch threads; per-step metrics after the first."""
    later = run_steps("grpo_smollm2_demo", steps, run_dir, f"trainer.n_gpus_per_node={workers}",
                      f"trainer.num_threads_per_worker={threads}")
    for record in later:
        record["tokens_per_s"] = record["perf/total_num_tokens"] / record["timing_s/step"]
    return later


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    started, loads = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), [os.getloadavg()[0]]
    load_before = list(os.getloadavg())
    results: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, (workers, threads) in LAYOUTS.items():
                results[name] += run(workers, threads, args.steps, Path(scratch) / f"{round_index}_{workers}")
                loads.append(os.getloadavg()[0])
    print(f"demo GRPO step, {args.steps} steps x {args.rounds} rounds per layout, started {started}, "
          f"load (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print("| layout | " + " | ".join(title for title, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, records in results.items():
        cells = []
        for _, key in COLUMNS:
            value = statistics.mean(r[key] for r in records)
            cells.append(f"{value:.1%}" if key.startswith("perf/mfu") else f"{value:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    rows = [{"layout": name, **record} for name, records in results.items() for record in records]
    print(f"raw results: {write_results('workers_threads', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
