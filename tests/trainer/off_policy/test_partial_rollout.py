"""Partial rollout without Ray: chunked generation resumes exactly (greedy, token for token, hf and native engines),
a resumed response continues under new weights with each token's version and log-prob kept, and the version
metrics and token-level correction of a response that spans two versions, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.rollout_correction import compute_rollout_correction
from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.models import build_tiny_model
from hybridflow.models.loader import prepare_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.trainer.off_policy.partial_rollout import (
    PartialRollout,
    compute_unfinished_rows,
    compute_version_metrics,
)
from hybridflow.trainer.guards import StaleWeightsError
from hybridflow.trainer.guards.versions import WEIGHT_VERSION_KEY
from tests.engines.helpers import encode_prompts

PROMPTS = ["hello there", "what is 12 + 7? The answer is", "x", "def add(a, b):\n    return"]
LENGTH = 12
GREEDY = SamplingParams(max_new_tokens=LENGTH, do_sample=False)
KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


@pytest.fixture(scope="module")
def sharp():
    """A tiny llama with large weights (varied greedy tokens) and its tokenizer."""
    model, tokenizer = build_tiny_model("llama", initializer_range=0.3, seed=1)
    return model.eval(), prepare_tokenizer(tokenizer)


def build_rollout(backend: str, model, tokenizer):
    return HFRollout(model, tokenizer, GREEDY) if backend == "hf" else NativeRollout(model, tokenizer, GREEDY)


def generate_in_chunks(rollout, prompts, chunk: int, stop_ids: list[int], versions=lambda index: (0, 0)):
    """The chunked generation of `prompts`; `versions(chunk index)` tags each chunk (and may change weights)."""
    partial = PartialRollout(prompts, LENGTH, chunk, stop_ids, rollout.tokenizer.pad_token_id)
    while not partial.done:
        param_version, policy_version = versions(partial.num_chunks)
        partial.add(rollout.generate_sequences(partial.request()), param_version, policy_version)
    return partial.finish(), partial


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("chunk", [pytest.param(1, marks=pytest.mark.slow), 4, 5])
def test_chunks_without_a_weight_change_equal_one_call(sharp, backend, chunk):
    model, tokenizer = sharp
    rollout = build_rollout(backend, model, tokenizer)
    free = rollout.generate_sequences(encode_prompts(tokenizer, PROMPTS)).batch["responses"]
    stop = int(free[1, 3])  # ends row 1 after 4 tokens (a chunk boundary for chunk=4), maybe others elsewhere
    prompts = encode_prompts(tokenizer, PROMPTS, {"stop_token_ids": (stop,)})
    expected = rollout.generate_sequences(prompts)
    out, partial = generate_in_chunks(rollout, prompts, chunk, [tokenizer.eos_token_id, stop])
    assert int(expected.batch["response_mask"][1].sum()) == 4
    assert expected.batch["response_mask"].sum(1).max() == LENGTH  # some row runs to the end
    for key in KEYS:
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["rollout_log_probs"], expected.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    assert partial.num_chunks == math.ceil(LENGTH / chunk)
    mask = out.batch["response_mask"].bool()
    versions = out.batch["token_param_versions"]
    assert (versions[mask] == 0).all() and (versions[~mask] == -1).all()


def test_a_resumed_response_continues_under_new_weights(sharp):
    """Chunk 1 (4 tokens) with weights A, chunks 2-3 with weights B: the prefix and its log-probs are A's, the rest
    is B's greedy continuation of prompt + prefix, and every token carries the version that sampled it."""
    _, tokenizer = sharp
    model_b, _ = build_tiny_model("llama", initializer_range=0.3, seed=2, tokenizer=tokenizer)
    model_a, _ = build_tiny_model("llama", initializer_range=0.3, seed=1, tokenizer=tokenizer)  # changed below
    rollout = HFRollout(model_a, tokenizer, GREEDY)
    prompts = encode_prompts(tokenizer, PROMPTS)
    one_call_a = rollout.generate_sequences(prompts)

    def versions(index: int) -> tuple[int, int]:
        if index == 1:  # the weight sync between chunks 1 and 2
            rollout.update_weights(model_b.state_dict().items())
        return (3, 6) if index == 0 else (4, 8)

    out, _ = generate_in_chunks(rollout, prompts, 4, [tokenizer.eos_token_id], versions)
    mask = out.batch["response_mask"]
    assert mask.sum(1).min() > 4, "every row goes past the first chunk (no eos from a random tiny model)"
    assert torch.equal(out.batch["responses"][:, :4], one_call_a.batch["responses"][:, :4])
    torch.testing.assert_close(out.batch["rollout_log_probs"][:, :4], one_call_a.batch["rollout_log_probs"][:, :4])
    # B continues from prompt + A's prefix: a B-only greedy call on that prompt gives the same 8 tokens
    ids = torch.cat([prompts.batch["input_ids"], one_call_a.batch["responses"][:, :4]], dim=1)
    attention = torch.cat([prompts.batch["attention_mask"], torch.ones(len(PROMPTS), 4, dtype=torch.long)], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    prefixed = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": attention, "position_ids": positions}, meta_info={"max_new_tokens": 8}
    )
    continued_b = rollout.generate_sequences(prefixed)
    assert torch.equal(out.batch["responses"][:, 4:], continued_b.batch["responses"])
    torch.testing.assert_close(out.batch["rollout_log_probs"][:, 4:], continued_b.batch["rollout_log_probs"])
    assert not torch.equal(continued_b.batch["responses"], one_call_a.batch["responses"][:, 4:]), "B differs from A"
    expected_param = torch.tensor([3] * 4 + [4] * (LENGTH - 4)).expand_as(mask)
    assert torch.equal(out.batch["token_param_versions"], torch.where(mask.bool(), expected_param, -1))
    assert torch.equal(out.batch["token_policy_versions"], torch.where(mask.bool(), expected_param * 2, -1))


def test_unfinished_rows():
    responses = torch.tensor([[5, 6, 7], [5, 2, 0], [5, 6, 2], [9, 9, 9]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    # row 0 used its budget, row 1 stopped early, row 2 ends on a stop token (2), row 3 goes on
    assert compute_unfinished_rows(responses, mask, torch.tensor([2])).tolist() == [True, False, False, True]


def test_version_metrics_count_each_token_and_partial_samples():
    versions = torch.tensor([[0, 0, 1, 1], [1, 1, -1, -1], [0, 2, 2, -1]])
    mask = (versions >= 0).long()
    metrics = compute_version_metrics(versions, mask, current_version=2)
    # token staleness 2 - v over the 9 sampled tokens: 2,2,1,1, 1,1, 2,0,0
    assert metrics["fully_async/token_staleness/mean"] == pytest.approx(10 / 9)
    assert metrics["fully_async/token_staleness/max"] == 2.0
    assert metrics["fully_async/partial/total_partial_num"] == 2.0  # rows 0 and 2 span two versions
    assert metrics["fully_async/partial/partial_ratio"] == pytest.approx(2 / 3)
    assert metrics["fully_async/partial/max_partial_span"] == 2.0


def test_token_level_correction_weighs_each_token_against_the_version_that_sampled_it():
    """A response whose first two tokens came from v0 and last two from v1, trained at v1: the v1 tokens' rollout
    log-probs equal the trainer's (weight 1), the v0 tokens' are the old policy's (weight exp(old - rollout),
    truncated at the threshold)."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -0.7]])  # the trainer's (v1) log-probs
    rollout = torch.tensor([[-1.5, -1.0, -0.5, -0.7]])  # v0 sampled tokens 0-1, v1 tokens 2-3
    weights, _, _ = compute_rollout_correction(
        old, rollout, torch.ones(1, 4), rollout_is="token", rollout_is_threshold=1.5
    )
    torch.testing.assert_close(weights, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0, 1.0]]).clamp(max=1.5))
    assert weights[0, 0] == pytest.approx(1.5)  # exp(0.5) = 1.65, truncated


def scripted_chunk(request: DataProto, tokens: int, served_version: int) -> DataProto:
    """A rollout's answer to `request`: `tokens` new tokens (id 7) per row, stamped with `served_version` as the
    worker stamps every sample."""
    rows = len(request)
    responses = torch.full((rows, tokens), 7)
    ones = torch.ones(rows, tokens, dtype=torch.long)
    ids = torch.cat([request.batch["input_ids"], responses], dim=1)
    mask = torch.cat([request.batch["attention_mask"], ones], dim=1)
    return DataProto.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses, "response_mask": ones, "rollout_log_probs": torch.zeros(rows, tokens),
        WEIGHT_VERSION_KEY: torch.full((rows,), served_version, dtype=torch.int64),
    })


def test_a_chunk_from_weights_other_than_the_synced_version_stops_the_generation():
    ids = torch.tensor([[5, 6, 8], [9, 5, 6]])
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                   "position_ids": torch.arange(3).expand(2, 3)})
    partial = PartialRollout(prompts, 4, 2, [2], pad_token_id=0)
    partial.add(scripted_chunk(partial.request(), 2, served_version=5), param_version=1, policy_version=5)
    # a sync announced version 6 to the trainer, but the rollout still serves version 5
    with pytest.raises(StaleWeightsError, match=r"chunk 1 of a partial rollout: the rollout served weight version 5, "
                                                 r"but the trainer synced version 6"):
        partial.add(scripted_chunk(partial.request(), 2, served_version=5), param_version=2, policy_version=6)
