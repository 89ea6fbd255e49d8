"""Pure tensor functions the native forward's attention variants share (Llama-family and latent attention)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm / Qwen2RMSNorm / DeepseekV3RMSNorm: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """RoPE on the last dim: rotate-half pairs (i, i + d/2), or DeepSeek's interleaved pairs (2i, 2i + 1) written
    back as [evens | odds] (transformers' `apply_rotary_pos_emb_interleave`); cos, sin: (..., d) as
    `cat(freqs, freqs)`, broadcastable to x."""
    half = x.shape[-1] // 2
    if interleave:
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
