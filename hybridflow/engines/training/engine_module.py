"""The HF module a training engine wraps: the checkpoint's causal LM or value model, with LoRA adapters and a frozen
vision tower where the config asks (built before sharding, loaded or empty on the meta device)."""

from __future__ import annotations

import os
import warnings

from torch import nn

from hybridflow.engines.training.config import FSDPEngineConfig
from hybridflow.models.loader import build_causal_lm, to_torch_dtype
from hybridflow.models.lora import apply_lora
from hybridflow.models.value_head import build_value_model
from hybridflow.models.vision import vision_tower_of


def build_engine_module(
    model_path: str | os.PathLike, config: FSDPEngineConfig, model_kind: str, *, empty: bool
) -> nn.Module:
    """The HF module of `model_kind` (with LoRA adapters when configured) in `fsdp.model_dtype`: loaded, or `empty`
    on the meta device."""
    model = config.model
    load = dict(dtype=config.fsdp.weight_dtype, attn_implementation=config.attn_implementation,
                trust_remote_code=model.trust_remote_code, empty=empty, config_overrides=model.hf_config_overrides)
    if model_kind == "causal_lm":
        module = build_causal_lm(model_path, **load)
    else:  # a reward model is a value model that must bring its trained head
        module = build_value_model(model_path, require_trained_head=model_kind == "reward", **load)
    if model.use_lora:
        with warnings.catch_warnings():  # an adapter's weights read into meta tensors: rank 0 sends them later
            warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model.*")
            module = apply_lora(
                module, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                target_modules=model.lora_target_modules, adapter_path=model.lora_adapter_path,
                target_parameters=model.lora_target_parameters, exclude_modules=model.lora_exclude_modules,
            )
        if config.fsdp.weight_dtype != "float32":  # peft makes float32 adapters; FSDP2 shards one dtype per group
            module.to(to_torch_dtype(config.fsdp.weight_dtype))
    if config.freeze_vision_tower:
        vision_tower_of(module).requires_grad_(False)
    return module
