"""Sync colocated, sync split, one-step off-policy and fully async GRPO, back to back, at equal samples.

Every mode runs `--steps` GRPO steps of the demo config (SmolLM2-135M-Instruct, the demo's reasoning-gym
arithmetic data, native rollout, fp32) with `--prompts` prompts x 8 samples per step, on the same number of
processes (2, one torch thread each):

- `sync colocated`: `hybridflow train`, one pool of 2 processes holding actor and rollout (hybrid engine);
- `sync split`: `hybridflow train`, `hybrid_engine=False`, 1 trainer + 1 rollout process, a weight sync per step;
- `one-step off`: `hybridflow train-one-step-off` on the same split pools;
- `fully async`: `hybridflow train-fully-async` on the same split pools, staleness_threshold=1, a sync every step.

The off-policy modes add `algorithm.rollout_correction.rollout_is=token` (their samples are one version stale), which
needs a separate old-log-prob pass before the update; `--modes` can add `one-step off without correction` (no pass).
The table gives per-step means over the steps after the first (warm-up; for the off-policy modes also the only
step without overlap): the step's wall time (`timing_s/step`), the time the trainer waited for samples
(`timing_s/gen`: the whole generation in the synchronous modes, only the part that training did not hide in the
others), old-log-prob and update time, the weight sync, the colocated handover (`timing_s/update_weights`, part of
the generation), staleness, response length and reward, and each mode's
ratio to sync colocated in the same run. `--long-tail` samples at temperature 1.2 with up to 128 new tokens, so
response lengths vary widely. A JSON line with every step's record follows the table (for the cost model in
docs/performance.md).

    python benchmarks/async_modes.py --steps 3 --prompts 4
    python benchmarks/async_modes.py --steps 3 --prompts 4 --long-tail
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridflow.trainer.plot import metrics_by_step

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "outputs" / "demo" / "data" / "train.parquet"
SPLIT = ("actor_rollout_ref.hybrid_engine=False", "trainer.n_gpus_per_node=1", "rollout.nnodes=1",
         "rollout.n_gpus_per_node=1")
CORRECTION = ("algorithm.rollout_correction.rollout_is=token",)
MODES = {
    "sync colocated": ("hybridflow.trainer.main_ppo", ("trainer.n_gpus_per_node=2",)),
    "sync split": ("hybridflow.trainer.main_ppo", SPLIT),
    "one-step off": ("hybridflow.trainer.off_policy.main_one_step_off", SPLIT + CORRECTION),
    "fully async": ("hybridflow.trainer.off_policy.main_fully_async", SPLIT + CORRECTION + (
        "async_training.staleness_threshold=1", "async_training.trigger_parameter_sync_step=1")),
    # Without the correction the update takes its old log-probs from its own forward (no separate pass), and
    # nothing corrects for the one step of staleness: not run by default.
    "one-step off without correction": ("hybridflow.trainer.off_policy.main_one_step_off", SPLIT),
}
DEFAULT_MODES = ("sync colocated", "sync split", "one-step off", "fully async")
KEYS = {  # column -> metric
    "step_s": "timing_s/step", "wait_gen_s": "timing_s/gen", "old_log_prob_s": "timing_s/old_log_prob",
    "update_s": "timing_s/update_actor", "sync_s": "timing_s/sync_rollout_weights", "reward_s": "timing_s/reward",
    "rollout_gen_s": "fully_async/rollout_gen_s", "handover_s": "timing_s/update_weights",
    "staleness": "rollout/staleness/mean",
    "response_length": "response_length/mean", "response_length_max": "response_length/max",
    "score": "critic/score/mean",
}


def run_mode(module: str, extra: tuple[str, ...], common: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """One training run in its own process; its per-step records and its wall time (start-up included)."""
    command = [sys.executable, "-m", module, "--config-name", "grpo_smollm2_demo", *common, *extra,
               f"trainer.default_local_dir={run_dir}"]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    records = metrics_by_step(run_dir)
    rows = [{"step": step, **{name: float(r.get(key, 0.0)) for name, key in KEYS.items()}}
            for step, r in sorted(records.items()) if step > 0]
    return rows, wall


def summarize(rows: list[dict]) -> dict[str, float]:
    """Means over the steps after the first (all steps when there is only one)."""
    later = rows[1:] or rows
    return {name: statistics.mean(r[name] for r in later) for name in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step (x 8 samples)")
    parser.add_argument("--long-tail", action="store_true", help="temperature 1.2, up to 128 new tokens")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help="comma-separated, from: " + ", ".join(MODES))
    args = parser.parse_args()
    from hybridflow import env
    from hybridflow.utils.host import write_results

    first_load = list(os.getloadavg())

    if not DEMO_DATA.is_file():
        raise SystemExit(f"{DEMO_DATA} is missing: run `make demo` once (it writes the demo data first)")
    common = [
        f"trainer.total_training_steps={args.steps}", f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", "data.val_files=[]",
        "trainer.val_before_train=False", "trainer.save_freq=-1", "trainer.logger=[file]",
        "trainer.num_threads_per_worker=1",
    ]
    if args.long_tail:
        # Smaller micro-batches: longer rows, and the machine may be shared (an OOM kill was seen at 8).
        common += ["actor_rollout_ref.rollout.temperature=1.2", "data.max_response_length=128",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = {}
    with tempfile.TemporaryDirectory(dir=env.cache_dir()) as scratch:
        for index, name in enumerate(args.modes.split(",")):
            module, extra = MODES[name]
            load_before = os.getloadavg()[0]
            rows, wall = run_mode(module, extra, common, Path(scratch) / f"mode{index}")
            results[name] = {"rows": rows, "wall_s": wall, "load": (load_before, os.getloadavg()[0])}
            print(f"{name}: {[round(r['step_s'], 1) for r in rows]} s per step, {wall:.0f} s with start-up",
                  flush=True)
    workload = "long tail (temperature 1.2, <= 128 tokens)" if args.long_tail else "demo (temp. 0.7, <= 48 tokens)"
    print(f"\n{workload}, {args.steps} steps x {args.prompts} prompts x 8 samples, run started {started}, "
          f"{os.cpu_count()} cores")
    print("| mode | step s | vs colocated | wait for samples s | old log-prob s | update s | sync s | "
          "handover s | rollout gen s | staleness | response length (max) | score | run s | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    baseline = summarize(results["sync colocated"]["rows"])["step_s"] if "sync colocated" in results else None
    for name, result in results.items():
        s = summarize(result["rows"])
        ratio = f"{baseline / s['step_s']:.2f}x" if baseline else "-"
        print(f"| {name} | {s['step_s']:.1f} | {ratio} | {s['wait_gen_s']:.1f} | {s['old_log_prob_s']:.1f} | "
              f"{s['update_s']:.1f} | {s['sync_s']:.2f} | {s['handover_s']:.2f} | {s['rollout_gen_s']:.1f} | "
              f"{s['staleness']:.2f} | "
              f"{s['response_length']:.1f} ({s['response_length_max']:.0f}) | {s['score']:.3f} | "
              f"{result['wall_s']:.0f} | {result['load'][0]:.1f}-{result['load'][1]:.1f} |")
    print("RESULTS_JSON " + json.dumps(results))
    rows = [{"mode": name, **result} for name, result in results.items()]
    print(f"raw results: {write_results('async_modes', vars(args), rows, first_load)}")


if __name__ == "__main__":
    main()
