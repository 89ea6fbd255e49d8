"""Geometry3K scorer (verl's `hiyouga/geometry3k` data source, a vision-language task): 90% for the right
`\\boxed{}` answer, 10% for the format `<think>...</think> ... \\boxed{...}`, as verl's geo3k reward weighs them.

verl grades the boxed answer with mathruler (sympy, which evaluates model-written expressions with an
`eval`-based parser); this scorer uses the MATH scorer's normalisation and exact numeric comparison of numbers
and fractions (`math.is_equiv`), which runs nothing the model wrote. Answers equal only symbolically (`2\\sqrt{3}`
against `\\sqrt{12}`) are therefore not matched.
"""

from __future__ import annotations

import re

from hybridflow.rewards.score.math import is_equiv, last_boxed_only_string, remove_boxed

__all__ = ["FORMAT_WEIGHT", "compute_score", "format_reward"]

FORMAT_WEIGHT = 0.1
"""verl's geo3k `format_score`: the format's share of the score."""

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    """1.0 if the response is reasoning in <think></think> followed by a boxed answer."""
    return 1.0 if _FORMAT.fullmatch(solution_str) else 0.0


def accuracy_reward(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer equals the ground truth."""
    boxed = last_boxed_only_string(solution_str)
    return 1.0 if boxed is not None and is_equiv(remove_boxed(boxed), str(ground_truth)) else 0.0


def compute_score(solution_str: str, ground_truth: str, format_weight: float = FORMAT_WEIGHT) -> float:
    """(1 - format_weight) x accuracy + format_weight x format."""
    return (1.0 - format_weight) * accuracy_reward(solution_str, ground_truth) + format_weight * format_reward(
        solution_str)
