"""Value-head models for critics and reward models, and the pure helpers that turn token scores into rewards.

As in verl, a critic or a model-based reward model is an `AutoModelForTokenClassification` with `num_labels=1`
on a causal-LM backbone: the backbone weights come from the causal-LM checkpoint, the `score` head (hidden -> 1)
is newly initialised unless the checkpoint already holds one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AutoModelForTokenClassification, PreTrainedModel

from hybridflow.models.loader import build_empty_model, load_model_config, split_model_location, to_torch_dtype


def build_value_model(
    path_or_name: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str = "sdpa",
    head_init_seed: int = 0,
    trust_remote_code: bool = False,
    require_trained_head: bool = False,
    empty: bool = False,
    config_overrides: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """Token-level value model (`...ForTokenClassification`, `num_labels=1`, no dropout) from a checkpoint.

    Args:
        path_or_name: catalogue name, model directory (causal LM or token classifier) or `.gguf` file.
        dtype: parameter dtype.
        attn_implementation: 'sdpa', 'eager' or 'flex_attention'.
        head_init_seed: seed of a newly initialised `score` head (normal(0, initializer_range), zero bias),
            identical on every rank and every run.
        trust_remote_code: allow model code shipped in the checkpoint directory.
        require_trained_head: raise when the checkpoint has no `score` weight (a reward model must bring its
            trained head; a fresh one would score at random).
        empty: build the architecture on the meta device without reading any weight (the caller fills it, e.g.
            from rank 0: `engines.training.rank0_init`).
        config_overrides: values set on the model's HF config first (`loader.apply_config_overrides`).

    Returns:
        A model whose `forward(input_ids, attention_mask, position_ids, use_cache=False).logits` is (bs, seq, 1).
    """
    directory, gguf = split_model_location(path_or_name)
    extra = {"gguf_file": gguf} if gguf else {}
    extra["trust_remote_code"] = trust_remote_code
    config = load_model_config(path_or_name, trust_remote_code, overrides=config_overrides)
    config.num_labels = 1
    # GenericForTokenClassification defaults to dropout 0.1; values must be deterministic.
    config.classifier_dropout = 0.0
    if empty:
        return build_empty_model(AutoModelForTokenClassification, config, dtype, attn_implementation, trust_remote_code)
    model, info = AutoModelForTokenClassification.from_pretrained(
        directory,
        config=config,
        dtype=to_torch_dtype(dtype),
        attn_implementation=attn_implementation,
        output_loading_info=True,
        **extra,
    )
    missing = set(info["missing_keys"])
    if require_trained_head and "score.weight" in missing:
        raise ValueError(
            f"{path_or_name} has no trained score head (it looks like a causal-LM checkpoint): a reward model must be "
            "a sequence- or token-classification checkpoint with one label"
        )
    _init_missing_head(model, missing, seed=head_init_seed)
    return model


def _init_missing_head(model: PreTrainedModel, missing_keys: set[str], seed: int) -> None:
    """Re-initialise a new `score` head from a seeded generator, so that every rank starts from the same head."""
    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    with torch.no_grad():
        for name, param in model.score.named_parameters():
            if f"score.{name}" not in missing_keys:
                continue
            if name == "weight":
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32) * std)
            else:
                param.zero_()


def compute_last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """attention_mask: (bs, seq) 0/1 with at least one 1 per row -> (bs,) int64 index of the last 1."""
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (attention_mask.bool().long() * positions).argmax(dim=-1)


def compute_sequence_scores(token_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score of each sequence: the token score at its last attended token.

    token_scores: (bs, seq) float; attention_mask: (bs, seq) 0/1 -> (bs,) float.
    """
    index = compute_last_token_index(attention_mask)
    return token_scores.gather(1, index[:, None]).squeeze(1)


def compute_token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last response token, zeros elsewhere (verl's `token_level_scores`).

    scores: (bs,) float; response_mask: (bs, response_len) 0/1 -> (bs, response_len) float.
    A row with an empty response gets its score on position 0.
    """
    index = compute_last_token_index(response_mask)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    return out.scatter_(1, index[:, None], scores[:, None])
