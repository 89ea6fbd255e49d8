"""MATH scorer: the last `\\boxed{...}` compared with the ground truth after Hendrycks-style normalization.

Normalization (Hendrycks et al. 2021, MATH, appendix code) makes equal: `\\dfrac`/`\\tfrac`/`\\frac`,
`\\frac12`/`\\frac{1}{2}`, `1/2`/`\\frac{1}{2}`, `.5`/`0.5`, `x = 3`/`3`, `5^\\circ`/`5`, `50\\%`/`50`,
`\\left(`/`(`, spaces, `\\text{ units}` suffixes. On top of that, plain numbers and simple fractions are
compared by value, so `0.5`, `\\frac{1}{2}` and `2/4` are all equal.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["compute_score", "is_equiv", "last_boxed_only_string", "remove_boxed", "strip_string"]


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) in `text`, braces matched; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    command = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    after = start + len(command)
    if text.startswith(" ", after):  # `\boxed 5`: the answer runs to the next `$` or the end
        end = text.find("$", after)
        boxed = text[start:end if end >= 0 else len(text)].rstrip()
        return boxed if len(boxed) > after - start else None  # `\boxed ` with nothing after it boxes nothing
    brace = text.find("{", after)
    if brace < 0 or text[after:brace].strip():
        return None
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[start:position + 1]
    return None  # unbalanced braces


def remove_boxed(boxed: str) -> str:
    """`\\boxed{X}` / `\\fbox{X}` / `\\boxed X` -> `X`."""
    for command in ("\\boxed", "\\fbox"):
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1:].strip()
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1:-1]
    raise ValueError(f"not a boxed expression: {boxed!r:.100}")


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{b}` -> `\\frac{1}{b}`, `\\frac{a}2` -> `\\frac{a}{2}`."""
    parts = text.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{"):
            close = _matching_brace(part, 0)
            if close is not None and close + 1 < len(part) and part[close + 1] != "{":
                part = part[:close + 1] + "{" + part[close + 1] + "}" + part[close + 2:]
            out += part
        elif len(part) >= 2:
            rest = part[2:]
            if part[1] == "{":
                out += "{" + part[0] + "}" + part[1:]
            else:
                out += "{" + part[0] + "}{" + part[1] + "}" + rest
        else:
            out += part
    return out


def _matching_brace(text: str, open_at: int) -> int | None:
    depth = 0
    for position in range(open_at, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return position
    return None


_SQRT_BARE = re.compile(r"\\sqrt(\w)")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}")
_SLASH_FRAC = re.compile(r"^(-?\d+)/(-?\d+)$")


def strip_string(text: str) -> str:
    """Normalize a LaTeX answer so that equal answers written differently compare equal as strings."""
    s = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # `5 \text{ cm}`: drop a units suffix
        s = s.split("\\text{ ")[0]
    s = _TEXT_WRAP.sub(r"\1", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:  # `x = 3`, `k=5`: keep the value
        s = sides[1]
    s = _SQRT_BARE.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    s = s.rstrip(".")
    match = _SLASH_FRAC.match(s)
    if match:
        s = f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


_PLAIN_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_LATEX_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")


def _as_fraction(s: str) -> Fraction | None:
    """The exact value of a plain number or a numeric fraction, else None."""
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    try:
        if _PLAIN_NUMBER.match(s):
            return Fraction(s)
        match = _LATEX_FRAC.match(s)
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
    except (ZeroDivisionError, ValueError):  # x/0, or more digits than Python converts (model output is untrusted)
        return None
    return None


def is_equiv(answer: str, ground_truth: str) -> bool:
    """True if the two answers are equal after `strip_string`, or equal as numbers."""
    a, b = strip_string(answer), strip_string(ground_truth)
    if a == b:
        return True
    value_a, value_b = _as_fraction(a), _as_fraction(b)
    return value_a is not None and value_a == value_b


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0) -> float:
    """1.0 if the last `\\boxed{}` in `solution_str` matches `ground_truth`, `format_score` if a boxed answer
    is wrong, 0.0 if there is no boxed answer. A boxed ground truth is unboxed first."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    truth_boxed = last_boxed_only_string(truth)
    if truth_boxed is not None:
        truth = remove_boxed(truth_boxed)
    return 1.0 if is_equiv(remove_boxed(boxed), truth) else format_score
