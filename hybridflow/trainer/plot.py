"""PNG plots of a run's metrics (reward, response length, KL, entropy, validation accuracy) against steps.

`hybridflow plot RUN_DIR` reads `RUN_DIR/metrics.jsonl` (the `file` tracking backend) and writes
`RUN_DIR/plots/*.png`; the trainer calls the same function at the end of a run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from hybridflow.trainer.tracking import METRICS_FILE

PANELS = {
    "reward": ["critic/score/mean", "critic/rewards/mean"],
    "response_length": ["response_length/mean", "response_length/clip_ratio"],
    "kl": ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"],
    "entropy": ["actor/entropy"],
    "validation": [],  # every val-core/* key
}


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The per-step records of `run_dir/metrics.jsonl`."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run with trainer.logger including 'file'")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
            keys = sorted({key for record in records for key in record if key.startswith("val-core/")})
        series = {
            key: [(r["step"], r[key]) for r in records if r.get(key) is not None] for key in keys
        }
        series = {key: points for key, points in series.items() if points}
        if not series:
            continue
        figure, axis = plt.subplots(figsize=(6, 3.5))
        for key, points in series.items():
            steps, values = zip(*points)
            axis.plot(steps, values, marker="o", markersize=3, label=key)
        axis.set_xlabel("step")
        axis.set_title(panel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        path = out_dir / f"{panel}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def main(argv: Sequence[str] = ()) -> int:
    """`hybridflow plot RUN_DIR`."""
    parser = argparse.ArgumentParser(prog="hybridflow plot", description=__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(list(argv))
    for path in plot_run(args.run_dir):
        print(path)
    return 0
