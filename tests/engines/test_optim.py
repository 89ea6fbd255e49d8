"""Learning-rate schedules and engine config validation."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_lr_scheduler, compute_lr_multiplier


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
    assert optim.num_warmup_steps == 2
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optim.lr)
    sched = build_lr_scheduler(opt, optim)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.875])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr_scheduler_type": "cosine"}, "total_training_steps"),
        ({"lr_warmup_steps_ratio": 0.1}, "total_training_steps"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"min_lr_ratio": 2.0}, "min_lr_ratio"),
    ],
)
def test_optim_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kwargs)


def test_engine_config_rejects_zero_micro_batch():
    with pytest.raises(ValueError, match="micro_batch_size_per_gpu"):
        FSDPEngineConfig(micro_batch_size_per_gpu=0)
