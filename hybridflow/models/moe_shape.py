"""The routing shape of a mixture-of-experts model, read from its HF config alone (no transformers import, so the
config checks before Ray can read it cheaply)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPERT_COUNT_KEYS", "MoeShape", "ROUTED_MODEL_TYPES", "REPLAY_MODEL_TYPES", "is_moe_config", "moe_shape_of",
    "moe_routing_unsupported_reason",
]

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""The names HF MoE configs give their routed-expert count (Mixtral; Qwen2/3-MoE; DeepSeek-V3), in lookup order."""


@dataclass(frozen=True)
class MoeShape:
    """The routing shape of an MoE model: routed experts per MoE layer, experts per token, and the MoE layers'
    count (DeepSeek-V3's first `first_k_dense_replace` layers are dense)."""

    num_experts: int
    top_k: int
    num_moe_layers: int


ROUTED_MODEL_TYPES = (
    "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "olmoe", "gpt_oss", "granitemoe", "granitemoeshared",
    "glm4_moe", "minimax", "cohere2_moe", "ernie4_5_moe", "exaone_moe", "phimoe", "hunyuan_v1_moe", "afmoe",
    "llama4_text", "llama4",
)
"""MoE families whose routers the engine hooks (one router per MoE layer of a shape `router_kinds` reads): router
losses, routing metrics. Each is built tiny and checked in tests/engines/training/test_moe_families.py."""

REPLAY_MODEL_TYPES = tuple(t for t in ROUTED_MODEL_TYPES if t != "phimoe")
"""The families router replay (R3) serves: replaying a router's own choice gives its own weights (tested). PhiMoE's
sparsemixer weighs experts by a masked second softmax that the router's outputs do not determine."""


TOP_K_KEYS = ("moe_topk", "num_experts_per_tok")
"""The names HF MoE configs give the experts per token (Hunyuan-MoE's first: it may also carry the other)."""


def moe_shape_of(config: Any) -> MoeShape | None:
    """The routing shape of a HF config (a multimodal one's text model: Llama-4's), or None for a dense model."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    num_experts = next((value for key in EXPERT_COUNT_KEYS if (value := getattr(config, key, None))), None)
    top_k = next((value for key in TOP_K_KEYS if (value := getattr(config, key, None))), None)
    if not num_experts or not top_k:
        return None
    return MoeShape(int(num_experts), int(top_k), sum(map(_is_moe_layer(config), range(config.num_hidden_layers))))


def _is_moe_layer(config: Any):
    """Which decoder layers hold experts, by each family's own keys (the others hold a dense MLP)."""
    get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
    if get("moe_layers") is not None:  # Llama-4: the MoE layers listed
        return lambda i: i in set(config.moe_layers)
    if get("num_dense_layers") is not None:  # AFMoE: dense layers first
        return lambda i: i >= config.num_dense_layers
    if get("mlp_layer_types") is not None:  # Exaone-MoE, Cohere2-MoE: "sparse" / "dense" per layer
        return lambda i: config.mlp_layer_types[i] != "dense"
    if get("moe_layer_interval") is not None:  # Ernie-4.5-MoE
        end = get("moe_layer_end_index", -1)
        end = config.num_hidden_layers - 1 if end is None or end < 0 else end
        return lambda i: (i + 1) % config.moe_layer_interval == 0 and get("moe_layer_start_index", 0) <= i <= end
    if get("decoder_sparse_step") is not None:  # Qwen2/3-MoE
        dense = set(get("mlp_only_layers") or ())
        return lambda i: i not in dense and (i + 1) % config.decoder_sparse_step == 0
    first_sparse = get("first_k_dense_replace", 0) or 0  # DeepSeek-V3, GLM-4-MoE
    return lambda i: i >= first_sparse


def moe_routing_unsupported_reason(config: Any, *, replay: bool) -> str | None:
    """Why the engine cannot hook this MoE model's routers (for router losses) or, with `replay`, replay them; None
    when it can (or the model is dense). `config`: a HF config or a config.json mapping."""
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    text = get("text_config") or {}
    text_get = text.get if isinstance(text, Mapping) else lambda key: getattr(text, key, None)
    if not any(get(key) or text_get(key) for key in EXPERT_COUNT_KEYS):
        return None
    model_type = get("model_type")
    families = REPLAY_MODEL_TYPES if replay else ROUTED_MODEL_TYPES
    if model_type not in families:
        return f"model type {model_type!r} is not among the mixture-of-experts families it serves: {families}"
    return None


def is_moe_config(config: Mapping[str, Any]) -> bool:
    """Whether a model's config.json mapping describes a mixture of experts (it, or its `text_config`, names a
    routed-expert count)."""
    text = config.get("text_config") or {}
    return any(key in config or key in text for key in EXPERT_COUNT_KEYS)
