"""Which checkpoints the `native` rollout can run, read from a model's config alone (no torch): the config checks
refuse the others before Ray starts, and the engine checks the loaded module with the same rules."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridflow.models.moe_shape import is_moe_config

NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
"""Model types whose forward the native engine reproduces: Llama-family attention (Qwen3's with per-head q/k norms)
or DeepSeek-V3's multi-head latent attention (absorbed, over a latent cache), with dense MLPs or with
mixture-of-experts blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3), which it runs through the model's own
routing code."""
NATIVE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE scalings whose frequencies do not change with the sequence length."""


def native_unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the native rollout cannot run a model with this HF config (a config.json mapping), or None if it can."""
    model_type = config.get("model_type")
    if model_type not in NATIVE_MODEL_TYPES:
        moe = is_moe_config(config)
        kind = "a mixture-of-experts model whose attention the native engine lacks" if moe else "not implemented"
        return f"model type {model_type!r} is {kind} (it runs {NATIVE_MODEL_TYPES})"
    # Qwen families switch the window on with use_sliding_window; Mistral's set it by its size alone.
    sliding = config.get("use_sliding_window") if "use_sliding_window" in config else config.get("sliding_window")
    if sliding:
        return "it does not implement sliding-window attention"
    scaling = config.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in NATIVE_ROPE_TYPES:
        return f"it supports rope types {NATIVE_ROPE_TYPES}, not {rope_type!r}"
    return None
