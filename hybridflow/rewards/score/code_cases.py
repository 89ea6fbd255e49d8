"""Test cases of a code row that are run one program run each: stdin/stdout cases, and call-based cases (APPS,
TACO, CodeContests and Codeforces rows of verl's PRIME data, with a `fn_name`).

Ground truth: `{"inputs": [...], "outputs": [...]}` (a dict or its JSON), with an optional `"fn_name"`.
- Without `fn_name`, each input is a program's stdin and its output the expected stdout, compared token by
  token (whitespace-insensitive).
- With `fn_name`, each input holds the function's arguments, one JSON value per line (PRIME's layout) or a
  list of them, and each output is the expected return value (JSON text or the value). The program runs with a
  driver appended that reads the arguments from stdin, calls `fn_name` (a top-level function, else a method
  of `Solution()`, the LeetCode layout) and prints the result as JSON on a marked last line. The result is
  compared here, as parsed JSON, so no object of the program's (an `__eq__` that always says True) takes
  part in the comparison. As in APPS' checker, a tuple equals the list with its items, and an output given
  as a one-item list also accepts the item itself.

Each case is a separate run, in the local sandbox or on a SandboxFusion server (`runner`), all of a
response's cases within one wall-time budget; cases the budget does not reach count as failed.

Scores: `all_passed` is True only if every case passed. `fraction` is verl's continuous score for PRIME's code
rows: the share of the first `CONTINUOUS_CASES` cases that pass. Unlike verl, a response that fails a later
case never gets 1.0 from it: its fraction is at most (k - 1) / k.
"""

from __future__ import annotations

import ast
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.sandbox import SandboxResult

__all__ = ["CONTINUOUS_CASES", "CaseOutcome", "CodeCases", "Runner", "call_driver", "call_result_matches", "parse_cases",
           "run_cases"]

CONTINUOUS_CASES = 10
"""Cases that count towards the continuous score (verl's prime_code tests the first 10)."""

RESULT_MARKER = "__hybridflow_call_result__:"

Runner = Callable[[str, str, float], SandboxResult]
"""(program, stdin, wall_time_s) -> how the run ended."""


@dataclass(frozen=True)
class CodeCases:
    """A row's cases: stdins and expected stdouts, or (with `fn_name`) argument lists and return values."""

    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None

    def __len__(self) -> int:
        return len(self.inputs)


@dataclass(frozen=True)
class CaseOutcome:
    """How a response did on its cases."""

    all_passed: bool
    fraction: float
    last_result: SandboxResult | None


def parse_cases(ground_truth: Any) -> CodeCases | None:
    """The cases of `ground_truth` (a dict, its JSON, or its Python repr), or None when it is test code (a string
    that does not start with '{'). A mapping without 'inputs' and 'outputs', or a '{' string that is neither, is
    an error: taken as test code it would pass every program that runs."""
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
        ground_truth = _mapping_text(ground_truth)
    if not isinstance(ground_truth, Mapping):
        return None
    if not {"inputs", "outputs"} <= set(ground_truth):
        raise ValueError(f"code ground truth must hold 'inputs' and 'outputs' (stdin/stdout or call cases), got "
                         f"keys {sorted(map(str, ground_truth))[:8]}")
    inputs, outputs = list(ground_truth["inputs"]), list(ground_truth["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"code ground truth has {len(inputs)} inputs but {len(outputs)} outputs")
    if not inputs:
        raise ValueError("code ground truth has no cases (empty 'inputs'): nothing could show an answer right")
    fn_name = ground_truth.get("fn_name") or None
    if fn_name is None:
        return CodeCases([str(i) for i in inputs], [str(o) for o in outputs])
    if not str(fn_name).isidentifier():
        raise ValueError(f"code ground truth's fn_name={fn_name!r} is not a Python name")
    return CodeCases([_arguments(i) for i in inputs], [_value(o) for o in outputs], str(fn_name))


def _mapping_text(text: str) -> Any:
    """The mapping a '{' string writes, as JSON or as a Python literal (`str(dict)`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as err:
        raise ValueError(f"code ground truth starts with '{{' but is neither JSON nor a Python dict literal "
                         f"({type(err).__name__}): {text[:80]!r}") from None


def _arguments(case_input: Any) -> list[Any]:
    if isinstance(case_input, str):
        return [json.loads(line) for line in case_input.split("\n") if line.strip()]
    if isinstance(case_input, list | tuple):
        return list(case_input)
    return [case_input]


def _value(case_output: Any) -> Any:
    if isinstance(case_output, str):
        try:
            return json.loads(case_output)
        except json.JSONDecodeError:
            return case_output
    return case_output


def call_driver(fn_name: str) -> str:
    """Code appended to the program: call `fn_name` with stdin's JSON lines and print the result, marked."""
    return f"""

def __hybridflow_call():
    import json, sys
    arguments = [json.loads(line) for line in sys.stdin.read().split("\\n") if line.strip()]
    function = globals().get({fn_name!r})
    if function is None and "Solution" in globals():
        function = getattr(Solution(), {fn_name!r})
    if function is None:
        raise NameError("the program defines no function or Solution method named " + {fn_name!r})
    result = function(*arguments)
    sys.stdout.write("\\n" + {RESULT_MARKER!r} + json.dumps(result) + "\\n")


if __name__ == "__main__":
    __hybridflow_call()
"""


def _normalised(value: Any) -> Any:
    return [_normalised(item) for item in value] if isinstance(value, list | tuple) else value


def call_result_matches(stdout: str, expected: Any) -> bool:
    """Whether the marked result line of `stdout` equals `expected` (as plain JSON data)."""
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not lines:
        return False
    try:
        result = json.loads(lines[-1][len(RESULT_MARKER):])
    except json.JSONDecodeError:
        return False
    expected = _normalised(expected)
    return result == expected or (isinstance(expected, list) and len(expected) == 1 and result == expected[0])


def _run_case(cases: CodeCases, index: int, program: str, runner: Runner, wall_time_s: float) -> SandboxResult:
    if cases.fn_name is None:
        return runner(program, cases.inputs[index], wall_time_s)
    stdin = "\n".join(json.dumps(argument) for argument in cases.inputs[index])
    return runner(program + call_driver(cases.fn_name), stdin, wall_time_s)


def _passed(cases: CodeCases, index: int, result: SandboxResult) -> bool:
    if not result.ok:
        return False
    if cases.fn_name is None:
        return result.stdout.split() == cases.outputs[index].split()
    return call_result_matches(result.stdout, cases.outputs[index])


def run_cases(program: str, cases: CodeCases, runner: Runner, wall_time_s: float, *,
              continuous: bool = False) -> CaseOutcome:
    """Run `program` on each case within `wall_time_s` in all. Without `continuous` the first failure ends it
    (fraction 0); with it the first `CONTINUOUS_CASES` cases all run and give the fraction."""
    deadline = time.monotonic() + wall_time_s
    counted = min(len(cases), CONTINUOUS_CASES) if continuous else 0
    passed_counted, result, failed = 0, None, False
    for index in range(len(cases)):
        remaining = deadline - time.monotonic()
        if failed and index >= counted:  # the score is settled: failed, and no counted case is left to run
            break
        if remaining <= 0:
            failed = True
            break
        result = _run_case(cases, index, program, runner, remaining)
        if _passed(cases, index, result):
            passed_counted += index < counted
        else:
            failed = True
    if not failed:
        return CaseOutcome(True, 1.0, result)
    fraction = min(passed_counted / counted, (counted - 1) / counted) if counted else 0.0
    return CaseOutcome(False, fraction, result)
