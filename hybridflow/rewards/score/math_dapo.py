"""DAPO's math scorer (verl's `math_dapo` data source, DAPO-Math-17k and AIME rows): the last "Answer: X" line of
the response's end, compared with the ground truth after Minerva-style normalisation (Lewkowycz et al. 2022,
appendix D.1); a right answer scores 1.0 and any other -1.0, as in the DAPO recipe.

The normalisation keeps the part after the last '=', removes units and filler words, unwraps `\\text{}`,
`\\textbf{}`, `\\overline{}`, `\\boxed{}` and `$...$`, expands shorthand `\\fracab` / `\\sqrta`, and drops thousands
separators from integers.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_answer", "normalize_final_answer"]

TAIL_CHARS = 300
"""Only the response's last characters are searched (DAPO's bound: the answer line comes last)."""

ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)
_UNWRAP = tuple(re.compile(rf"({re.escape(command)}\{{)(.*?)(\}})") for command in ("\\text", "\\textbf", "\\overline"))


def normalize_final_answer(answer: str) -> str:
    """A final answer in the form two equal answers share (see the module docstring)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)  # the first $...$ span
    for pattern in _UNWRAP:
        answer = pattern.sub("\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_answer(solution_str: str) -> str | None:
    """The last "Answer: ..." line among the response's last `TAIL_CHARS` characters, or None."""
    found = ANSWER_LINE.findall(solution_str[-TAIL_CHARS:])
    return found[-1] if found else None


def compute_score(solution_str: str, ground_truth: str) -> dict:
    """{'score': 1.0 or -1.0, 'acc': right or not, 'pred': the normalised answer ('[INVALID]' without a line)}."""
    answer = extract_answer(solution_str)
    pred = normalize_final_answer(answer) if answer is not None else "[INVALID]"
    correct = answer is not None and pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
