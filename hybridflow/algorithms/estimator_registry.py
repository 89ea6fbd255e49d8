"""The advantage-estimator registry, and what each estimator needs from the run (its `EstimatorSpec`).

Config and validation code asks the spec, never the name: "does this run train a critic" is
`estimator_spec(name).needs_critic`, not `name == "gae"`. The module imports no torch, so the config
schema and the checks before Ray can read names and specs cheaply; the built-in estimators are
registered lazily (their functions import on first `get`). A custom estimator written for verl
registers with `@register_adv_est("my_est")` unchanged (and needs nothing, unless it passes a spec).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Any

from hybridflow.utils.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageEstimator",
    "EstimatorSpec",
    "estimator_name",
    "estimator_spec",
    "get_adv_estimator_fn",
    "register_adv_est",
]


class AdvantageEstimator(StrEnum):
    """Names of the built-in estimators; each member equals its string (`AdvantageEstimator.GAE == "gae"`)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    OPO = "opo"
    GRPO_PASSK = "grpo_passk"
    GPG = "gpg"
    PRIME = "prime"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"


@dataclass(frozen=True, kw_only=True)
class EstimatorSpec:
    """What an estimator needs from the run; the trainer and the config checks read these, not names."""

    needs_critic: bool = False
    """Takes `values` from a critic (a value model trained beside the actor), e.g. gae."""
    group_based: bool = False
    """Compares the samples of one prompt's group (`index`): with one sample per prompt (rollout.n=1) there is no
    group baseline."""
    runs_with_one_sample: bool = True
    """A group-based estimator that takes groups of one sample, as verl runs it with rollout.n=1 (no baseline: the
    advantage is the sample's own score, or its return); False: it needs rollout.n >= 2 (grpo_passk)."""
    greedy_baseline: bool = False
    """Takes `reward_baselines`, the reward of each prompt's greedy response, which the trainer generates (remax)."""
    implicit_prm: bool = False
    """Takes `rm_scores` from an implicit process reward model that the run trains online (prime)."""
    needs_sum_pi_squared: bool = False
    """Takes `old_log_probs` and `sum_pi_squared` from the old-log-prob pass (actor.calculate_sum_pi_squared=True),
    and the rollout's importance weights when rollout correction computes them (optimal_token_baseline)."""


EstimatorFn = Callable[..., Any]
ADV_ESTIMATORS: Registry[EstimatorFn] = Registry("advantage estimator")
_SPECS: dict[str, EstimatorSpec] = {}


def estimator_name(name_or_enum: str | Enum) -> str:
    """The registry name of a name or an `AdvantageEstimator` member."""
    return name_or_enum.value if isinstance(name_or_enum, Enum) else name_or_enum


def register_adv_est(
    name_or_enum: str | AdvantageEstimator, spec: EstimatorSpec | None = None
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator registering an estimator and its spec (default: needs nothing); a taken name raises `ValueError`."""
    name = estimator_name(name_or_enum)
    add = ADV_ESTIMATORS.register(name)

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        add(fn)
        _SPECS[name] = spec or EstimatorSpec()
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | AdvantageEstimator) -> EstimatorFn:
    """The estimator registered under a name; an unknown name raises `KeyError` listing the known ones."""
    return ADV_ESTIMATORS.get(estimator_name(name_or_enum))


def estimator_spec(name_or_enum: str | AdvantageEstimator) -> EstimatorSpec:
    """What the named estimator needs; an unknown name raises `KeyError` listing the known ones."""
    name = estimator_name(name_or_enum)
    if name not in ADV_ESTIMATORS:
        raise KeyError(f"unknown {ADV_ESTIMATORS.kind} {name!r}; known: {ADV_ESTIMATORS.names()}")
    # An estimator registered on the bare registry (ADV_ESTIMATORS.register) declared nothing: it needs nothing.
    return _SPECS.get(name, EstimatorSpec())


_ADVANTAGES = "hybridflow.algorithms.advantages"
_BUILT_IN: tuple[tuple[AdvantageEstimator, str, EstimatorSpec], ...] = (
    (AdvantageEstimator.GAE, f"{_ADVANTAGES}:compute_gae_advantage_return", EstimatorSpec(needs_critic=True)),
    (AdvantageEstimator.GRPO, f"{_ADVANTAGES}:compute_grpo_outcome_advantage", EstimatorSpec(group_based=True)),
    (AdvantageEstimator.GRPO_PASSK, f"{_ADVANTAGES}:compute_grpo_passk_outcome_advantage",
     EstimatorSpec(group_based=True, runs_with_one_sample=False)),
    (AdvantageEstimator.RLOO, f"{_ADVANTAGES}:compute_rloo_outcome_advantage", EstimatorSpec(group_based=True)),
    (AdvantageEstimator.OPO, f"{_ADVANTAGES}:compute_opo_outcome_advantage", EstimatorSpec(group_based=True)),
    (AdvantageEstimator.REINFORCE_PLUS_PLUS, f"{_ADVANTAGES}:compute_reinforce_plus_plus_outcome_advantage",
     EstimatorSpec()),
    (AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE,
     f"{_ADVANTAGES}:compute_reinforce_plus_plus_baseline_outcome_advantage", EstimatorSpec(group_based=True)),
    (AdvantageEstimator.REMAX, f"{_ADVANTAGES}:compute_remax_outcome_advantage", EstimatorSpec(greedy_baseline=True)),
    (AdvantageEstimator.GPG, f"{_ADVANTAGES}:compute_gpg_outcome_advantage", EstimatorSpec(group_based=True)),
    (AdvantageEstimator.PRIME, "hybridflow.algorithms.prime:compute_prime_advantage_return",
     EstimatorSpec(group_based=True, implicit_prm=True)),
    (AdvantageEstimator.OPTIMAL_TOKEN_BASELINE,
     "hybridflow.algorithms.optimal_baseline:compute_optimal_token_baseline_advantage",
     EstimatorSpec(group_based=True, needs_sum_pi_squared=True)),
    (AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE,
     "hybridflow.algorithms.optimal_baseline:compute_multi_turn_optimal_token_baseline_advantage",
     EstimatorSpec(group_based=True, needs_sum_pi_squared=True)),
)
for _estimator, _target, _spec in _BUILT_IN:
    ADV_ESTIMATORS.register_lazy(_estimator.value, _target)
    _SPECS[_estimator.value] = _spec
