"""Loading HF causal LMs and their tokenizers from a directory, a GGUF file or a catalogue name.

Everything that turns a name or path into a `PreTrainedModel` / tokenizer lives here, so that engines,
workers and data code agree on dtype names, pad tokens and chat templates.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.models.catalogue import clear_quantization_markers, resolve_model_path
from hybridflow.models.chat_template import CHATML_TEMPLATE

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map 'float32'/'fp32'/'bfloat16'/'bf16'/'float16'/'fp16' (or a torch.dtype) to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not known; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype setting on `device`: 'auto' is bfloat16 on accelerators and float32 on CPU (bf16 matmuls are about
    20x slower on CPUs without bf16 units); any other name as `to_torch_dtype`."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return to_torch_dtype(dtype)


def split_model_location(path_or_name: str | os.PathLike, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Resolve a catalogue name / directory / `.gguf` file to `(directory, gguf_file_name_or_None)`."""
    if gguf_file is not None:
        return str(path_or_name), gguf_file
    resolved = Path(resolve_model_path(path_or_name))
    if resolved.is_file() and resolved.suffix == ".gguf":
        return str(resolved.parent), resolved.name
    return str(resolved), None


def load_tokenizer(
    path_or_name: str | os.PathLike, *, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """A tokenizer with a chat template and a pad token (eos when the checkpoint has none).

    Args:
        path_or_name: a catalogue name, a model directory, or a `.gguf` file.
        gguf_file: file name inside `path_or_name` when it is a directory holding a GGUF file.
        trust_remote_code: allow tokenizer code shipped in the checkpoint directory.
    """
    directory, gguf = split_model_location(path_or_name, gguf_file)
    extra = {"gguf_file": gguf} if gguf else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code, **extra)
    return prepare_tokenizer(tokenizer)


def with_chat_template(tokenizer: PreTrainedTokenizerBase, template: str | None) -> PreTrainedTokenizerBase:
    """`tokenizer` rendering conversations with `template` (a Jinja chat template; None keeps its own)."""
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Set the pad token to eos when missing and a ChatML chat template when missing (one warning each)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("tokenizer has neither a pad token nor an eos token; add one before training")
        logger.warning("tokenizer has no pad token; using eos %r as pad", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        logger.warning("tokenizer has no chat template; using ChatML")
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def apply_config_overrides(config: Any, overrides: Mapping[str, Any]) -> Any:
    """Set `overrides` on a HF config in place (verl's `update_model_config`): a dict value for a sub-config
    (e.g. text_config) updates it key by key; returns the config.

    `rope_scaling` (verl's docs: `override_config.rope_scaling.{type: yarn, factor, ...}`) is merged into the
    config's rope parameters: transformers 5 keeps them there, `rope_theta` included, and assigning
    `rope_scaling` would replace them and lose the base frequency."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        parameters = getattr(config, "rope_parameters", None)
        if key == "rope_scaling" and isinstance(value, Mapping) and isinstance(parameters, Mapping):
            merged = {**parameters, **value}
            if "type" in value:
                merged["rope_type"] = value["type"]
            config.rope_parameters = merged
        elif isinstance(value, Mapping) and current is not None and not isinstance(current, Mapping):
            apply_config_overrides(current, value)
        else:
            setattr(config, key, value)
    return config


def load_model_config(
    path_or_name: str | os.PathLike, trust_remote_code: bool = False, gguf_file: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The HF config of a catalogue name / directory / `.gguf` file (or `gguf_file` inside the directory), without
    loading weights, with `overrides` set on it (`apply_config_overrides`)."""
    directory, gguf = split_model_location(path_or_name, gguf_file)
    extra = {"gguf_file": gguf} if gguf else {}
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code, **extra)
    return apply_config_overrides(config, overrides or {})


def causal_lm_class(config: Any) -> Any:
    """The transformers auto class that builds a text generator from `config`: `AutoModelForCausalLM`, or
    `AutoModelForImageTextToText` for vision-language models (e.g. Qwen2-VL), which have no CausalLM class."""
    if getattr(config, "vision_config", None) is not None:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def build_causal_lm(
    path_or_name: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    gguf_file: str | None = None,
    attn_implementation: str | None = "sdpa",
    trust_remote_code: bool = False,
    empty: bool = False,
    config_overrides: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """Load an HF causal LM (or a vision-language model, which generates text) on CPU from a catalogue name, a
    directory or a GGUF file.

    GGUF weights are dequantized by transformers; the quantizer markers are cleared so that the model
    saves with `save_pretrained` like any other.

    Args:
        path_or_name: catalogue name (e.g. 'smollm2-135m-instruct'), model directory or `.gguf` file.
        dtype: parameter dtype ('float32' on CPU).
        gguf_file: file name inside the directory `path_or_name`, for GGUF checkpoints.
        attn_implementation: 'sdpa', 'eager' or 'flex_attention'; None: transformers' choice (sdpa where the family
            has it, else eager).
        trust_remote_code: allow model code shipped in the checkpoint directory.
        empty: build the architecture on the meta device without reading any weight (the caller fills it, e.g.
            from rank 0: `engines.training.rank0_init`).
        config_overrides: values set on the model's HF config before it is built (`apply_config_overrides`).
    """
    directory, gguf = split_model_location(path_or_name, gguf_file)
    config = load_model_config(path_or_name, trust_remote_code, gguf_file, config_overrides)
    auto_cls = AutoModelForCausalLM if gguf else causal_lm_class(config)
    if empty:
        return build_empty_model(auto_cls, config, dtype, attn_implementation, trust_remote_code)
    kwargs = {
        "dtype": to_torch_dtype(dtype),
        "attn_implementation": attn_implementation,
        "trust_remote_code": trust_remote_code,
    }
    if gguf:
        kwargs["gguf_file"] = gguf
    if config_overrides:  # a GGUF file's config is read from the file by from_pretrained itself
        kwargs["config"] = config
    model = auto_cls.from_pretrained(directory, **kwargs)
    if gguf:
        clear_quantization_markers(model)
    return model


def build_empty_model(
    auto_cls: Any, config: Any, dtype: str | torch.dtype, attn_implementation: str, trust_remote_code: bool
) -> PreTrainedModel:
    """`auto_cls`'s model for `config` on the meta device: the architecture, no storage, no weight read."""
    with torch.device("meta"):
        return auto_cls.from_config(
            config, dtype=to_torch_dtype(dtype), attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )


def load_model_and_tokenizer(
    path_or_name: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    gguf_file: str | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`build_causal_lm` and `load_tokenizer` on the same location."""
    model = build_causal_lm(path_or_name, dtype=dtype, gguf_file=gguf_file, attn_implementation=attn_implementation)
    return model, load_tokenizer(path_or_name, gguf_file=gguf_file)


def save_model_and_tokenizer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, path: str | os.PathLike
) -> Path:
    """Write `model` (safetensors) and `tokenizer` into directory `path`; returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path
