"""Attention masks for the training forwards, built on the device from what the layout already knows.

Handed a 2D padding mask, or no mask and packed position ids, transformers picks its mask by reading values on the host:
- whether any padding is left (`_ignore_causal_mask_sdpa`);
- whether the position ids restart (`find_packed_sequence_indices`).

That is one device synchronisation per forward, and so per micro-batch. The 2026-11-27 H200 bundle found these with
`set_sync_debug_mode("error")`. A prepared 4D mask is taken as it is. These pure functions build the same masks that
transformers would build, in the form each attention kernel takes, without reading a value:
- sdpa: bool, True = may attend;
- eager: additive float, 0 or the dtype's minimum.

Three kinds of model keep transformers' own mask building, and with it the synchronisation:
- models with sliding-window or chunked layers, where one mask for every layer would be wrong;
- attention kernels that take no dense mask (flash_attention_2 uses the position ids; flex_attention uses a block
  mask);
- mixture-of-experts models, whose router loss reads the 2D padding mask (their expert loop syncs anyway).
"""

from __future__ import annotations

import torch

__all__ = ["DENSE_MASK_KERNELS", "takes_prebuilt_mask", "causal_padding_mask", "packed_causal_mask", "for_kernel"]

DENSE_MASK_KERNELS = ("sdpa", "eager")
"""Attention kernels that take a dense 4D mask as it is."""


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def takes_prebuilt_mask(config) -> bool:
    """Whether a model of this (text) config gets one dense causal mask for every layer: a dense-mask kernel, every
    layer full attention (no sliding window, no attention chunks), and no experts."""
    if getattr(config, "_attn_implementation", None) not in DENSE_MASK_KERNELS:
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


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(1, 1, total, total) bool for one packed row of (1, total) position ids: causal within each sequence, where
    a sequence starts wherever the position does not follow the previous one (transformers' packed-sequence rule)."""
    row = position_ids.reshape(-1)
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[1:] = row[1:] != row[:-1] + 1
    segment = starts.cumsum(0)
    index = torch.arange(row.numel(), device=row.device)
    allowed = (index[None, :] <= index[:, None]) & (segment[None, :] == segment[:, None])
    return allowed[None, None]


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
