"""The optimal token baseline (verl's optimal_token_baseline / tir_optimal_token_baseline) against a per-group,
per-trajectory loop written from its formulas, and the variance proxies by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import compute_advantage_by_name
from hybridflow.algorithms.optimal_baseline import (
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    variance_proxy_metrics,
)


def _loop_baseline(returns, energy, mask, index, *, compact: bool, zero_tail: bool, eps=1e-8):
    """Advantages by the definition: per prompt group, B_t = sum_i G_t W_t / (sum_i W_t + eps) over the group's
    trajectories (t over every position, or with `compact` over each trajectory's own response tokens only)."""
    bs, width = returns.shape
    series = []  # per row: (positions, G over them, W over them)
    for i in range(bs):
        positions = [t for t in range(width) if mask[i, t] > 0] if compact else list(range(width))
        weights = [energy[i, t] * mask[i, t] for t in positions]
        series.append((positions, [returns[i, t] * mask[i, t] for t in positions], weights))
    advantages = torch.zeros_like(returns, dtype=torch.float64)
    for uid in dict.fromkeys(index):
        members = [i for i in range(bs) if index[i] == uid and (not compact or mask[i].sum() > 0)]
        lengths = {i: int(mask[i].sum()) for i in members}
        span = width
        baseline = [0.0] * span
        if len(members) > 1:
            for t in range(span):
                num = sum(series[i][1][t] * series[i][2][t] for i in members if t < len(series[i][0]))
                den = sum(series[i][2][t] for i in members if t < len(series[i][0]))
                baseline[t] = float(num) / (float(den) + eps)
        for i in members:
            own = list(baseline)
            ordered = sorted(lengths.values())
            if zero_tail and len(members) > 1 and ordered.count(ordered[-1]) == 1 and lengths[i] == ordered[-1]:
                own[ordered[-2]:] = [0.0] * (span - ordered[-2])
            for k, t in enumerate(series[i][0]):
                advantages[i, t] = (float(series[i][1][k]) - own[k]) * float(mask[i, t])
    return advantages


def _inputs(seed: int, holes: bool):
    gen = torch.Generator().manual_seed(seed)
    bs, width = 11, 9
    index = np.array(["a", "a", "a", "b", "b", "c", "d", "d", "d", "d", "e"], dtype=object)  # c and e: singletons
    lengths = torch.tensor([9, 4, 6, 7, 7, 3, 2, 8, 5, 1, 6])
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    if holes:  # tool outputs between turns: positions inside a response that the model did not write
        mask[0, 2:4] = 0
        mask[2, 1] = 0
        mask[7, 3:6] = 0
        mask[9] = 0  # a trajectory without a response token
    rewards = torch.zeros(bs, width)
    last = (mask * torch.arange(width)).argmax(-1)
    rewards[torch.arange(bs), last] = torch.randint(0, 2, (bs,), generator=gen).float()
    rewards[0, last[0]] = 1.0  # group a's longest trajectory has a return past the others' ends
    rewards[:, 1] += 0.1 * torch.randn(bs, generator=gen)  # a shaped token reward too
    old_log_probs = -torch.rand(bs, width, generator=gen) * 3
    sum_pi_squared = torch.rand(bs, width, generator=gen) * 0.5 + old_log_probs.exp() ** 2
    weights = torch.rand(bs, width, generator=gen) * 1.5
    return rewards * mask, mask, index, old_log_probs, sum_pi_squared, weights


def _reference(rewards, mask, index, old_log_probs, sum_pi_squared, weights, *, compact, zero_tail):
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1).double()
    energy = (1 - 2 * old_log_probs.exp() + sum_pi_squared).double()
    if weights is not None:
        energy = energy * weights.double() ** 2
    cumulative = torch.zeros_like(energy)
    for i in range(energy.size(0)):
        total = 0.0
        for t in range(energy.size(1)):
            total += float(energy[i, t] * mask[i, t])
            cumulative[i, t] = total
    return _loop_baseline(returns, cumulative, mask.double(), index, compact=compact, zero_tail=zero_tail), returns


@pytest.mark.parametrize("importance_weights", [False, True])
@pytest.mark.parametrize("zero_tail", [False, True])
def test_otb_equals_the_per_group_loop(importance_weights, zero_tail):
    rewards, mask, index, old_lp, spsq, weights = _inputs(0, holes=False)
    weights = weights if importance_weights else None
    got, got_returns = compute_optimal_token_baseline_advantage(
        rewards, mask, index, old_lp, spsq, rollout_is_weights=weights, handle_zero_tail=zero_tail
    )
    expected, returns = _reference(rewards, mask, index, old_lp, spsq, weights, compact=False, zero_tail=zero_tail)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_returns.double(), returns * mask, atol=1e-6, rtol=0)
    if zero_tail:  # group a's longest trajectory (row 0, 9 tokens against 6) keeps its return past position 6
        torch.testing.assert_close(got[0, 6:], got_returns[0, 6:])
        assert not torch.allclose(got[0, 6:], compute_optimal_token_baseline_advantage(
            rewards, mask, index, old_lp, spsq, rollout_is_weights=weights)[0][0, 6:])
    # singleton groups (c, e) have no baseline: their advantage is their return
    for row in (5, 10):
        torch.testing.assert_close(got[row], got_returns[row] * mask[row])


@pytest.mark.parametrize("zero_tail", [False, True])
def test_tool_integrated_otb_counts_positions_over_the_models_own_tokens(zero_tail):
    rewards, mask, index, old_lp, spsq, weights = _inputs(1, holes=True)
    got, _ = compute_multi_turn_optimal_token_baseline_advantage(
        rewards, mask, index, old_lp, spsq, rollout_is_weights=weights, handle_zero_tail=zero_tail
    )
    expected, _ = _reference(rewards, mask, index, old_lp, spsq, weights, compact=True, zero_tail=zero_tail)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert (got[mask == 0] == 0).all()
    # with holes, counting positions over the whole response gives other baselines
    plain, _ = compute_optimal_token_baseline_advantage(
        rewards, mask, index, old_lp, spsq, rollout_is_weights=weights, handle_zero_tail=zero_tail
    )
    assert not torch.allclose(plain, got, atol=1e-3)


def test_both_forms_agree_without_tool_outputs_and_the_registry_dispatches_them():
    rewards, mask, index, old_lp, spsq, _ = _inputs(2, holes=False)
    inputs = dict(old_log_probs=old_lp, sum_pi_squared=spsq)
    single = compute_advantage_by_name(
        "optimal_token_baseline", token_level_rewards=rewards, response_mask=mask, index=index, extra_inputs=inputs
    )
    multi = compute_advantage_by_name(
        "tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask, index=index,
        extra_inputs=dict(inputs, handle_zero_tail=False),
    )
    torch.testing.assert_close(single[0], multi[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(TypeError, match="sum_pi_squared"):
        compute_advantage_by_name("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                  index=index, extra_inputs=dict(old_log_probs=old_lp))


def test_equal_energy_makes_the_baseline_the_group_mean_return():
    """Two trajectories with the same energy at every step: B_t is the mean of their returns, A = +-(r1 - r2) / 2."""
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    old_lp = torch.full((2, 3), float(np.log(0.5)))
    spsq = torch.full((2, 3), 0.5)  # energy 1 - 1 + 0.5 = 0.5 per token
    advantages, _ = compute_optimal_token_baseline_advantage(rewards, mask, np.array([0, 0]), old_lp, spsq)
    torch.testing.assert_close(advantages, torch.tensor([[0.5] * 3, [-0.5] * 3]), atol=1e-6, rtol=0)


def test_variance_proxies_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old_lp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.5, 0.5, 0.5]]))
    spsq = torch.tensor([[0.5, 0.25, 0.0], [0.5, 0.5, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, -2.0]])
    # W: row 0 (1 - 1 + .5) + (1 - .5 + .25) = 1.25; row 1: 3 * 0.5 = 1.5
    metrics = variance_proxy_metrics(old_lp, spsq, advantages, mask, grad_norm=1.0)
    total = (1.0 * 1.25 + 4.0 * 1.5) / 2
    assert metrics["variance_proxy/proxy2_total_power"] == pytest.approx(total, rel=1e-5)
    assert metrics["variance_proxy/proxy1_signal_strength"] == 1.0
    assert metrics["variance_proxy/proxy3_pure_noise"] == pytest.approx(total - 1.0, rel=1e-5)
    assert metrics["variance_proxy/expected_w"] == pytest.approx(1.375, rel=1e-5)
    assert metrics["variance_proxy/expected_a_squared"] == pytest.approx(2.5, rel=1e-5)
    weights = torch.full((2, 3), 2.0)
    weighted = variance_proxy_metrics(old_lp, spsq, advantages, mask, rollout_is_weights=weights)
    assert weighted["variance_proxy/proxy2_total_power"] == pytest.approx(4 * total, rel=1e-5)
    assert weighted["variance_proxy/proxy3_pure_noise"] == 0.0  # no gradient norm given
