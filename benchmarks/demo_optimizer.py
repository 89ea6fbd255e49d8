"""The demo's GRPO step with the fused AdamW kernel (the engine's default) against torch's per-tensor loop
(`override_optimizer_config.foreach=False`), alternating, from the same seed. The table shows the means over the
steps after each run's first of the step, the actor update and its MFU:

    python benchmarks/demo_optimizer.py --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse

from demo_steps import compare_and_report  # benchmarks/ is on the path when run as a script

VARIANTS = {
    "fused AdamW (default)": [],
    "per-tensor AdamW loop": ["+actor_rollout_ref.actor.optim.override_optimizer_config.foreach=False"],
}
COLUMNS = (("step s", "timing_s/step"), ("update s", "timing_s/update_actor"), ("update MFU", "perf/mfu/actor"),
           ("tokens/s", "tokens_per_s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    compare_and_report("demo_optimizer", "grpo_smollm2_demo", VARIANTS, COLUMNS, "variant", args.steps, args.rounds)


if __name__ == "__main__":
    main()
