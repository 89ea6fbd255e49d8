"""The routing shape of a mixture-of-experts model, read from its HF config alone (no transformers import, so the
config checks before Ray can read it cheaply)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoeShape", "moe_shape_of"]


@dataclass(frozen=True)
class MoeShape:
    """The routing shape of an MoE model: routed experts per MoE layer, experts per token, and the MoE layers'
    count (DeepSeek-V3's first `first_k_dense_replace` layers are dense)."""

    num_experts: int
    top_k: int
    num_moe_layers: int


def moe_shape_of(config: Any) -> MoeShape | None:
    """The routing shape of a HF config, or None for a dense model."""
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    num_experts = num_experts or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        return None
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    return MoeShape(int(num_experts), int(top_k), config.num_hidden_layers - dense)
