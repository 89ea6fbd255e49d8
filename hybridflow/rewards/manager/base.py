"""What every reward manager shares: the `REWARD_MANAGERS` registry, the `RewardManager` base (its constructor,
`from_config`, the precomputed-score and decoding half of `__call__`, `close`), the `RewardResult` every manager's
`__call__(data)` returns, decoding responses, and turning scorer outcomes into a `(bs, response_len)` reward
tensor, per-sample extra-info lists and error/timeout counts."""

from __future__ import annotations

import functools
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.pool import ScoreOutcome, ScorerPool, ScoringConfig
from hybridflow.rewards.score import resolve_scorer, scorer_kwargs
from hybridflow.sandbox import SandboxLimits
from hybridflow.sandbox.remote import SandboxFusionEndpoint
from hybridflow.rewards.manager_registry import REWARD_MANAGERS

__all__ = ["REWARD_MANAGERS", "DecodedBatch", "RewardManager", "RewardResult", "ScoredBatch", "bind_scorers",
           "build_reward_result", "decode_batch", "get_reward_manager_cls", "log_examples", "precomputed_reward",
           "sample_accuracy", "unpack_outcomes"]

logger = logging.getLogger(__name__)



def get_reward_manager_cls(name: str) -> type:
    """The reward manager class registered as `name` (verl's name for this lookup)."""
    return REWARD_MANAGERS.get(name)


@dataclass(frozen=True, kw_only=True)
class RewardResult:
    """What a reward manager returns for a batch: token-level rewards for training, per-sample columns for
    validation metrics, and batch counts for logging."""

    reward_tensor: torch.Tensor
    """(bs, response_len) float32: each sample's reward on its last valid response token, 0 elsewhere."""
    extra_info: dict[str, list[Any]] = field(default_factory=dict)
    """Per-sample columns of bs values each (`score`, `acc`, keys the scorers return); validation aggregates
    them per data source (verl's `reward_extra_info`)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Batch metrics the trainer logs: `reward/errors`, `reward/timeouts` (scorer calls that failed)."""


def precomputed_reward(data: DataProto) -> RewardResult | None:
    """The reward model's `rm_scores` (bs, response_len) when `data.batch` has them (used as they are),
    else None: the manager scores the batch itself."""
    if "rm_scores" not in data.batch.keys():
        return None
    return RewardResult(reward_tensor=data.batch["rm_scores"])


@dataclass
class DecodedBatch:
    """Per-sample inputs to the scorers, in batch order."""

    prompt_strs: list[str]
    response_strs: list[str]
    valid_response_lengths: list[int]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict[str, Any]]


@dataclass
class ScoredBatch:
    """Scorer results: `scores` (float per sample), `details` (the dict a scorer returned, else {})."""

    scores: list[float]
    details: list[dict[str, Any]]
    errored: list[bool]
    """Per sample: the scorer raised or returned something that is not a score."""
    timed_out: list[bool]
    """Per sample: the scorer ran past its timeout."""

    @property
    def num_errors(self) -> int:
        """Samples whose scorer failed."""
        return sum(self.errored)

    @property
    def num_timeouts(self) -> int:
        """Samples whose scorer timed out."""
        return sum(self.timed_out)


def checked_reward_result(manager: Any, result: Any, batch_size: int) -> RewardResult:
    """A reward manager's result, or an error naming the manager and its contract (a verl-style manager that
    returns a bare tensor failed later as "'Tensor' object has no attribute 'metrics'")."""
    contract = (f"reward manager {type(manager).__name__} must return a hybridflow.rewards.RewardResult "
                f"(reward_tensor (bs, response_len), extra_info, metrics)")
    if not isinstance(result, RewardResult):
        hint = ("; wrap a token-level reward tensor as RewardResult(reward_tensor=...)"
                if isinstance(result, torch.Tensor) else "")
        raise TypeError(f"{contract}; it returned {type(result).__name__}{hint}")
    if result.reward_tensor.dim() != 2 or result.reward_tensor.shape[0] != batch_size:
        raise ValueError(f"{contract}; its reward_tensor has shape {tuple(result.reward_tensor.shape)} for a batch "
                         f"of {batch_size}")
    return result


def decode_batch(data: DataProto, tokenizer: Any, reward_fn_key: str) -> DecodedBatch:
    """Decode each sample's valid prompt and response tokens.

    data.batch: prompts (bs, prompt_len) left-padded, responses (bs, response_len),
    attention_mask (bs, prompt_len + response_len). data.non_tensor_batch: `reward_fn_key`,
    reward_model ({'ground_truth', ...}), optionally extra_info, and an agent loop's `tool_extra_fields` (its
    `tool_rewards`, `turn_scores`), merged into each row's extra_info as verl's reward managers merge them.
    """
    for key in ("prompts", "responses", "attention_mask"):
        if key not in data.batch.keys():
            raise KeyError(f"reward managers need data.batch[{key!r}]; got keys {sorted(data.batch.keys())}")
    for key in (reward_fn_key, "reward_model"):
        if key not in data.non_tensor_batch:
            raise KeyError(f"reward managers need data.non_tensor_batch[{key!r}]; got {sorted(data.non_tensor_batch)}")
    prompts, responses = data.batch["prompts"], data.batch["responses"]
    attention_mask = data.batch["attention_mask"]
    prompt_len = prompts.shape[-1]
    prompt_lengths = attention_mask[:, :prompt_len].sum(-1).tolist()
    response_lengths = attention_mask[:, prompt_len:].sum(-1).tolist()
    response_ids = [responses[i, :n].tolist() for i, n in enumerate(response_lengths)]
    prompt_ids = [prompts[i, prompt_len - n:].tolist() for i, n in enumerate(prompt_lengths)]
    extra = data.non_tensor_batch.get("extra_info")
    extra_infos = [dict(info) if isinstance(info, dict) else {} for info in extra] if extra is not None else [
        {} for _ in range(len(data))]
    for info, fields in zip(extra_infos, data.non_tensor_batch.get("tool_extra_fields", [])):
        info.update(fields if isinstance(fields, dict) else {})
    return DecodedBatch(
        prompt_strs=tokenizer.batch_decode(prompt_ids, skip_special_tokens=True),
        response_strs=tokenizer.batch_decode(response_ids, skip_special_tokens=True),
        valid_response_lengths=[int(n) for n in response_lengths],
        data_sources=[str(ds) for ds in data.non_tensor_batch[reward_fn_key]],
        ground_truths=[rm["ground_truth"] for rm in data.non_tensor_batch["reward_model"]],
        extra_infos=extra_infos,
    )


def bind_scorers(compute_score: Callable[..., Any] | None, data_sources: Sequence[str],
                 format_score: float, sandbox: SandboxLimits | None = None,
                 remote_sandbox: SandboxFusionEndpoint | None = None) -> dict[str, Callable[..., Any]]:
    """data source -> the function to call. With no custom `compute_score`, each data source's registered
    scorer is looked up here in the driver, so an unknown data source fails at once (ValueError); scorers that
    run code get `sandbox` (`reward_model.scoring.sandbox`) and `remote_sandbox` (reward_model.sandbox_fusion)."""
    if compute_score is not None:
        return {ds: compute_score for ds in set(data_sources)}
    scorers = {ds: resolve_scorer(ds) for ds in set(data_sources)}
    return {ds: functools.partial(fn, **scorer_kwargs(fn, format_score, sandbox, remote_sandbox))
            for ds, fn in scorers.items()}


def unpack_outcomes(outcomes: Sequence[ScoreOutcome]) -> ScoredBatch:
    """Scores from outcomes: errors and timeouts score 0; a value that is neither a finite number nor a dict
    with a finite numeric 'score' counts as an error (one NaN would make every advantage and gradient NaN)."""
    scores, details, errored = [], [], []
    for outcome in outcomes:
        value = outcome.value
        score, detail, error = 0.0, {}, False
        if outcome.status == "error":
            error = True
        elif outcome.status == "timeout":
            pass  # scores 0, counted in timed_out
        elif isinstance(value, dict) and isinstance(value.get("score"), numbers.Real):
            score, detail = float(value["score"]), dict(value)
        elif isinstance(value, numbers.Real):
            score = float(value)
        else:
            logger.warning("reward function returned %r; expected a number or a dict with 'score'", value)
            error = True
        if not math.isfinite(score):
            logger.warning("reward function returned the score %s; it scores 0 (counted in reward/errors)", score)
            score, detail, error = 0.0, {}, True
        scores.append(score)
        details.append(detail)
        errored.append(error)
    return ScoredBatch(scores, details, errored, [outcome.status == "timeout" for outcome in outcomes])


def check_error_fraction(decoded: DecodedBatch, scored: ScoredBatch, max_error_fraction: float) -> None:
    """Stop when more than `max_error_fraction` of a batch's scorer calls failed (raised, returned no finite score,
    or ran past the timeout): that is a wrong or too slow scorer or ground-truth format, not a bad sample, and
    training on the zeros would teach nothing. Names the data sources."""
    failed_calls = [error or timed_out for error, timed_out in zip(scored.errored, scored.timed_out)]
    if not failed_calls or sum(failed_calls) <= max_error_fraction * len(failed_calls):
        return
    failed: dict[str, list[int]] = {}
    for source, failure in zip(decoded.data_sources, failed_calls):
        counts = failed.setdefault(source, [0, 0])
        counts[0] += int(failure)
        counts[1] += 1
    summary = ", ".join(f"{source}: {errors}/{total}" for source, (errors, total) in sorted(failed.items()) if errors)
    raise RuntimeError(
        f"{sum(failed_calls)} of {len(failed_calls)} reward scorer calls failed in this batch ({summary}: "
        f"{scored.num_errors} raised or returned no finite score, {scored.num_timeouts} ran past "
        f"reward_model.scoring.timeout_s), more than reward_model.scoring.max_error_fraction={max_error_fraction}; "
        "the first traceback or timeout is in the log. Check the scorer and the ground-truth format of these data "
        "sources, or raise the timeout for a slow scorer"
    )


def sample_accuracy(score: float, detail: dict[str, Any]) -> float:
    """A sample's accuracy: the scorer's 'acc' where its dict gives one, else 1.0 when the score reaches full marks."""
    acc = detail.get("acc")
    return float(acc) if isinstance(acc, numbers.Real) else float(score >= 1.0)


def _fill_value(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return 0.0 if present and all(isinstance(v, numbers.Real) for v in present) else None


def build_reward_result(data: DataProto, decoded: DecodedBatch, scored: ScoredBatch, rewards: Sequence[float],
                        extra_columns: dict[str, list[Any]] | None = None) -> RewardResult:
    """The `RewardResult` with rewards[i] on sample i's last valid response token (an empty response, an aborted
    over-sampled row, on the last column, as verl puts it: its reward is the scorer's for the empty response and
    counts in its group's statistics, while its all-zero response mask keeps it out of the loss) and the scorers'
    error/timeout counts as metrics.

    extra_info always has 'score' (the scorer's score) and 'acc' (the scorer's 'acc', else 1.0 when the
    score reaches full marks 1.0); keys a scorer's dict returns for some samples are filled with 0.0
    (numbers) or None for the others; `extra_columns` are added as they are.
    """
    responses = data.batch["responses"]
    reward_tensor = torch.zeros(responses.shape, dtype=torch.float32)
    for i, (reward, length) in enumerate(zip(rewards, decoded.valid_response_lengths)):
        reward_tensor[i, length - 1 if length > 0 else -1] = reward
    keys = sorted({key for detail in scored.details for key in detail} - {"score", "acc"})
    info: dict[str, list[Any]] = {
        "score": list(scored.scores),
        "acc": [sample_accuracy(s, d) for s, d in zip(scored.scores, scored.details)],
    }
    for key in keys:
        column = [detail.get(key) for detail in scored.details]
        fill = _fill_value(column)
        info[key] = [fill if key not in detail else detail[key] for detail in scored.details]
    info.update(extra_columns or {})
    return RewardResult(
        reward_tensor=reward_tensor.to(responses.device),
        extra_info=info,
        metrics={"reward/errors": float(scored.num_errors), "reward/timeouts": float(scored.num_timeouts)},
    )


def log_examples(decoded: DecodedBatch, scores: Sequence[float], num_examine: int) -> None:
    """Log the first `num_examine` samples of each data source (prompt, response, ground truth, score)."""
    if num_examine <= 0:
        return
    shown: dict[str, int] = {}
    for i, data_source in enumerate(decoded.data_sources):
        if shown.get(data_source, 0) >= num_examine:
            continue
        shown[data_source] = shown.get(data_source, 0) + 1
        logger.info("[%s] [prompt] %s\n[response] %s\n[ground_truth] %s\n[score] %s", data_source,
                    decoded.prompt_strs[i], decoded.response_strs[i], decoded.ground_truths[i], scores[i])


class RewardManager:
    """A reward manager: a generated `DataProto` in, a `RewardResult` out. Subclasses score a decoded batch
    (`score_decoded`); precomputed `rm_scores` in data.batch are returned as they are (`precomputed_reward`).

    Args:
        tokenizer: decodes the response tokens.
        num_examine: samples per data source to log at INFO on each call.
        compute_score: a custom `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`
            (e.g. from `load_custom_reward_fn`); None uses the scorer registered for each data source.
        reward_fn_key: the non-tensor column naming the data source.
        format_score: for the registered scorers, the score of a well-formed but wrong answer.
        scoring: worker count, per-call timeout and process start method.
        remote_sandbox: a SandboxFusion server that runs the code scorers' test cases (None: the local sandbox).
    """

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Callable[..., Any] | None = None,
                 reward_fn_key: str = "data_source", *, format_score: float = 0.0,
                 scoring: ScoringConfig = ScoringConfig(),
                 remote_sandbox: SandboxFusionEndpoint | None = None) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.format_score = format_score
        self.remote_sandbox = remote_sandbox
        self.pool = ScorerPool(scoring)

    @classmethod
    def from_config(cls, tokenizer: Any, compute_score: Callable[..., Any] | None, reward: Any, data: Any):
        """The manager of a run: `reward` is the `reward_model` section (`scoring`, `sandbox_fusion`, and what a
        subclass reads), `data` the `data` section (`reward_fn_key`, ...)."""
        return cls(tokenizer, 0, compute_score, data.reward_fn_key, scoring=reward.scoring,
                   remote_sandbox=reward.sandbox_fusion.endpoint())

    def __call__(self, data: DataProto) -> RewardResult:
        """data: see `decode_batch`. Returns the rewards, extra info and metrics (see `build_reward_result`);
        precomputed `rm_scores` in data.batch are returned as they are (`precomputed_reward`)."""
        if (precomputed := precomputed_reward(data)) is not None:
            return precomputed
        return self.score_decoded(data, decode_batch(data, self.tokenizer, self.reward_fn_key))

    def score_decoded(self, data: DataProto, decoded: DecodedBatch) -> RewardResult:
        """The rewards of `data`, whose samples `decoded` holds as text."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the scorer processes."""
        self.pool.close()
