"""MoE settings are checked before Ray starts: router replay needs the hf rollout's recording, unsupported verl
keys are refused naming the key."""

from __future__ import annotations

import pytest

from hybridflow.trainer.config.loader import load_config

R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]


def test_router_replay_r3_with_recording_is_accepted():
    config = load_config(R3)
    assert config.actor_rollout_ref.actor.router_replay.mode == "R3"
    assert config.actor_rollout_ref.rollout.enable_rollout_routing_replay
    assert load_config([]).actor_rollout_ref.actor.router_replay.mode == "disabled"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (R3[:1], "actor_rollout_ref.actor.router_replay.mode='R3'"),
        (R3[1:], "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
        (["actor_rollout_ref.actor.router_replay.mode=R2"], "actor_rollout_ref.actor.router_replay.mode='R2'"),
        (["actor_rollout_ref.actor.router_replay.replay_file=r.pt"], "actor_rollout_ref.actor.router_replay.replay_file"),
        ([*R3, "actor_rollout_ref.rollout.name=native"], "enable_rollout_routing_replay=True"),
        ([*R3, "actor_rollout_ref.actor.use_prefix_grouper=true"], "padded and packed forwards only"),
        (["actor_rollout_ref.rollout.expert_parallel_size=2"], "actor_rollout_ref.rollout.expert_parallel_size=2"),
        (["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"], "expert_model_parallel_size"),
    ],
)
def test_unsupported_moe_settings_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ValueError) as err:
        load_config(overrides)
    assert key in str(err.value)
