"""What the end-to-end tests share: a workspace of reasoning-gym rows, a tiny model and a length reward, and a run
directory that starts from a copy of another run's checkpoint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hybridflow.trainer.checkpoint_dirs import LATEST_FILE, step_of

# Rewards responses by their length: a signal that a random tiny model's samples differ on, so advantages
# are non-zero and weights really change (the arithmetic verifier would score them all 0).
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 11) / 10.0
'''


def build_workspace(root: Path, train_size: int, test_size: int, num_layers: int = 2, hidden: int = 64) -> Path:
    """`root/data/{train,test}.parquet` (smollm2_easy rows), `root/tiny` (seed 0) and `root/reward.py`."""
    subprocess.run(
        [sys.executable, "-m", "hybridflow.data.preprocess.reasoning_gym", "--preset", "smollm2_easy",
         "--local_dir", str(root / "data"), "--train_size", str(train_size), "--test_size", str(test_size),
         "--seed", "0"],
        check=True, capture_output=True,
    )
    from hybridflow.models import save_tiny_model

    save_tiny_model(root / "tiny", num_layers=num_layers, hidden=hidden, seed=0)
    (root / "reward.py").write_text(REWARD_FILE)
    return root


def start_from_checkpoint(checkpoint: Path, run_dir: Path) -> Path:
    """A new run directory whose only (and latest) checkpoint is a copy of `checkpoint` (a global_step_N)."""
    run_dir.mkdir()
    shutil.copytree(checkpoint, run_dir / checkpoint.name)
    (run_dir / LATEST_FILE).write_text(str(step_of(checkpoint)))
    return run_dir
