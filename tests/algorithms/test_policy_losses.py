"""Policy losses against hand-computed values, gradient checks, dispatch and the registry."""

import dataclasses
import math
import uuid

import pytest
import torch

from hybridflow.algorithms import (
    POLICY_LOSSES,
    PolicyLossConfig,
    PPOLossConfig,
    agg_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_from_config,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
    get_policy_loss_fn,
    register_policy_loss,
)
from hybridflow.algorithms.policy_loss_registry import loss_hyperparameters
from hybridflow.utils.config import ConfigFieldError


def log(*ratios):
    return torch.tensor([[math.log(r) for r in ratios]])


# Vanilla PPO example: old_log_prob 0, ratios 1.5, 0.5, 1.1, 5.0, advantages +1, +1, -1, -1, eps 0.2, c 3.
#   t0: r 1.5, A+1: max(-1.5, -1.2) = -1.2   (clipped above)
#   t1: r 0.5, A+1: max(-0.5, -0.8) = -0.5
#   t2: r 1.1, A-1: max(1.1, 1.1) = 1.1, min(3, 1.1) = 1.1
#   t3: r 5.0, A-1: max(5, 1.2) = 5, dual-clip min(3, 5) = 3
# token-mean: (-1.2 - 0.5 + 1.1 + 3) / 4 = 0.6
OLD = torch.zeros(1, 4)
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
MASK = torch.ones(1, 4)


def test_vanilla_ppo_by_hand():
    log_prob = log(1.5, 0.5, 1.1, 5.0).requires_grad_(True)
    loss, metrics = compute_policy_loss_vanilla(OLD, log_prob, ADV, MASK)
    assert loss.item() == pytest.approx(0.6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)  # t0
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # t3
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 5) / 4
    assert metrics["actor/ppo_kl"] == pytest.approx(-0.3542665, abs=1e-6)
    # detached 0-dim tensors: read on the host once per mini-batch, not per micro-batch
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    # gradient: clipped tokens (t0 by the clip, t3 by the dual clip) get none; d(-A r)/d logp = -A r, / 4 tokens
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 4, 1.1 / 4, 0.0])


def test_vanilla_clip_higher_and_dual_clip_constant():
    # DAPO clip-higher: t0 is clipped at 1.28 instead of 1.2 -> (-1.28 - 0.5 + 1.1 + 3) / 4
    loss, _ = compute_policy_loss_vanilla(OLD, log(1.5, 0.5, 1.1, 5.0), ADV, MASK, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(0.58)
    # c = 2: t3 becomes min(2, 5) = 2 -> (-1.2 - 0.5 + 1.1 + 2) / 4
    loss, _ = compute_policy_loss_vanilla(OLD, log(1.5, 0.5, 1.1, 5.0), ADV, MASK, clip_ratio_c=2.0)
    assert loss.item() == pytest.approx(0.35)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss_vanilla(OLD, log(1.5, 0.5, 1.1, 5.0), ADV, MASK, clip_ratio_c=1.0)


def test_rollout_is_weights_multiply_the_per_token_loss():
    # weights 2, 1, 1, 0.5: (-2.4 - 0.5 + 1.1 + 1.5) / 4
    weights = torch.tensor([[2.0, 1.0, 1.0, 0.5]])
    loss, _ = compute_policy_loss_vanilla(OLD, log(1.5, 0.5, 1.1, 5.0), ADV, MASK, rollout_is_weights=weights)
    assert loss.item() == pytest.approx(-0.075)


def test_vanilla_micro_batch_invariance_with_global_token_count():
    torch.manual_seed(0)
    old, new, adv = -torch.rand(6, 5), -torch.rand(6, 5), torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.3).float()
    full, _ = compute_policy_loss_vanilla(old, new, adv, mask)
    parts = [
        compute_policy_loss_vanilla(
            old[i : i + 2], new[i : i + 2], adv[i : i + 2], mask[i : i + 2], batch_num_tokens=mask.sum()
        )[0]
        for i in range(0, 6, 2)
    ]
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-6)


def test_gspo_by_hand():
    # row 0: ratios 1.1, 1.3 -> s = sqrt(1.43) = 1.1958 (inside [0.8, 1.2]), A = +1 -> loss -s per token
    # row 1: ratios 2, 0.5 -> s = 1, A = -1 -> loss 1 per token
    # seq-mean-token-mean: (-1.1958 + 1) / 2
    old = torch.zeros(2, 2)
    log_prob = torch.cat([log(1.1, 1.3), log(2.0, 0.5)]).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = compute_policy_loss_gspo(old, log_prob, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-0.0979130, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    # each token's gradient is -A s / (|y| * B): row 0 -1.1958 / 4, row 1 +1 / 4
    loss.backward()
    assert log_prob.grad.flatten().tolist() == pytest.approx([-0.2989565] * 2 + [0.25] * 2, abs=1e-6)


def test_gspo_gradient_equals_sequence_level_objective():
    # autograd reference: l_i = max(-A_i s_i, -A_i clip(s_i)) with s_i = exp(mean_t(logp - old)) fully differentiable
    torch.manual_seed(0)
    old = -torch.rand(4, 6)
    new = (old + 0.1 * torch.randn(4, 6)).requires_grad_(True)
    adv = torch.randn(4, 1).expand(4, 6)
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    loss, _ = compute_policy_loss_gspo(old, new, adv, mask, clip_ratio=0.05)
    (grad,) = torch.autograd.grad(loss, new)

    ref_new = new.detach().clone().requires_grad_(True)
    s = torch.exp(((ref_new - old) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    ref_loss = torch.maximum(-a * s, -a * torch.clamp(s, 0.95, 1.05)).mean()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_new)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    assert torch.allclose(grad, ref_grad * mask, atol=1e-6)


def test_sapo_by_hand_and_gradient_at_ratio_one():
    # t0: r 1, A +1, tau_pos 1: f = sigmoid(0) * 4 = 2 -> loss -2
    # t1: r 2, A -1, tau_neg 1.05: f = sigmoid(1.05) * 4 / 1.05 = 2.822 -> loss +2.822
    log_prob = log(1.0, 2.0).requires_grad_(True)
    loss, metrics = compute_policy_loss_sapo(torch.zeros(1, 2), log_prob, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx((-2 + 2.8219996) / 2, abs=1e-6)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    # at r = 1 the gate's slope is sigmoid'(0) * 4 = 1: the gradient equals the policy gradient -A / 2 tokens
    loss.backward()
    assert log_prob.grad[0, 0].item() == pytest.approx(-0.5)


def test_gpg_loss():
    # -logp * A: -(-1)(2) = 2, -(-2)(0.5) = 1 -> mean 1.5
    loss, metrics = compute_policy_loss_gpg(
        None, torch.tensor([[-1.0, -2.0]]), torch.tensor([[2.0, 0.5]]), torch.ones(1, 2)
    )
    assert loss.item() == pytest.approx(1.5)
    assert metrics == {}


def test_cispo_clips_the_weight_not_the_gradient():
    # ratios 1.5, 0.5, 1 -> clipped weights 1.2, 0.8, 1; A +1, +1, -1
    # loss = -w A logp: -1.2 ln1.5, -0.8 ln0.5, 0 -> mean 0.0226532
    log_prob = log(1.5, 0.5, 1.0).requires_grad_(True)
    loss, metrics = compute_policy_loss_cispo(
        torch.zeros(1, 3), log_prob, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3)
    )
    assert loss.item() == pytest.approx(0.0226532, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # d/dlogp = -w A / 3: every token keeps a gradient, even the clipped ones
    assert log_prob.grad.tolist()[0] == pytest.approx([-0.4, -0.8 / 3, 1 / 3])


def test_geo_mean_by_hand():
    # row 0, A +1: log-ratios ln1.1, ln1.5 -> ln1.5 clipped to 0.2 -> R = exp((ln1.1 + 0.2) / 2) = 1.15911
    # row 1, A -1: log-ratios ln0.5, 0 -> ln0.5 clipped to -0.2 -> R = exp(-0.1) = 0.904837
    # loss = mean(-1 * 1.15911, +1 * 0.904837)
    log_prob = torch.cat([log(1.1, 1.5), log(0.5, 1.0)])
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = compute_policy_loss_geo_mean(torch.zeros(2, 2), log_prob, adv, torch.ones(2, 2))
    assert loss.item() == pytest.approx(-0.1271378, abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)  # row 0 token 1
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # row 1 token 0
    # with a global sequence count the mean becomes sum / count * dp_size
    loss2, _ = compute_policy_loss_geo_mean(
        torch.zeros(2, 2), log_prob, adv, torch.ones(2, 2), global_batch_size=4, dp_size=2
    )
    assert loss2.item() == pytest.approx(loss.item())


# Covariance example for kl_cov / clip_cov: logp -0.1, -1, -1, -1 (mean -0.775).
LOGP = torch.tensor([[-0.1, -1.0, -1.0, -1.0]])


def test_kl_cov_penalises_the_top_covariance_token():
    # A = 2, 0, 0, 0 (mean 0.5): cov t0 = 1.5 * 0.675 = 1.0125, others 0.1125 -> top-1 (4 * 0.0002 -> 1 token) is t0
    # t0 has ratio 1.5: loss -2 * 1.5 + 0.5 * ln1.5; others 0 -> mean over 4 tokens
    old = LOGP.clone()
    old[0, 0] -= math.log(1.5)
    loss, metrics = compute_policy_loss_kl_cov(old, LOGP, torch.tensor([[2.0, 0.0, 0.0, 0.0]]), MASK, ppo_kl_coef=0.5)
    assert loss.item() == pytest.approx(-0.6993169, abs=1e-6)
    assert metrics == {"actor/ppo_kl": pytest.approx(math.log(1.5) / 4)}


def test_clip_cov_cuts_the_gradient_of_high_covariance_tokens():
    # A = 2, 1, 0, 0 (mean 0.75): cov t0 = 1.25 * 0.675 = 0.84375, t1 -0.05625, t2/t3 0.16875
    # with lb 0.5 only t0 is a candidate and is cut; ratios are 1 so the loss is -A: (0 - 1 + 0 + 0) / 4
    log_prob = LOGP.clone().requires_grad_(True)
    adv = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    loss, metrics = compute_policy_loss_clip_cov(LOGP, log_prob, adv, MASK, clip_cov_lb=0.5)
    assert loss.item() == pytest.approx(-0.25)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
    loss.backward()
    assert log_prob.grad.tolist()[0] == pytest.approx([0.0, -0.25, 0.0, 0.0])


@pytest.mark.parametrize("name", ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "cispo", "geo_mean"])
def test_dispatch_from_config_matches_direct_call(name):
    torch.manual_seed(0)
    old, new, adv = -torch.rand(3, 4), -torch.rand(3, 4), torch.randn(3, 1).expand(3, 4)
    mask = torch.ones(3, 4)
    # actor-level settings (PPOLossConfig) and loss-specific ones (its policy_loss section) both reach the loss
    actor_level = {"clip_ratio_high": 0.28, "tau_pos": 1.5}
    loss_level = {"clip_cov_lb": 0.5, "kl_cov_ratio": 0.5, "ppo_kl_coef": 0.3}
    cfg = PPOLossConfig(
        loss_agg_mode="seq-mean-token-mean", **actor_level, policy_loss=PolicyLossConfig(loss_mode=name, **loss_level)
    )
    torch.manual_seed(1)
    loss, metrics = compute_policy_loss_from_config(cfg, old, new, adv, mask)
    fn = get_policy_loss_fn(name)
    accepted = {key: value for key, value in {**actor_level, **loss_level}.items() if key in fn.__kwdefaults__}
    torch.manual_seed(1)
    direct, direct_metrics = fn(old, new, adv, mask, "seq-mean-token-mean", **accepted)
    assert loss.item() == pytest.approx(direct.item())
    assert metrics == direct_metrics


def test_keyword_defaults_live_in_the_loss_configs():
    defaults = loss_hyperparameters(PPOLossConfig())
    checked = set()
    for name in POLICY_LOSSES.names():
        for key, value in (get_policy_loss_fn(name).__kwdefaults__ or {}).items():
            if key in defaults:
                assert value == defaults[key], (name, key)
                checked.add(key)
    assert {"clip_ratio", "clip_ratio_c", "tau_pos", "clip_cov_ratio", "kl_cov_ratio", "ppo_kl_coef"} <= checked


def test_loss_hyperparameters_flatten_both_sections():
    policy_loss = PolicyLossConfig(loss_mode="kl_cov", ppo_kl_coef=0.5)
    cfg = PPOLossConfig(clip_ratio=0.3, entropy_coeff=0.01, policy_loss=policy_loss)
    params = loss_hyperparameters(cfg)
    assert params["clip_ratio"] == 0.3 and params["ppo_kl_coef"] == 0.5
    # the loss name, its aggregation and the actor's other loss terms are not keyword arguments of a loss
    not_loss_args = {"loss_mode", "policy_loss", "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef"}
    assert not not_loss_args & set(params)
    assert set(params) == {f.name for f in dataclasses.fields(PolicyLossConfig) if f.name != "loss_mode"} | {
        "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg", "loss_scale_factor"
    }


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: PPOLossConfig(clip_ratio_c=0.5), r"^clip_ratio_c=0.5 must be > 1"),
        (lambda: PPOLossConfig(clip_ratio=0.0), r"^clip_ratio=0.0 must be > 0"),
        (lambda: PPOLossConfig(clip_ratio_high=-0.1), r"^clip_ratio_high=-0.1 must be > 0"),
        (lambda: PPOLossConfig(kl_loss_type="nope"), r"^kl_loss_type='nope' is not one of"),
        (lambda: PolicyLossConfig(clip_cov_ratio=2.0), r"^clip_cov_ratio=2.0 must be in"),
        (lambda: PolicyLossConfig(clip_cov_lb=6.0), r"^clip_cov_lb=6.0 is above clip_cov_ub=5.0"),
    ],
)
def test_config_validation_names_the_field(make, match):
    with pytest.raises(ConfigFieldError, match=match):
        make()


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPOLossConfig().clip_ratio = 0.3
    with pytest.raises(dataclasses.FrozenInstanceError):
        PPOLossConfig().policy_loss.loss_mode = "gspo"


@pytest.fixture
def scratch_registry():
    saved = dict(POLICY_LOSSES._entries)
    yield
    POLICY_LOSSES._entries.clear()
    POLICY_LOSSES._entries.update(saved)


def test_custom_loss_and_global_batch_check(scratch_registry):
    name = f"my_loss_{uuid.uuid4().hex[:6]}"

    @register_policy_loss(name)
    def my_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, clip_ratio=0.2):
        return agg_loss(-advantages * log_prob * clip_ratio, response_mask, loss_agg_mode), {}

    cfg = PPOLossConfig(clip_ratio=0.5, policy_loss=PolicyLossConfig(loss_mode=name))
    loss, _ = compute_policy_loss_from_config(cfg, OLD, -torch.ones(1, 4), torch.ones(1, 4), MASK)
    assert loss.item() == pytest.approx(0.5)
    # the loss cannot normalise over the global batch, so asking for it is an error rather than a silent mistake
    with pytest.raises(ValueError, match="batch_num_tokens"):
        compute_policy_loss_from_config(
            cfg, OLD, -torch.ones(1, 4), torch.ones(1, 4), MASK, dp_size=2, batch_num_tokens=8
        )


@pytest.mark.parametrize(("returned", "error"), [
    (lambda lp, mask: -lp * mask, r"; it returned Tensor"),
    (lambda lp, mask: (-lp * mask, {}), r"its loss is \(1, 4\) \(aggregate the per-token loss with agg_loss\)"),
    (lambda lp, mask: (-(lp * mask).sum().detach(), {}), "its loss carries no gradient"),
    (lambda lp, mask: (-(lp * mask).sum(), None), "its metrics are NoneType"),
    (lambda lp, mask: (-(lp * mask).sum(), {"my/ratio": lp.detach()}), r"its metric 'my/ratio' has shape \(1, 4\)"),
])
def test_a_custom_loss_that_breaks_the_contract_is_named(scratch_registry, returned, error):
    """A custom loss's mistakes (no agg_loss, a detached loss, no metrics dict, a per-token metric) are refused at
    its first call naming the loss and the contract, instead of surfacing as a torch error inside backward."""
    name = f"my_loss_{uuid.uuid4().hex[:6]}"
    register_policy_loss(name)(lambda old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean":
                               returned(log_prob, response_mask))
    log_prob = torch.zeros(1, 4, requires_grad=True)
    with pytest.raises((TypeError, ValueError), match=rf"policy loss '{name}' must return \(loss, metrics\).*{error}"):
        compute_policy_loss_from_config(PPOLossConfig(policy_loss=PolicyLossConfig(loss_mode=name)), OLD, log_prob,
                                        ADV, MASK)


def test_registry_errors(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(compute_policy_loss_vanilla)
    with pytest.raises(KeyError) as err:
        get_policy_loss_fn("vanila")
    assert "vanilla" in str(err.value) and "gspo" in str(err.value)
    with pytest.raises(KeyError):
        unknown = PPOLossConfig(policy_loss=PolicyLossConfig(loss_mode="nope"))
        compute_policy_loss_from_config(unknown, OLD, OLD, ADV, MASK)


@pytest.mark.parametrize("seed", [0, 1])
def test_clip_cov_cuts_exactly_its_budget_of_candidates(seed):
    # 8 valid tokens, all candidates (ratio 1, bounds wide): int(0.25 * 8) = 2 are drawn and cut, whatever the draw
    log_prob = torch.linspace(-2.0, -1.0, 8).view(1, 8)
    adv = torch.arange(8.0).view(1, 8)
    generator = torch.Generator().manual_seed(seed)
    _, metrics = compute_policy_loss_clip_cov(
        log_prob, log_prob, adv, torch.ones(1, 8), clip_cov_ratio=0.25, clip_cov_lb=-1e9, clip_cov_ub=1e9,
        generator=generator,
    )
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.25)
