"""The routing shape of a mixture-of-experts model, read from its HF config alone (no transformers import, so the
config checks before Ray can read it cheaply)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EXPERT_COUNT_KEYS", "MoeShape", "is_moe_config", "moe_shape_of"]

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""The names HF MoE configs give their routed-expert count (Mixtral; Qwen2/3-MoE; DeepSeek-V3), in lookup order."""


@dataclass(frozen=True)
class MoeShape:
    """The routing shape of an MoE model: routed experts per MoE layer, experts per token, and the MoE layers'
    count (DeepSeek-V3's first `first_k_dense_replace` layers are dense)."""

    num_experts: int
    top_k: int
    num_moe_layers: int


def moe_shape_of(config: Any) -> MoeShape | None:
    """The routing shape of a HF config, or None for a dense model."""
    num_experts = next((value for key in EXPERT_COUNT_KEYS if (value := getattr(config, key, None))), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not num_experts or not top_k:
        return None
    dense = getattr(config, "first_k_dense_replace", 0) or 0
    return MoeShape(int(num_experts), int(top_k), config.num_hidden_layers - dense)


def is_moe_config(config: Mapping[str, Any]) -> bool:
    """Whether a model's config.json mapping describes a mixture of experts (it names a routed-expert count)."""
    return any(key in config for key in EXPERT_COUNT_KEYS)
