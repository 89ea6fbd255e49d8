"""Validation metrics over N sampled responses per prompt: mean@N, std@N, best@k, worst@k, maj@k.

`process_validation_metrics` returns verl's nested `{data_source: {var: {metric: value}}}`;
`flatten_validation_metrics` turns it into the logged keys `val-core/{data_source}/{var}/{metric}`
(the core variable `acc`, or `reward` when there is no `acc`, for mean/maj/best at the largest N)
and `val-aux/...` (everything else). Bootstrap sampling is seeded and uses its own numpy
`RandomState`, so the numbers equal verl's (which seeds the global numpy RNG) without touching global
state.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

__all__ = [
    "bootstrap_metric",
    "calc_maj_val",
    "compute_mean_interval",
    "process_validation_metrics",
    "flatten_validation_metrics",
    "interval_keys",
    "validation_intervals",
]

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


def bootstrap_metric(
    data: Sequence[Any],
    subset_size: int,
    reduce_fns: Sequence[Callable[[list[Any]], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """Mean and std of each `reduce_fn` over `n_bootstrap` resamples (with replacement) of size `subset_size`.

    Args:
        data: the values (or records) of one prompt.
        subset_size: size k of each resample.
        reduce_fns: functions of a list of data points (e.g. `np.max`).
        n_bootstrap: number of resamples.
        seed: seed of the resampling RNG (same stream as verl's `np.random.seed(seed)`).

    Returns:
        One `(mean, std)` per reduce function.
    """
    rng = np.random.RandomState(seed)
    all_idxs = rng.choice(len(data), size=(n_bootstrap, subset_size), replace=True)
    samples = [[data[i] for i in idxs] for idxs in all_idxs]
    results = [[reduce_fn(sample) for sample in samples] for reduce_fn in reduce_fns]
    return [(float(np.mean(lst)), float(np.std(lst))) for lst in results]


def calc_maj_val(data: Sequence[Mapping[str, Any]], vote_key: str, val_key: str) -> Any:
    """Majority vote: the `val_key` of the first record whose `vote_key` is the most frequent.

    Ties between equally frequent votes go to the vote seen first.
    """
    vote2vals: dict[Any, list[Any]] = defaultdict(list)
    for record in data:
        vote2vals[record[vote_key]].append(record[val_key])
    maj_vote = max(vote2vals, key=lambda vote: len(vote2vals[vote]))
    return vote2vals[maj_vote][0]


def _sample_sizes(n_resps: int) -> list[int]:
    """k = 2, 4, 8, ... below n, then n itself (as verl)."""
    sizes, n = [], 2
    while n < n_resps:
        sizes.append(n)
        n *= 2
    return [*sizes, n_resps]


def _prompt_metrics(var_vals: list[Any], preds: list[Any] | None, seed: int) -> dict[str, float]:
    n_resps = len(var_vals)
    metric = {f"mean@{n_resps}": float(np.mean(var_vals))}
    if n_resps == 1:
        return metric
    metric[f"std@{n_resps}"] = float(np.std(var_vals))
    for n in _sample_sizes(n_resps):
        [(bon_mean, bon_std), (won_mean, won_std)] = bootstrap_metric(var_vals, n, [np.max, np.min], seed=seed)
        metric[f"best@{n}/mean"], metric[f"best@{n}/std"] = bon_mean, bon_std
        metric[f"worst@{n}/mean"], metric[f"worst@{n}/std"] = won_mean, won_std
        if preds is not None:
            vote_data = [{"val": val, "pred": pred} for val, pred in zip(var_vals, preds, strict=True)]
            maj = partial(calc_maj_val, vote_key="pred", val_key="val")
            [(maj_mean, maj_std)] = bootstrap_metric(vote_data, n, [maj], seed=seed)
            metric[f"maj@{n}/mean"], metric[f"maj@{n}/std"] = maj_mean, maj_std
    return metric


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_uids: Sequence[Any],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per data source and variable, average over prompts of the per-prompt statistics.

    For each prompt (same uid) with N responses and each numeric variable in `infos_dict`:
    `mean@N`, `std@N` (population std), and for k in 2, 4, 8, ... < N and k = N:
    `best@k/mean|std`, `worst@k/mean|std` (bootstrap of max/min over k draws) and, when a `pred`
    variable exists, `maj@k/mean|std` (the value of the majority-voted prediction). `None` values
    (failed samples) are left out; `maj@k` needs a non-None `pred` for every kept value.
    String-valued variables (such as `pred`) get no metrics. Prompts with different N produce
    separate keys.

    Args:
        data_sources: (num_samples,) data source of each sample.
        sample_uids: (num_samples,) prompt id of each sample.
        infos_dict: variable name -> (num_samples,) values, e.g. `{"reward": [...], "acc": [...]}`.
        seed: bootstrap seed.

    Returns:
        `{data_source: {var_name: {metric_name: value}}}`.
    """
    grouped: dict[str, dict[Any, dict[str, list[Any]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for sample_idx, data_source in enumerate(data_sources):
        var2vals = grouped[data_source][sample_uids[sample_idx]]
        for var_name, var_vals in infos_dict.items():
            var2vals[var_name].append(var_vals[sample_idx])

    collected: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for data_source, uid2var2vals in grouped.items():
        for var2vals in uid2var2vals.values():
            preds = var2vals.get("pred")
            for var_name, all_vals in var2vals.items():
                var_vals = [value for value in all_vals if value is not None]
                if not var_vals or isinstance(var_vals[0], str):
                    continue
                usable_preds = preds
                if preds is not None and (len(preds) != len(var_vals) or any(p is None for p in preds)):
                    usable_preds = None
                for metric_name, value in _prompt_metrics(var_vals, usable_preds, seed).items():
                    collected[data_source][var_name][metric_name].append(value)

    return {
        data_source: {
            var_name: {metric_name: float(np.mean(vals)) for metric_name, vals in metric2vals.items()}
            for var_name, metric2vals in var2metric2vals.items()
        }
        for data_source, var2metric2vals in collected.items()
    }


def flatten_validation_metrics(
    data_src2var2metric2val: Mapping[str, Mapping[str, Mapping[str, float]]],
) -> dict[str, float]:
    """Logged keys for `process_validation_metrics` output, split into `val-core/` and `val-aux/` as verl.

    A metric is core when its variable is the core variable (`acc` if present for that data source,
    else `reward`), its name starts with `mean`, `maj` or `best`, and it is at the largest N seen for
    that variable; everything else is auxiliary.

    Returns:
        `{f"{section}/{data_source}/{var_name}/{metric_name}": value}`.
    """
    flat: dict[str, float] = {}
    for data_source, var2metric2val in data_src2var2metric2val.items():
        core_var = "acc" if "acc" in var2metric2val else "reward"
        for var_name, metric2val in var2metric2val.items():
            n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
            for metric_name, metric_val in metric2val.items():
                is_core = (
                    var_name == core_var
                    and metric_name.startswith(("mean", "maj", "best"))
                    and f"@{n_max}" in metric_name
                )
                section = "val-core" if is_core else "val-aux"
                flat[f"{section}/{data_source}/{var_name}/{metric_name}"] = metric_val
    return flat


def compute_mean_interval(values: Sequence[float], z: float = Z_95) -> tuple[float, float]:
    """Two-sided interval (95% by default) for the mean of `values`, one value per prompt.

    Prompts are the independent draws, so samples of one prompt are averaged before this. When every value is
    0 or 1 (greedy accuracy) the Wilson score interval is used: unlike mean +- z*se it stays inside [0, 1] and is
    not empty at 0% or 100%. Otherwise the normal interval mean +- z * s / sqrt(k), with the sample std s,
    clipped to [0, 1] when every value lies there (mean@N accuracies).

    Args:
        values: (k,) per-prompt scores, k >= 1.
        z: the normal quantile of the interval's level.

    Returns:
        `(low, high)`.
    """
    scores = np.asarray(values, dtype=np.float64)
    k = scores.size
    if k == 0:
        raise ValueError("compute_mean_interval needs at least one value")
    mean = float(scores.mean())
    if np.isin(scores, (0.0, 1.0)).all():
        centre = (mean + z * z / (2 * k)) / (1 + z * z / k)
        half = z / (1 + z * z / k) * float(np.sqrt(mean * (1 - mean) / k + z * z / (4 * k * k)))
        return float(max(0.0, centre - half)), float(min(1.0, centre + half))
    if k == 1:
        return mean, mean
    half = z * float(scores.std(ddof=1)) / float(np.sqrt(k))
    if ((scores >= 0.0) & (scores <= 1.0)).all():
        return max(0.0, mean - half), min(1.0, mean + half)
    return mean - half, mean + half


def interval_keys(core_key: str) -> tuple[str, str]:
    """The `(low, high)` interval keys that `validation_intervals` logs for the core mean `core_key`
    (`val-core/{data_source}/{var}/mean@{N}`)."""
    aux_key = "val-aux/" + core_key.removeprefix("val-core/")
    return f"{aux_key}/ci95_low", f"{aux_key}/ci95_high"


def validation_intervals(
    data_sources: Sequence[str], sample_uids: Sequence[Any], infos_dict: Mapping[str, Sequence[Any]]
) -> dict[str, float]:
    """95% intervals of each data source's core validation mean, with the number of prompts behind it.

    The core variable is `acc` when present, else `reward` (as `flatten_validation_metrics`). Per prompt its N
    samples are averaged (`None` values left out), then `compute_mean_interval` runs over prompts.

    Returns:
        `{f"val-aux/{data_source}/{var}/mean@{N}/ci95_low": ..., ".../ci95_high": ...,
        f"val-aux/{data_source}/{var}/num_prompts": k}`.
    """
    core_var = "acc" if "acc" in infos_dict else "reward"
    if core_var not in infos_dict:
        return {}
    per_prompt: dict[str, dict[Any, list[float]]] = defaultdict(lambda: defaultdict(list))
    for data_source, uid, value in zip(data_sources, sample_uids, infos_dict[core_var], strict=True):
        per_prompt[data_source][uid].append(value)
    flat: dict[str, float] = {}
    for data_source, uid2values in per_prompt.items():
        prompt_means, num_samples = [], 0
        for values in uid2values.values():
            kept = [float(value) for value in values if value is not None]
            if kept:
                prompt_means.append(float(np.mean(kept)))
                num_samples = max(num_samples, len(values))
        if not prompt_means:
            continue
        low, high = compute_mean_interval(prompt_means)
        low_key, high_key = interval_keys(f"val-core/{data_source}/{core_var}/mean@{num_samples}")
        flat[low_key], flat[high_key] = low, high
        flat[f"val-aux/{data_source}/{core_var}/num_prompts"] = float(len(prompt_means))
    return flat
