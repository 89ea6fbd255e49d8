"""Multi-head latent attention (MLA: DeepSeek-V2/V3) for the native rollout, in its absorbed form over a latent
cache.

HF's `DeepseekV3Attention` expands every cached latent into per-head keys and values (`kv_b_proj`) at each step.
Here the cache holds, per token and layer, only the normalised latent `c` (kv_lora_rank) and the rotated shared
key `k_rot` (qk_rope_head_dim), as one key/value head of width rank + rope. `kv_b_proj`'s two halves are absorbed
into the query and the output instead:

    score(h, t) = q_nope[h] . (W_uk[h] c_t) + q_rot[h] . k_rot_t = (W_uk[h]^T q_nope[h]) . c_t + q_rot[h] . k_rot_t
    out[h]      = sum_t p(h, t) W_uv[h] c_t                      = W_uv[h] (sum_t p(h, t) c_t)

so attention runs as multi-query attention of the `num_heads` queries `[W_uk^T q_nope | q_rot]` over keys
`[c | k_rot]` and values `c` (a view of the keys' first kv_lora_rank features: no second tensor), followed by
`W_uv` per head. The same sums in another order: log-probs equal HF's to float rounding. A DeepSeek-V3 token
then caches 576 numbers per layer instead of 128 heads x (192 + 128).

`W_uk` and `W_uv` are views of `kv_b_proj.weight`, so in-place weight updates reach them at once.

Under rollout tensor parallelism each rank holds its heads' rows of `q_b_proj` (or `q_proj`) and `kv_b_proj`, and
its heads' columns of `o_proj` (`DEEPSEEK_V3_ROLLOUT_PLAN`); the latent projections are replicated, so every rank
caches the whole latent and the per-head products above need no exchange until o_proj's sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engines.rollout.native.ops import rms_norm, rotate


@dataclass(frozen=True)
class MLAShape:
    """The attention widths of an MLA config."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool

    @classmethod
    def of(cls, config, tp_size: int = 1) -> MLAShape | None:
        """The shape of an MLA model's config, or None for another attention. Under rollout tensor parallelism of
        `tp_size` ranks, `num_heads` is one rank's share (the latent and its rotated key are every rank's); the
        sharded build has checked that they divide (`check_rollout_tp_layout`)."""
        if getattr(config, "kv_lora_rank", None) is None:
            return None
        return cls(
            num_heads=config.num_attention_heads // tp_size, q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim, rope_interleave=bool(getattr(config, "rope_interleave", False)),
        )

    @property
    def cache_dim(self) -> int:
        """Width of one cached token: the latent and the shared rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLAWeights:
    """References to one MLA layer's parameters (views for the absorbed halves of kv_b_proj)."""

    q: torch.Tensor | None
    """q_proj (heads * qk_head_dim, hidden), when the query is not low-rank."""
    q_a: torch.Tensor | None
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_a_eps: float
    q_b: torch.Tensor | None
    kv_a: torch.Tensor
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor
    kv_a_eps: float
    absorb_k: torch.Tensor
    """(heads, qk_nope_head_dim, kv_lora_rank): W_uk, a view of kv_b_proj.weight."""
    absorb_v: torch.Tensor
    """(heads, v_head_dim, kv_lora_rank): W_uv, a view of kv_b_proj.weight."""
    scaling: float

    @classmethod
    def of(cls, attn: nn.Module, shape: MLAShape) -> MLAWeights:
        kv_b = attn.kv_b_proj.weight.view(shape.num_heads, shape.qk_nope_head_dim + shape.v_head_dim, -1)
        low_rank = shape.q_lora_rank is not None
        return cls(
            q=None if low_rank else attn.q_proj.weight,
            q_a=attn.q_a_proj.weight if low_rank else None,
            q_a_bias=attn.q_a_proj.bias if low_rank else None,
            q_a_norm=attn.q_a_layernorm.weight if low_rank else None,
            q_a_eps=attn.q_a_layernorm.variance_epsilon if low_rank else 0.0,
            q_b=attn.q_b_proj.weight if low_rank else None,
            kv_a=attn.kv_a_proj_with_mqa.weight, kv_a_bias=attn.kv_a_proj_with_mqa.bias,
            kv_a_norm=attn.kv_a_layernorm.weight, kv_a_eps=attn.kv_a_layernorm.variance_epsilon,
            absorb_k=kv_b[:, : shape.qk_nope_head_dim], absorb_v=kv_b[:, shape.qk_nope_head_dim :],
            scaling=float(attn.scaling),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if isinstance(t, torch.Tensor)]


def latent_queries_and_keys(
    h: torch.Tensor, w: MLAWeights, shape: MLAShape, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised states h (..., hidden) -> absorbed queries (..., heads, rank + rope), already scaled, and the
    tokens' cache entries (..., rank + rope). cos, sin: (..., rope) broadcastable to h's leading dims."""
    if w.q is not None:
        q = F.linear(h, w.q)
    else:
        q = F.linear(rms_norm(F.linear(h, w.q_a, w.q_a_bias), w.q_a_norm, w.q_a_eps), w.q_b)
    q = q.unflatten(-1, (shape.num_heads, shape.qk_nope_head_dim + shape.qk_rope_head_dim))
    q_nope, q_rot = q.split([shape.qk_nope_head_dim, shape.qk_rope_head_dim], dim=-1)
    latent, k_rot = F.linear(h, w.kv_a, w.kv_a_bias).split([shape.kv_lora_rank, shape.qk_rope_head_dim], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, w.kv_a_eps)
    q_rot = rotate(q_rot, cos.unsqueeze(-2), sin.unsqueeze(-2), shape.rope_interleave)
    k_rot = rotate(k_rot, cos, sin, shape.rope_interleave)
    q_latent = per_head_product(q_nope, w.absorb_k)  # each head's query taken into the latent space
    queries = torch.cat([q_latent, q_rot], dim=-1) * w.scaling
    return queries, torch.cat([latent, k_rot], dim=-1)


def expand_values(latent_out: torch.Tensor, w: MLAWeights) -> torch.Tensor:
    """Attention outputs in the latent space (..., heads, rank) -> (..., heads * v_head_dim) through W_uv."""
    return per_head_product(latent_out, w.absorb_v.transpose(-1, -2)).flatten(-2)


def per_head_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each head's rows times that head's matrix: x (..., heads, d_in), weight (heads, d_in, d_out) ->
    (..., heads, d_out), as one `bmm` over the heads. (`matmul` would broadcast the weight over the leading dims and
    copy it once per row: on a 2-core CPU that copy took 60% of a decode step.)"""
    heads, d_in = x.shape[-2:]
    rows = x.reshape(-1, heads, d_in).transpose(0, 1)  # (heads, rows, d_in)
    return torch.bmm(rows, weight).transpose(0, 1).reshape(*x.shape[:-1], weight.shape[-1])
