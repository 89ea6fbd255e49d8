"""The native rollout on mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE with
its per-head q/k norms, DeepSeek-V3 with multi-head latent attention): greedy tokens equal transformers', sampled
log-probs equal the training engine's, and families it cannot run are refused."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.native_support import native_unsupported_reason
from hybridflow.models import build_causal_lm
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.moe import build_tiny_moe_model
from tests.engines.helpers import assert_native_log_probs_match_engine, encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):\n    return"]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def moe_dir(request, tmp_path_factory, tiny_tokenizer):
    model, tokenizer = build_tiny_moe_model(request.param, seed=1, tokenizer=tiny_tokenizer, initializer_range=0.3)
    return str(save_model_and_tokenizer(model, tokenizer, tmp_path_factory.mktemp(request.param)))


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_moe_greedy_equals_transformers_token_for_token(moe_dir, tiny_tokenizer, kernels):
    model = build_causal_lm(moe_dir)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    expected = HFRollout(model, tiny_tokenizer, GREEDY).generate_sequences(prompts)
    rollout = NativeRollout(model, tiny_tokenizer, GREEDY, max_num_seqs=3, kernels=kernels)
    mla = rollout.forward.mla is not None  # latent attention decodes with torch ops
    assert rollout.forward.has_moe and (rollout.forward.kernels is not None) == (kernels == "cpu" and not mla)
    out = rollout.generate_sequences(prompts)
    assert len(set(out.batch["responses"].flatten().tolist())) > 10  # varied tokens: routing matters
    for key in ("responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)


def test_moe_sampled_log_probs_match_the_training_engine(moe_dir, tiny_tokenizer):
    assert_native_log_probs_match_engine(moe_dir, tiny_tokenizer, PROMPTS, kernels="cpu")


def test_moe_families_with_other_attention_are_refused(tiny_tokenizer):
    """A family whose attention the engine lacks (GPT-OSS: attention sinks; DeepSeek-V2) is refused with the reason
    and the way out; DeepSeek-V3's latent attention is taken."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    assert native_unsupported_reason({"model_type": "deepseek_v3", "n_routed_experts": 8}) is None
    assert "mixture-of-experts" in native_unsupported_reason({"model_type": "deepseek_v2", "n_routed_experts": 8})
    config = GptOssConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = AutoModelForCausalLM.from_config(config)
    assert "mixture-of-experts" in native_unsupported_reason(model.config.to_dict())
    with pytest.raises(ValueError, match=r"cannot run this model: model type 'gpt_oss'.*rollout name 'hf'"):
        NativeRollout(model, tiny_tokenizer, GREEDY)


def test_a_mistral_style_sliding_window_is_refused():
    assert "sliding-window" in native_unsupported_reason({"model_type": "mixtral", "sliding_window": 4096})
    assert native_unsupported_reason({"model_type": "mixtral", "sliding_window": None}) is None
    assert native_unsupported_reason({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}) is None
