"""How the training engine wraps a model: FSDP2 units (each decoder layer, each expert-parallel experts module on
its own mesh, the root) and activation checkpointing of the decoder layers."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hybridflow.engines.training.config import FSDPEngineConfig
from hybridflow.engines.training.expert_parallel import apply_expert_fsdp
from hybridflow.env import dist_world_size
from hybridflow.models.loader import resolve_dtype, to_torch_dtype
from hybridflow.utils.device import get_dist_backend

logger = logging.getLogger(__name__)

__all__ = [
    "apply_fsdp2", "check_one_rank_lora", "enable_activation_checkpointing", "join_group_for_param_offload",
    "join_single_rank_group",
]


def join_single_rank_group(config: FSDPEngineConfig, device: torch.device) -> bool:
    """Give a lone rank that computes below float32 a process group of its own, as a one-rank torchrun would;
    True if one was made. An engine built afterwards shards over it and computes through FSDP2's mixed precision
    (parameters cast once per forward, bf16 activations and residual stream over float32 master weights) instead
    of autocast over unsharded float32 weights.

    Opt-in, not the engine's default. On an H200 (2026-11-28, `gpu_profile.py --sections levers`, one process)
    it made qwen2-0.5b's update 0.965x autocast's time (0.661 s against 0.685 s; log-prob 0.219 s against 0.229 s)
    but broke LoRA on CUDA (FSDP2 assigned a bf16 gradient to a float32 shard), which no CPU run reproduces.
    The group uses an in-memory store (no port) and the device's backend. A rank of a larger worker group
    (WORLD_SIZE > 1, joined or not), or one computing in float32 (the CPU default), is left as it is."""
    if not _alone() or resolve_dtype(config.fsdp.compute_dtype, device) == torch.float32:
        return False
    _join_one_rank_group(device)
    logger.info(
        "one rank computing in %s: a one-rank process group runs FSDP2's mixed precision", config.fsdp.compute_dtype
    )
    return True


def join_group_for_param_offload(config: FSDPEngineConfig, device: torch.device) -> bool:
    """Give a lone rank on an accelerator that sets `fsdp_config.param_offload` a process group of its own; True if
    one was made. Parameter offload is FSDP2's CPUOffloadPolicy (parameters, gradients and the optimizer step on
    the host, each layer copied to the device for its forward and backward), which needs a group to shard over:
    without one the engine would keep the whole module on the device and the setting would do nothing. On a CPU
    the device is the host, so a lone CPU rank is left as it is (its parameters are on the host already)."""
    if not config.fsdp.param_offload or device.type == "cpu" or not _alone():
        return False
    _join_one_rank_group(device)
    logger.info("one rank with param_offload on %s: a one-rank process group runs FSDP2's CPU offload", device)
    return True


def _alone() -> bool:
    """This process is in no process group and no larger worker group (WORLD_SIZE 1 or unset)."""
    return dist.is_available() and not dist.is_initialized() and dist_world_size() == 1


def _join_one_rank_group(device: torch.device) -> None:
    if device.type == "cuda" and device.index is None:  # init_process_group's device_id needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend=get_dist_backend(), store=dist.HashStore(), rank=0, world_size=1,
        device_id=device if device.type == "cuda" else None,
    )


def check_one_rank_lora(
    lora: bool, sharded: bool, world_size: int, device: torch.device, param_dtype: torch.dtype
) -> None:
    """Refuse LoRA under FSDP2's mixed precision over a one-rank CUDA group: its first update fails there (torch
    2.11: FSDP2 assigns a bf16 gradient to a float32 shard; seen on an H200, 2026-11-28, not on CPU)."""
    if lora and sharded and world_size == 1 and device.type == "cuda" and param_dtype != torch.float32:
        raise RuntimeError(
            "LoRA with FSDP2's bf16 mixed precision over a one-rank process group fails on CUDA (FSDP2 assigns a "
            "bf16 gradient to a float32 shard): run this rank without a process group (autocast; a lone GPU with "
            "fsdp_config.param_offload=True joins one, so leave param_offload off), or set fsdp_config.dtype=float32"
        )


def apply_fsdp2(
    module: nn.Module, config: FSDPEngineConfig, device: torch.device, mesh: Any = None, expert_mesh: Any = None
) -> nn.Module:
    """Shard every decoder layer (classes in `module._no_split_modules`) and then the root over `mesh` (default:
    a 1-D mesh of all ranks), in place; with expert parallelism each experts module first over `expert_mesh`."""
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    param_dtype = resolve_dtype(config.fsdp.compute_dtype, device)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=to_torch_dtype(config.fsdp.reduce_dtype),
    )
    # Pinned memory needs an accelerator: CPUOffloadPolicy() fails on CPU-only hosts.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if config.fsdp.param_offload else OffloadPolicy()
    kwargs = {"mp_policy": mp_policy, "offload_policy": offload}
    layer_names = set(getattr(module, "_no_split_modules", None) or ())
    layers = [sub for sub in module.modules() if type(sub).__name__ in layer_names]
    if expert_mesh is not None:
        apply_expert_fsdp(
            module, expert_mesh, dist.get_world_size(), reshard_after_forward=config.fsdp.reshard_after_forward, **kwargs
        )
    if not layers:
        logger.warning("no decoder layers (%s) found in %s; sharding the root only", layer_names, type(module).__name__)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=config.fsdp.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, final norm, head) are needed again right after forward.
    fully_shard(module, mesh=mesh, reshard_after_forward=False, **kwargs)
    if config.fsdp.forward_prefetch:
        prefetch_next_layers(layers)
    return module


def prefetch_next_layers(layers: list[nn.Module]) -> None:
    """Each sharded decoder layer starts the next one's all-gather before its own forward computes (FSDP2's
    explicit forward prefetch; `layers` in execution order, as the model registers them)."""
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])


def enable_activation_checkpointing(module: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, under either name transformers has given
    the switch (`activation_checkpointing_enable` in 5.23; only `gradient_checkpointing_enable` in 5.17). A layer's
    recomputation in backward runs under the Ulysses context of its forward (`ulysses.checkpoint_context_fn`)."""
    from hybridflow.engines.training.ulysses import checkpoint_context_fn

    kwargs = {"use_reentrant": False, "context_fn": checkpoint_context_fn}
    if hasattr(module, "activation_checkpointing_enable"):
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
