"""PRIME end to end on 2 Ray workers (tiny model): the implicit PRM trains online next to the actor, its dense
rewards enter the advantage, and it is checkpointed with the run; its settings are refused in other runs."""

from __future__ import annotations

import math

import pytest

from hybridflow.trainer.config import load_config, validate_config
from tests.tiny_runs import build_workspace
from tests.trainer.placement_runs import overrides, train


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("prime"), train_size=8, test_size=2)


def prime(root, run_dir, *extra):
    return overrides(
        root, run_dir,
        "algorithm.adv_estimator=prime",
        "reward_model.enable=True",
        f"reward_model.model.path={root / 'tiny'}",
        "reward_model.model.update=before",
        "reward_model.model.optim.lr=1e-3",
        *extra,
    )


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_prime_trains_the_implicit_prm_online(workspace, ray_cluster):
    records, _ = train(prime(workspace, workspace / "run", "trainer.save_freq=2"))
    assert sorted(records) == [1, 2]
    for step in (1, 2):
        record = records[step]
        for key in ("reward_model/prime_loss", "reward_model/grad_norm", "reward_model/dpo_acc", "actor/pg_loss"):
            assert math.isfinite(record[key]), (step, key)
        assert record["timing_s/prime_rm"] > 0
    assert records[1]["reward_model/prime_loss"] == pytest.approx(math.log(2.0), abs=1e-4)  # starts at sigmoid(0)
    assert records[2]["reward_model/implicit_reward/mean"] != 0, "after one update the PRM differs from its reference"
    assert any((workspace / "run" / "global_step_2" / "reward").glob("model_world_size_2_rank_*.pt"))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["reward_model.model.update=before"], "configures PRIME"),
        (["algorithm.reward_dpo_coef=1.0"], "configures PRIME"),
        (["algorithm.adv_estimator=prime"], "reward_model.enable=True"),
        (["algorithm.adv_estimator=prime", "reward_model.enable=True", "reward_model.model.path={tiny}"],
         "would be 0 forever"),
        (["algorithm.adv_estimator=prime", "reward_model.enable=True", "reward_model.model.path={tiny}",
          "reward_model.model.update=before", "reward_model.rule_reward_coef=1.0"], "reward_gt_coef"),
    ],
)
def test_prime_settings_are_checked_before_ray_starts(workspace, extra, words):
    extra = [item.format(tiny=workspace / "tiny") for item in extra]
    with pytest.raises(ValueError, match=words):
        validate_config(load_config(overrides(workspace, workspace / "never", *extra)))
