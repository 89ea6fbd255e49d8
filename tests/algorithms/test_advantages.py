"""Advantage estimators against hand-computed values, and the estimator registry."""

import math
import uuid

import numpy as np
import pytest
import torch

from hybridflow.algorithms import (
    ADV_ESTIMATORS,
    AdvantageEstimator,
    compute_advantage_by_name,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

# Six responses in three groups. Scores sit on the last valid token.
#   row  group  mask      length  score
#   0    a      1 1 1     3       1
#   1    a      1 1 0     2       0
#   2    a      1 0 0     1       2
#   3    b      1 0 0     1       3
#   4    b      1 1 1     3       1
#   5    c      1 1 0     2       5   (singleton group)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
REWARDS = torch.tensor([[0, 0, 1], [0, 0, 0], [2, 0, 0], [3, 0, 0], [0, 0, 1], [0, 5, 0]], dtype=torch.float32)
INDEX = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)


def per_sequence(adv):
    """Advantages of outcome estimators are constant over a response: the value, checked to be masked."""
    assert torch.equal(adv * (1 - MASK), torch.zeros_like(adv))
    return adv[:, 0].tolist()


def test_enum_values_are_the_registry_names():
    assert AdvantageEstimator.GAE == "gae"
    assert AdvantageEstimator.GRPO == "grpo"
    assert {e.value for e in AdvantageEstimator} <= set(ADV_ESTIMATORS.names())
    assert get_adv_estimator_fn(AdvantageEstimator.RLOO) is compute_rloo_outcome_advantage


def test_grpo():
    # group a: scores 1, 0, 2 -> mean 1, unbiased std sqrt((0 + 1 + 1) / 2) = 1
    # group b: scores 3, 1 -> mean 2, std sqrt(2)
    # group c: a singleton -> mean 0, std 1
    adv, ret = compute_grpo_outcome_advantage(REWARDS, MASK, INDEX)
    eps = 1e-6
    s2 = math.sqrt(2)
    expected = [0.0, -1 / (1 + eps), 1 / (1 + eps), 1 / (s2 + eps), -1 / (s2 + eps), 5 / (1 + eps)]
    assert per_sequence(adv) == pytest.approx(expected, abs=1e-6)
    assert torch.equal(adv, ret)


def test_dr_grpo_does_not_divide_by_std():
    adv, _ = compute_grpo_outcome_advantage(REWARDS, MASK, INDEX, norm_adv_by_std_in_grpo=False)
    assert per_sequence(adv) == pytest.approx([0.0, -1.0, 1.0, 1.0, -1.0, 5.0])


def test_grpo_groups_by_id_not_position():
    perm = [5, 3, 0, 4, 2, 1]
    adv, _ = compute_grpo_outcome_advantage(REWARDS, MASK, INDEX)
    adv_perm, _ = compute_grpo_outcome_advantage(REWARDS[perm], MASK[perm], INDEX[perm])
    assert torch.allclose(adv_perm, adv[perm])
    # integer uids work as well as strings
    adv_int, _ = compute_grpo_outcome_advantage(REWARDS, MASK, np.array([7, 7, 7, 8, 8, 9], dtype=object))
    assert torch.allclose(adv_int, adv)


def test_grpo_passk():
    # only the best of each group: a -> row 2 gets 2 - 1 = 1 (std 1); b -> row 3 gets 3 - 1 = 2 (std sqrt 2)
    rewards, mask, index = REWARDS[:5], MASK[:5], INDEX[:5]
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index)
    assert adv[:, 0].tolist() == pytest.approx([0, 0, 1 / (1 + 1e-6), 2 / (math.sqrt(2) + 1e-6), 0], abs=1e-6)
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert adv[:, 0].tolist() == pytest.approx([0, 0, 1, 2, 0])
    assert adv[2].tolist() == pytest.approx([1, 0, 0])  # masked beyond the response


def test_grpo_passk_needs_two_per_group():
    with pytest.raises(ValueError, match="at least 2"):
        compute_grpo_passk_outcome_advantage(REWARDS, MASK, INDEX)


def test_rloo():
    # a: 1 - (0+2)/2 = 0, 0 - (1+2)/2 = -1.5, 2 - (1+0)/2 = 1.5; b: 3 - 1 = 2, 1 - 3 = -2
    # singleton c keeps its raw score (verl)
    adv, _ = compute_rloo_outcome_advantage(REWARDS, MASK, INDEX)
    assert per_sequence(adv) == pytest.approx([0.0, -1.5, 1.5, 2.0, -2.0, 5.0])


def test_opo_length_weighted_baseline():
    # a: lengths 3, 2, 1 -> baseline (3*1 + 2*0 + 1*2) / 6 = 5/6
    # b: lengths 1, 3 -> baseline (1*3 + 3*1) / 4 = 1.5; singleton c: baseline 0
    adv, _ = compute_opo_outcome_advantage(REWARDS, MASK, INDEX)
    assert per_sequence(adv) == pytest.approx([1 / 6, -5 / 6, 7 / 6, 1.5, -0.5, 5.0])


def test_reinforce_plus_plus_baseline():
    # centred scores: a 0, -1, 1; b 1, -1; c 5 (mean 0). Broadcast over the 12 valid tokens:
    # 0 0 0 | -1 -1 | 1 | 1 | -1 -1 -1 | 5 5 -> mean 7/12, unbiased var (57 - 12 (7/12)^2) / 11 = 635/132
    adv, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(REWARDS, MASK, INDEX)
    z = {0: -0.265960350, -1: -0.721892380, 1: 0.189971679, 5: 2.013699796}  # (x - 7/12) / sqrt(635/132)
    expected = torch.tensor([[z[0]] * 3, [z[-1]] * 2 + [0], [z[1], 0, 0], [z[1], 0, 0], [z[-1]] * 3, [z[5]] * 2 + [0]])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_reinforce_plus_plus_discounts_and_skips_observation_tokens():
    # gamma 0.5; mask 1 1 0 1 1 (index 2 is a tool observation whose reward 9 is ignored)
    # right to left: G4 = 2, G3 = 0 + 0.5*2 = 1, (skip 2), G1 = 1 + 0.5*1 = 1.5, G0 = 0 + 0.5*1.5 = 0.75
    rewards = torch.tensor([[0.0, 1.0, 9.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    assert ret.tolist()[0] == pytest.approx([0.75, 1.5, 0.0, 1.0, 2.0])
    # whitened over 0.75, 1.5, 1, 2: mean 1.3125, unbiased var 0.921875 / 3
    assert adv.tolist()[0] == pytest.approx([-1.0147221, 0.3382407, 0.0, -0.5637345, 1.2402159], abs=1e-5)


def test_remax():
    # return-to-go minus the greedy baseline; padding (mask 0) rewards are dropped
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = compute_remax_outcome_advantage(rewards, torch.tensor([0.5, 3.0]), mask)
    assert ret.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]


def test_gpg():
    # 5 of 6 scores are non-zero -> alpha = 6/5; advantage alpha * (s - group mean)
    adv, _ = compute_gpg_outcome_advantage(REWARDS, MASK, INDEX)
    assert per_sequence(adv) == pytest.approx([0.0, -1.2, 1.2, 1.2, -1.2, 6.0], abs=1e-6)


def test_gae_single_turn():
    # gamma 0.9, lam 0.8, values 0.5 0.6 0.7, reward 1 at the end
    # t2: delta 1 - 0.7 = 0.3, A2 = 0.3
    # t1: delta 0.9*0.7 - 0.6 = 0.03, A1 = 0.03 + 0.72*0.3 = 0.246
    # t0: delta 0.9*0.6 - 0.5 = 0.04, A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = compute_gae_advantage_return(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0], abs=1e-6)  # A + V before whitening
    assert adv.tolist()[0] == pytest.approx([-0.8855125, -0.1990343, 1.0845468], abs=1e-5)  # whitened A


def test_gae_multi_turn_skips_observation_tokens():
    # mask 1 0 1: the middle token is a tool observation; its value (9) and reward (5) are skipped.
    # t2: A2 = 1 - 0.7 = 0.3; t1 passes V=0.7, A=0.3 through; t0: delta 0.9*0.7 - 0.5 = 0.13, A0 = 0.13 + 0.72*0.3
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    assert ret.tolist()[0] == pytest.approx([0.346 + 0.5, 0.0, 1.0], abs=1e-6)
    assert adv.tolist()[0] == pytest.approx([0.7071034, 0.0, -0.7071034], abs=1e-5)  # two values whitened
    # same as running GAE on the sequence with the observation removed
    adv_c, ret_c = compute_gae_advantage_return(rewards[:, [0, 2]], values[:, [0, 2]], mask[:, [0, 2]], 0.9, 0.8)
    assert torch.allclose(adv[:, [0, 2]], adv_c) and torch.allclose(ret[:, [0, 2]], ret_c)


def test_dispatch_by_name_passes_what_each_estimator_declares():
    adv, _ = compute_advantage_by_name("grpo", token_level_rewards=REWARDS, response_mask=MASK, index=INDEX)
    assert torch.allclose(adv, compute_grpo_outcome_advantage(REWARDS, MASK, INDEX)[0])
    adv, _ = compute_advantage_by_name(
        "gae", token_level_rewards=REWARDS, response_mask=MASK, values=torch.zeros_like(REWARDS), gamma=0.9, lam=0.8
    )
    assert torch.allclose(adv, compute_gae_advantage_return(REWARDS, torch.zeros_like(REWARDS), MASK, 0.9, 0.8)[0])
    adv, _ = compute_advantage_by_name(
        "grpo_passk",
        token_level_rewards=REWARDS[:5],
        response_mask=MASK[:5],
        index=INDEX[:5],
        norm_adv_by_std_in_grpo=False,
    )
    assert adv[:, 0].tolist() == pytest.approx([0, 0, 1, 2, 0])
    with pytest.raises(TypeError, match="values"):
        compute_advantage_by_name("gae", token_level_rewards=REWARDS, response_mask=MASK)
    with pytest.raises(TypeError, match="reward_baselines"):
        compute_advantage_by_name("remax", token_level_rewards=REWARDS, response_mask=MASK)


@pytest.fixture
def scratch_registry():
    saved = dict(ADV_ESTIMATORS._entries)
    yield
    ADV_ESTIMATORS._entries.clear()
    ADV_ESTIMATORS._entries.update(saved)


def test_custom_estimator_written_for_verl_registers_unchanged(scratch_registry):
    name = f"my_est_{uuid.uuid4().hex[:6]}"

    @register_adv_est(name)
    def my_estimator(token_level_rewards, response_mask, config=None, **kwargs):
        scores = token_level_rewards.sum(-1, keepdim=True) * config["scale"]
        return scores * response_mask, scores * response_mask

    adv, _ = compute_advantage_by_name(
        name, token_level_rewards=REWARDS, response_mask=MASK, index=INDEX, extra_inputs={"config": {"scale": 2.0}}
    )
    assert adv[5].tolist() == [10.0, 10.0, 0.0]


@pytest.mark.parametrize(("returned", "error"), [
    (lambda r, m: r * m, r"; it returned Tensor"),
    (lambda r, m: None, r"; it returned NoneType"),
    (lambda r, m: (r.sum(-1), r.sum(-1)), r"; its advantages have shape \(6,\) \(a per-sequence value goes on every"),
    (lambda r, m: (r * m, [0.0]), r"; its returns are list"),
])
def test_a_custom_estimator_that_breaks_the_contract_is_named(scratch_registry, returned, error):
    """A (bs,) result broadcast along the tokens in the loss (or failed there as a torch error); now the driver
    names the estimator and the shape it must return."""
    name = f"my_est_{uuid.uuid4().hex[:6]}"
    register_adv_est(name)(lambda token_level_rewards, response_mask: returned(token_level_rewards, response_mask))
    with pytest.raises((TypeError, ValueError), match=rf"advantage estimator '{name}' must return \(advantages, "
                                                      rf"returns\), each a tensor of shape \(6, 3\){error}"):
        compute_advantage_by_name(name, token_level_rewards=REWARDS, response_mask=MASK, index=INDEX)


def test_registry_errors(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda **_: None)
    with pytest.raises(KeyError) as err:
        get_adv_estimator_fn("grpo_typo")
    assert "grpo" in str(err.value) and "rloo" in str(err.value)
