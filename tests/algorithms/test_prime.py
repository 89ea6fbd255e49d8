"""PRIME's pure functions: the advantage against a direct transcription of the recipe's loops, implicit rewards,
normalisation, the implicit PRM's loss and its pairwise accuracy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms import compute_advantage_by_name, masked_whiten
from hybridflow.algorithms.prime import (
    compute_prime_advantage_return,
    implicit_token_rewards,
    last_token_mask,
    prime_ce_loss,
    prime_dpo_accuracy,
    prime_normalize,
)


def _reference_advantage(rm_scores, acc, mask, n, dpo_coef, gt_coef):
    """The recipe's loops over contiguous groups of n, written out: RLOO per source, summed, reverse cumsum,
    whitened."""
    def masked_rloo(rewards, token_mask):
        rewards = rewards.clone()
        rewards[~token_mask] = 0
        for start in range(0, rewards.shape[0], n):
            means = [rewards[pos][token_mask[pos]].mean() for pos in range(start, start + n)]
            baseline = sum(means) / (n - 1)
            block = rewards[start:start + n]
            block_mask = token_mask[start:start + n]
            block[block_mask] = block[block_mask] * (n / (n - 1)) - baseline
        return rewards

    lengths = mask.sum(-1)
    last = torch.zeros_like(mask, dtype=torch.bool)
    last[torch.arange(len(lengths)), lengths - 1] = True
    outcome = torch.zeros_like(rm_scores)
    outcome[torch.arange(len(lengths)), lengths - 1] = acc
    total = masked_rloo(rm_scores, mask.bool()) * dpo_coef + masked_rloo(outcome, last) * gt_coef
    returns = (total * mask).flip(-1).cumsum(-1).flip(-1)
    return masked_whiten(returns, mask), returns


@pytest.fixture()
def batch():
    gen = torch.Generator().manual_seed(0)
    n, groups, length = 4, 3, 7
    lengths = torch.randint(1, length + 1, (n * groups,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    rm_scores = torch.randn(n * groups, length, generator=gen) * mask
    acc = torch.randint(0, 2, (n * groups,), generator=gen).float()
    outcome_tokens = torch.zeros(n * groups, length)
    outcome_tokens[torch.arange(n * groups), lengths - 1] = acc
    index = np.array([f"g{i // n}" for i in range(n * groups)], dtype=object)
    return dict(n=n, mask=mask, rm_scores=rm_scores, acc=acc, outcome_tokens=outcome_tokens, index=index)


def test_prime_advantage_matches_the_recipe_loops(batch):
    expected_adv, expected_ret = _reference_advantage(
        batch["rm_scores"], batch["acc"], batch["mask"], batch["n"], dpo_coef=5.0, gt_coef=2.0
    )
    adv, ret = compute_prime_advantage_return(
        batch["outcome_tokens"], batch["mask"], batch["index"], batch["rm_scores"], reward_dpo_coef=5.0, reward_gt_coef=2.0
    )
    mask = batch["mask"].bool()
    torch.testing.assert_close(ret[mask], expected_ret[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(adv[mask], expected_adv[mask], atol=1e-5, rtol=1e-5)
    assert (adv[~mask] == 0).all()


def test_prime_advantage_groups_by_uid_in_any_order(batch):
    order = torch.randperm(len(batch["index"]), generator=torch.Generator().manual_seed(1))
    adv, _ = compute_prime_advantage_return(
        batch["outcome_tokens"], batch["mask"], batch["index"], batch["rm_scores"]
    )
    shuffled, _ = compute_prime_advantage_return(
        batch["outcome_tokens"][order], batch["mask"][order], batch["index"][order.numpy()], batch["rm_scores"][order]
    )
    torch.testing.assert_close(shuffled, adv[order], atol=1e-6, rtol=0)


def test_prime_is_dispatched_by_name_with_its_extra_inputs(batch):
    direct, _ = compute_prime_advantage_return(
        batch["outcome_tokens"], batch["mask"], batch["index"], batch["rm_scores"], reward_dpo_coef=1.0
    )
    by_name, _ = compute_advantage_by_name(
        "prime", token_level_rewards=batch["outcome_tokens"], response_mask=batch["mask"], index=batch["index"],
        extra_inputs={"rm_scores": batch["rm_scores"], "reward_dpo_coef": 1.0, "reward_gt_coef": 5.0},
    )
    torch.testing.assert_close(by_name, direct)
    outcome_only, _ = compute_prime_advantage_return(batch["outcome_tokens"], batch["mask"], batch["index"])
    assert not torch.allclose(outcome_only, direct), "the implicit rewards change the advantage"


def test_implicit_rewards_per_token_or_on_the_last_token():
    q = torch.tensor([[0.5, -1.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    token = implicit_token_rewards(q, mask, beta=0.1, granularity="token")
    torch.testing.assert_close(token, torch.tensor([[0.05, -0.1, 0.2, 0.0]]))
    whole = implicit_token_rewards(q, mask, beta=0.1, granularity="whole")
    torch.testing.assert_close(whole, torch.tensor([[0.0, 0.0, 0.15, 0.0]]))
    assert last_token_mask(torch.tensor([[1, 1, 0], [0, 0, 0]])).tolist() == [[False, True, False], [False, False, False]]
    with pytest.raises(ValueError, match="prime_granularity"):
        implicit_token_rewards(q, mask, beta=0.1, granularity="step")


def test_batch_norm_bounds_every_return_by_one():
    scores = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 0.5, 0.0]])
    normed = prime_normalize(scores, "batch_norm")
    returns = normed.flip(-1).cumsum(-1).flip(-1)
    assert returns.abs().max().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(prime_normalize(scores, "none"), scores)


def test_ce_loss_pushes_correct_samples_up_and_wrong_ones_down():
    q = torch.zeros(2, 3, requires_grad=True)
    loss = prime_ce_loss(q, torch.tensor([1.0, 0.0]), torch.ones(2, 3), beta=0.5)
    loss.backward()
    assert loss.item() == pytest.approx(np.log(2.0))
    assert (q.grad[0] < 0).all() and (q.grad[1] > 0).all()  # descent raises q of the correct one


def test_dpo_accuracy_counts_pairs_ordered_as_outcomes():
    mask = torch.ones(4, 1)
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0])
    index = np.array(["a", "a", "b", "b"], dtype=object)
    right = torch.tensor([[2.0], [1.0], [0.0], [5.0]])  # group a ordered right; group b all correct: 0.5
    assert prime_dpo_accuracy(right, acc, mask, index) == pytest.approx(0.75)
    wrong = torch.tensor([[1.0], [2.0], [0.0], [5.0]])
    assert prime_dpo_accuracy(wrong, acc, mask, index) == pytest.approx(0.25)
