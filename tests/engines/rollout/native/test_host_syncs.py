"""The native rollout does not wait on the device per prompt or per decode step (issue 25).

On an H200 (2026-11-28) a native generation of 64 prompts made 222 stream synchronisations, about 3.5 per prompt:
prompts were trimmed with a mask index and measured with `int()` on the device, one prompt at a time. Prompts are
now trimmed on the host and reach the device in one copy per prefill chunk. Here every call that would block the
host on an accelerator (see `SyncCounter`) is counted from the rollout's files during a real generation on CPU:
the count does not grow with the number of prompts, and decode steps add only the finished-sequence checks, one
every `done_check_interval` steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import hybridflow.engines.rollout as rollout_package
from hybridflow.engines.rollout import SamplingParams
from hybridflow.engines.rollout.native import NativeRollout
from tests.engines.helpers import encode_prompts
from tests.engines.rollout.native.test_decode_graph import _NoEosTokenizer
from tests.engines.sync_counter import SyncCounter

WATCHED = (str(Path(rollout_package.__file__).parent),)
WORDS = ["hello there", "what is 12 + 7?", "x", "0 1 2 3", "Solve it", "a b", "say yes", "the end of it"]
INTERVAL = 8


def _counted_generation(
    model, tokenizer, counter: SyncCounter, num_prompts: int, new_tokens: int, copies: int = 1
) -> int:
    params = SamplingParams(max_new_tokens=new_tokens, do_sample=True, temperature=1.0)
    rollout = NativeRollout(
        model, _NoEosTokenizer(tokenizer), params, kernels="torch", done_check_interval=INTERVAL, max_num_seqs=32
    )
    prompts = encode_prompts(tokenizer, WORDS[:num_prompts])
    if copies > 1:  # the trainer's layout: each prompt's copies together (one prefill, `copies` samples)
        prompts = prompts.repeat(copies, interleave=True)
    rollout.generate_sequences(prompts)  # warm-up
    counter.calls.clear()
    counter.active = True
    try:
        out = rollout.generate_sequences(prompts)
    finally:
        counter.active = False
    assert int(out.batch["response_mask"].sum()) == num_prompts * copies * new_tokens  # every row ran to its limit
    return counter.total()


def test_generation_waits_per_call_not_per_prompt_or_step(sharp_model, tiny_tokenizer, monkeypatch):
    counter = SyncCounter(monkeypatch, WATCHED)
    two, eight = (_counted_generation(sharp_model, tiny_tokenizer, counter, k, 16) for k in (2, 8))
    assert two == eight, f"{eight - two} more waits for 6 more prompts: {counter.calls}"
    longer = _counted_generation(sharp_model, tiny_tokenizer, counter, 8, 16 + 2 * INTERVAL)
    assert longer - eight == 2, f"16 more decode steps made {longer - eight} more waits (2 checks expected)"
    # the trainer's grouped rows (8 or 32 rows, one prefill per prompt, 4 samples each)
    grouped_two, grouped_eight = (_counted_generation(sharp_model, tiny_tokenizer, counter, k, 16, copies=4) for k in (2, 8))
    assert grouped_two == grouped_eight, counter.calls
    # per call: the prompt checks, the finished-sequence checks (3 here) and the outputs' copy to the host; 0
    # would mean the counter saw nothing
    assert 0 < eight <= 32, counter.calls
