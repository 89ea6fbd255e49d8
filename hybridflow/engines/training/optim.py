"""AdamW, gradient clipping over sharded parameters, and the learning-rate schedules (constant / linear / cosine,
each with linear warm-up)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.training.config import FSDPEngineConfig, OptimConfig

logger = logging.getLogger(__name__)


def build_optimizer(module: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """`optim.optimizer` from `optim.optimizer_impl` over all trainable parameters of `module` (DTensor shards under
    FSDP2), with `optimizer_kwargs`. A torch optimizer with a fused kernel runs it where the parameters' device has
    one, unless `override_optimizer_config` names `fused` or `foreach`."""
    params = [p for p in module.parameters() if p.requires_grad]
    cls = optimizer_class(optim)
    kwargs = optimizer_kwargs(optim, cls)
    if _takes_fused_default(cls, kwargs):
        try:
            return cls(params, **kwargs, fused=True)
        except RuntimeError as err:  # a device or dtype without the fused kernel: torch's per-tensor default
            logger.info("optimizer %s: no fused kernel for these parameters (%s); torch's default", cls.__name__, err)
    return cls(params, **kwargs)


def optimizer_class(optim: OptimConfig) -> type[torch.optim.Optimizer]:
    """The class `optim.optimizer` of module `optim.optimizer_impl`; ValueError names the key and the fix."""
    try:
        source = importlib.import_module(optim.optimizer_impl)
    except ImportError as err:
        raise ValueError(
            f"optim.optimizer_impl={optim.optimizer_impl!r} cannot be imported ({err}); install its package or use "
            "torch.optim"
        ) from err
    cls = getattr(source, optim.optimizer, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        known = sorted(
            name for name, value in vars(source).items()
            if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
            and value is not torch.optim.Optimizer
        )
        raise ValueError(
            f"optim.optimizer={optim.optimizer!r} is not an optimizer class of {optim.optimizer_impl}; known: {known}"
        )
    return cls


_STANDARD_ARGS = ("betas", "eps", "weight_decay")
"""OptimConfig's own hyperparameters besides lr, passed to the classes that take them."""


def optimizer_kwargs(optim: OptimConfig, cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The keyword arguments `cls` is built with: lr, the standard hyperparameters it takes, then
    `override_optimizer_config` over them. ValueError for a key `cls` does not take, or a standard hyperparameter
    changed from its default for a class that ignores it (a setting is never accepted and then dropped)."""
    signature = inspect.signature(cls.__init__).parameters
    takes_any = any(param.kind is inspect.Parameter.VAR_KEYWORD for param in signature.values())
    name = f"{optim.optimizer_impl}.{optim.optimizer}"
    defaults = {field.name: field.default for field in dataclasses.fields(OptimConfig)}
    kwargs: dict[str, Any] = {"lr": optim.lr}
    for key in _STANDARD_ARGS:
        value = getattr(optim, key)
        if key in signature or takes_any:
            kwargs[key] = tuple(value) if key == "betas" else value
        elif value != defaults[key]:
            raise ValueError(f"optim.{key}={value!r}: {name} has no {key} parameter; drop it or use another optimizer")
    override = dict(optim.override_optimizer_config or {})
    unknown = sorted(key for key in override if key == "params" or (key not in signature and not takes_any))
    if unknown:
        known = sorted(key for key in signature if key not in ("self", "params"))
        raise ValueError(
            f"optim.override_optimizer_config has {unknown}, which {name} does not take; it takes {known}"
        )
    return {**kwargs, **override}


def _takes_fused_default(cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> bool:
    """Whether to ask for the fused kernel: a torch optimizer that has one, the user having chosen neither way."""
    fused_optimizers = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
    return cls in fused_optimizers and not ({"fused", "foreach"} & kwargs.keys())


def check_optimizer(optim: OptimConfig, section: str) -> None:
    """Before Ray starts: the optimizer class imports and takes the configured arguments (ValueError naming
    `section`.optim; `section` "" for a top-level optim section)."""
    try:
        optimizer_kwargs(optim, optimizer_class(optim))
    except ValueError as err:
        raise ValueError(f"{section}.{err}" if section else str(err)) from err


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
    num_cycles: float = 0.5,
) -> float:
    """Learning-rate factor at scheduler step `step` (0-based): linear warm-up from 0, then the schedule.

    Same formulas as transformers' `get_*_schedule_with_warmup` (which verl uses): step 0 of a warm-up has factor 0.

    constant: 1 after warm-up; linear: 1 -> min_lr_ratio at `total_steps`; cosine: min_lr_ratio + (1 - min_lr_ratio)
    * (1 + cos(2 pi num_cycles progress)) / 2, verl's formula (num_cycles 0.5: one half cosine 1 -> min_lr_ratio).
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
        wave = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * wave
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
        num_cycles=optim.num_cycles,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
