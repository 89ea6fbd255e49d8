"""Learning-rate schedules and engine config validation."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engines.training import (
    FSDPConfig,
    FSDPEngineConfig,
    OptimConfig,
    build_lr_scheduler,
    compute_lr_multiplier,
)
from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import ConfigFieldError


def test_lr_multiplier_by_hand():
    assert [compute_lr_multiplier(s, 2, 10, "constant") for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert compute_lr_multiplier(6, 2, 10, "linear") == pytest.approx(0.5)
    assert compute_lr_multiplier(10, 2, 10, "linear", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert compute_lr_multiplier(6, 2, 10, "cosine") == pytest.approx(0.5)
    expected = 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4))
    assert compute_lr_multiplier(4, 2, 10, "cosine", 0.2) == pytest.approx(expected)
    assert compute_lr_multiplier(50, 2, 10, "cosine") == pytest.approx(0.0)


def test_scheduler_follows_multiplier():
    optim = OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2, lr_scheduler_type="linear", total_training_steps=10)
    assert optim.num_warmup_steps(10) == 2
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = build_lr_scheduler(opt, FSDPEngineConfig(optim=optim))
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.875])


def test_num_warmup_steps_explicit_steps_win_over_ratio():
    assert OptimConfig(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5).num_warmup_steps(10) == 3
    assert OptimConfig(lr_warmup_steps_ratio=0.5).num_warmup_steps(10) == 5
    assert OptimConfig(lr_warmup_steps_ratio=0.5).num_warmup_steps(-1) == 0


def test_schedule_length_defaults_to_the_trainer_steps():
    """optim.total_training_steps=-1 takes the engine's (trainer's) total; a positive value overrides it."""
    trainer_steps = FSDPEngineConfig(
        optim=OptimConfig(lr=1.0, lr_warmup_steps_ratio=0.2, lr_scheduler_type="linear"), total_training_steps=10
    )
    assert trainer_steps.schedule_steps == 10
    own_steps = FSDPEngineConfig(
        optim=OptimConfig(lr=1.0, lr_scheduler_type="linear", total_training_steps=4), total_training_steps=10
    )
    assert own_steps.schedule_steps == 4
    lrs = {}
    for name, config in (("trainer", trainer_steps), ("own", own_steps)):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=config.optim.lr)
        sched = build_lr_scheduler(opt, config)
        lrs[name] = []
        for _ in range(4):
            lrs[name].append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
    assert lrs["trainer"] == pytest.approx([0.0, 0.5, 1.0, 0.875])
    assert lrs["own"] == pytest.approx([1.0, 0.75, 0.5, 0.25])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_grad": -1.0}, "^clip_grad=-1.0 must be >= 0"),
        ({"min_lr_ratio": 2.0}, "^min_lr_ratio=2.0 must be in"),
        ({"lr_warmup_steps_ratio": 1.0}, r"^lr_warmup_steps_ratio=1.0 must be in \[0.0, 1.0\)"),
        ({"lr": -1.0}, "^lr=-1.0 must be >= 0"),
        ({"weight_decay": -0.1}, "^weight_decay=-0.1 must be >= 0"),
        ({"lr_warmup_steps": -2}, "^lr_warmup_steps=-2 must be >= -1"),
        ({"betas": (0.9, 1.0)}, r"^betas\[1\]=1.0 must be in"),
    ],
)
def test_optim_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ConfigFieldError, match=match):
        OptimConfig(**kwargs)


@pytest.mark.parametrize(
    ("optim", "match"),
    [
        ({"lr_scheduler_type": "cosine"}, "^optim.lr_scheduler_type='cosine' needs the number of training steps"),
        ({"lr_warmup_steps_ratio": 0.1}, "^optim.lr_warmup_steps_ratio=0.1 needs the number of training steps"),
    ],
)
def test_engine_config_schedule_needs_steps(optim, match):
    """A schedule that needs its length is refused by the engine config until some total is known."""
    OptimConfig(**optim)  # the section alone does not know the trainer's steps
    with pytest.raises(ConfigFieldError, match=match):
        FSDPEngineConfig(optim=OptimConfig(**optim))
    FSDPEngineConfig(optim=OptimConfig(**optim), total_training_steps=10)
    FSDPEngineConfig(optim=OptimConfig(**optim, total_training_steps=10))


def test_engine_config_nests_sections():
    config = FSDPEngineConfig(
        model=ModelConfig(lora_rank=4, enable_gradient_checkpointing=True),
        fsdp=FSDPConfig(dtype="float32", param_offload=True),
        optim=OptimConfig(clip_grad=0.5),
    )
    assert config.model.use_lora and config.model.enable_gradient_checkpointing
    assert config.fsdp.dtype == "float32" and config.fsdp.param_offload
    assert config.optim.clip_grad == 0.5
    assert FSDPEngineConfig().model.use_lora is False


def test_engine_config_rejects_zero_micro_batch():
    with pytest.raises(ConfigFieldError, match="^micro_batch_size_per_gpu=0 must be >= 1"):
        FSDPEngineConfig(micro_batch_size_per_gpu=0)
