"""Per-step training metrics with verl's keys: data statistics, stage timings and throughput.

These functions take plain mappings of tensors (the keys of a `DataProto.batch` in verl), so they
stay torch-only; the trainer passes `batch.batch` (and, for `__num_turns__`, the numpy column).
All returned values are Python floats.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "compute_data_metrics",
    "compute_response_info",
    "compute_rollout_probs_diff",
    "compute_stage_throughput_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
]

_TOKENS_PER_STAGE_OVERALL = ("ref", "values", "adv", "update_critic", "update_actor")


def compute_response_info(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split `attention_mask` into prompt and response parts.

    Args:
        batch: needs `responses` (bs, response_len) and `attention_mask` (bs, prompt_len + response_len).

    Returns:
        `response_mask` (bs, response_len), `prompt_length` (bs,) float, `response_length` (bs,) float.
    """
    response_len = batch["responses"].shape[-1]
    prompt_mask = batch["attention_mask"][:, :-response_len]
    response_mask = batch["attention_mask"][:, -response_len:]
    return {
        "response_mask": response_mask,
        "prompt_length": prompt_mask.sum(-1).float(),
        "response_length": response_mask.sum(-1).float(),
    }


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean/max/min of `values`; NaN (with a warning) when it is empty, as verl."""
    if values.numel() == 0:
        logger.warning("no valid element for %s metrics (all samples aborted or masked); logging NaN", prefix)
        return {f"{prefix}/{k}": float("nan") for k in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": torch.mean(values).item(),
        f"{prefix}/max": torch.max(values).item(),
        f"{prefix}/min": torch.min(values).item(),
    }


def compute_data_metrics(batch: Mapping[str, Any], use_critic: bool = True) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of one training batch (verl keys).

    Args:
        batch: tensors `token_level_scores`, `token_level_rewards`, `advantages`, `returns`,
            `responses`, `attention_mask`, `response_mask` (all (bs, response_len) except
            `attention_mask`, (bs, prompt_len + response_len)); `values` when `use_critic`;
            optionally `prompts` (bs, prompt_len), and the (bs,) numpy arrays `__num_turns__`
            and `tool_call_counts`.
        use_critic: include `critic/values/*` and `critic/vf_explained_var`.

    Returns:
        `critic/score/{mean,max,min}` and `critic/rewards/*` (sequence sums, over non-aborted
        samples), `critic/advantages/*`, `critic/returns/*` (over masked tokens), `critic/values/*`,
        `critic/vf_explained_var` (= 1 - Var(R - V) / (Var(R) + 1e-5)), `response_length/*` incl.
        `clip_ratio` (share at the maximum length), `response_length_non_aborted/*`,
        `response/aborted_ratio` (share of empty responses), `prompt_length/*`, `num_turns/*` and
        `tool_call_counts/*`. Statistics over an empty set are NaN (logged once as a warning).
    """
    sequence_score = batch["token_level_scores"].sum(-1)
    sequence_reward = batch["token_level_rewards"].sum(-1)
    max_response_length = batch["responses"].shape[-1]
    max_prompt_length = batch["attention_mask"].shape[-1] - max_response_length
    response_mask = batch["response_mask"].bool()

    info = compute_response_info(batch)
    prompt_length, response_length = info["prompt_length"], info["response_length"]
    aborted = response_length == 0
    kept = ~aborted

    valid_adv = torch.masked_select(batch["advantages"], response_mask)
    valid_returns = torch.masked_select(batch["returns"], response_mask)
    metrics = {
        **_stats("critic/score", sequence_score[kept]),
        **_stats("critic/rewards", sequence_reward[kept]),
        **_stats("critic/advantages", valid_adv),
        **_stats("critic/returns", valid_returns),
    }
    if use_critic:
        valid_values = torch.masked_select(batch["values"], response_mask)
        metrics.update(_stats("critic/values", valid_values))
        explained = float("nan")
        if valid_values.numel() > 0:
            return_diff_var = torch.var(valid_returns - valid_values)
            explained = (1.0 - return_diff_var / (torch.var(valid_returns) + 1e-5)).item()
        metrics["critic/vf_explained_var"] = explained

    non_aborted_length = response_length[kept]
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = torch.eq(response_length, max_response_length).float().mean().item()
    metrics.update(_stats("response_length_non_aborted", non_aborted_length))
    metrics["response_length_non_aborted/clip_ratio"] = (
        torch.eq(non_aborted_length, max_response_length).float().mean().item()
        if non_aborted_length.numel() > 0
        else float("nan")
    )
    metrics["response/aborted_ratio"] = aborted.float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = torch.eq(prompt_length, max_prompt_length).float().mean().item()

    for key, prefix in (("__num_turns__", "num_turns"), ("tool_call_counts", "tool_call_counts")):
        if key in batch:
            counts = batch[key]
            metrics.update({f"{prefix}/{k}": float(getattr(counts, k)()) for k in ("min", "max", "mean")})
    return metrics


def compute_timing_metrics(batch: Mapping[str, torch.Tensor], timing_raw: Mapping[str, float]) -> dict[str, float]:
    """Stage timings (`timing_s/{stage}`) and per-token timings (`timing_per_token_ms/{stage}`).

    Args:
        batch: needs `responses` and `attention_mask` (see `compute_response_info`).
        timing_raw: seconds per stage (`gen`, `reward`, `old_log_prob`, `ref`, `values`, `adv`,
            `update_critic`, `update_actor`, `update_weights`, `step`, ...).

    Returns:
        `timing_s/{stage}` for every stage; `timing_per_token_ms/{stage}` for `gen` (per response
        token) and `ref`, `values`, `adv`, `update_critic`, `update_actor` (per prompt+response token).
    """
    info = compute_response_info(batch)
    num_response_tokens = info["response_length"].sum().item()
    num_overall_tokens = info["prompt_length"].sum().item() + num_response_tokens
    num_tokens_of_stage = {"gen": num_response_tokens, **dict.fromkeys(_TOKENS_PER_STAGE_OVERALL, num_overall_tokens)}
    metrics = {f"timing_s/{name}": float(value) for name, value in timing_raw.items()}
    for name, num_tokens in num_tokens_of_stage.items():
        if name in timing_raw:
            metrics[f"timing_per_token_ms/{name}"] = timing_raw[name] * 1000 / num_tokens
    return metrics


def compute_throughput_metrics(
    global_token_num: Sequence[int], timing_raw: Mapping[str, float], num_workers: int
) -> dict[str, float]:
    """Token throughput of one step (verl's `compute_throughout_metrics`).

    Args:
        global_token_num: per-sample token counts (prompt + response) of the step's batch
            (verl keeps it in `meta_info["global_token_num"]`).
        timing_raw: must hold `step`, the step's wall time in seconds.
        num_workers: number of accelerators (or CPU workers) sharing the work.

    Returns:
        `perf/total_num_tokens`, `perf/time_per_step` (s), `perf/throughput` (tokens / s / worker).
    """
    total_num_tokens = float(sum(global_token_num))
    time = float(timing_raw["step"])
    return {
        "perf/total_num_tokens": total_num_tokens,
        "perf/time_per_step": time,
        "perf/throughput": total_num_tokens / (time * num_workers),
    }


_TOKENS_PER_STAGE_THROUGHPUT = ("old_log_prob", "ref", "values", "update_critic", "update_actor")


def compute_stage_throughput_metrics(
    batch: Mapping[str, torch.Tensor], timing_raw: Mapping[str, float]
) -> dict[str, float]:
    """Tokens per second of each timed stage, over the whole worker group (`perf/tokens_per_s/{stage}`).

    Args:
        batch: needs `responses` and `attention_mask` (see `compute_response_info`).
        timing_raw: seconds per stage, as for `compute_timing_metrics`.

    Returns:
        `perf/tokens_per_s/gen` (response tokens generated per second) and, for `old_log_prob`, `ref`, `values`,
        `update_critic` and `update_actor` where timed, prompt + response tokens processed per second.
    """
    info = compute_response_info(batch)
    num_response_tokens = info["response_length"].sum().item()
    num_overall_tokens = info["prompt_length"].sum().item() + num_response_tokens
    num_tokens_of_stage = {"gen": num_response_tokens, **dict.fromkeys(_TOKENS_PER_STAGE_THROUGHPUT, num_overall_tokens)}
    return {
        f"perf/tokens_per_s/{name}": num_tokens / timing_raw[name]
        for name, num_tokens in num_tokens_of_stage.items()
        if timing_raw.get(name, 0.0) > 0
    }


def compute_rollout_probs_diff(
    rollout_log_probs: torch.Tensor, actor_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the training engine's (verl's debug metrics).

    rollout_log_probs, actor_log_probs, response_mask: (bs, response_len) -> `training/rollout_probs_diff_{max,
    mean,std}` of |p_rollout - p_actor| over response tokens, and their Pearson correlation. A large gap means
    the rollout's log-probs must not stand in for the trainer's (bypass mode) and the policy is off its samples.
    """
    mask = response_mask.bool()
    rollout = torch.exp(rollout_log_probs.detach().float())[mask]
    actor = torch.exp(actor_log_probs.detach().float())[mask]
    if rollout.numel() == 0:
        return {"training/rollout_probs_diff_valid": 0.0}
    diff = (rollout - actor).abs()
    corr = torch.corrcoef(torch.stack([rollout, actor]))[0, 1] if rollout.numel() > 1 else torch.tensor(1.0)
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
        "training/rollout_actor_probs_pearson_corr": float(torch.nan_to_num(corr, nan=1.0)),
    }
