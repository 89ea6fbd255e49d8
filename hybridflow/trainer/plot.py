"""PNG plots of a run's metrics (reward, response length, KL, entropy, tool use, validation accuracy) against steps.

`hybridflow plot RUN_DIR` reads `RUN_DIR/metrics.jsonl` (the `file` tracking backend) and writes
`RUN_DIR/plots/*.png`; the trainer calls the same function at the end of a run. Per-step training metrics are
noisy at RL batch sizes, so each is drawn as its raw points with an exponential moving average over them; a
validation mean is drawn with its 95% interval (`val-aux/.../ci95_low|high`) as a band. Each PNG is tagged as
this module's (`PLOT_SOFTWARE`); a file of the same name that is not is never written over.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from hybridflow.algorithms.validation_metrics import interval_keys
from hybridflow.trainer.tracking import METRICS_FILE

logger = logging.getLogger(__name__)

PLOT_SOFTWARE = "hybridflow plot_run"
"""The PNG `Software` text of every plot written here: a file without it is someone else's."""

SMOOTHING = 0.6  # weight of the running average: each point moves it by 40% of the gap

PANELS = {
    "reward": ["critic/score/mean", "critic/rewards/mean"],
    "response_length": ["response_length/mean", "response_length/clip_ratio"],
    "kl": ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"],
    "entropy": ["actor/entropy"],
    "tools": ["tool_calls/used_ratio", "tool_calls/mean", "agent/truncated"],  # agent loops only
    "validation": [],  # every val-core/* key, and an agent's share of samples that called a tool
}


def validation_keys(records: Sequence[dict]) -> list[str]:
    """The validation panel's keys: every `val-core/*` mean, and the agent loops' `val-aux/<source>/tool_used/*`
    means (the share of validation samples that called a tool), which the same 0-1 axis shows."""
    keys = {key for record in records for key in record if key.startswith("val-core/")}
    keys |= {key for record in records for key in record
             if key.startswith("val-aux/") and "/tool_used/mean@" in key and not key.endswith(("_low", "_high"))}
    return sorted(keys)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The per-step records of `run_dir/metrics.jsonl`."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run with trainer.logger including 'file'")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def merge_by_step(records: Sequence[dict]) -> dict[int, dict]:
    """`records` (several may share a step: its training metrics, its validation) merged into one dict per step."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return merged


def metrics_by_step(run_dir: str | Path) -> dict[int, dict]:
    """`run_dir/metrics.jsonl`, one merged dict per step (`read_metrics`, `merge_by_step`)."""
    return merge_by_step(read_metrics(run_dir))


def compute_ema(values: Sequence[float], smoothing: float = SMOOTHING) -> list[float]:
    """Exponential moving average of `values`, started at the first value: (n,) -> (n,)."""
    smoothed: list[float] = []
    for value in values:
        smoothed.append(value if not smoothed else smoothing * smoothed[-1] + (1 - smoothing) * value)
    return smoothed


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write one PNG per panel that has data; return the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for panel, keys in PANELS.items():
        if panel == "validation":
            keys = validation_keys(records)
        series = {
            key: [(r["step"], r[key]) for r in records if r.get(key) is not None] for key in keys
        }
        series = {key: points for key, points in series.items() if points}
        if not series:
            continue
        path = out_dir / f"{panel}.png"
        if not is_ours_to_write(path):
            logger.warning("%s was not written by hybridflow's plots, so it is left as it is; move it and run "
                           "`hybridflow plot %s` for the %s plot", path, run_dir, panel)
            continue
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            steps, values = zip(*points)
            if panel == "validation":
                _plot_with_interval(axis, records, key, steps, values)
            else:
                line = axis.plot(steps, compute_ema(values), label=f"{key} (EMA {SMOOTHING})")[0]
                axis.plot(steps, values, "o", markersize=3, alpha=0.35, color=line.get_color())
        axis.set_xlabel("step")
        axis.set_title(panel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(path, dpi=100, metadata={"Software": PLOT_SOFTWARE})
        plt.close(figure)
        written.append(path)
    return written


def is_ours_to_write(path: Path) -> bool:
    """Whether `path` is free or a plot this module wrote (its PNG `Software` text is `PLOT_SOFTWARE`)."""
    if not path.exists() and not path.is_symlink():
        return True
    if not path.is_file() or path.is_symlink():
        return False
    from PIL import Image  # matplotlib's own dependency

    try:
        with Image.open(path) as image:
            return getattr(image, "text", {}).get("Software") == PLOT_SOFTWARE
    except Exception:  # noqa: BLE001 - anything unreadable as a PNG is not ours
        return False


def _plot_with_interval(axis, records: list[dict], key: str, steps: Sequence[int], values: Sequence[float]) -> None:
    line = axis.plot(steps, values, marker="o", markersize=3, label=key)[0]
    low_key, high_key = interval_keys(key)
    bands = [
        (r["step"], r[low_key], r[high_key])
        for r in records
        if r.get(low_key) is not None and r.get(high_key) is not None
    ]
    if bands:
        band_steps, lows, highs = zip(*bands)
        axis.fill_between(band_steps, lows, highs, alpha=0.2, color=line.get_color(), label=f"{key} 95% interval")


def main(argv: Sequence[str] = ()) -> int:
    """`hybridflow plot RUN_DIR`."""
    parser = argparse.ArgumentParser(prog="hybridflow plot", description=__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(list(argv))
    for path in plot_run(args.run_dir):
        print(path)
    return 0
