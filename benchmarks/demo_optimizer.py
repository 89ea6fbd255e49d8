"""The demo's GRPO step with the fused AdamW kernel (the engine's default) against torch's per-tensor loop
(`override_optimizer_config.foreach=False`), alternating, from the same seed. The table shows the means over the
steps after each run's first of the step, the actor update and its MFU:

    python benchmarks/demo_optimizer.py --steps 3 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from demo_steps import compare_variants, print_mean_table  # benchmarks/ is on the path when run as a script
from hybridflow.utils.host import write_results

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
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), list(os.getloadavg())
    with tempfile.TemporaryDirectory() as scratch:
        results, loads = compare_variants("grpo_smollm2_demo", VARIANTS, args.steps, args.rounds, Path(scratch))
    print(f"demo GRPO step, {args.steps} steps x {args.rounds} rounds per variant, started {started}, "
          f"load (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print_mean_table(results, COLUMNS, "optimizer")
    rows = [{"variant": name, **record} for name, records in results.items() for record in records]
    print(f"raw results: {write_results('demo_optimizer', vars(args), rows, load_before)}")


if __name__ == "__main__":
    main()
