"""Call-based and stdin/stdout cases of code rows (verl's PRIME code data: codecontests, apps, codeforces,
taco), run in the local sandbox: what passes, the continuous score, and the results the program cannot forge."""

from __future__ import annotations

import json

import pytest

from hybridflow.rewards.score import default_compute_score
from hybridflow.rewards.score.code_cases import parse_cases
from hybridflow.sandbox import SandboxLimits

LIMITS = SandboxLimits(cpu_time_s=4.0, wall_time_s=8.0, memory_mb=512)


def call_row(fn_name: str, cases: list[tuple[list, object]]) -> str:
    """PRIME's layout: each input is the arguments as JSON lines, each output the value as JSON."""
    return json.dumps({"fn_name": fn_name, "inputs": ["\n".join(json.dumps(a) for a in args) for args, _ in cases],
                       "outputs": [json.dumps(out) for _, out in cases]})


ADD = call_row("add", [([1, 2], 3), ([5, 7], 12), ([-1, 1], 0), ([10, 0], 10)])


def score(data_source: str, answer: str, ground_truth, **kwargs) -> dict:
    return default_compute_score(data_source, f"```python\n{answer}\n```", ground_truth, sandbox=LIMITS, **kwargs)


def test_a_right_function_and_a_solution_method_score_one() -> None:
    assert score("apps", "def add(a, b):\n    return a + b", ADD)["score"] == 1.0
    solution = "class Solution:\n    def add(self, a, b):\n        return a + b"
    assert score("taco", solution, ADD) == {"score": 1.0, "acc": 1.0, "status": "ok"}


def test_tuples_equal_lists_and_a_one_item_list_output_accepts_the_item() -> None:
    pairs = call_row("pair", [([1], [1, 2]), ([3], [[3, 4]])])
    assert score("codeforces", "def pair(x):\n    return (x, x + 1)", pairs)["score"] == 1.0


def test_a_wrong_answer_scores_the_share_of_cases_it_passes() -> None:
    half = score("codecontests", "def add(a, b):\n    return a + b if a > 0 else 99", ADD)
    assert half["score"] == pytest.approx(0.75) and half["acc"] == 0.0 and half["status"] == "wrong_answer"
    assert score("apps", "def add(a, b):\n    raise ValueError", ADD)["score"] == 0.0


def test_a_failure_after_the_tenth_case_never_scores_one() -> None:
    cases = [([i, 1], i + 1) for i in range(12)]
    answer = "def add(a, b):\n    return a + b if a < 11 else 0"
    assert score("apps", answer, call_row("add", cases))["score"] == pytest.approx(0.9)


def test_code_rows_outside_prime_keep_all_or_nothing_scores() -> None:
    answer = "def add(a, b):\n    return a + b if a > 0 else 99"
    assert score("code/calls", answer, ADD)["score"] == 0.0


def test_stdin_cases_count_continuously_too() -> None:
    truth = {"inputs": ["1 2\n", "3 4\n", "5 5\n"], "outputs": ["3\n", "7\n", "10\n"]}
    answer = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)"
    assert score("codecontests", answer, truth)["score"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("answer", [
    # an object that claims to equal anything cannot be sent back as JSON
    "class Same:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Same()",
    # printing a result line and leaving before the driver runs only gives the program's own guess
    "import os, sys\nsys.stdout.write('__hybridflow_call_result__:3\\n')\nsys.stdout.flush()\nos._exit(0)\n"
    "def add(a, b):\n    return 0",
    # a function that is not there
    "def plus(a, b):\n    return a + b",
])
def test_answers_that_do_not_compute_the_results_fail(answer: str) -> None:
    assert score("apps", answer, ADD)["score"] <= 0.25


@pytest.mark.parametrize("ground_truth, message", [
    ({"inputs": [], "outputs": []}, "no cases"),
    ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
    ({"inputs": ["1"], "outputs": ["1"], "fn_name": "not a name"}, "not a Python name"),
])
def test_malformed_cases_are_errors(ground_truth, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cases(ground_truth)


def test_arguments_as_lists_and_outputs_as_values_are_read_too() -> None:
    cases = parse_cases({"fn_name": "f", "inputs": [[1, [2, 3]]], "outputs": [[5]]})
    assert cases.inputs == [[1, [2, 3]]] and cases.outputs == [[5]] and cases.fn_name == "f"


def test_no_case_runs_once_the_score_is_settled() -> None:
    """A failure ends the run at once (all-or-nothing), or once the counted cases have run (continuous)."""
    from hybridflow.rewards.score.code_cases import CodeCases, run_cases
    from hybridflow.sandbox import SandboxResult

    cases = CodeCases([str(i) for i in range(15)], [str(i) for i in range(15)])
    calls: list[str] = []

    def runner(program: str, stdin: str, wall_time_s: float) -> SandboxResult:
        calls.append(stdin)
        return SandboxResult(status="ok", exit_code=0, stdout="x" if stdin == "2" else stdin, stderr="", wall_s=0.0)

    outcome = run_cases("program", cases, runner, 60.0, continuous=True)
    assert len(calls) == 10 and outcome.fraction == pytest.approx(0.9) and not outcome.all_passed
    calls.clear()
    assert run_cases("program", cases, runner, 60.0).fraction == 0.0 and calls == ["0", "1", "2"]
