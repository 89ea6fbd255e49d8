"""Validation metrics: mean@N / std@N by hand, bootstrap best/worst/maj, verl key layout."""

import numpy as np
import pytest

from hybridflow.algorithms import bootstrap_metric, calc_maj_val, flatten_validation_metrics, process_validation_metrics

# data source "gsm": prompt p1 with acc 1, 0 (preds A, B); prompt p2 with acc 1, 1 (preds A, A)
# data source "code": prompt q with reward 0.2, 0.4, 0.6, 0.8, 1.0 (no acc, no pred)
SOURCES = ["gsm"] * 4
UIDS = ["p1", "p1", "p2", "p2"]
INFOS = {"acc": [1.0, 0.0, 1.0, 1.0], "reward": [1.0, -1.0, 1.0, 1.0], "pred": ["A", "B", "A", "A"]}


def test_mean_and_std_by_hand():
    out = process_validation_metrics(SOURCES, UIDS, INFOS)
    acc = out["gsm"]["acc"]
    assert acc["mean@2"] == pytest.approx(0.75)  # mean(0.5, 1)
    assert acc["std@2"] == pytest.approx(0.25)  # mean(0.5, 0) (population std per prompt)
    assert "pred" not in out["gsm"]  # strings get no metrics


def test_bootstrap_statistics_are_close_to_their_expectation():
    acc = process_validation_metrics(SOURCES, UIDS, INFOS)["gsm"]["acc"]
    # p1: max of 2 draws from {1, 0} is 1 w.p. 0.75; p2 always 1 -> 0.875; min: 0.25 and 1 -> 0.625
    assert acc["best@2/mean"] == pytest.approx(0.875, abs=0.03)
    assert acc["worst@2/mean"] == pytest.approx(0.625, abs=0.03)
    # maj@2 on p1: (A,A) -> 1, (B,B) -> 0, a tie goes to the first vote drawn -> 0.5; p2 -> 1
    assert acc["maj@2/mean"] == pytest.approx(0.75, abs=0.03)


def test_sample_sizes_are_powers_of_two_then_n():
    out = process_validation_metrics(["code"] * 5, ["q"] * 5, {"reward": [0.2, 0.4, 0.6, 0.8, 1.0]})
    keys = set(out["code"]["reward"])
    assert {"mean@5", "std@5", "best@2/mean", "best@4/std", "worst@5/mean"} <= keys
    assert not any(k.startswith("maj") for k in keys)  # no pred
    assert out["code"]["reward"]["best@5/mean"] <= 1.0
    assert out["code"]["reward"]["worst@2/mean"] >= 0.2


def test_single_response_has_only_mean():
    out = process_validation_metrics(["s"], ["u"], {"acc": [1.0]})
    assert out == {"s": {"acc": {"mean@1": 1.0}}}


def test_none_values_are_skipped():
    out = process_validation_metrics(["s"] * 3, ["u"] * 3, {"acc": [1.0, None, 0.0]})
    assert out["s"]["acc"]["mean@2"] == 0.5


def test_seeded_and_free_of_global_rng_state():
    np.random.seed(0)
    before = np.random.get_state()[1].copy()
    a = process_validation_metrics(SOURCES, UIDS, INFOS, seed=7)
    b = process_validation_metrics(SOURCES, UIDS, INFOS, seed=7)
    assert a == b
    assert (np.random.get_state()[1] == before).all()


def test_bootstrap_and_majority_helpers():
    [(mean, std)] = bootstrap_metric([3.0, 3.0], subset_size=2, reduce_fns=[np.max])
    assert (mean, std) == (3.0, 0.0)
    votes = [{"pred": "x", "val": 0.0}, {"pred": "y", "val": 1.0}, {"pred": "y", "val": 0.5}]
    assert calc_maj_val(votes, vote_key="pred", val_key="val") == 1.0  # y wins, its first value


def test_flatten_splits_core_and_aux_as_verl():
    flat = flatten_validation_metrics(process_validation_metrics(SOURCES, UIDS, INFOS))
    # core: the acc variable, mean/maj/best at the largest N
    assert "val-core/gsm/acc/mean@2" in flat
    assert "val-core/gsm/acc/best@2/mean" in flat and "val-core/gsm/acc/maj@2/mean" in flat
    assert "val-aux/gsm/acc/std@2" in flat and "val-aux/gsm/acc/worst@2/mean" in flat
    # reward is auxiliary when acc exists
    assert "val-aux/gsm/reward/mean@2" in flat
    # without acc, reward is the core variable
    flat2 = flatten_validation_metrics(process_validation_metrics(["code"] * 2, ["q"] * 2, {"reward": [0.0, 1.0]}))
    assert flat2["val-core/code/reward/mean@2"] == 0.5


def test_wilson_interval_of_a_binary_accuracy_matches_the_formula():
    from hybridflow.algorithms.validation_metrics import compute_mean_interval

    low, high = compute_mean_interval([1.0] * 10 + [0.0] * 54)  # 10/64, the demo's base accuracy
    assert (round(low, 4), round(high, 4)) == (0.0871, 0.2643)  # Wilson score interval, z = 1.96
    low, high = compute_mean_interval([0.0] * 64)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.0566, abs=1e-4)  # not empty at 0%


def test_interval_of_graded_scores_is_the_normal_interval_of_prompt_means():
    from hybridflow.algorithms.validation_metrics import compute_mean_interval

    scores = [2.0, -1.0, 0.5, 3.0]
    mean, sd = np.mean(scores), np.std(scores, ddof=1)
    low, high = compute_mean_interval(scores)
    assert low == pytest.approx(mean - 1.959964 * sd / 2) and high == pytest.approx(mean + 1.959964 * sd / 2)
    assert compute_mean_interval([0.5, 1.0])[1] == 1.0  # 0.75 + 0.49 > 1: mean@N accuracies are clipped to [0, 1]
    with pytest.raises(ValueError, match="at least one value"):
        compute_mean_interval([])


def test_validation_intervals_average_samples_per_prompt_then_count_prompts():
    from hybridflow.algorithms.validation_metrics import compute_mean_interval, validation_intervals

    flat = validation_intervals(
        ["a", "a", "a", "a", "b"], [0, 0, 1, 1, 2], {"acc": [1.0, 0.0, 1.0, None, 0.0], "reward": [9] * 5}
    )
    low, high = compute_mean_interval([0.5, 1.0])  # prompt 0: mean of 1 and 0; prompt 1: its one kept sample
    assert flat["val-aux/a/acc/mean@2/ci95_low"] == pytest.approx(low)
    assert flat["val-aux/a/acc/mean@2/ci95_high"] == pytest.approx(high)
    assert flat["val-aux/a/acc/num_prompts"] == 2 and flat["val-aux/b/acc/num_prompts"] == 1
    assert set(validation_intervals(["a"], [0], {"reward": [0.5]})) == {
        "val-aux/a/reward/mean@1/ci95_low", "val-aux/a/reward/mean@1/ci95_high", "val-aux/a/reward/num_prompts"
    }
