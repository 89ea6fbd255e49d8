"""The engine's start-up probe (`forward_check`) and the config rules beside it: a layout or fused head that would
compute other log-probs than the model's own padded forward is refused (before Ray when the config says so, at
engine start otherwise), and a plain scale on the logits is folded into the fused head."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.training import FSDPEngineConfig, build_fsdp_engine
from hybridflow.engines.training.forward_check import ForwardMismatchError, probe_batch
from hybridflow.models.config import ModelConfig
from hybridflow.models.forward_support import packing_unsupported_reason
from hybridflow.trainer.config import load_config, validate_config
from tests.engines.helpers import make_batch
from tests.helpers import grpo_overrides, nothing_started, write_rows
from tests.model_families import save_family_model


def engine_config(packed: bool, fused: bool, attn: str = "sdpa") -> FSDPEngineConfig:
    return FSDPEngineConfig(micro_batch_size_per_gpu=4, model=ModelConfig(
        use_remove_padding=packed, use_fused_kernels=fused, override_config={"attn_implementation": attn},
    ))


@pytest.mark.parametrize(("model_type", "attn", "overrides", "multiplier", "softcap"), [
    ("cohere2", "sdpa", {"logit_scale": 0.25}, 0.25, None),  # logits * logit_scale
    ("granite", "sdpa", {"logits_scaling": 4.0}, 0.25, None),  # logits / logits_scaling
    ("gemma2", "eager", {"final_logit_softcapping": 2.0}, 1.0, 2.0),  # 2.0 * tanh(logits / 2.0)
])
def test_the_fused_head_applies_what_a_model_does_to_its_logits(tmp_path, tiny_tokenizer, model_type, attn,
                                                                 overrides, multiplier, softcap):
    """A scale is measured and folded into the temperature; a soft cap is applied (and its gradient) in the chunks."""
    path = save_family_model(tmp_path / model_type, model_type, tiny_tokenizer, attn=attn, **overrides)
    batch = make_batch(len(tiny_tokenizer), batch_size=4)
    plain = build_fsdp_engine(path, engine_config(packed=False, fused=False, attn=attn))
    fused = build_fsdp_engine(path, engine_config(packed=model_type != "gemma2", fused=True, attn=attn))
    assert plain.head.logit_multiplier == 1.0 and plain.head.logit_softcap is None
    assert fused.head.logit_multiplier == pytest.approx(multiplier, rel=1e-5) and fused.head.logit_softcap == softcap
    assert fused._work == {False: type(fused._work[False])(), True: type(fused._work[True])()}  # the probe left none
    expected, _ = plain.compute_log_prob(batch, temperature=0.7)
    got, _ = fused.compute_log_prob(batch, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    assert (got - expected)[mask].abs().max().item() < 1e-5


@pytest.mark.parametrize(("model_type", "attn", "packed", "fused", "fix"), [
    ("minimax", "sdpa", True, False, "use_remove_padding=True: MiniMaxForCausalLM's packed rows"),  # linear attention
    ("gpt_oss", "eager", True, False, "use_remove_padding=True: GptOssForCausalLM's packed rows"),  # sinks
    ("afmoe", "sdpa", True, False, "use_remove_padding=True: AfmoeForCausalLM's packed rows"),
])
def test_a_forward_unlike_the_models_own_stops_the_engine_naming_the_setting(tmp_path, tiny_tokenizer, model_type,
                                                                             attn, packed, fused, fix):
    path = save_family_model(tmp_path / model_type, model_type, tiny_tokenizer, attn=attn)
    with pytest.raises(ForwardMismatchError, match=fix):
        build_fsdp_engine(path, engine_config(packed, fused, attn))
    build_fsdp_engine(path, engine_config(packed=False, fused=False, attn=attn))  # the plain forward is accepted


def test_the_probe_batch_has_what_the_layouts_must_get_right():
    batch = probe_batch(vocab_size=50)
    mask, response_mask = batch.batch["attention_mask"], batch.batch["response_mask"]
    prompt = mask[:, : mask.size(1) - response_mask.size(1)]
    assert len(set(prompt.sum(1).tolist())) > 1 and len(set(response_mask.sum(1).tolist())) > 1  # padding both ends
    assert torch.equal(batch.batch["input_ids"][0, : prompt.size(1)], batch.batch["input_ids"][1, : prompt.size(1)])
    assert torch.equal(probe_batch(50).batch["input_ids"], batch.batch["input_ids"])  # the same on every rank


def test_config_rules_name_the_layers_and_caps_they_cannot_take():
    assert "linear_attention" in packing_unsupported_reason({"model_type": "minimax",
                                                             "layer_types": ["full_attention", "linear_attention"]})
    assert "gpt_oss" in packing_unsupported_reason({"model_type": "gpt_oss"})
    assert "afmoe" in packing_unsupported_reason({"model_type": "afmoe"})
    sliding = {"model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"]}
    assert packing_unsupported_reason(sliding) is None
    vision = {"model_type": "llava", "text_config": {"model_type": "qwen3_next", "layer_types": ["linear_attention"]}}
    assert "linear_attention" in packing_unsupported_reason(vision)


@pytest.mark.parametrize(("model_type", "attn", "extra", "message"), [
    ("minimax", "sdpa", ["actor_rollout_ref.model.use_remove_padding=True"],
     r"packed rows are wrong for .*\['linear_attention'\] layers.*set actor_rollout_ref.model.use_remove_padding=False"),
    ("gpt_oss", "eager", ["actor_rollout_ref.actor.use_prefix_grouper=True"],
     r"packed rows are wrong .*gpt_oss.*use_remove_padding=False and actor_rollout_ref.actor.use_prefix_grouper=False"),
])
def test_the_config_refuses_them_before_ray(tmp_path, tiny_tokenizer, model_type, attn, extra, message):
    path = save_family_model(tmp_path / model_type, model_type, tiny_tokenizer, attn=attn)
    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k", "reasoning_gym/basic_arithmetic"] * 8)
    overrides = grpo_overrides(train_file, f"actor_rollout_ref.model.path={path}",
                               f"+actor_rollout_ref.model.override_config.attn_implementation={attn}")
    with nothing_started():
        with pytest.raises(ValueError, match=message):
            validate_config(load_config(overrides + extra))
        validate_config(load_config(overrides + ["actor_rollout_ref.model.use_remove_padding=False",
                                                 "actor_rollout_ref.model.use_fused_kernels=False"]))


def test_a_transform_on_the_logits_the_fused_head_does_not_know_stops_the_engine(tmp_path, tiny_tokenizer,
                                                                                  monkeypatch):
    """A soft cap the fused head is not told about (as a family with an unknown transform would be): the probe's
    fit of the model's logits to the head's projection leaves a residual, and the engine refuses."""
    import dataclasses

    from hybridflow.engines.training import fsdp

    path = save_family_model(tmp_path / "gemma2", "gemma2", tiny_tokenizer, attn="eager", final_logit_softcapping=2.0)
    build_head = fsdp.build_head
    uncapped = lambda *args, **kwargs: dataclasses.replace(build_head(*args, **kwargs), logit_softcap=None)  # noqa: E731
    monkeypatch.setattr(fsdp, "build_head", uncapped)
    with pytest.raises(ForwardMismatchError, match=r"use_fused_kernels=True: Gemma2ForCausalLM transforms its logits "
                                                   r"after the output head .*set actor_rollout_ref.model.use_fused_kernels=False"):
        build_fsdp_engine(path, engine_config(packed=False, fused=True, attn="eager"))


def test_a_family_without_sdpa_is_told_to_run_eager_before_ray(tmp_path, tiny_tokenizer):
    """gpt-oss and Gemma-2 have no sdpa path in transformers; the default kernel would fail in the workers."""
    path = save_family_model(tmp_path / "gpt_oss", "gpt_oss", tiny_tokenizer, attn="eager")
    train_file = write_rows(tmp_path / "train.parquet", ["gsm8k", "reasoning_gym/basic_arithmetic"] * 8)
    overrides = grpo_overrides(train_file, f"actor_rollout_ref.model.path={path}")
    with nothing_started():
        with pytest.raises(ValueError, match=r"'gpt_oss'\) has no sdpa attention in transformers.*"
                                             r"set \+actor_rollout_ref.model.override_config.attn_implementation=eager"):
            validate_config(load_config(overrides))
        validate_config(load_config(overrides + ["+actor_rollout_ref.model.override_config.attn_implementation=eager"]))
