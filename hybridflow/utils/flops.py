"""Model FLOPs of a training or forward pass, and model FLOPs utilisation (what `perf/mfu/*` reports).

Model FLOPs count what the model needs for a batch, as PaLM's MFU (appendix B) and verl's flops counter do:
- 2 FLOPs per matmul weight per token in the forward, 4 more in the backward (6 for an update);
- attention's scores and weighted values (QK^T and PV): 4 x layers x heads x head_dim FLOPs per (query, key)
  pair in the forward, over the full seq_len^2 pairs of each sequence (verl's and PaLM's convention; a causal
  kernel needs about half). A shared-prompt row `[prompt, r1, ..., rn]` counts P^2 + sum_i (2 P R_i + R_i^2):
  what the n separate sequences would count, less the prompt's repeats;
- the vocabulary head: 2 x hidden x vocab per position that is projected (the engine projects only the positions
  that predict response tokens).
Not counted: recomputation (activation checkpointing, the fused head's backward), elementwise work, the embedding
lookup, a vision tower. The tokens are those the training engine computes: padding is not counted, and a prompt
shared by a group's samples (`use_prefix_grouper`) counts once per micro-batch, not once per sample as verl's
counter would, so that MFU stays the hardware's share of its peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

__all__ = [
    "ForwardWork",
    "ModelFlopsShape",
    "compute_mfu",
    "compute_model_flops",
    "model_flops_shape",
    "sequence_attention_pairs",
]


@dataclass(frozen=True)
class ModelFlopsShape:
    """The sizes that set a decoder's FLOPs per token."""

    matmul_params: int
    """Weights of the matmuls every token goes through: the decoder layers' linear layers (and a value head), not
    the embedding table nor the vocabulary head."""
    head_params: int
    """hidden x vocab of the vocabulary head (0 for value models)."""
    num_layers: int
    num_heads: int
    head_dim: int


def compute_model_flops(
    shape: ModelFlopsShape, num_tokens: int, attention_pairs: int, num_projected: int, *, backward: bool
) -> float:
    """Model FLOPs of passes over `num_tokens` tokens.

    Args:
        shape: the model's sizes.
        num_tokens: tokens that went through the decoder layers (no padding).
        attention_pairs: (query, key) pairs of attention: sum of seq_len^2 over the sequences (see the module's
            docstring; `sequence_attention_pairs`).
        num_projected: positions projected to the vocabulary (response tokens of a causal LM; 0 for value models).
        backward: training passes (forward + backward: 3x the forward's FLOPs) rather than forwards only.

    Returns:
        FLOPs, e.g. 2 x 134.5M x 4,608 = 1.24e12 for a SmolLM2 forward over 8 x 576 tokens, before attention.
    """
    forward = (
        2 * shape.matmul_params * num_tokens
        + 4 * shape.num_layers * shape.num_heads * shape.head_dim * attention_pairs
        + 2 * shape.head_params * num_projected
    )
    return float(forward * (3 if backward else 1))


def sequence_attention_pairs(sequence_lengths: Sequence[int]) -> int:
    """Attention pairs of separate sequences: the sum of their squared lengths."""
    return sum(length * length for length in sequence_lengths)


@dataclass(frozen=True)
class ForwardWork:
    """What an engine's forwards computed (the inputs of `compute_model_flops`), for passes with or without autograd."""

    num_tokens: int = 0
    attention_pairs: int = 0
    num_projected: int = 0


def compute_mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: `flops` done in `seconds`, over the device's peak FLOP/s (a fraction, 0.45 = 45%)."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"seconds and peak_flops_per_s must be > 0, got {seconds} and {peak_flops_per_s}")
    return flops / seconds / peak_flops_per_s


def model_flops_shape(module: nn.Module) -> ModelFlopsShape:
    """The sizes of an HF decoder (causal LM, value model, or a peft / FSDP / tensor-parallel wrapping of one).

    Every `nn.Linear` weight counts as a per-token matmul except the vocabulary head (`get_output_embeddings`);
    sharded (DTensor) weights count their full size. Tied embeddings count once, as the head.
    """
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_weight = head.weight if isinstance(head, nn.Linear) else None
    matmul = sum(
        sub.weight.numel() for sub in module.modules() if isinstance(sub, nn.Linear) and sub.weight is not head_weight
    )
    config = text_config(base.config)
    return ModelFlopsShape(
        matmul_params=int(matmul),
        head_params=int(head_weight.numel()) if head_weight is not None else 0,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        head_dim=attention_head_dim(config),
    )


def text_config(config):
    """The language model's config of an HF config (a vision-language model's text part; else the config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_head_dim(config) -> int:
    """Per-head width: `head_dim` when the config sets it, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
