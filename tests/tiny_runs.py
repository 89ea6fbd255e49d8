"""What the end-to-end tests share: a workspace of reasoning-gym rows, a tiny model and a length reward, and a run
directory that starts from a copy of another run's checkpoint."""

from __future__ import annotations

import atexit
import importlib.util
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hybridflow.trainer.checkpoint_dirs import LATEST_FILE, step_of

# Rewards responses by their length: a signal that a random tiny model's samples differ on, so advantages
# are non-zero and weights really change (the arithmetic verifier would score them all 0).
REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 11) / 10.0
'''


_BUILT: dict[tuple[int, int, int, int], Path] = {}
"""Workspaces built in this process, by (train_size, test_size, num_layers, hidden): later requests copy them."""


def build_workspace(root: Path, train_size: int, test_size: int, num_layers: int = 2, hidden: int = 64) -> Path:
    """`root/data/{train,test}.parquet` (smollm2_easy rows), `root/tiny` (seed 0) and `root/reward.py`.

    The first request for a shape builds it (about 9 s: a preprocessing subprocess and a model save); later ones
    in the same test process copy that build, which is identical, since both steps are seeded."""
    key = (train_size, test_size, num_layers, hidden)
    if key not in _BUILT:
        source = Path(tempfile.mkdtemp(prefix="hybridflow_workspace_"))
        atexit.register(shutil.rmtree, source, ignore_errors=True)
        _build_workspace(source, *key)
        _BUILT[key] = source
    shutil.copytree(_BUILT[key], root, dirs_exist_ok=True)
    return root


def workspace_overrides(root: Path, run_dir: Path, *, validate: bool = True, mini_batch: int = 2) -> list[str]:
    """The command-line keys every tiny run of a `build_workspace` shares: its data (4 prompts a step, prompts up to
    128 and responses up to 12 tokens; its test split too when `validate`), its model and reward, micro-batches of
    2 rows in mini-batches of `mini_batch` prompts, and `run_dir`."""
    return [
        f"data.train_files=[{root / 'data' / 'train.parquet'}]",
        f"data.val_files=[{root / 'data' / 'test.parquet'}]" if validate else "data.val_files=[]",
        "data.train_batch_size=4",
        "data.max_prompt_length=128",
        "data.max_response_length=12",
        f"actor_rollout_ref.model.path={root / 'tiny'}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"trainer.default_local_dir={run_dir}",
        f"custom_reward_function.path={root / 'reward.py'}",
    ]


def _build_workspace(root: Path, train_size: int, test_size: int, num_layers: int, hidden: int) -> None:
    if importlib.util.find_spec("reasoning_gym") is None:  # GPU nodes often lack the data extras
        write_arithmetic_rows(root / "data", train_size, test_size, seed=0)
    else:
        subprocess.run(
            [sys.executable, "-m", "hybridflow.data.preprocess.reasoning_gym", "--preset", "smollm2_easy",
             "--local_dir", str(root / "data"), "--train_size", str(train_size), "--test_size", str(test_size),
             "--seed", "0"],
            check=True, capture_output=True,
        )
    from hybridflow.models import save_tiny_model

    save_tiny_model(root / "tiny", num_layers=num_layers, hidden=hidden, seed=0)
    (root / "reward.py").write_text(REWARD_FILE)


def write_arithmetic_rows(data_dir: Path, train_size: int, test_size: int, seed: int) -> None:
    """`data_dir/{train,test}.parquet` of two-term sums in the dataset schema, without reasoning-gym."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", train_size), ("test", test_size)):
        rows = []
        for index in range(size):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            rows.append({
                "data_source": "arithmetic", "ability": "math",
                "prompt": [{"role": "user", "content": f"Calculate {a} + {b}.\n\nEnd with: Answer: <answer>"}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": index},
            })
        pq.write_table(pa.Table.from_pylist(rows), data_dir / f"{split}.parquet")


def start_from_checkpoint(checkpoint: Path, run_dir: Path) -> Path:
    """A new run directory whose only (and latest) checkpoint is a copy of `checkpoint` (a global_step_N)."""
    run_dir.mkdir()
    shutil.copytree(checkpoint, run_dir / checkpoint.name)
    (run_dir / LATEST_FILE).write_text(str(step_of(checkpoint)))
    return run_dir
