"""Exact-match QA scorer of verl's Search-R1 data (`searchR1_nq`, `searchR1_hotpotqa`, ...): the last
`<answer>...</answer>` of the response against the row's golden answers (`ground_truth['target']`, a list or a
string), both normalised SQuAD-style (lower case, no punctuation, no articles, single spaces).

Scores as verl's search_r1_like_qa_em: 1.0 right, `format_score` for a wrong tagged answer, 0.0 without an
answer tag; a right answer among more than 10 opening or closing answer tags scores a quarter (tag spam).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["TAG_SPAM_LIMIT", "compute_score", "extract_answer", "golden_answers", "normalize_answer"]

TAG_SPAM_LIMIT = 10
"""More answer tags than this (opening or closing) quarter a right answer's score, as verl does."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and the articles a/an/the removed, whitespace collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def extract_answer(solution_str: str) -> str | None:
    """The text of the last <answer></answer>, stripped, or None."""
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def golden_answers(ground_truth: Any) -> list[str]:
    """The accepted answers: `ground_truth['target']` (verl's rows), or the ground truth itself."""
    target = ground_truth.get("target") if isinstance(ground_truth, Mapping) else ground_truth
    if isinstance(target, str):
        return [target]
    if isinstance(target, Sequence) or hasattr(target, "tolist"):  # a list, or a numpy array from parquet
        return [str(item) for item in (target.tolist() if hasattr(target, "tolist") else target)]
    raise ValueError(f"search QA ground truth must hold 'target' (a string or a list of them), got {ground_truth!r}")


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for an exact match (a quarter of it among tag spam), `format_score` for a wrong answer, 0.0
    without one."""
    answers = golden_answers(ground_truth)
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    prediction = normalize_answer(answer)
    if not any(normalize_answer(golden) == prediction for golden in answers):
        return format_score
    spam = max(solution_str.count("<answer>"), solution_str.count("</answer>")) > TAG_SPAM_LIMIT
    return score / 4 if spam else score
