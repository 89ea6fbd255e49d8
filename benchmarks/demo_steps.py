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
