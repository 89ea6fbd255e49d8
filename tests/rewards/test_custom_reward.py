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


def _bonus_file(tmp_path: Path) -> Path:
    path = tmp_path / "bonus_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
                    "    return float(solution_str == ground_truth) + bonus\n")
    return path


def test_reward_kwargs_from_the_command_line_reach_the_function(tmp_path: Path) -> None:
    """verl's `+custom_reward_function.reward_kwargs.NAME=VALUE` is passed on every call."""
    from hybridflow.trainer.config.loader import load_config
    from hybridflow.trainer.run import build_reward_manager

    config = load_config([f"custom_reward_function.path={_bonus_file(tmp_path)}",
                          "+custom_reward_function.reward_kwargs.bonus=0.25"])
    assert dict(config.custom_reward_function.reward_kwargs) == {"bonus": 0.25}
    manager = build_reward_manager(config.reward_model, config.custom_reward_function, config.data, tokenizer=None)
    fn = next(value for value in vars(manager).values() if callable(value) and hasattr(value, "reward_kwargs"))
    assert fn(data_source="d", solution_str="x", ground_truth="x", extra_info=None) == 1.25


def test_reward_kwargs_without_a_path_are_refused() -> None:
    from hybridflow.trainer.config.loader import load_config

    with pytest.raises(ValueError, match="reward_kwargs.*no path is set"):
        load_config(["+custom_reward_function.reward_kwargs.bonus=0.25"])


def test_reward_kwargs_the_function_does_not_take_are_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"does not take custom_reward_function\.reward_kwargs \['bonsu'\]"):
        load_custom_reward_fn(_bonus_file(tmp_path), "compute_score", {"bonsu": 0.25})
