"""verl's default micro-batch sizes are null: with token budgets (use_dynamic_bsz) they load, validate and build the
engines; cutting by rows without a size is refused naming both keys; a global size given beside a null per-GPU one
is divided as verl does."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config import load_config, validate_config
from tests.helpers import nothing_started
from tests.trainer.test_config_tree import files  # noqa: F401  (fixture)

NULLS = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null",
    "critic.ppo_micro_batch_size_per_gpu=null",
    "critic.forward_micro_batch_size_per_gpu=null",
]


def line(files, *extra: str) -> list[str]:  # noqa: F811
    return [f"data.train_files={files['train']}", f"actor_rollout_ref.model.path={files['model']}",
            "algorithm.adv_estimator=gae", f"critic.model.path={files['model']}", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.n_gpus_per_node=2", *extra]


def test_null_sizes_with_token_budgets_load_validate_and_build_the_engines(files):  # noqa: F811
    cfg = load_config(line(files, "actor_rollout_ref.actor.use_dynamic_bsz=True", *NULLS))
    with nothing_started():
        sizes = validate_config(cfg)
    assert sizes["actor"].token_budget == 16384 and sizes["critic"].token_budget == 32768
    assert "tokens each" in sizes["actor"].table("actor")
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_micro_batch_size_per_gpu is None and arr.rollout.log_prob_micro_batch_size_per_gpu is None
    for engine in (arr.actor.engine_config(arr.model), arr.ref.engine_config(arr.model, False),
                   cfg.critic.engine_config()):
        assert engine.micro_batch_size_per_gpu == 1  # never read: the token budget cuts the micro-batches


def test_the_log_prob_size_follows_a_null_actor_size_as_in_verl(files):  # noqa: F811
    cfg = load_config(line(files, "actor_rollout_ref.actor.use_dynamic_bsz=True",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"))
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu is None
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu is None


@pytest.mark.parametrize(("override", "budget_key"), [
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null", "use_dynamic_bsz"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null", "log_prob_use_dynamic_bsz"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null", "log_prob_use_dynamic_bsz"),
    ("critic.forward_micro_batch_size_per_gpu=null", "use_dynamic_bsz"),
])
def test_a_null_size_cut_by_rows_is_refused_naming_both_keys(files, override, budget_key):  # noqa: F811
    with nothing_started(), pytest.raises(ValueError) as info:
        validate_config(load_config(line(files, override)))
    message = str(info.value)
    assert override.split("=")[0] in message and f"{budget_key}=False" in message, message


def test_a_global_size_beside_a_null_per_gpu_size_is_divided(files):  # noqa: F811
    cfg = load_config(line(files, "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"))
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4  # 8 over 2 ranks
    with pytest.raises(ValueError, match="both given"):  # a real per-GPU size beside it is still refused
        load_config(line(files, "actor_rollout_ref.actor.ppo_micro_batch_size=8",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"))
