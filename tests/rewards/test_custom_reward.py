"""Custom reward functions from a file: loading errors name the path or the function."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from hybridflow.rewards import load_custom_reward_fn


def test_loads_and_passes_reward_kwargs(tmp_path: Path) -> None:
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info, bonus=0.0):\n"
                    "    return float(solution_str == ground_truth) + bonus\n")
    fn = load_custom_reward_fn(path, "compute_score", {"bonus": 0.5})
    assert fn(data_source="d", solution_str="a", ground_truth="a", extra_info=None) == 1.5
    assert pickle.loads(pickle.dumps(fn))(data_source="d", solution_str="a", ground_truth="b", extra_info=None) == 0.5


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function\.path not found: .*absent\.py"):
        load_custom_reward_fn(tmp_path / "absent.py", "compute_score")


def test_missing_function_names_function_and_path(tmp_path: Path) -> None:
    path = tmp_path / "other.py"
    path.write_text("def something_else():\n    return 0\n")
    message = r"custom_reward_function\.name='compute_score' is not defined in .*other\.py"
    with pytest.raises(AttributeError, match=message):
        load_custom_reward_fn(path, "compute_score")
