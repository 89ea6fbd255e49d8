"""Which training-engine forwards a model supports, read from its config alone (no torch, so the config checks
refuse the others before Ray starts). The engine checks the loaded model itself at start (`forward_check`), so a
model these rules do not know is still caught, after Ray.

- Packed rows (`use_remove_padding`, and the shared-prompt and Ulysses layouts built on them) need every layer to
  be attention that restarts at each packed sequence: a recurrent, linear-attention or convolution layer carries
  its state from one packed sequence into the next.
- The fused head (`use_fused_kernels`) projects the hidden states itself; it applies the model's soft cap
  (`final_logit_softcapping`) and measures and folds in a plain scale, so no config rule refuses it (the engine's
  probe still compares it with the model's own head).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ATTENTION_LAYER_TYPES", "PACKING_UNSUPPORTED_MODEL_TYPES", "packing_unsupported_reason"]

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""transformers' `layer_types` entries that are attention layers (the others: linear attention, Mamba, convolution)."""

PACKING_UNSUPPORTED_MODEL_TYPES = {
    "gpt_oss": "its attention with sinks gives packed rows other log-probs than padded ones (measured: 0.95 at "
               "most on a tiny gpt-oss, transformers 5.23)",
    "afmoe": "its packed rows give other log-probs than padded ones (measured: 1.31 at most, 0.46 on average on a "
             "tiny AFMoE with sliding and global attention layers, transformers 5.23)",
}
"""Attention-only families whose packed forward was measured wrong (`forward_check`'s probe found them)."""


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    return config.get("text_config") or config


def packing_unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why packed rows would compute other values than padded ones for a model with this config.json mapping, or
    None when the rules know no reason."""
    text = _text_config(config)
    model_type = text.get("model_type", config.get("model_type"))
    if model_type in PACKING_UNSUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r}: {PACKING_UNSUPPORTED_MODEL_TYPES[model_type]}"
    others = sorted({kind for kind in text.get("layer_types") or () if kind not in ATTENTION_LAYER_TYPES})
    if others:
        return (
            f"model type {model_type!r} has {others} layers, which carry their state from one packed sequence into "
            "the next"
        )
    return None
