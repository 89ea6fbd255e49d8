"""Multi-head latent attention in the native rollout (absorbed, over a latent cache): greedy tokens and log-probs
equal transformers' for DeepSeek-V3 variants (interleaved rope, a full-rank query, yarn's attention scale), and the
cache holds one latent per token and layer, its values a view of its keys."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.native.kv_cache import KVCache
from tests.engines.helpers import encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):\n    return"]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)
VARIANTS = {
    "interleaved-rope": dict(rope_interleave=True),
    "full-rank-query": dict(q_lora_rank=None),
    "yarn-mscale": dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 256, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
}


def _mla_model(tokenizer, **overrides):
    config = DeepseekV3Config(**{
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 1024,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "rope_interleave": False, "initializer_range": 0.3,
        "tie_word_embeddings": True, "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id, **overrides,
    })
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_latent_attention_greedy_equals_transformers(tiny_tokenizer, variant):
    model = _mla_model(tiny_tokenizer, **VARIANTS[variant])
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    expected = HFRollout(model, tiny_tokenizer, GREEDY).generate_sequences(prompts)
    rollout = NativeRollout(model, tiny_tokenizer, GREEDY, max_num_seqs=3)
    out = rollout.generate_sequences(prompts)
    assert len(set(out.batch["responses"].flatten().tolist())) > 10
    for key in ("responses", "attention_mask", "response_mask"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    cache = rollout.cache  # after the call: one (rank + rope)-wide head per layer; values share the keys' memory
    assert cache.num_kv_heads == 1 and cache.head_dim == 16 + 8 and cache.latent_values == 16
    assert all(v.data_ptr() == k.data_ptr() and v.shape[-1] == 16 for k, v in zip(cache.keys, cache.values))
    assert cache.num_bytes == sum(k.numel() * k.element_size() for k in cache.keys)


def test_a_latent_cache_moves_and_copies_its_keys_and_refuses_separate_values():
    cache = KVCache(2, 1, 6, torch.float32, torch.device("cpu"), latent_values=4)
    cache.reserve(3, 5)
    assert cache.bytes_per_token == 2 * 6 * 4  # keys only: 2 layers x 6 floats
    keys = torch.arange(2 * 1 * 3 * 6, dtype=torch.float32).view(2, 1, 3, 6)
    cache.write_prompts(0, 0, keys, None, repeats=1)
    assert torch.equal(cache.values[0][:2, :, :3], keys[..., :4])
    cache.move_slots(torch.tensor([1]), torch.tensor([2]), 3)
    assert torch.equal(cache.values[0][2, :, :3], keys[1, ..., :4])
    with pytest.raises(ValueError, match="latent cache stores no values"):
        cache.write_prompts(0, 0, keys, keys, repeats=1)
    with pytest.raises(ValueError, match="latent_values=7 must be in"):
        KVCache(2, 1, 6, torch.float32, torch.device("cpu"), latent_values=7)


def test_extending_a_cached_prefix_equals_a_fresh_prefill(tiny_tokenizer):
    """The generation server's prefix reuse: continuing a latent cache from position 5 gives the logits of a
    prefill of the whole sequence."""
    model = _mla_model(tiny_tokenizer, rope_interleave=True)
    rollout = NativeRollout(model, tiny_tokenizer, GREEDY, max_num_seqs=2)
    forward, cache = rollout.forward, rollout.cache
    ids = torch.tensor(tiny_tokenizer("one two three four five six seven eight")["input_ids"])
    positions = torch.arange(ids.numel())
    cache.reserve(2, 32)
    forward.bind(32)
    with torch.no_grad():
        whole = forward.prefill(ids[None], positions[None], torch.tensor([ids.numel() - 1]), cache, 1, 1)
        forward.prefill(ids[None, :5], positions[None, :5], torch.tensor([4]), cache, 0, 1)
        extended = forward.extend(ids[5:], positions[5:], cache, 0, 5)
    torch.testing.assert_close(extended, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.keys[0][0, :, : ids.numel()], cache.keys[0][1, :, : ids.numel()], atol=1e-6, rtol=0)
