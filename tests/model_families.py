"""Tiny random models of any transformers family, built from its config class (tests of family coverage)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.moe import MOE_ARCHS, build_tiny_moe_model


def build_family_model(model_type: str, tokenizer, attn: str = "sdpa", **overrides) -> PreTrainedModel:
    """2 layers of 64 units (4 experts, 2 per token, where the family has experts); the project's own tiny MoE
    builders for the families it ships them for."""
    if model_type in MOE_ARCHS and not overrides:
        return build_tiny_moe_model(model_type, tokenizer=tokenizer)[0]
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
        initializer_range=0.1, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, moe_intermediate_size=32, num_experts_per_tok=2,
    )
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hasattr(config, key):
            setattr(config, key, 4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)


def save_family_model(path, model_type: str, tokenizer, attn: str = "sdpa", **overrides) -> str:
    """`build_family_model` saved with its tokenizer to `path` (returned as a string)."""
    model = build_family_model(model_type, tokenizer, attn, **overrides)
    return str(save_model_and_tokenizer(model, tokenizer, path))
