"""Ulysses sequence parallelism: each rank of a group holds a slice of one packed row; attention all-to-alls.

Around attention, an all-to-all turns (all heads, sequence slice) into (heads slice, whole sequence), attention
runs over the whole packed row with a block-diagonal causal mask built from its position ids (a new sequence
starts where the position id is 0), and a second all-to-all turns it back. Everything else (projections, MLP,
norms, the head) is token-wise and runs on the local slice. The attention kernel is registered with transformers'
`AttentionInterface` under `ULYSSES_ATTENTION` and wraps the model's own implementation (sdpa or eager).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from hybridflow.models.parallel_plan import head_replicas

__all__ = [
    "ULYSSES_ATTENTION",
    "enable_ulysses_attention",
    "gather_sequence",
    "pad_packed_row",
    "ulysses_context",
]

ULYSSES_ATTENTION = "hybridflow_ulysses"
SUPPORTED_INNER = ("sdpa", "eager")


@dataclass
class _Active:
    group: dist.ProcessGroup
    mask: torch.Tensor  # (1, 1, total, total) bool, True = may attend


_ACTIVE: _Active | None = None


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into `size` chunks along `scatter_dim`, send chunk j to rank j, concatenate what arrives along
    `gather_dim` (autograd: the backward is the reverse all-to-all)."""
    size = dist.get_world_size(group)
    chunks = x.movedim(scatter_dim, 0)
    chunks = chunks.reshape(size, chunks.size(0) // size, *chunks.shape[1:]).contiguous()
    received = dist_fn.all_to_all_single(torch.empty_like(chunks), chunks, group=group)
    # received[j] is rank j's chunk: put the ranks' slices side by side along the gathered dim.
    parts = [received[j].movedim(0, scatter_dim) for j in range(size)]
    return torch.cat(parts, dim=gather_dim)


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """(batch, heads, local_len, dim) inputs -> (batch, local_len, heads, dim) output, attending over the row."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    active = _ACTIVE
    if active is None:
        raise RuntimeError("the Ulysses attention ran outside ulysses_context(); the engine sets it per forward")
    inner_name = getattr(module, "_hybridflow_inner_attention", "sdpa")
    size, groups = dist.get_world_size(active.group), getattr(module, "num_key_value_groups", 1)
    # Fewer key/value heads than ranks: each rank gets the one its query heads attend with, and autograd sums the
    # replicas' gradients back into the head.
    replicas = head_replicas(key.size(1), size)
    if replicas > 1:
        key, value = (t.repeat_interleave(replicas, dim=1) for t in (key, value))
    query, key, value = (_all_to_all(t, active.group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    mask = active.mask
    if inner_name == "eager":
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min
        )
    inner = ALL_ATTENTION_FUNCTIONS["sdpa"] if inner_name == "sdpa" else _eager()
    kwargs.pop("is_causal", None)
    module.num_key_value_groups = groups // replicas  # this rank's query heads per key/value head
    try:
        output, _ = inner(module, query, key, value, mask, is_causal=False, **kwargs)  # (b, total, heads/sp, d)
    finally:
        module.num_key_value_groups = groups
    return _all_to_all(output, active.group, scatter_dim=1, gather_dim=2), None


def _eager():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def enable_ulysses_attention(module: nn.Module, inner: str) -> None:
    """Route `module`'s attention through the Ulysses kernel wrapping `inner` (sdpa or eager), in place."""
    from transformers import AttentionInterface

    if inner not in SUPPORTED_INNER:
        raise ValueError(
            f"ulysses_sequence_parallel_size > 1 needs attn_implementation in {SUPPORTED_INNER}, got {inner!r}"
        )
    AttentionInterface.register(ULYSSES_ATTENTION, _attention)
    for sub in module.modules():
        sub._hybridflow_inner_attention = inner
    module.set_attn_implementation(ULYSSES_ATTENTION)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, total) position ids of a packed row -> (1, 1, total, total) bool mask: causal within each sequence
    (sequences start where the position id is 0 or stops growing by one)."""
    pos = position_ids[0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    seq = torch.cumsum(starts.long(), 0)
    index = torch.arange(pos.numel(), device=pos.device)
    mask = (seq[:, None] == seq[None, :]) & (index[None, :] <= index[:, None])
    return mask[None, None]


def pad_packed_row(ids: torch.Tensor, pos: torch.Tensor, multiple: int, pad_id: int = 0) -> tuple[torch.Tensor, ...]:
    """Pad a packed row (1, total) to a multiple of `multiple` tokens with a separate dummy sequence (positions
    from 0), which attends only to itself and is never read back."""
    pad = (-ids.size(1)) % multiple
    if not pad:
        return ids, pos
    return (
        torch.cat([ids, ids.new_full((1, pad), pad_id)], dim=1),
        torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1),
    )


@contextlib.contextmanager
def ulysses_context(group: dist.ProcessGroup, full_position_ids: torch.Tensor) -> Iterator[None]:
    """Make the Ulysses kernel attend over the packed row whose position ids are `full_position_ids` (1, total)."""
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = _Active(group=group, mask=block_causal_mask(full_position_ids))
    try:
        yield
    finally:
        _ACTIVE = previous


def checkpoint_context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` (non-reentrant): the recomputation of a checkpointed layer, which runs in
    backward after `ulysses_context` has exited, attends under the context of the forward it repeats."""
    return contextlib.nullcontext(), _restored(_ACTIVE)


@contextlib.contextmanager
def _restored(state: _Active | None) -> Iterator[None]:
    global _ACTIVE
    previous = _ACTIVE
    _ACTIVE = state
    try:
        yield
    finally:
        _ACTIVE = previous


def local_slice(total: int, group: dist.ProcessGroup) -> slice:
    """This rank's slice of a packed row of `total` tokens (a multiple of the group size)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = total // size
    return slice(rank * chunk, (rank + 1) * chunk)


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate the ranks' equal slices along dim 0 (autograd: each rank gets its slice's summed gradient)."""
    return _GatherSequence.apply(local, group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 whose backward sums the gathered gradient over the group and keeps this rank's slice.
    torch.distributed.nn's all_gather cannot serve here: on gloo its backward scatters with group-local ranks where
    global ones are expected, so it fails for every sequence-parallel group but the one holding rank 0."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return total.chunk(size, dim=0)[rank], None
