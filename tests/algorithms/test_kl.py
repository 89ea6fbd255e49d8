"""KL estimators, straight-through '+' variants, controllers and KL-in-reward."""

import math
from types import SimpleNamespace

import pytest
import torch

from hybridflow.algorithms import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
)

# The anchor: logprob -1, ref -1.5 -> d = 0.5
LOGP = torch.tensor([[-1.0]])
REF = torch.tensor([[-1.5]])
K3 = math.exp(-0.5) - 0.5  # exp(ref - logp) - (ref - logp) - 1 = 0.10653


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kl", 0.5),
        ("k1", 0.5),
        ("abs", 0.5),
        ("mse", 0.125),  # d^2 / 2
        ("k2", 0.125),
        ("low_var_kl", K3),
        ("k3", K3),
    ],
)
def test_estimators_by_hand(name, expected):
    assert kl_penalty(LOGP, REF, name).item() == pytest.approx(expected, abs=1e-6)
    # the '+' variant keeps the value
    assert kl_penalty(LOGP, REF, name + "+").item() == pytest.approx(expected, abs=1e-6)


def test_anchor_numbers():
    assert kl_penalty(LOGP, REF, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(LOGP, REF, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(LOGP, REF, "k3").item() == pytest.approx(0.10653, abs=1e-5)


def _grad(name, logp=-1.0, ref=-1.5):
    x = torch.tensor([[logp]], requires_grad=True)
    kl_penalty(x, torch.tensor([[ref]]), name).sum().backward()
    return x.grad.item()


def test_plus_variants_take_the_k2_gradient():
    # d k2 / d logp = logp - ref = 0.5; k1's is 1; k3's is 1 - exp(ref - logp) = 0.3935
    assert _grad("k2") == pytest.approx(0.5)
    assert _grad("k1") == pytest.approx(1.0)
    assert _grad("k3") == pytest.approx(1 - math.exp(-0.5))
    for name in ("k1+", "kl+", "k3+", "low_var_kl+", "abs+", "k2+", "mse+"):
        assert _grad(name) == pytest.approx(_grad("k2")), name


def test_low_var_kl_is_clamped():
    # ref - logp = -30 is clamped to -20 -> exp(-20) + 19 -> clamped to 10; +30 -> exp(20) - 21 -> 10
    logp = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[-30.0, 30.0]])
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == [[10.0, 10.0]]


def test_unknown_estimator_lists_names():
    assert "k3+" in KL_PENALTY_TYPES
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="known"):
        kl_penalty(LOGP, REF, "k4+")


def test_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(current_kl=5.0, n_steps=100)
    assert fixed.value == 0.1
    # e = clip(0.1 / 0.05 - 1, -0.2, 0.2) = 0.2 -> value *= 1 + 0.2 * 10 / 100
    adaptive = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.05, horizon=100)
    adaptive.update(current_kl=0.1, n_steps=10)
    assert adaptive.value == pytest.approx(0.204)
    adaptive.update(current_kl=0.0, n_steps=10)  # e = -0.2 -> *= 0.98
    assert adaptive.value == pytest.approx(0.204 * 0.98)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.2, 0.05, 0)


def test_controller_factories():
    assert isinstance(build_kl_controller("fixed", kl_coef=0.3), FixedKLController)
    ctrl = get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.3, target_kl=0.1, horizon=50))
    assert isinstance(ctrl, AdaptiveKLController) and ctrl.value == 0.3 and ctrl.horizon == 50
    with pytest.raises(ValueError, match="fixed"):
        build_kl_controller("pid")


SCORES = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.full((2, 3), -1.0)
REF_LP = torch.tensor([[-1.5, -1.0, -2.0], [-1.0, -0.5, -9.0]])


def test_apply_kl_penalty():
    # k1 = old - ref: row 0 [0.5, 0, 1], row 1 [0, -0.5, (8, masked)]; beta 0.1
    # rewards: row 0 [-0.05, 0, 0.9], row 1 [0, 2.05, 0]
    # current_kl = mean of per-sequence means = (1.5/3 + -0.5/2) / 2 = 0.125
    ctrl = FixedKLController(0.1)
    rewards, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, ctrl, "kl")
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.0, 0.9], [0.0, 2.05, 0.0]]))
    assert metrics == {
        "actor/reward_kl_penalty": pytest.approx(0.125),
        "actor/reward_kl_penalty_coeff": 0.1,
    }


def test_apply_kl_penalty_updates_an_adaptive_controller():
    # e = clip(0.125 / 0.1 - 1, -0.2, 0.2) = 0.2, n_steps = batch size 2 -> 0.1 * (1 + 0.2 * 2 / 10)
    ctrl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    _, metrics = apply_kl_penalty(SCORES, OLD, REF_LP, MASK, ctrl, "kl")
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the coefficient used this step
    assert ctrl.value == pytest.approx(0.104)


def test_compute_rewards():
    assert torch.allclose(compute_rewards(SCORES, OLD, REF_LP, 0.1)[0], torch.tensor([-0.05, 0.0, 0.9]))
