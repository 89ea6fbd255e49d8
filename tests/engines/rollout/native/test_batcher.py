"""Continuous batching: with fewer slots than sequences, mixed prompt lengths and sequences finishing at
different steps, every sequence decodes exactly as it does alone."""

from __future__ import annotations

import torch

from hybridflow.engines.rollout import NativeRollout, SamplingParams
from tests.engines.helpers import encode_prompts

PROMPTS = [
    "hello there",
    "what is 12 + 7? The answer is",
    "x",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "0 1 2 3",
    "Solve the equation step by step",
]


def test_each_sequence_matches_running_it_alone(sharp_model, tiny_tokenizer):
    probe = NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(max_new_tokens=9, do_sample=False))
    free = probe.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS)).batch["responses"]
    # Stop tokens taken from some rows' outputs: those rows end early, at different steps, freeing slots
    # in the middle of the batch while longer rows keep decoding.
    stops = (int(free[0, 1]), int(free[3, 4]), int(free[5, 6]))
    params = SamplingParams(max_new_tokens=9, do_sample=False, stop_token_ids=stops)
    batched = NativeRollout(sharp_model, tiny_tokenizer, params, max_num_seqs=3)
    out = batched.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS))
    lengths = out.batch["response_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 3  # sequences really finish at different steps
    assert out.meta_info == {} and batched.last_stats["num_decode_steps"] > 8
    alone = NativeRollout(sharp_model, tiny_tokenizer, params, max_num_seqs=1)
    for row, text in enumerate(PROMPTS):
        single = alone.generate_sequences(encode_prompts(tiny_tokenizer, [text]))
        assert torch.equal(out.batch["responses"][row], single.batch["responses"][0]), row
        assert torch.equal(out.batch["response_mask"][row], single.batch["response_mask"][0]), row
        torch.testing.assert_close(
            out.batch["rollout_log_probs"][row], single.batch["rollout_log_probs"][0], atol=1e-4, rtol=0
        )


def test_small_prefill_budget_splits_prompts(sharp_model, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=5, do_sample=False)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    whole = NativeRollout(sharp_model, tiny_tokenizer, params).generate_sequences(prompts)
    split = NativeRollout(sharp_model, tiny_tokenizer, params, max_prefill_tokens=8).generate_sequences(prompts)
    assert torch.equal(whole.batch["responses"], split.batch["responses"])
