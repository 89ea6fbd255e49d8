"""GSM8K scorer: the number after the last `#### ` (strict) or the last number in the text (flexible)."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Literal

__all__ = ["check_ground_truth", "compute_score", "extract_solution", "normalize_number"]

# Only the tail is searched: the final answer is at the end, and long rambling responses stay cheap to scan.
_CLIP_CHARS = 300
_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+")


def normalize_number(text: str) -> str:
    """'1,234.50' -> '1234.50', '$42.' -> '42': drop thousands separators, dollar signs, a trailing period."""
    return text.strip().replace(",", "").replace("$", "").rstrip(".").strip()


def extract_solution(solution_str: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer string, normalized, or None if there is none in the last 300 characters.

    strict: the number after the last '####'; flexible: the last number anywhere.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_CLIP_CHARS:]
    pattern = _STRICT if method == "strict" else _NUMBER
    matches = pattern.findall(tail)
    if not matches:
        return None
    answer = normalize_number(matches[-1])
    return answer or None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Fraction(a) == Fraction(b)
    except (ValueError, ZeroDivisionError):
        return False


def check_ground_truth(ground_truth: Any) -> None:
    """Raise unless `ground_truth` is a number ('1,234', '$42.' too): an answer is compared with it as a number, so
    any other text (a whole worked solution) would score every response 0 as if it were wrong."""
    normalized = normalize_number(str(ground_truth))
    try:
        Fraction(normalized)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"a gsm8k ground truth must be the final number (verl's preprocessing keeps the text after "
                         f"'####'), got {str(ground_truth)[:80]!r}") from None


def compute_score(solution_str: str, ground_truth: str, method: Literal["strict", "flexible"] = "strict",
                  format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the extracted answer equals `ground_truth` as a number ('42.0' == '42'), `format_score`
    if an answer was found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, normalize_number(str(ground_truth))) else format_score
