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


def test_cosine_cycles_follow_verls_formula():
    """num_cycles=1 goes down to min_lr_ratio at half the schedule and back up to 1 at its end (verl's formula);
    0.5 is the half cosine of before."""
    assert compute_lr_multiplier(5, 0, 10, "cosine", 0.2, num_cycles=1.0) == pytest.approx(0.2)
    assert compute_lr_multiplier(10, 0, 10, "cosine", 0.2, num_cycles=1.0) == pytest.approx(1.0)
    for step in range(11):
        assert compute_lr_multiplier(step, 0, 10, "cosine", 0.1, num_cycles=0.5) == compute_lr_multiplier(
            step, 0, 10, "cosine", 0.1
        )
    with pytest.raises(ConfigFieldError, match="^num_cycles=1.0 shapes the cosine schedule only"):
        OptimConfig(num_cycles=1.0)


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _module():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_default_adamw_runs_the_fused_kernel_with_the_configured_hyperparameters():
    from hybridflow.engines.training import build_optimizer

    optimizer = build_optimizer(_module(), OptimConfig(lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05))
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["fused"] is True  # CPU has torch's fused AdamW too
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.1, (0.8, 0.9), 1e-6, 0.05)


def test_fused_and_per_tensor_adamw_take_the_same_steps():
    """The fused kernel is AdamW: ten steps of it land where torch's per-tensor loop does, to float rounding."""
    from hybridflow.engines.training import build_optimizer

    modules = {}
    for name, override in (("fused", None), ("loop", {"foreach": False})):
        torch.manual_seed(0)
        module = _module()
        optimizer = build_optimizer(module, OptimConfig(lr=0.05, override_optimizer_config=override))
        assert optimizer.param_groups[0]["fused"] is (True if override is None else None)
        for step in range(10):
            loss = module(torch.full((2, 3), float(step))).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        modules[name] = module
    for fused, loop in zip(modules["fused"].parameters(), modules["loop"].parameters()):
        torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)


def test_another_optimizer_class_and_overrides_are_built_as_configured():
    from hybridflow.engines.training import build_optimizer

    sgd = build_optimizer(
        _module(), OptimConfig(optimizer="SGD", lr=0.1, override_optimizer_config={"momentum": 0.9, "nesterov": True})
    )
    assert type(sgd) is torch.optim.SGD
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["nesterov"] is True
    assert sgd.param_groups[0]["weight_decay"] == 0.01  # the section's default, which SGD takes


@pytest.mark.parametrize(
    ("optim", "match"),
    [
        ({"optimizer": "AdamWW"}, r"optimizer='AdamWW' is not an optimizer class of torch.optim; known: \[.*'AdamW'"),
        ({"optimizer_impl": "no_such_optim_package"}, "optimizer_impl='no_such_optim_package' cannot be imported"),
        ({"override_optimizer_config": {"fusd": True}},
         r"override_optimizer_config has \['fusd'\], which torch.optim.AdamW does not take; it takes \[.*'fused'"),
        ({"optimizer": "SGD", "eps": 1e-6}, "eps=1e-06: torch.optim.SGD has no eps parameter"),
        ({"override_optimizer_config": {"params": []}}, r"override_optimizer_config has \['params'\]"),
    ],
)
def test_optimizer_choices_are_checked_naming_the_key(optim, match):
    from hybridflow.engines.training.optim import check_optimizer

    with pytest.raises(ValueError, match="^actor_rollout_ref.actor.optim." + match):
        check_optimizer(OptimConfig(**optim), "actor_rollout_ref.actor")


def test_an_optimizer_name_that_is_no_python_name_is_refused():
    with pytest.raises(ConfigFieldError, match="^optimizer_impl='torch optim' is not a Python name"):
        OptimConfig(optimizer_impl="torch optim")
