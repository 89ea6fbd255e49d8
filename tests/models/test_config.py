"""ModelConfig.override_config: verl's attn_implementation is applied; other HF overrides are refused."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import ConfigFieldError


def test_attn_implementation_defaults_to_sdpa_and_reaches_the_engine(tmp_path):
    from hybridflow.models import save_tiny_model

    tiny_llama_dir = save_tiny_model(tmp_path, arch="llama", seed=0)
    assert ModelConfig().attn_implementation == "sdpa"
    config = FSDPEngineConfig(model=ModelConfig(override_config={"attn_implementation": "eager"}))
    engine = build_fsdp_engine(tiny_llama_dir, config)
    assert engine.module.config._attn_implementation == "eager"


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"rope_theta": 1.0}, r"\['rope_theta'\] are not applied"),
        ({"attn_implementation": "flash_attention_9"}, "is not known"),
    ],
)
def test_unapplied_overrides_are_refused(override, match):
    with pytest.raises(ConfigFieldError, match=match) as info:
        ModelConfig(override_config=override)
    assert info.value.field.startswith("override_config")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_the_package_is_refused_with_the_install_command():
    with pytest.raises(ConfigFieldError, match="pip install flash-attn"):
        ModelConfig(override_config={"attn_implementation": "flash_attention_2"})


def test_flash_attention_with_shared_prompt_forwards_is_refused(monkeypatch):
    monkeypatch.setattr("hybridflow.models.config.check_override_config", lambda override: None)
    model = ModelConfig(override_config={"attn_implementation": "flash_attention_2"})
    with pytest.raises(ConfigFieldError, match="block attention mask"):
        FSDPEngineConfig(model=model, share_prompts=True)
    FSDPEngineConfig(model=model)  # alone it is a valid config (the engine then needs a CUDA device)
    with pytest.raises(ConfigFieldError, match="Ulysses attention wraps sdpa or eager"):
        FSDPEngineConfig(model=dataclasses.replace(model, use_remove_padding=True), ulysses_sequence_parallel_size=2)
