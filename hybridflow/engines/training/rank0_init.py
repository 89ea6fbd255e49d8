"""Loading a model once for a whole process group: rank 0 reads the checkpoint, every rank shards an empty copy.

Without this, each of N ranks reads the full float32 model into host memory and moves it whole to its device
before sharding: N full copies at peak (a 7B model on 8 ranks: about 8 x 28 GB of host RAM). Instead:
- rank 0 loads the checkpoint on CPU and keeps its tensors (`Rank0Weights`);
- every rank builds the same architecture on the meta device (`build_causal_lm(..., empty=True)`), reading no
  weights;
- every rank applies tensor parallel and FSDP2 to its meta module and allocates only its own shards
  (`to_empty`);
- `set_model_state_dict(..., broadcast_from_rank0=True)` sends each tensor from rank 0 and each rank keeps its
  shard, one tensor at a time;
- buffers that are not in state dicts (e.g. rotary `inv_freq`, left as garbage by `to_empty`) are broadcast
  from rank 0 too (the pitfall in PLATFORM.md: a NaN loss otherwise).
Host memory at peak: one full copy on rank 0's node, none elsewhere; device memory: the shards only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Rank0Weights", "materialize_from_rank0", "weights_of"]


@dataclass
class Rank0Weights:
    """Rank 0's full tensors of a module that is on the meta device on every rank (empty on the other ranks)."""

    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    """The module's state dict (persistent parameters and buffers), full tensors on CPU."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Buffers that state dicts leave out (non-persistent), by their name in `named_buffers()`."""


def weights_of(module: nn.Module) -> Rank0Weights:
    """A loaded module's tensors (rank 0): its state dict and the buffers that the state dict leaves out."""
    state_dict = dict(module.state_dict())
    buffers = {name: buf for name, buf in module.named_buffers() if name not in state_dict}
    return Rank0Weights(state_dict=state_dict, buffers=buffers)


def materialize_from_rank0(module: nn.Module, weights: Rank0Weights, device: torch.device) -> None:
    """Allocate a sharded meta `module` on `device` and fill it with rank 0's tensors, in place (collective:
    every rank of the default group calls it; only rank 0's `weights` are read)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank()
    module.to_empty(device=device)
    set_model_state_dict(
        module,
        weights.state_dict if rank == 0 else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    non_persistent = sorted(name for name, _ in module.named_buffers() if name not in _persistent_names(module))
    for name in non_persistent:  # the same names in the same order on every rank
        buffer = module.get_buffer(name)
        if rank == 0:
            if name not in weights.buffers:
                raise RuntimeError(f"rank 0 holds no value for the buffer {name!r} (not in the state dict)")
            buffer.copy_(weights.buffers[name])
        dist.broadcast(buffer, src=0)
    weights.state_dict.clear()
    weights.buffers.clear()


def _persistent_names(module: nn.Module) -> set[str]:
    """Names of the buffers that the module's state dict holds."""
    names = set()
    for prefix, sub in module.named_modules():
        for name in sub._buffers:
            if name not in sub._non_persistent_buffers_set:
                names.add(f"{prefix}.{name}" if prefix else name)
    return names
