"""A damaged checkpoint names its file and the way on (an earlier step), instead of torch's zip-archive error or a
bare JSONDecodeError."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.engines.training.checkpoint import load_shard
from hybridflow.trainer.config.resume_checks import check_resumed_settings


def test_a_truncated_shard_names_its_file(tmp_path):
    shard = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"w": torch.ones(64, 64)}, shard)
    assert torch.equal(load_shard(shard)["w"], torch.ones(64, 64))
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(RuntimeError, match=rf"checkpoint file {shard} cannot be read .* truncated or corrupted: "
                                           r"resume from an earlier global_step_N"):
        load_shard(shard)


def test_a_cut_driver_state_is_named_before_ray(tmp_path):
    step = tmp_path / "global_step_2"
    step.mkdir()
    (step / "driver_state.json").write_text(json.dumps({"global_steps": 2})[:10])
    with pytest.raises(ValueError, match=r"driver_state.json is not valid JSON .* the checkpoint is damaged"):
        check_resumed_settings(step, {"optim.lr": 1e-3})
