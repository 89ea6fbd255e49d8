"""Sampling filters against transformers' warpers, and the reported log-probs."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hybridflow.engines.rollout import SamplingParams
from hybridflow.engines.rollout.native import sampler
from hybridflow.engines.rollout.native.sampler import apply_top_k, apply_top_p, sample_tokens


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 4.0, 2.0]])
    out = apply_top_k(logits.clone(), 2)
    inf = float("-inf")
    assert out.tolist() == [[inf, 3.0, 2.0, inf], [inf, inf, 4.0, 2.0]]
    torch.testing.assert_close(out, TopKLogitsWarper(2)(None, logits.clone()))


@pytest.mark.parametrize("candidates", [3, 1024])  # 3: the nucleus often lies outside, full-sort fallback
@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_equals_transformers(monkeypatch, candidates, top_p):
    monkeypatch.setattr(sampler, "_TOP_P_CANDIDATES", candidates)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 2
    expected = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(apply_top_p(logits.clone(), top_p).isinf(), expected.isinf())


def test_top_p_hand_computed():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, 0.85 the first three
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert apply_top_p(logits.clone(), 0.7).isfinite().tolist() == [[True, True, False, False]]
    assert apply_top_p(logits.clone(), 0.85).isfinite().tolist() == [[True, True, True, False]]


def test_log_probs_use_raw_logits_over_temperature():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.5, top_k=3)
    torch.manual_seed(0)
    tokens, log_probs = sample_tokens(logits, params)
    top3 = logits.topk(3).indices
    assert all(int(t) in top3[i].tolist() for i, t in enumerate(tokens))
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(log_probs, expected)


def test_greedy_is_argmax_and_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, log_probs = sample_tokens(logits, SamplingParams(do_sample=False, temperature=2.0))
    assert tokens.tolist() == [1]
    # greedy log-probs are reported at temperature 1 whatever the configured temperature (log_prob_temperature)
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1)[:, 1])
    zero_tokens, zero_log_probs = sample_tokens(logits, SamplingParams(temperature=0.0))  # temperature 0 is greedy
    assert zero_tokens.tolist() == [1]
    torch.testing.assert_close(zero_log_probs, torch.log_softmax(logits, -1)[:, 1])
    torch.manual_seed(0)
    many = logits.expand(20000, 3).contiguous()
    counts = torch.bincount(sample_tokens(many, SamplingParams())[0], minlength=3).float() / 20000
    torch.testing.assert_close(counts, torch.softmax(logits[0], -1), atol=0.015, rtol=0)


@pytest.mark.parametrize("draw", [sampler.sample_from_weights, sampler.race_from_weights], ids=["cdf", "race"])
def test_both_draws_never_pick_zero_weight_and_follow_weights(draw):
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0]]).expand(40000, 5).contiguous()
    torch.manual_seed(0)
    counts = torch.bincount(draw(weights.clone()), minlength=5).float() / 40000
    assert counts[[0, 2, 4]].sum() == 0
    torch.testing.assert_close(counts, torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0]), atol=0.01, rtol=0)


def test_the_race_follows_a_large_vocabulary_and_accelerators_use_it():
    """The exponential race over a 20k vocabulary whose mass sits on a few tokens among tiny weights (as after
    `exp(logits - max)`): each token's frequency within binomial noise of its probability, the tail's total too."""
    torch.manual_seed(1)
    vocab, rows = 20_000, 1000
    logits = torch.randn(vocab) * 0.1 - 12.0
    logits[[7, 123, 19_000]] = torch.tensor([2.0, 1.0, 0.0])
    probs = torch.softmax(logits, -1)
    weights = (logits - logits.max()).exp().expand(rows, vocab).contiguous()
    tokens = sampler.race_from_weights(weights)
    for token in (7, 123, 19_000):
        share = (tokens == token).float().mean().item()
        tolerance = 4 * (probs[token].item() * (1 - probs[token].item()) / rows) ** 0.5
        assert abs(share - probs[token].item()) < tolerance, token
    tail = 1 - probs[[7, 123, 19_000]].sum().item()
    assert abs((~torch.isin(tokens, torch.tensor([7, 123, 19_000]))).float().mean().item() - tail) < 0.04
    assert sampler.draw_for(torch.device("cpu")) is sampler.sample_from_weights
    assert sampler.draw_for(torch.device("cuda", 0)) is sampler.race_from_weights
