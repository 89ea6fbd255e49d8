"""Workers x threads on a CPU host: the demo's GRPO step with 2 workers of 1 thread against 1 worker of 2 threads.

Each layout runs `--steps` steps of the demo config (SmolLM2, 8 prompts x 8 samples, <= 48 new tokens, native
rollout) from the same seed; the layouts alternate for `--rounds` rounds so that a noisy machine hurts them
alike. The table shows the means over the steps after the first (warm-up) of the step, generation and update
seconds, tokens per second over the whole step, and the update's MFU:

    python benchmarks/workers_threads.py --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse

from demo_steps import compare_and_report  # benchmarks/ is on the path when run as a script

LAYOUTS = {"2 workers x 1 thread": (2, 1), "1 worker x 2 threads": (1, 2)}
COLUMNS = (("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("update s", "timing_s/update_actor"),
           ("tokens/s", "tokens_per_s"), ("update MFU", "perf/mfu/actor"), ("response length", "response_length/mean"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    variants = {
        name: [f"trainer.n_gpus_per_node={workers}", f"trainer.num_threads_per_worker={threads}"]
        for name, (workers, threads) in LAYOUTS.items()
    }
    compare_and_report("workers_threads", "grpo_smollm2_demo", variants, COLUMNS, "layout", args.steps, args.rounds)


if __name__ == "__main__":
    main()
