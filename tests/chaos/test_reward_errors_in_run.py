"""A reward function that raises on every sample (e.g. a wrong ground-truth format) stops a real GRPO run at the
first step, naming the data source, instead of training on zeros."""

from __future__ import annotations

import pytest

from tests.trainer.e2e_runs import overrides, run, workspace  # noqa: F401  (workspace is a fixture)

RAISING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth["not_a_key"])  # the ground truth is a string: every call raises
'''


def test_a_reward_function_failing_on_every_sample_stops_the_run(workspace):  # noqa: F811
    (workspace / "raising_reward.py").write_text(RAISING_REWARD)
    args = overrides(
        workspace, workspace / "raising", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=2", "trainer.val_before_train=False", "data.val_files=[]",
        f"custom_reward_function.path={workspace / 'raising_reward.py'}",
    )
    with pytest.raises(RuntimeError, match=r"8 of 8 reward scorer calls failed.*reasoning_gym/basic_arithmetic.*max_error_fraction"):
        run(args)
    assert not (workspace / "raising" / "metrics.jsonl").exists() or "actor/grad_norm" not in (
        workspace / "raising" / "metrics.jsonl").read_text(), "no update ran on the zero rewards"
