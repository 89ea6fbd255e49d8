"""The `native` rollout against transformers and the training engine: greedy tokens, layout, log-probs,
n samples, weight updates, sleep/wake_up, registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.engines.rollout import ROLLOUTS, HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.native.rollout import interleaved_copies
from hybridflow.models import build_causal_lm, build_tiny_model
from tests.engines.helpers import assert_native_log_probs_match_engine, encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):\n    return"]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)


def test_registered_as_native():
    assert ROLLOUTS.get("native") is NativeRollout


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("max_num_seqs", [64, 2])
def test_greedy_equals_transformers_with_left_padding(sharp_model, tiny_tokenizer, max_num_seqs, kernels):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    assert (prompts.batch["attention_mask"] == 0).any()  # mixed lengths, left-padded
    expected = HFRollout(sharp_model, tiny_tokenizer, GREEDY).generate_sequences(prompts)
    rollout = NativeRollout(sharp_model, tiny_tokenizer, GREEDY, max_num_seqs=max_num_seqs, kernels=kernels)
    assert (rollout.forward.kernels is not None) == (kernels == "cpu")
    out = rollout.generate_sequences(prompts)
    assert len(set(out.batch["responses"].flatten().tolist())) > 10  # varied tokens, not one repeated id
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_qwen3_per_head_norms_greedy_and_log_probs(tmp_path, tiny_tokenizer, kernels):
    """Qwen3's attention normalises each query and key head before RoPE: greedy tokens equal transformers' and the
    sampled log-probs the training engine's."""
    from hybridflow.models.loader import save_model_and_tokenizer

    model, _ = build_tiny_model("qwen3", initializer_range=0.3, seed=1, tokenizer=tiny_tokenizer)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    expected = HFRollout(model, tiny_tokenizer, GREEDY).generate_sequences(prompts)
    out = NativeRollout(model, tiny_tokenizer, GREEDY, max_num_seqs=3, kernels=kernels).generate_sequences(prompts)
    assert len(set(out.batch["responses"].flatten().tolist())) > 10
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    model_dir = save_model_and_tokenizer(model, tiny_tokenizer, tmp_path / "qwen3")
    assert_native_log_probs_match_engine(model_dir, tiny_tokenizer, PROMPTS, kernels)


def test_layout_stop_tokens_and_pads(sharp_model, tiny_tokenizer):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    free = NativeRollout(sharp_model, tiny_tokenizer, GREEDY).generate_sequences(prompts).batch["responses"]
    stop = int(free[1, 3])  # row 1's fourth token ends it
    params = SamplingParams(max_new_tokens=10, do_sample=False, stop_token_ids=(stop,))
    out = NativeRollout(sharp_model, tiny_tokenizer, params).generate_sequences(prompts)
    bs, prompt_len = prompts.batch["input_ids"].shape
    pad = tiny_tokenizer.pad_token_id
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert responses.shape == mask.shape == out.batch["rollout_log_probs"].shape == (bs, 10)
    assert out.batch["input_ids"].shape == out.batch["position_ids"].shape == (bs, prompt_len + 10)
    assert torch.equal(out.batch["input_ids"][:, prompt_len:], responses)
    assert torch.equal(out.batch["attention_mask"][:, prompt_len:], mask)
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out.batch["position_ids"][:, prompt_len:], last + torch.arange(1, 11))
    for row in range(bs):
        hits = (free[row] == stop).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 10
        assert mask[row].tolist() == [1] * end + [0] * (10 - end)
        assert torch.equal(responses[row, :end], free[row, :end])
        assert (responses[row, end:] == pad).all() and (out.batch["rollout_log_probs"][row, end:] == 0).all()
    assert mask[1].sum() == 4


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_sampled_log_probs_match_training_engine(sharp_model_dir, tiny_tokenizer, kernels):
    assert_native_log_probs_match_engine(sharp_model_dir, tiny_tokenizer, PROMPTS, kernels)


def test_n_samples_share_prefill(sharp_model, tiny_tokenizer):
    rollout = NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(max_new_tokens=6), max_num_seqs=5)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS[:3], {"n": 3, "step": 7})
    prompts.non_tensor_batch["uid"] = np.array(["a", "b", "c"], dtype=object)
    torch.manual_seed(0)
    sampled = rollout.generate_sequences(prompts)
    assert len(sampled) == 9 and list(sampled.non_tensor_batch["uid"]) == list("aaabbbccc")
    assert sampled.meta_info["step"] == 7
    assert torch.equal(sampled.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    assert len({tuple(r) for r in sampled.batch["responses"].tolist()}) > 3  # samples differ
    # Greedy with n=3: every copy of the shared prompt cache must decode exactly like n=1.
    greedy = rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS[:3], {"n": 3, "do_sample": False}))
    single = rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS[:3], {"do_sample": False}))
    assert torch.equal(greedy.batch["responses"], single.batch["responses"].repeat_interleave(3, dim=0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS[:1], {"n": 6}))


def test_interleaved_copies_detects_only_whole_blocks_of_equal_rows():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert interleaved_copies(ids, mask, pos) == 1
    assert interleaved_copies(*(t.repeat_interleave(4, dim=0) for t in (ids, mask, pos))) == 4
    assert interleaved_copies(*(t.repeat(4, 1) for t in (ids, mask, pos))) == 1  # tiled, not interleaved
    ragged = torch.cat([ids[:1].repeat(2, 1), ids[1:].repeat(3, 1)])  # blocks of 2 then 3
    ragged_mask = torch.cat([mask[:1].repeat(2, 1), mask[1:].repeat(3, 1)])
    ragged_pos = torch.cat([pos[:1].repeat(2, 1), pos[1:].repeat(3, 1)])
    assert interleaved_copies(ragged, ragged_mask, ragged_pos) == 1
    other_mask = mask.repeat_interleave(2, dim=0)
    other_mask[1, 0] = 1  # same ids and positions, another mask: not a copy
    assert interleaved_copies(ids.repeat_interleave(2, dim=0), other_mask, pos.repeat_interleave(2, dim=0)) == 1


def test_repeated_prompt_rows_share_one_prefill(sharp_model, tiny_tokenizer):
    """The trainer sends each prompt n times (n=1 rollout): each distinct prompt is prefilled once; greedy rows equal
    the distinct prompts' own, and sampled rows are drawn independently with the engine's log-probs."""
    rollout = NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(max_new_tokens=6), max_num_seqs=8)
    distinct = encode_prompts(tiny_tokenizer, PROMPTS[:3])
    repeated = distinct.repeat(4, interleave=True)
    distinct_tokens = int(distinct.batch["attention_mask"].sum())
    greedy = rollout.generate_sequences(repeated.__class__.from_dict(
        tensors=dict(repeated.batch.items()), meta_info={"do_sample": False}))
    assert rollout.last_stats["prefill_tokens"] == distinct_tokens
    single = rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS[:3], {"do_sample": False}))
    assert torch.equal(greedy.batch["responses"], single.batch["responses"].repeat_interleave(4, dim=0))
    assert torch.equal(greedy.batch["prompts"], repeated.batch["input_ids"])
    torch.manual_seed(0)
    sampled = rollout.generate_sequences(repeated)
    assert rollout.last_stats["prefill_tokens"] == distinct_tokens and len(sampled) == 12
    assert len({tuple(r) for r in sampled.batch["responses"].tolist()}) > 3
    # 4 copies x n=3 exceed 8 slots: every row is prefilled on its own, as before
    rollout.generate_sequences(repeated.__class__.from_dict(tensors=dict(repeated.batch.items()), meta_info={"n": 3}))
    assert rollout.last_stats["prefill_tokens"] == 4 * distinct_tokens


def test_repeated_rows_over_a_memory_budget_fall_back_to_one_prefill_each(sharp_model, tiny_tokenizer):
    """A memory budget that holds n samples but not copies x n: the call runs row by row, as before sharing,
    rather than failing."""

    class FiveSequences:
        def max_sequences(self, bytes_per_sequence, needed=1):
            if needed > 5:
                raise ValueError(f"room for 5 sequences, fewer than the {needed} decoded together")
            return 5

    rollout = NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(max_new_tokens=4, n=2), max_num_seqs=8)
    rollout.memory_budget = FiveSequences()
    distinct = encode_prompts(tiny_tokenizer, PROMPTS[:3])
    out = rollout.generate_sequences(distinct.repeat(4, interleave=True))  # 4 copies x n=2 = 8 > 5 slots
    assert len(out) == 24 and rollout.last_stats["prefill_tokens"] == 4 * int(distinct.batch["attention_mask"].sum())


def test_update_weights_then_restore(sharp_model_dir, tiny_tokenizer):
    source = build_causal_lm(sharp_model_dir)
    original = {name: p.detach().clone() for name, p in source.named_parameters()}
    other, _ = build_tiny_model("llama", initializer_range=0.3, seed=5, tokenizer=tiny_tokenizer)
    rollout = NativeRollout(source, tiny_tokenizer, GREEDY)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    before = rollout.generate_sequences(prompts).batch["responses"]
    if source.config.model_type == "llama":  # same parameter names: load the other model's weights
        rollout.update_weights((name, p.detach()) for name, p in other.named_parameters())
        expected = HFRollout(other, tiny_tokenizer, GREEDY).generate_sequences(prompts).batch["responses"]
    else:  # qwen2 has q/k/v biases: perturb in place instead
        rollout.update_weights((name, p + 0.1 * torch.randn_like(p)) for name, p in original.items())
        expected = HFRollout(source, tiny_tokenizer, GREEDY).generate_sequences(prompts).batch["responses"]
    changed = rollout.generate_sequences(prompts).batch["responses"]
    assert not torch.equal(changed, before) and torch.equal(changed, expected)
    rollout.update_weights(original.items())
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before)
    with pytest.raises(KeyError, match="no_such"):
        rollout.update_weights([("no_such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape mismatch"):
        rollout.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_sleep_frees_cache_and_wake_up_restores_it(sharp_model, tiny_tokenizer):
    rollout = NativeRollout(sharp_model, tiny_tokenizer, GREEDY)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    before = rollout.generate_sequences(prompts)
    allocated = rollout.cache.num_bytes
    assert allocated > 0
    rollout.sleep()
    assert rollout.cache.num_bytes == 0
    rollout.wake_up()
    assert rollout.cache.num_bytes == allocated
    assert torch.equal(rollout.generate_sequences(prompts).batch["responses"], before.batch["responses"])


def test_unsupported_model_type_is_a_clear_error(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tiny_tokenizer)))
    with pytest.raises(ValueError, match="rollout name 'hf'"):
        NativeRollout(model, tiny_tokenizer, GREEDY)


def test_lora_wrapped_module_is_refused(sharp_model, tiny_tokenizer):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(sharp_model, LoraConfig(r=4, target_modules="all-linear"))
    with pytest.raises(ValueError, match="LoRA"):
        NativeRollout(peft_model.get_base_model(), tiny_tokenizer, GREEDY)
