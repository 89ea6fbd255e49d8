"""Scorer of the synthetic image task `color_square` (`hybridflow.data.preprocess.color_square`): exact match of
the colour word."""

from __future__ import annotations

__all__ = ["compute_score", "normalize_answer"]

_STRIP = " \t\n.,!?;:'\"`*"


def normalize_answer(solution_str: str) -> str:
    """The response lower-cased, without surrounding whitespace, punctuation or markdown emphasis."""
    return solution_str.strip(_STRIP).lower()


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response is exactly the colour word (case and surrounding punctuation aside), else 0.0."""
    return 1.0 if normalize_answer(solution_str) == str(ground_truth).strip().lower() else 0.0
