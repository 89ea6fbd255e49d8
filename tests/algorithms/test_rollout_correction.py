"""Rollout correction math against hand-computed values: truncated importance weights (token, sequence,
batch-normalised), each rejection rule's mask, verl's `rollout_corr/*` metrics, and the config's checks."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, get_policy_loss_fn
from hybridflow.algorithms.config import RolloutCorrectionConfig
from hybridflow.algorithms.rollout_correction import (
    ROLLOUT_RS_OPTIONS,
    build_rejection_rules,
    compute_bypass_correction,
    compute_offpolicy_metrics,
    compute_rollout_correction,
    compute_rollout_is_weights,
    compute_rollout_log_ratio,
    compute_rollout_rejection_mask,
)
from hybridflow.utils.config import ConfigFieldError

# Token ratios pi_old / pi_rollout: row 0 has 4 valid tokens, row 1 has 2 (then padding).
RATIOS = [[3.0, 0.4, 1.0, 1.5], [0.25, 1.8]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
ROLLOUT = torch.full((2, 4), -1.0)
OLD = ROLLOUT + torch.tensor([[math.log(r) for r in RATIOS[0]], [math.log(r) for r in RATIOS[1]] + [7.0, float("nan")]])
LOG_RATIO = compute_rollout_log_ratio(OLD, ROLLOUT, MASK)


def approx(value: float) -> pytest.approx:
    return pytest.approx(value, rel=1e-5, abs=1e-6)


def test_log_ratio_is_zero_at_padding_even_for_nan():
    assert LOG_RATIO[1, 2:].tolist() == [0.0, 0.0]
    torch.testing.assert_close(LOG_RATIO[0], torch.tensor([math.log(r) for r in RATIOS[0]]))


def test_token_tis_truncates_each_token_at_the_threshold():
    weights, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.4, 1.0, 1.5], [0.25, 1.8, 0.0, 0.0]]))
    assert not weights.requires_grad
    # Metrics describe the weights before truncation (as verl's): raw = [3, .4, 1, 1.5, .25, 1.8].
    assert metrics["rollout_is_mean"] == approx(7.95 / 6)
    assert (metrics["rollout_is_max"], metrics["rollout_is_min"]) == (approx(3.0), approx(0.25))
    assert metrics["rollout_is_ratio_fraction_high"] == approx(1 / 6)  # 3 > 2: the truncated fraction
    assert metrics["rollout_is_ratio_fraction_low"] == approx(2 / 6)  # .4 and .25 < 1/2
    # Bounded to [1/2, 2]: [2, .5, 1, 1.5, .5, 1.8]; mean 7.3/6, E[w^2] 10.99/6.
    mean, second = 7.3 / 6, 10.99 / 6
    assert metrics["rollout_is_std"] == approx(math.sqrt(second - mean**2))
    assert metrics["rollout_is_eff_sample_size"] == approx(mean**2 / second)
    # Per-sequence mean raw weights: 5.9/4 = 1.475 and 2.05/2 = 1.025.
    assert metrics["rollout_is_seq_mean"] == approx(1.25)
    assert metrics["rollout_is_seq_std"] == approx(0.45 / math.sqrt(2))
    assert (metrics["rollout_is_seq_max"], metrics["rollout_is_seq_min"]) == (approx(1.475), approx(1.025))
    assert metrics["rollout_is_seq_max_deviation"] == approx(0.475)
    assert metrics["rollout_is_seq_fraction_high"] == metrics["rollout_is_seq_fraction_low"] == 0.0
    assert "rollout_is_batch_norm_factor" not in metrics


def test_sequence_tis_is_the_truncated_product_on_every_token():
    weights, metrics = compute_rollout_is_weights(LOG_RATIO, MASK, rollout_is="sequence", rollout_is_threshold=1.5)
    # Products: 3 * .4 * 1 * 1.5 = 1.8 (truncated to 1.5) and .25 * 1.8 = .45.
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5, 1.5], [0.45, 0.45, 0.0, 0.0]]))
    assert metrics["rollout_is_mean"] == approx((4 * 1.8 + 2 * 0.45) / 6)
    assert (metrics["rollout_is_max"], metrics["rollout_is_min"]) == (approx(1.8), approx(0.45))
    assert metrics["rollout_is_ratio_fraction_high"] == 0.5 and metrics["rollout_is_ratio_fraction_low"] == 0.5


def test_sequence_weights_beyond_the_safety_bound_are_clamped():
    log_ratio = torch.tensor([[15.0, 15.0], [0.0, 0.0]])
    weights, metrics = compute_rollout_is_weights(log_ratio, torch.ones(2, 2), rollout_is="sequence",
                                                  rollout_is_threshold=5.0)
    assert weights[0].tolist() == [5.0, 5.0] and metrics["rollout_is_max"] == approx(math.exp(20.0))


@pytest.mark.parametrize(
    ("level", "threshold", "expected", "factor"),
    [
        ("token", 2.0, [[2.0, 0.4, 1.0, 1.5], [0.25, 1.8, 0, 0]], 6.95 / 6),  # mean over the 6 tokens
        ("sequence", 1.5, [[1.5] * 4, [0.45, 0.45, 0, 0]], 0.975),  # mean over the 2 sequences
    ],
)
def test_batch_normalisation_divides_by_the_mean_weight(level, threshold, expected, factor):
    weights, metrics = compute_rollout_is_weights(
        LOG_RATIO, MASK, rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True
    )
    torch.testing.assert_close(weights, torch.tensor(expected) / factor)
    assert metrics["rollout_is_batch_norm_factor"] == approx(factor)


@pytest.mark.parametrize(
    ("rule", "threshold", "expected"),
    [
        # k1 = -log ratio within [log lower, log upper]; symmetric bounds keep ratios in [1/2, 2].
        ("token_k1", "0.5_2.0", [[0, 0, 1, 1], [0, 1, 0, 0]]),
        # verl's convention for asymmetric bounds: -log ratio in [log .8, log 1.6], i.e. ratio in [.625, 1.25].
        ("token_k1", "0.8_1.6", [[0, 0, 1, 0], [0, 0, 0, 0]]),
        # k2 = (log ratio)^2 / 2: .604, .420, 0, .082 | .961, .173.
        ("token_k2", 0.3, [[0, 0, 1, 1], [0, 1, 0, 0]]),
        # k3 = ratio - 1 - log ratio: .901, .316, 0, .095 | .636, .212.
        ("token_k3", "0.35", [[0, 1, 1, 1], [0, 1, 0, 0]]),
        # Sequence ratios 1.8 and .45, sums of k1 -.588 and .799; a single number u means ratios [1/u, u].
        ("seq_sum_k1", 2.0, [[1, 1, 1, 1], [0, 0, 0, 0]]),
        ("seq_sum_k1", "0.6_2.5", [[0, 0, 0, 0], [1, 1, 0, 0]]),  # bounds [-.511, .916]
        # Means of k1 -.147 and .399 (minus the log of the geometric-mean ratios 1.158 and .671).
        ("seq_mean_k1", "0.8_1.25", [[1, 1, 1, 1], [0, 0, 0, 0]]),  # bounds [-.223, .223]
        ("seq_mean_k2", 0.3, [[1, 1, 1, 1], [0, 0, 0, 0]]),  # means of k2: .276 and .567
        ("seq_sum_k3", 1.0, [[0, 0, 0, 0], [1, 1, 0, 0]]),  # sums of k3: 1.312 and .849
        ("seq_max_k3", 0.7, [[0, 0, 0, 0], [1, 1, 0, 0]]),  # max k3: .901 and .636
    ],
)
def test_each_rejection_rule_by_hand(rule, threshold, expected):
    mask, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs=rule, rollout_rs_threshold=threshold)
    assert mask.tolist() == expected, rule
    assert mask.dtype == MASK.dtype
    rejected = sum(m - k for row_m, row_k in zip(MASK.tolist(), expected) for m, k in zip(row_m, row_k))
    assert metrics[f"rollout_rs_{rule}_masked_fraction"] == approx(rejected / 6)
    assert metrics["rollout_rs_masked_fraction"] == approx(rejected / 6)


def test_chained_rules_must_all_pass_and_report_per_rule_metrics():
    mask, metrics = compute_rollout_rejection_mask(
        LOG_RATIO, MASK, rollout_rs="token_k3, seq_max_k3,token_k3", rollout_rs_threshold="0.35,0.7"
    )
    # token_k3 drops (0, 0) and (1, 0); seq_max_k3 drops row 0.
    assert mask.tolist() == [[0, 0, 0, 0], [0, 1, 0, 0]]
    assert metrics["rollout_rs_token_k3_masked_fraction"] == approx(2 / 6)
    assert metrics["rollout_rs_token_k3_seq_masked_fraction"] == approx(1.0)
    assert metrics["rollout_rs_seq_max_k3_masked_fraction"] == approx(4 / 6)
    assert metrics["rollout_rs_seq_max_k3_seq_masked_fraction"] == approx(0.5)
    assert metrics["rollout_rs_masked_fraction"] == approx(5 / 6)
    assert metrics["rollout_rs_seq_masked_fraction"] == approx(1.0)
    k3 = [[3 - 1 - math.log(3), 0.4 - 1 - math.log(0.4), 0.0, 0.5 - math.log(1.5)],
          [0.25 - 1 - math.log(0.25), 0.8 - math.log(1.8)]]
    row_max = [max(k3[0]), max(k3[1])]
    # A sequence rule's statistic: token-weighted mean, max/min and fractions over sequences, no lower bound.
    assert metrics["rollout_rs_seq_max_k3_mean"] == approx((4 * row_max[0] + 2 * row_max[1]) / 6)
    assert metrics["rollout_rs_seq_max_k3_max"] == approx(row_max[0])
    assert metrics["rollout_rs_seq_max_k3_min"] == approx(row_max[1])
    assert metrics["rollout_rs_seq_max_k3_fraction_high"] == 0.5 and metrics["rollout_rs_seq_max_k3_fraction_low"] == 0.0
    assert metrics["rollout_rs_seq_max_k3_seq_max_deviation"] == approx(row_max[0])
    assert "rollout_rs_seq_max_k3_seq_fraction_low" not in metrics
    # A token rule's statistic: over valid tokens; its per-sequence values are token means.
    tokens = k3[0] + k3[1]
    assert metrics["rollout_rs_token_k3_mean"] == approx(sum(tokens) / 6)
    assert metrics["rollout_rs_token_k3_max"] == approx(max(tokens))
    assert metrics["rollout_rs_token_k3_fraction_high"] == approx(2 / 6)
    assert metrics["rollout_rs_token_k3_seq_mean"] == approx((sum(k3[0]) / 4 + sum(k3[1]) / 2) / 2)


def test_k1_rules_report_fractions_below_the_lower_bound():
    _, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs="token_k1", rollout_rs_threshold=2.0)
    # k1 = -log ratio: -1.10, .92, 0, -.41 | 1.39, -.59 against [log 1/2, log 2] = [-.69, .69].
    assert metrics["rollout_rs_token_k1_fraction_low"] == approx(1 / 6)
    assert metrics["rollout_rs_token_k1_fraction_high"] == approx(2 / 6)
    assert "rollout_rs_token_k1_seq_fraction_low" in metrics


@pytest.mark.parametrize("rule", ROLLOUT_RS_OPTIONS)
def test_every_rule_runs_and_keeps_padding_out(rule):
    mask, metrics = compute_rollout_rejection_mask(LOG_RATIO, MASK, rollout_rs=rule, rollout_rs_threshold=100.0)
    assert mask.tolist() == MASK.tolist(), "nothing is beyond a wide bound"
    assert metrics[f"rollout_rs_{rule}_masked_fraction"] == 0.0


def test_offpolicy_metrics_by_hand():
    metrics = compute_offpolicy_metrics(OLD, ROLLOUT, MASK)
    flat = RATIOS[0] + RATIOS[1]
    logs = [math.log(r) for r in flat]
    assert metrics["kl"] == approx(-sum(logs) / 6)  # E[log pi_rollout - log pi_old]
    assert metrics["k3_kl"] == approx(sum(r - 1 - lr for r, lr in zip(flat, logs)) / 6)
    assert metrics["chi2_token"] == approx(sum(r * r for r in flat) / 6 - 1)
    assert metrics["chi2_seq"] == approx((1.8**2 + 0.45**2) / 2 - 1)
    train_means = [-1 + math.log(1.8) / 4, -1 + math.log(0.45) / 2]
    assert metrics["training_ppl"] == approx(sum(math.exp(-m) for m in train_means) / 2)
    assert metrics["training_log_ppl"] == approx(-sum(train_means) / 2)
    assert metrics["rollout_ppl"] == approx(math.e) and metrics["rollout_log_ppl"] == approx(1.0)
    diffs = [-1 - m for m in train_means]
    assert metrics["log_ppl_diff"] == approx(sum(diffs) / 2)
    assert metrics["log_ppl_abs_diff"] == approx(sum(abs(d) for d in diffs) / 2)
    assert (metrics["log_ppl_diff_max"], metrics["log_ppl_diff_min"]) == (approx(max(diffs)), approx(min(diffs)))
    assert metrics["ppl_ratio"] == approx(sum(math.exp(d) for d in diffs) / 2)


def test_pipeline_prefixes_metrics_and_weights_use_the_original_mask():
    weights, mask, metrics = compute_rollout_correction(
        OLD, ROLLOUT, MASK, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_max_k3",
        rollout_rs_threshold=0.7,
    )
    assert mask.tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    assert weights[0].tolist() == pytest.approx([2.0, 0.4, 1.0, 1.5]), "rejection does not zero the weights"
    assert all(key.startswith("rollout_corr/") for key in metrics)
    for key in ("rollout_is_mean", "rollout_is_eff_sample_size", "rollout_rs_masked_fraction", "kl", "chi2_seq"):
        assert f"rollout_corr/{key}" in metrics, key
    none_weights, same_mask, only_diagnostics = compute_rollout_correction(OLD, ROLLOUT, MASK)
    assert none_weights is None and torch.equal(same_mask, MASK)
    assert "rollout_corr/kl" in only_diagnostics and not any("rollout_is" in k for k in only_diagnostics)


def test_identical_log_probs_give_unit_weights_and_keep_everything():
    weights, mask, metrics = compute_rollout_correction(
        ROLLOUT, ROLLOUT, MASK, rollout_is="sequence", rollout_rs="seq_mean_k1,token_k2", rollout_rs_threshold="1.01"
    )
    torch.testing.assert_close(weights, MASK)
    assert torch.equal(mask, MASK) and metrics["rollout_corr/kl"] == 0.0
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == approx(1.0)


def test_an_empty_mask_is_refused():
    with pytest.raises(ValueError, match="at least one valid token"):
        compute_rollout_correction(OLD, ROLLOUT, torch.zeros_like(MASK), rollout_is="token")


@pytest.mark.parametrize("name", ["vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "cispo", "geo_mean"])
def test_every_policy_loss_scales_with_uniform_importance_weights(name):
    assert name in POLICY_LOSSES.names()
    generator = torch.Generator().manual_seed(0)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.0]])
    new = old + torch.tensor([[0.1, -0.2, 0.05], [0.3, 0.0, -0.1]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    fn = get_policy_loss_fn(name)
    kwargs = {"generator": generator} if name == "clip_cov" else {}
    plain, _ = fn(old, new, adv, mask, **kwargs)
    generator.manual_seed(0)
    weighted, _ = fn(old, new, adv, mask, rollout_is_weights=torch.full_like(old, 2.0), **kwargs)
    torch.testing.assert_close(weighted, 2 * plain)


# ----------------------------------------------------------------------------- the config section
def test_threshold_parsing():
    rules = build_rejection_rules("token_k1,seq_max_k2", "0.5_1.5,3")
    assert (rules[0].lower, rules[0].upper) == (approx(math.log(0.5)), approx(math.log(1.5)))
    assert (rules[1].lower, rules[1].upper) == (None, 3.0)
    (single,) = build_rejection_rules("seq_mean_k1", 4)
    assert (single.lower, single.upper) == (approx(-math.log(4)), approx(math.log(4)))


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (dict(rollout_is="tokens"), "rollout_is", ["rollout_is='tokens'", "token", "sequence"]),
        (dict(rollout_is="token", rollout_is_threshold=0.0), "rollout_is_threshold", ["rollout_is_threshold=0.0", "> 0"]),
        (dict(rollout_is_batch_normalize=True), "rollout_is_batch_normalize", ["rollout_is is null"]),
        (dict(rollout_rs="seq_k1", rollout_rs_threshold=2.0), "rollout_rs", ["unknown rule 'seq_k1'", "seq_mean_k1"]),
        (dict(rollout_rs=" , "), "rollout_rs", ["names no rule"]),
        (dict(rollout_rs="token_k1"), "rollout_rs_threshold", ["needs rollout_rs_threshold="]),
        (dict(rollout_rs_threshold=2.0), "rollout_rs_threshold", ["rollout_rs is null"]),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="2.0_0.5"), "rollout_rs_threshold", ["lower ratio 2"]),
        (dict(rollout_rs="token_k1", rollout_rs_threshold=0.5), "rollout_rs_threshold", ["u >= 1"]),
        (dict(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0"), "rollout_rs_threshold", ["one upper bound"]),
        (dict(rollout_rs="token_k2", rollout_rs_threshold=-1.0), "rollout_rs_threshold", ["must be > 0"]),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="0.5_2_0"), "rollout_rs_threshold", ["'2_0'", "not a number"]),
        (dict(rollout_rs="token_k2,seq_max_k3", rollout_rs_threshold="1,2,3"), "rollout_rs_threshold", ["3 entries for 2"]),
        (dict(loss_type="reinforce"), "loss_type", ["bypass mode's loss", "set bypass_mode=True"]),
    ],
)
def test_config_refuses_bad_values_naming_the_field(kwargs, field, words):
    with pytest.raises(ConfigFieldError) as info:
        RolloutCorrectionConfig(**kwargs)
    assert info.value.field == field
    message = str(info.value)
    assert f"{field}=" in message, message
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_config_accepts_verl_presets():
    assert not RolloutCorrectionConfig().enabled
    assert RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0).enabled
    seq_mis = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0")
    assert seq_mis.enabled
    multi = RolloutCorrectionConfig(rollout_rs="token_k1,seq_max_k2", rollout_rs_threshold="0.6_1.6,2.5")
    assert multi.rollout_is is None and multi.enabled
    assert RolloutCorrectionConfig(bypass_mode=True).enabled is False
    assert not RolloutCorrectionConfig(bypass_mode=True).in_loss, "plain bypass: the PPO loss against the rollout"
    bypass_pg_is = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="sequence")
    assert bypass_pg_is.in_loss and RolloutCorrectionConfig(bypass_mode=True, rollout_rs="seq_mean_k1",
                                                            rollout_rs_threshold="0.5_2.0").in_loss


@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
@pytest.mark.parametrize("rules", [("token_k1,seq_max_k2", "0.5_2.0,1.0"), ("seq_mean_k3", 0.2)])
def test_bypass_correction_is_the_decoupled_one_with_the_current_policy_and_reads_nothing_back(rollout_is, rules):
    """Inside the loss (bypass mode), the current policy takes the old one's place: the same weights and mask as
    the driver's correction, and device tensors for metrics."""
    kwargs = dict(rollout_is=rollout_is, rollout_is_threshold=2.0, rollout_rs=rules[0], rollout_rs_threshold=rules[1])
    old = torch.where(MASK.bool(), OLD, torch.zeros(()))
    expected_weights, expected_mask, _ = compute_rollout_correction(old, ROLLOUT, MASK, **kwargs)
    weights, mask, metrics = compute_bypass_correction(old, ROLLOUT, MASK, **kwargs)
    torch.testing.assert_close(weights, expected_weights)
    assert torch.equal(mask, expected_mask)
    assert all(isinstance(value, torch.Tensor) and value.dim() == 0 for value in metrics.values()), metrics
    assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == approx(1 - float(mask.sum() / MASK.sum()))


def test_bypass_reinforce_loss_is_the_importance_weighted_policy_gradient():
    """loss_type=reinforce: the gradient is -A * w * grad log pi with w the truncated ratio to the rollout, detached;
    ppo_clip takes the rollout as the old policy (ratio 1 at the rollout's own log-probs: the plain PG)."""
    from hybridflow.workers.config import ActorConfig
    from hybridflow.workers.ppo_update import bypass_policy_loss

    actor = ActorConfig(loss_agg_mode="token-mean")
    log_prob = torch.where(MASK.bool(), OLD, torch.zeros(())).clone().requires_grad_(True)
    advantages = torch.tensor([[1.0, -2.0, 0.5, 1.0], [2.0, 1.0, 0.0, 0.0]])
    agg = dict(dp_size=1, batch_num_tokens=float(MASK.sum()), global_batch_size=2.0)
    correction = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="token")
    loss, _ = bypass_policy_loss(actor, correction, ROLLOUT, log_prob, advantages, MASK, agg)
    loss.backward()
    weights = torch.tensor([[2.0, 0.4, 1.0, 1.5], [0.25, 1.8, 0.0, 0.0]])  # token ratios truncated at 2
    torch.testing.assert_close(log_prob.grad, -advantages * weights * MASK / MASK.sum())
    at_rollout = ROLLOUT.clone().requires_grad_(True)
    clip = RolloutCorrectionConfig(bypass_mode=True)
    loss, _ = bypass_policy_loss(actor, clip, ROLLOUT, at_rollout, advantages, MASK, agg)
    loss.backward()
    torch.testing.assert_close(at_rollout.grad, -advantages * MASK / MASK.sum())
