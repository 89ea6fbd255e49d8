"""The demo's GRPO step on SmolLM2-135M-Instruct against the same step on its 4-expert top-2 upcycled Mixtral.

Both run their packaged config (`grpo_smollm2_demo`, `grpo_smollm2_moe_demo`: 8 prompts x 8 samples, <= 48 new
tokens, one worker of 2 threads, native rollout) for `--steps` steps, alternating for `--rounds` rounds so that a
noisy machine hurts them alike. The table has the means over the steps after the first (warm-up) and the peak RSS
of the worker; the raw per-step rows go to benchmarks/results/moe_demo_<UTC>.json with the host's facts:

    python benchmarks/moe_demo.py --steps 3 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from demo_steps import REPO, run_steps  # benchmarks/ is on the path when run as a script

CONFIGS = {"dense SmolLM2-135M": "grpo_smollm2_demo", "upcycled 4x top-2 Mixtral": "grpo_smollm2_moe_demo"}
COLUMNS = (("step s", "timing_s/step"), ("gen s", "timing_s/gen"), ("update s", "timing_s/update_actor"),
           ("response length", "response_length/mean"), ("score", "critic/score/mean"),
           ("peak RSS GB", "perf/max_memory_allocated_gb"))
MOE_DIR = REPO / "outputs" / "smollm2_moe"


def main() -> None:
    from hybridflow.utils.host import write_results

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if not (MOE_DIR / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "hybridflow.models.upcycle", "--model", "smollm2-135m-instruct",
                        "--target_dir", str(MOE_DIR)], cwd=REPO, check=True)
    load_before = list(os.getloadavg())
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for name, config_name in CONFIGS.items():
                results[name] += run_steps(config_name, args.steps, Path(scratch) / f"{round_index}_{config_name}")
    rows = [{"model": name, **record} for name, records in results.items() for record in records]
    path = write_results("moe_demo", {"steps": args.steps, "rounds": args.rounds, "configs": CONFIGS}, rows,
                         load_before, REPO / "benchmarks" / "results")
    print(f"demo GRPO step, dense vs upcycled MoE, {args.steps} steps x {args.rounds} rounds ({path.name})")
    print("| model | " + " | ".join(title for title, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    means = {}
    for name, records in results.items():
        means[name] = {key: statistics.mean(r[key] for r in records) for _, key in COLUMNS}
        print(f"| {name} | " + " | ".join(f"{means[name][key]:.2f}" for _, key in COLUMNS) + " |")
    dense, moe = (means[name]["timing_s/step"] for name in CONFIGS)
    print(f"MoE step / dense step: {moe / dense:.2f}x")


if __name__ == "__main__":
    main()
