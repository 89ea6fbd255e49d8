"""Rule-based scorers, dispatched on a row's `data_source` through the `SCORERS` registry.

A scorer is `fn(data_source, solution_str, ground_truth, extra_info, *, format_score) -> float | dict`
(a dict holds at least 'score'); it may carry a `preload()` attribute that imports what it needs, and a
`uses_sandbox = True` attribute when it also takes `sandbox=` (the `SandboxLimits` of
`reward_model.scoring.sandbox`) and `remote_sandbox=` (a SandboxFusion server, verl's
`reward_model.sandbox_fusion.url`, or None); `scorer_kwargs` adds them.
`resolve_scorer(data_source)` finds it: the exact data source first, then its family, the part before
the first '/' ('reasoning_gym/countdown' -> 'reasoning_gym'), then a prefix in `PREFIXES` ('aime2025' -> 'aime').
Every data source verl's `default_compute_score` knows is registered. Add a data source with
`SCORERS.register("my/source", fn)` before the reward manager's first call; reward managers resolve the
scorer in the driver and send it to the scorer processes by reference (module + name), so `fn` must be
a module-level function.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.rewards.score import (
    code, color_square, countdown, geometry3k, gsm8k, math, math_dapo, reasoning_gym, search_qa)
from hybridflow.sandbox import SandboxLimits
from hybridflow.sandbox.remote import SandboxFusionEndpoint
from hybridflow.utils.registry import Registry

__all__ = ["PREFIXES", "SCORERS", "check_ground_truth_given", "default_compute_score", "default_compute_score_batched",
           "ground_truth_error", "has_scorer", "resolve_scorer", "scorer_kwargs"]

SCORERS: Registry[Callable[..., float | dict]] = Registry("reward scorer")


def check_ground_truth_given(ground_truth: Any) -> None:
    """Raise when a row's ground truth is empty (a blank string, an empty list or mapping): several scorers would
    score an empty answer right against it."""
    if (isinstance(ground_truth, str) and not ground_truth.strip()) or (
            isinstance(ground_truth, (list, tuple, dict)) and not ground_truth):
        raise ValueError(f"reward_model.ground_truth is empty ({ground_truth!r}): an empty answer would match it")


def _refuses_empty_ground_truth(scorer: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in scorer that raises on an empty ground truth (counted as a scorer error, never scored)."""
    @functools.wraps(scorer)
    def checked(data_source: str, solution_str: str, ground_truth: Any, *args: Any, **kwargs: Any) -> Any:
        check_ground_truth_given(ground_truth)
        return scorer(data_source, solution_str, ground_truth, *args, **kwargs)
    return checked


@_refuses_empty_ground_truth
def _score_gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                 format_score: float = 0.0) -> float:
    gsm8k.check_ground_truth(ground_truth)
    return gsm8k.compute_score(solution_str, ground_truth, method="strict", format_score=format_score)


@_refuses_empty_ground_truth
def _score_math(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                format_score: float = 0.0) -> float:
    return math.compute_score(solution_str, ground_truth, format_score=format_score)


@_refuses_empty_ground_truth
def _score_math_dapo(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                     format_score: float = 0.0) -> dict:
    return math_dapo.compute_score(solution_str, ground_truth)  # +1 / -1: DAPO's recipe has no format score


@_refuses_empty_ground_truth
def _score_countdown(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                     format_score: float = 0.0) -> float:
    return countdown.compute_score(solution_str, ground_truth, format_score=format_score)


@_refuses_empty_ground_truth
def _score_code(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                format_score: float = 0.0, sandbox: SandboxLimits | None = None,
                remote_sandbox: SandboxFusionEndpoint | None = None) -> dict:
    return code.compute_score(solution_str, ground_truth, extra_info, format_score=format_score, limits=sandbox,
                              remote=remote_sandbox)


@_refuses_empty_ground_truth
def _score_prime_code(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                      format_score: float = 0.0, sandbox: SandboxLimits | None = None,
                      remote_sandbox: SandboxFusionEndpoint | None = None) -> dict:
    """verl's PRIME code rows: cases scored continuously (the share of the first 10 that pass)."""
    return code.compute_score(solution_str, ground_truth, extra_info, format_score=format_score, limits=sandbox,
                              remote=remote_sandbox, continuous=True)


@_refuses_empty_ground_truth
def _score_geometry3k(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                      format_score: float = 0.0) -> float:
    return geometry3k.compute_score(solution_str, ground_truth)


@_refuses_empty_ground_truth
def _score_search_qa(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                     format_score: float = 0.0) -> float:
    return search_qa.compute_score(solution_str, ground_truth, format_score=format_score)


@_refuses_empty_ground_truth
def _score_reasoning_gym(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                         format_score: float = 0.0) -> float:
    return reasoning_gym.compute_score(data_source, solution_str, ground_truth, extra_info, format_score=format_score)


@_refuses_empty_ground_truth
def _score_color_square(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None, *,
                        format_score: float = 0.0) -> float:
    return color_square.compute_score(solution_str, ground_truth)


# Heavy imports a scorer needs, run by `resolve_scorer` in the driver so that forked workers inherit them.
_score_reasoning_gym.preload = reasoning_gym.preload  # type: ignore[attr-defined]
_score_code.uses_sandbox = True  # type: ignore[attr-defined]
_score_prime_code.uses_sandbox = True  # type: ignore[attr-defined]
# A ground truth a scorer cannot grade against, refused before Ray (`ground_truth_error`) and counted if it slips by.
_score_gsm8k.check_ground_truth = gsm8k.check_ground_truth  # type: ignore[attr-defined]
_score_code.check_ground_truth = code.check_ground_truth  # type: ignore[attr-defined]
_score_prime_code.check_ground_truth = code.check_ground_truth  # type: ignore[attr-defined]

# The data sources verl's default_compute_score knows, scored as it scores them, then hybridflow's own.
for _name in ("openai/gsm8k", "gsm8k"):
    SCORERS.register(_name, _score_gsm8k)
for _name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
    SCORERS.register(_name, _score_math)
# verl's DAPO data (DAPO-Math-17k), 'math', and AIME sets (any data source starting with 'aime', see PREFIXES)
for _name in ("math_dapo", "math", "math_dapo_reasoning", "aime"):
    SCORERS.register(_name, _score_math_dapo)
# PRIME's NuminaMath rows: the last boxed answer (verl grades them with prime_math, sympy on model text; README)
for _name in ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
              "numina_cn_k12", "numina_olympiads"):
    SCORERS.register(_name, _score_math)
for _name in ("codecontests", "apps", "codeforces", "taco"):  # PRIME's code rows
    SCORERS.register(_name, _score_prime_code)
SCORERS.register("hiyouga/geometry3k", _score_geometry3k)
for _name in ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
              "searchR1_musique", "searchR1_bamboogle"):
    SCORERS.register(_name, _score_search_qa)
SCORERS.register("countdown", _score_countdown)
for _name in ("openai_humaneval", "code"):  # 'code/<anything>' resolves to 'code'
    SCORERS.register(_name, _score_code)
SCORERS.register("reasoning_gym", _score_reasoning_gym)
SCORERS.register("color_square", _score_color_square)

PREFIXES: dict[str, str] = {"aime": "aime"}
"""Data-source prefix -> registered name, for data sources not registered themselves ('aime2024_test' is
scored as 'aime', as verl scores every data source starting with 'aime')."""


def _registered_name(data_source: str) -> str | None:
    """The registered name that scores `data_source`: itself, its family (before the first '/'), or the name
    of its prefix in PREFIXES; None if none."""
    if data_source in SCORERS:
        return data_source
    if "/" in data_source and data_source.split("/", 1)[0] in SCORERS:
        return data_source.split("/", 1)[0]
    return next((name for prefix, name in PREFIXES.items() if data_source.startswith(prefix)), None)


def ground_truth_error(data_source: str, ground_truth: Any) -> str | None:
    """Why the built-in scorer of `data_source` cannot grade against `ground_truth` (empty, or a form its scorer
    does not read: its `check_ground_truth` attribute), or None."""
    scorer = SCORERS.get(_registered_name(data_source)) if has_scorer(data_source) else None
    try:
        check_ground_truth_given(ground_truth)
        if scorer is not None and hasattr(scorer, "check_ground_truth"):
            scorer.check_ground_truth(ground_truth)
    except ValueError as err:
        return str(err)
    return None


def has_scorer(data_source: str) -> bool:
    """Whether `resolve_scorer` finds a scorer for `data_source` (without loading it)."""
    return _registered_name(data_source) is not None


def resolve_scorer(data_source: str) -> Callable[..., float | dict]:
    """The scorer for `data_source` (exact name, else the family before '/', else a prefix in PREFIXES);
    ValueError listing known ones."""
    name = _registered_name(data_source)
    if name is not None:
        scorer = SCORERS.get(name)
        if hasattr(scorer, "preload"):
            scorer.preload()
        return scorer
    raise ValueError(
        f"no reward scorer for data_source {data_source!r}; known: {SCORERS.names()} "
        "(families match '<family>/...'); register one in hybridflow.rewards.score.SCORERS "
        "or set custom_reward_function.path/name"
    )


def scorer_kwargs(scorer: Callable[..., Any], format_score: float, sandbox: SandboxLimits | None,
                  remote_sandbox: SandboxFusionEndpoint | None = None) -> dict[str, Any]:
    """The keyword arguments to call a registered `scorer` with: `format_score`, and for the scorers that run
    code `sandbox` and `remote_sandbox` (each when not None)."""
    kwargs: dict[str, Any] = {"format_score": format_score}
    if getattr(scorer, "uses_sandbox", False):
        if sandbox is not None:
            kwargs["sandbox"] = sandbox
        if remote_sandbox is not None:
            kwargs["remote_sandbox"] = remote_sandbox
    return kwargs


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                          *, format_score: float = 0.0, sandbox: SandboxLimits | None = None,
                          remote_sandbox: SandboxFusionEndpoint | None = None) -> float | dict:
    """Score one response with the scorer registered for its data source (verl's `default_compute_score`);
    `sandbox` limits the scorers that run code (None: their own defaults), and `remote_sandbox` (a SandboxFusion
    server) runs their test cases instead.

    Returns the scorer's float (1.0 right, `format_score` well-formed but wrong, 0.0 unreadable) or dict.
    """
    scorer = resolve_scorer(data_source)
    return scorer(data_source, solution_str, ground_truth, extra_info,
                  **scorer_kwargs(scorer, format_score, sandbox, remote_sandbox))


def default_compute_score_batched(data_sources: Sequence[str], solution_strs: Sequence[str],
                                  ground_truths: Sequence[Any], extra_infos: Sequence[dict | None], *,
                                  format_score: float = 0.0, sandbox: SandboxLimits | None = None,
                                  remote_sandbox: SandboxFusionEndpoint | None = None) -> list[float | dict]:
    """`default_compute_score` over a batch (the `batch` reward manager's calling convention)."""
    score = functools.partial(default_compute_score, format_score=format_score, sandbox=sandbox,
                              remote_sandbox=remote_sandbox)
    rows = zip(data_sources, solution_strs, ground_truths, extra_infos)
    return [score(ds, sol, gt, info) for ds, sol, gt, info in rows]
