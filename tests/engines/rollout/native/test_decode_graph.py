"""Static decode shapes (what CUDA graph capture needs), checked on CPU: the decode step sees the same tensor
shapes over many steps, and checking for finished sequences only every k steps leaves the outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import NativeRollout, SamplingParams
from hybridflow.engines.rollout.native.decode_graph import DecodeStep, decode_rows, decode_span
from tests.engines.helpers import encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x", "0 1 2 3", "Solve the equation step by step"]


class _NoEosTokenizer:
    """A tokenizer view whose eos id is never sampled: every response runs to max_new_tokens."""

    eos_token_id = -1

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str):
        return getattr(self._tokenizer, name)


def _record_step_shapes(rollout: NativeRollout) -> list[tuple]:
    """Patch the rollout's decode step to record the shape of every input and output tensor, and the span."""
    calls: list[tuple] = []
    step = rollout.batcher.decode
    original = DecodeStep.__call__

    def recording(tokens, positions, lengths, span):
        logits = original(step, tokens, positions, lengths, span)
        calls.append((tuple(tokens.shape), tuple(positions.shape), tuple(lengths.shape), span, tuple(logits.shape)))
        return logits

    rollout.batcher.decode = recording
    recording.graphs, recording.num_captures = step.graphs, step.num_captures  # the attributes the batcher reads
    return calls


def test_decode_step_shapes_are_static_over_many_steps(sharp_model, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    rollout = NativeRollout(
        sharp_model, _NoEosTokenizer(tiny_tokenizer), params, kernels="torch", done_check_interval=8
    )
    rollout.batcher.span_multiple = None  # the GPU setting: one span, the whole cache
    calls = _record_step_shapes(rollout)
    out = rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS))
    assert out.batch["response_mask"].sum().item() == len(PROMPTS) * 40  # nothing ended early
    assert len(calls) >= 39
    assert len(set(calls)) == 1, set(calls)  # one shape for every step of the run: one graph
    rows, _, _, span, logits = calls[0]
    assert rows == (8,) and span == rollout.cache.max_len and logits[0] == 8


def test_cpu_span_is_static_per_bucket(sharp_model, tiny_tokenizer):
    params = SamplingParams(max_new_tokens=70, do_sample=False)
    rollout = NativeRollout(sharp_model, _NoEosTokenizer(tiny_tokenizer), params, kernels="torch")
    calls = _record_step_shapes(rollout)
    rollout.generate_sequences(encode_prompts(tiny_tokenizer, PROMPTS))
    spans = [call[3] for call in calls]
    assert len(calls) == 69 and spans == sorted(spans)
    assert set(spans) == {64, rollout.cache.max_len}  # two buckets, each static for its steps
    assert len({call[:3] for call in calls}) == 1


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_checking_done_every_k_steps_keeps_the_outputs(sharp_model, tiny_tokenizer, kernels):
    prompts = encode_prompts(tiny_tokenizer, PROMPTS)
    free = NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(max_new_tokens=12, do_sample=False))
    responses = free.generate_sequences(prompts).batch["responses"]
    # Rows end at different steps, and 2 slots for 5 prompts make the batcher refill freed slots.
    stops = (int(responses[0, 1]), int(responses[3, 5]), int(responses[4, 9]))
    params = SamplingParams(max_new_tokens=12, do_sample=False, stop_token_ids=stops)
    outs = {}
    for interval in (1, 8):
        rollout = NativeRollout(
            sharp_model, tiny_tokenizer, params, max_num_seqs=2, kernels=kernels, done_check_interval=interval
        )
        outs[interval] = rollout.generate_sequences(prompts)
        steps = rollout.last_stats["num_decode_steps"]
    lengths = outs[1].batch["response_mask"].sum(1)
    assert len(set(lengths.tolist())) >= 3
    assert steps > 12  # refills happened
    for key in ("responses", "response_mask", "input_ids", "attention_mask"):
        assert torch.equal(outs[8].batch[key], outs[1].batch[key]), key
    torch.testing.assert_close(outs[8].batch["rollout_log_probs"], outs[1].batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_decode_buckets():
    # graph replay: powers of two from 8, capped by the slots; torch ops: multiples of 8; kernels: exact
    assert [decode_rows(n, 256, graphs=True, kernels=False) for n in (1, 8, 9, 33, 200)] == [8, 8, 16, 64, 256]
    assert decode_rows(100, 96, graphs=True, kernels=False) == 96
    assert [decode_rows(n, 64, graphs=False, kernels=False) for n in (1, 9, 63)] == [8, 16, 64]
    assert decode_rows(13, 64, graphs=False, kernels=True) == 13
    assert decode_span(5, 300, None) == 300
    assert [decode_span(s, 300, 64) for s in (1, 64, 65, 299)] == [64, 64, 128, 300]


def test_done_check_interval_must_be_positive(sharp_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="done_check_interval must be >= 1, got 0"):
        NativeRollout(sharp_model, tiny_tokenizer, SamplingParams(), kernels="torch", done_check_interval=0)


@pytest.mark.slow
def test_a_compiled_decode_step_gives_the_eager_tokens(sharp_model, tiny_tokenizer):
    """`compile_decode=True` (the A/B of `gpu_profile.py`'s decode section): inductor's step gives the eager step's
    greedy tokens and log-probs; the CPU kernels, which it cannot trace, are refused with the fix."""
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    prompts = encode_prompts(tiny_tokenizer, PROMPTS[:4])
    eager = NativeRollout(sharp_model, tiny_tokenizer, params, kernels="torch").generate_sequences(prompts)
    rollout = NativeRollout(sharp_model, tiny_tokenizer, params, kernels="torch", compile_decode=True)
    assert rollout.batcher.decode.step is not rollout.forward.decode
    compiled = rollout.generate_sequences(prompts)
    assert torch.equal(compiled.batch["responses"], eager.batch["responses"])
    torch.testing.assert_close(compiled.batch["rollout_log_probs"], eager.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="kernels='torch'"):
        NativeRollout(sharp_model, tiny_tokenizer, params, kernels="cpu", compile_decode=True)
