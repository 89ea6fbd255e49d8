"""Attention masks for the training forwards, built on the device from what the layout already knows.

Handed a 2D padding mask, or no mask and packed position ids, transformers picks its mask by reading values on the host:
- whether any padding is left (`_ignore_causal_mask_sdpa`);
- whether the position ids restart (`find_packed_sequence_indices`).

That is one device synchronisation per forward, and so per micro-batch. The 2026-11-27 H200 bundle found these with
`set_sync_debug_mode("error")`. A prepared 4D mask is taken as it is. These pure functions build the same masks that
transformers would build, in the form each attention kernel takes, without reading a value:
- sdpa: bool, True = may attend;
- eager: additive float, 0 or the dtype's minimum.

flex_attention gets a block mask instead (`block_mask`): the same pattern as a function of the query and key
positions, evaluated block by block, so no (total x total) tensor exists. Packed rows and shared prompts use it.

Three kinds of model keep transformers' own mask building, and with it the synchronisation:
- models with sliding-window or chunked layers, where one mask for every layer would be wrong;
- flash_attention_2, which takes the position ids instead of a mask, and flex_attention on padded rows;
- mixture-of-experts models, whose router loss reads the 2D padding mask (their expert loop syncs anyway).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.models.moe_shape import EXPERT_COUNT_KEYS

__all__ = [
    "DENSE_MASK_KERNELS", "PREBUILT_MASK_KERNELS", "takes_prebuilt_mask", "causal_padding_mask", "packed_causal_mask",
    "packed_segments", "packed_allowed", "dense_mask", "block_mask", "for_kernel",
]

DENSE_MASK_KERNELS = ("sdpa", "eager")
"""Attention kernels that take a dense 4D mask as it is."""
PREBUILT_MASK_KERNELS = (*DENSE_MASK_KERNELS, "flex_attention")
"""Attention kernels whose masks the layouts build (flex_attention: a block mask)."""



def takes_prebuilt_mask(config) -> bool:
    """Whether a model of this (text) config gets one dense causal mask for every layer: a dense-mask kernel, every
    layer full attention (no sliding window, no attention chunks), and no experts."""
    if getattr(config, "_attn_implementation", None) not in PREBUILT_MASK_KERNELS:
        return False
    if any(getattr(config, key, None) for key in EXPERT_COUNT_KEYS):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    if getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None) is not None:
        return False
    return getattr(config, "attention_chunk_size", None) is None


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(bs, 1, seq, seq) bool from a (bs, seq) padding mask: key j is visible to query i when j <= i and j is a real
    token (transformers' causal mask with padding, without its no-padding shortcut)."""
    seq = attention_mask.size(-1)
    index = torch.arange(seq, device=attention_mask.device)
    causal = index[None, :] <= index[:, None]
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """(total,) int64: the sequence of each token of one packed row of (1, total) position ids. A sequence starts
    wherever the position does not follow the previous one (transformers' packed-sequence rule)."""
    row = position_ids.reshape(-1)
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[1:] = row[1:] != row[:-1] + 1
    return starts.cumsum(0)


def dense_mask(allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], length: int,
               device: torch.device) -> torch.Tensor:
    """(1, 1, length, length) bool: `allowed(q, kv)` over every pair of one row's positions (what `block_mask`
    evaluates block by block)."""
    index = torch.arange(length, device=device)
    return allowed(index[:, None], index[None, :])[None, None]


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, 1, total, total) bool for one packed row of (1, total) position ids: causal within each sequence."""
    segment = packed_segments(position_ids)
    return dense_mask(packed_allowed(segment), segment.numel(), segment.device)


def block_mask(allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], length: int, device: torch.device,
               rows: int = 1):
    """flex_attention's BlockMask over `rows` rows of `length` tokens, where `allowed(q, kv)` says (elementwise, on
    flat position tensors, `row * length + column`) whether query q may attend to key kv of the same row. The
    pattern is evaluated block by block, compiled, so no (length x length) tensor is made."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, kv):
        return allowed(b * length + q, b * length + kv)

    return create_block_mask(mask_mod, rows, None, length, length, device=device, _compile=True)


def packed_allowed(segment: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`allowed(q, kv)` of a packed row: causal within each sequence of `segment`."""
    return lambda q, kv: (kv <= q) & (segment[kv] == segment[q])


def for_kernel(allowed: torch.Tensor, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """`allowed` (bool, True = may attend) in the form `kernel` takes: as it is for sdpa; for eager, 0 where allowed
    and the minimum of `dtype` (the model's activations) elsewhere, which its softmax turns into 0."""
    if kernel == "sdpa":
        return allowed
    if kernel == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min
        )
    raise ValueError(f"attention kernel {kernel!r} takes no dense mask; one of {DENSE_MASK_KERNELS} does")
