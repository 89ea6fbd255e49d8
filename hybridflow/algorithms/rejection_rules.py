"""Rollout correction's rejection rules as config values: the `rollout_is` levels, the `rollout_rs` rule names and
their thresholds, parsed and checked without torch (the config section `algorithms/config.py` uses them;
`rollout_correction.py` applies them to tensors)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "RejectionRule", "build_rejection_rules", "parse_rollout_rs"]

ROLLOUT_IS_LEVELS = ("token", "sequence")
"""`rollout_is` values: one weight per token, or one per sequence (the product of its token ratios)."""
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
"""`rollout_rs` rules (verl's names)."""


@dataclass(frozen=True)
class RejectionRule:
    """One rejection rule with its bounds on the divergence statistic (log-space for k1 rules)."""

    option: str
    """A `ROLLOUT_RS_OPTIONS` name, e.g. `seq_mean_k1`."""
    upper: float
    """Keep where the statistic <= upper."""
    lower: Optional[float] = None
    """Keep where the statistic >= lower too (k1 rules only)."""

    @property
    def aggregation(self) -> str:
        """`token`, `sum`, `mean` or `max`."""
        return "token" if self.option.startswith("token") else self.option.split("_")[1]

    @property
    def estimator(self) -> str:
        """`k1`, `k2` or `k3`."""
        return self.option.rpartition("_")[2]


def parse_rollout_rs(rollout_rs: str) -> list[str]:
    """The rules of a comma-separated `rollout_rs` string, in order, without repeats; ValueError names unknown ones."""
    options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no rule; use one of {list(ROLLOUT_RS_OPTIONS)} or null")
    unknown = [option for option in options if option not in ROLLOUT_RS_OPTIONS]
    if unknown:
        raise ValueError(
            f"rollout_rs={rollout_rs!r}: unknown rule {unknown[0]!r}; known: {list(ROLLOUT_RS_OPTIONS)} "
            "(join several with commas, e.g. 'token_k1,seq_max_k2')"
        )
    return options


def _number(option: str, text: str) -> float:
    try:
        if "_" in text:  # float() would read "2_0" as 20
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise ValueError(f"entry {text!r} (for {option}) is not a number") from None
    if not value > 0:
        raise ValueError(f"entry {text!r} (for {option}) must be > 0")
    return value


def build_rejection_rules(rollout_rs: str, rollout_rs_threshold: str | float | None) -> tuple[RejectionRule, ...]:
    """The rules of `rollout_rs` with their bounds from `rollout_rs_threshold`.

    The threshold is one entry for all rules or one per rule, comma-separated. k1 rules take `lower_upper`
    ratios (`"0.5_2.0"`; a single number u means lower 1/u); k2/k3 rules a single upper bound.
    Raises ValueError naming the entry and what it should be.
    """
    options = parse_rollout_rs(rollout_rs)
    if rollout_rs_threshold is None or isinstance(rollout_rs_threshold, bool):
        raise ValueError(
            f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold=<bounds>, e.g. '0.5_2.0' for k1 rules, 2.0 for k2/k3"
        )
    specs = [part.strip() for part in str(rollout_rs_threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold={rollout_rs_threshold!r} has {len(specs)} entries for {len(options)} rules "
            f"{options}; give one entry for all or one per rule"
        )
    entries = specs * len(options) if len(specs) == 1 else specs
    try:
        return tuple(_rejection_rule(option, spec) for option, spec in zip(options, entries))
    except ValueError as err:
        raise ValueError(f"rollout_rs_threshold={rollout_rs_threshold!r}: {err}") from None


def _rejection_rule(option: str, spec: str) -> RejectionRule:
    """One rule from its threshold entry; ValueError says what is wrong with the entry."""
    if option.endswith("k1"):
        if "_" in spec:
            low_text, _, high_text = spec.partition("_")
            lower, upper = _number(option, low_text), _number(option, high_text)
        else:
            upper = _number(option, spec)
            lower = 1.0 / upper
        if lower > upper:
            raise ValueError(
                f"entry {spec!r} (for {option}) gives lower ratio {lower:g} above upper {upper:g}; write "
                "lower_upper with lower <= upper, e.g. '0.5_2.0' (a single number u means 1/u_u, so u >= 1)"
            )
        return RejectionRule(option, upper=math.log(upper), lower=math.log(lower))
    if "_" in spec:
        raise ValueError(f"entry {spec!r} (for {option}) must be one upper bound; only k1 rules take lower_upper")
    return RejectionRule(option, upper=_number(option, spec))
