"""ModelConfig.override_config: verl's attn_implementation picks the kernel, other keys are set on the model's HF
config (training engines, the rollout's copy, vLLM's hf_overrides, the context-length check); Megatron's sections
are refused."""

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
        ({"model_config": {"max_position_embeddings": 32768}}, r"override_config\['model_config'\] configures verl's Meg"),
        ({"attn_implementation": "flash_attention_9"}, "is not known"),
    ],
)
def test_unapplied_overrides_are_refused(override, match):
    with pytest.raises(ConfigFieldError, match=match) as info:
        ModelConfig(override_config=override)
    assert info.value.field.startswith("override_config")


def test_hf_config_overrides_are_set_on_the_models_the_engine_builds(tmp_path):
    """A value that changes the forward (rms_norm_eps) changes the engine's log-probs, so it is applied, not only
    stored; the meta-device build (rank-0 loading) and value models take it too; a dict value sets a dict key."""
    import torch

    from hybridflow.models import save_tiny_model
    from hybridflow.models.loader import apply_config_overrides, build_causal_lm
    from hybridflow.models.value_head import build_value_model

    path = save_tiny_model(tmp_path, arch="llama", seed=0)
    overrides = {"rms_norm_eps": 0.5, "max_position_embeddings": 4096}
    model = ModelConfig(override_config={"attn_implementation": "eager", **overrides})
    assert model.hf_config_overrides == overrides
    plain = build_fsdp_engine(path, FSDPEngineConfig())
    changed = build_fsdp_engine(path, FSDPEngineConfig(model=model))
    assert changed.module.config.max_position_embeddings == 4096 and changed.module.config.rms_norm_eps == 0.5
    assert changed.module.config._attn_implementation == "eager"
    ids = torch.arange(3, 11).reshape(1, 8)
    with torch.no_grad():
        assert not torch.allclose(plain.module(ids).logits, changed.module(ids).logits, atol=1e-3)
    assert build_causal_lm(path, empty=True, config_overrides=overrides).config.rms_norm_eps == 0.5
    assert build_value_model(path, config_overrides=overrides).config.max_position_embeddings == 4096
    nested = apply_config_overrides(build_causal_lm(path).config, {"rope_scaling": {"rope_type": "linear",
                                                                                     "factor": 2.0}})
    assert nested.rope_scaling["rope_type"] == "linear" and nested.rope_scaling["factor"] == 2.0  # a dict key
    # verl's docs/advance/rope.rst: `rope_scaling.{type: yarn, ...}` keeps the base frequency, and the model builds
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    scaled = build_causal_lm(path, config_overrides={"rope_scaling": yarn})
    theta = build_causal_lm(path).config.rope_parameters["rope_theta"]
    assert scaled.config.rope_parameters["rope_type"] == "yarn" and scaled.config.rope_parameters["rope_theta"] == theta
    with torch.no_grad():
        assert torch.isfinite(scaled(ids).logits).all()
    from transformers import Llama4Config

    multimodal = apply_config_overrides(Llama4Config(), {"text_config": {"max_position_embeddings": 77}})
    assert multimodal.text_config.max_position_embeddings == 77  # a dict value updates a sub-config


def test_vllm_takes_the_overrides_as_hf_overrides():
    import torch

    from hybridflow.engines.rollout.config import RolloutConfig
    from hybridflow.engines.rollout.vllm_convert import compute_vllm_engine_kwargs

    common = dict(tokenizer_dir="t", device=torch.device("cpu"), config=RolloutConfig(name="vllm"),
                  logprobs_mode="processed_logprobs", kv_cache_memory_bytes=None, seed=0)
    kwargs = compute_vllm_engine_kwargs("m", **common, hf_overrides={"max_position_embeddings": 32768})
    assert kwargs["hf_overrides"] == {"max_position_embeddings": 32768}
    assert "hf_overrides" not in compute_vllm_engine_kwargs("m", **common)


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
