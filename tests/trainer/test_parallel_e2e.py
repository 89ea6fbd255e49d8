"""End-to-end PPO with tensor-parallel and sequence-parallel training on 2 Ray workers (tiny model): the driver's
batches go to each data-parallel group once, the peers train together, and the run learns like any other."""

from __future__ import annotations

import math

import pytest

from hybridflow.trainer.config import load_config, validate_config
from tests.tiny_runs import build_workspace
from tests.trainer.placement_runs import overrides, train


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("parallel"), train_size=8, test_size=2)


def _check_run(records: dict[int, dict], digests: list) -> None:
    assert sorted(records) == [1, 2]
    for step in (1, 2):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss"):
            assert math.isfinite(records[step][key]), f"step {step} {key}={records[step][key]}"
        assert records[step]["actor/grad_norm"] > 0
    (actor_start, _), (actor_end, _) = digests
    assert actor_end != actor_start, "the updates changed the weights"


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_tensor_parallel_ppo_with_critic(workspace, ray_cluster):
    records, digests = train(overrides(
        workspace, workspace / "tp2",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2",
        "critic.model.fsdp_config.tensor_parallel_size=2",
        "critic.optim.lr=1e-3",
    ))
    _check_run(records, digests)
    for step in (1, 2):
        assert math.isfinite(records[step]["critic/vf_loss"]) and records[step]["critic/grad_norm"] > 0


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_sequence_parallel_grpo(workspace, ray_cluster):
    records, digests = train(overrides(
        workspace, workspace / "sp2",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    ))
    _check_run(records, digests)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=3"], "cannot form groups"),
        (["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2", "trainer.n_gpus_per_node=4",
          "actor_rollout_ref.model.path=smollm2-135m-instruct"], "does not divide the model's num_attention_heads=9"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "use_remove_padding=True"),
        (["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
          "actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2", "trainer.n_gpus_per_node=4"],
         "combining them is not implemented"),
        (["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2", "actor_rollout_ref.model.lora_rank=8"],
         "LoRA"),
        (["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2",
          "actor_rollout_ref.ref.fsdp_config.tensor_parallel_size=1"], "differ from the actor's"),
        (["actor_rollout_ref.actor.fsdp_config.tensor_parallel_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.n=1",
          "algorithm.adv_estimator=reinforce_plus_plus"], None),
    ],
)
def test_invalid_layouts_are_refused_before_ray_starts(workspace, extra, words):
    config = load_config(overrides(workspace, workspace / "never", *extra))
    if words is None:  # 1 prompt x n=1 over one data-parallel group (tp=2 on 2 ranks): valid
        sizes = validate_config(config)
        assert sizes["actor"].mini_batch_samples_per_rank == 1
        return
    with pytest.raises(ValueError, match=words):
        validate_config(config)


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_reward_loop_serves_a_tensor_parallel_reward_model(workspace, ray_cluster):
    """verl's reward loop on 2 ranks: the reward model is one replica of 2 tensor-parallel ranks, scores every
    re-templated conversation, and its score alone is the training reward."""
    from hybridflow.models import save_tiny_reward_model

    rm_dir = workspace / "tiny_rm"
    if not rm_dir.exists():
        save_tiny_reward_model(rm_dir, num_layers=2, hidden=64, seed=5)
    records, digests = train(overrides(
        workspace, workspace / "reward_loop",
        "custom_reward_function.path=null", "data.return_raw_chat=True",
        "reward_model.enable=True", "reward_model.use_reward_loop=True", f"reward_model.model.path={rm_dir}",
        "reward_model.rollout.name=hf", "reward_model.rollout.tensor_model_parallel_size=2",
        "reward_model.rollout.prompt_length=256", "reward_model.rollout.response_length=64",
        "reward_model.rollout.max_num_batched_tokens=512", "reward_model.num_workers=2",
    ))
    _check_run(records, digests)
    for step in (1, 2):
        assert records[step]["reward/rm_score/mean"] == pytest.approx(records[step]["critic/score/mean"], abs=1e-6)
        assert records[step]["reward/rm_score/mean"] != 0.0
