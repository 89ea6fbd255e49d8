"""Countdown scorer: an arithmetic equation that uses each given number exactly once and hits the target.

The equation is parsed with `ast` and evaluated exactly with `Fraction` over an allow-list of nodes
(integer literals, + - * /, parentheses); nothing is ever passed to `eval`.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

__all__ = ["compute_score", "evaluate_equation", "extract_equation"]

_MAX_EQUATION_CHARS = 200  # bounds parse depth and work for pathological outputs
_ALLOWED_CHARS = re.compile(r"^[0-9+\-*/() \t]+$")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
               ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def extract_equation(solution_str: str) -> str | None:
    """The equation: inside the last <answer></answer>, else after the last 'Answer:', else the last
    non-empty line; anything from the first '=' on (`(3+5)*2 = 16`) is dropped."""
    tags = _ANSWER_TAG.findall(solution_str)
    if tags:
        text = tags[-1]
    elif "answer:" in solution_str.lower():
        text = solution_str[solution_str.lower().rfind("answer:") + len("answer:"):]
    else:
        lines = [line for line in solution_str.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    text = text.strip().split("=")[0].strip().strip("`*$").strip()
    return text or None


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINARY_OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported element {type(node).__name__}")


def evaluate_equation(equation: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, integer literals used) of an equation of ints, + - * / and parentheses; None if the
    text is not such an equation or divides by zero."""
    if len(equation) > _MAX_EQUATION_CHARS or not _ALLOWED_CHARS.match(equation):
        return None
    try:
        tree = ast.parse(equation, mode="eval")
        used: list[int] = []
        return _evaluate(tree.body, used), used
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _parse_ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    if isinstance(ground_truth, str):
        ground_truth = json.loads(ground_truth)
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, "
                         f"got {ground_truth!r}")
    numbers: Sequence[Any] = ground_truth["numbers"]
    return Fraction(int(ground_truth["target"])), [int(n) for n in numbers]


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the equation uses each number in `ground_truth['numbers']` exactly once and equals
    `ground_truth['target']`; `format_score` for a well-formed equation that does not; 0.0 for no equation."""
    target, numbers = _parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    result = evaluate_equation(equation)
    if result is None:
        return 0.0
    value, used = result
    if sorted(used) != sorted(numbers) or value != target:
        return format_score
    return score
