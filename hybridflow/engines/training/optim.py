"""AdamW, gradient clipping over sharded parameters, and the learning-rate schedules (constant / linear / cosine,
each with linear warm-up)."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.training.config import FSDPEngineConfig, OptimConfig


def build_optimizer(module: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over all trainable parameters of `module` (DTensor shards under FSDP2)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )


def clip_grad_norm_over_meshes(parameters, max_norm: float) -> torch.Tensor:
    """Clip the gradients of `parameters` to a global 2-norm of `max_norm` (inf: measure only); returns the norm
    before clipping, a plain tensor (collective under FSDP2).

    `torch.nn.utils.clip_grad_norm_` combines the per-parameter norms in one stack, which fails when DTensors live
    on different meshes (expert parallelism: the experts on (efsdp, ep), everything else on all ranks). Each
    mesh's gradients give their own total norm, made whole with `full_tensor()`; the squares add up."""
    groups: dict[object, list[nn.Parameter]] = {}  # parameters with a gradient, by their gradient's mesh
    for param in parameters:
        if param.grad is not None:
            mesh = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(mesh, []).append(param)
    if not groups:
        return torch.tensor(0.0)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([param.grad for param in params], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in norms]), 2.0)
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def compute_lr_multiplier(
    step: int,
    num_warmup_steps: int,
    total_steps: int,
    scheduler_type: str,
    min_lr_ratio: float = 0.0,
) -> float:
    """Learning-rate factor at scheduler step `step` (0-based): linear warm-up from 0, then the schedule.

    Same formulas as transformers' `get_*_schedule_with_warmup` (which verl uses): step 0 of a warm-up has factor 0.

    constant: 1 after warm-up; linear: 1 -> min_lr_ratio at `total_steps`; cosine: half cosine 1 -> min_lr_ratio.
    Steps past `total_steps` keep the final factor.
    """
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    if scheduler_type == "constant":
        return 1.0
    decay_steps = max(total_steps - num_warmup_steps, 1)
    progress = min((step - num_warmup_steps) / decay_steps, 1.0)
    if scheduler_type == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    if scheduler_type == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_scheduler_type={scheduler_type!r} is not known; use constant, linear or cosine")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: FSDPEngineConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `compute_lr_multiplier`; call `.step()` once per training step."""
    optim, total_steps = config.optim, config.schedule_steps
    multiplier = functools.partial(
        compute_lr_multiplier,
        num_warmup_steps=optim.num_warmup_steps(total_steps),
        total_steps=total_steps,
        scheduler_type=optim.lr_scheduler_type,
        min_lr_ratio=optim.min_lr_ratio,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
