"""Run a packaged trainer config for a few steps in a subprocess and read its per-step metrics (shared by the
benchmarks that time the demo's step: workers_threads.py, moe_demo.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybridflow.trainer.plot import metrics_by_step

REPO = Path(__file__).resolve().parents[1]


def run_steps(config_name: str, steps: int, run_dir: Path, *overrides: str) -> list[dict]:
    """`steps` steps of `config_name` (plus `overrides`) without validation or checkpoints; the merged metrics of
    each step after the first (warm-up)."""
    command = [
        sys.executable, "-m", "hybridflow.trainer.main_ppo", "--config-name", config_name, *overrides,
        f"trainer.total_training_steps={steps}", "data.val_files=[]", "trainer.val_before_train=False",
        "trainer.save_freq=-1", f"trainer.default_local_dir={run_dir}", "trainer.logger=[file]",
    ]
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [record for step, record in sorted(metrics_by_step(run_dir).items()) if step > 1]


def compare_variants(
    config_name: str, variants: dict[str, list[str]], steps: int, rounds: int, scratch: Path
) -> tuple[dict[str, list[dict]], list[float]]:
    """Each variant's overrides for `steps` steps, the variants alternating for `rounds` rounds so that a noisy
    machine hurts them alike; returns the per-step metrics after each run's first step, by variant, and the 1-minute
    load average before and after every run. Each record also gets `tokens_per_s` over the whole step."""
    results: dict[str, list[dict]] = {name: [] for name in variants}
    loads = [os.getloadavg()[0]]
    for round_index in range(rounds):
        for index, (name, overrides) in enumerate(variants.items()):
            for record in run_steps(config_name, steps, scratch / f"{round_index}_{index}", *overrides):
                record["tokens_per_s"] = record["perf/total_num_tokens"] / record["timing_s/step"]
                results[name].append(record)
            loads.append(os.getloadavg()[0])
    return results, loads


def print_mean_table(results: dict[str, list[dict]], columns: tuple[tuple[str, str], ...], label: str) -> None:
    """A markdown table of each variant's mean of each column (`perf/mfu*` as percentages)."""
    import statistics

    print(f"| {label} | " + " | ".join(title for title, _ in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, records in results.items():
        cells = []
        for _, key in columns:
            value = statistics.mean(r[key] for r in records)
            cells.append(f"{value:.1%}" if key.startswith("perf/mfu") else f"{value:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def compare_and_report(
    benchmark: str, config_name: str, variants: dict[str, list[str]], columns: tuple[tuple[str, str], ...],
    label: str, steps: int, rounds: int,
) -> None:
    """`compare_variants` in a scratch directory, then its table (with the start time and the load range) and its
    raw records in benchmarks/results/`benchmark`_<time>.json."""
    import tempfile
    import time

    from hybridflow.utils.host import write_results

    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), list(os.getloadavg())
    with tempfile.TemporaryDirectory() as scratch:
        results, loads = compare_variants(config_name, variants, steps, rounds, Path(scratch))
    print(f"{config_name}, {steps} steps x {rounds} rounds per {label}, started {started}, "
          f"load (1 min) {min(loads):.1f}-{max(loads):.1f}")
    print_mean_table(results, columns, label)
    rows = [{label: name, **record} for name, records in results.items() for record in records]
    config = {"config_name": config_name, "steps": steps, "rounds": rounds, "variants": variants}
    print(f"raw results: {write_results(benchmark, config, rows, load_before)}")
