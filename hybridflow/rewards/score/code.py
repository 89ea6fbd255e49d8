"""Code scorer: run the response's program followed by the row's tests in the sandbox; 1.0 if all pass.

Rows (see `hybridflow.data.preprocess.human_eval`, data_source `openai_humaneval`; any `code` or `code/...`
data source works the same way):
- `reward_model.ground_truth`: test code appended after the program (HumanEval: the `check` function and
  `check(<entry_point>)`), or cases `{"inputs": [...], "outputs": [...]}` (a dict or its JSON), each run as a
  separate program: stdin/stdout cases (output compared token by token) or, with `"fn_name"`, call-based
  cases (verl's PRIME rows: data sources `codecontests`, `apps`, `codeforces`, `taco`); see `code_cases`.
  Cases can run on a SandboxFusion server instead (`remote`, verl's reward_model.sandbox_fusion.url);
- `extra_info['prompt_code']` (optional): the function stub given in the prompt. It goes before the response's
  code, so a whole-function answer keeps the stub's imports and helper functions, and a completion-style
  answer (the function body only, no `def <entry_point>`) continues the stub. The harness also runs the stub
  itself before the tests, so the helpers the tests call (HumanEval/32's `poly`) are the stub's, never a
  redefinition in the answer;
- `extra_info['entry_point']` (optional): the function under test. With it, the tests reach only the entry
  point and the stub's unimplemented functions (a body of a docstring, `pass` or `...`) in the program.

The program is the last ```python (or ```py) block of the response, else the last ``` block, else the whole
response. It runs in `hybridflow.sandbox` with `DEFAULT_LIMITS` (or `reward_model.scoring.sandbox`), never in
this process. Test code runs in the sandbox's harness, a separate process the program cannot reach: the
program's module code runs first, then the tests call its functions across a pipe, with arguments and results
copied as plain data (`hybridflow.sandbox._harness`). The score is 1.0 only if the harness reports that the
tests ran to their end and the program exited cleanly. So nothing the program prints, no early
`sys.exit(0)`/`os._exit(0)`, no frame or gc introspection (the test code and its expected values are not in
its process), no patched builtin or module (they live in the program's process), no redefined helper, no
`StopIteration` ending a test's `map` early and no result object whose `__eq__` always says True (it reaches
the tests as a reference that cannot be compared) can earn the score; `tests/rewards/test_reward_hacking.py`
tries each.

Limits of the harness: a test that checks an argument the function mutated in place fails (arguments are
copies), and so does a test that passes a function (a callback) to the program.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from typing import Any

from hybridflow.rewards.score.code_cases import Runner, parse_cases, run_cases
from hybridflow.sandbox import SandboxLimits, SandboxResult, run_python
from hybridflow.sandbox.remote import SandboxFusionEndpoint

__all__ = ["DEFAULT_LIMITS", "check_ground_truth", "check_test_code", "compute_score", "extract_program", "stub_functions"]

DEFAULT_LIMITS = SandboxLimits(cpu_time_s=4.0, wall_time_s=6.0, memory_mb=1024, output_bytes=16384)
"""6 s of wall time in all per response (all stdin/stdout cases together): below the reward pool's default
per-call timeout (`ScoringConfig.timeout_s`, 10 s), so the sandbox stops a slow program itself and reports
status 'timeout', instead of the pool cutting the scorer off. Raise both together."""

_PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_BLOCK = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_program(solution_str: str, prompt_code: str | None = None,
                    entry_point: str | None = None) -> tuple[str, bool]:
    """(program, fenced): the code to run and whether it came from a fenced block.

    With `prompt_code` (the stub from the prompt), the program is the stub followed by the answer: after a
    blank line if the answer defines `entry_point` (or no entry point is known), else directly (the
    answer is the body of the stub's last function).
    """
    blocks = _PYTHON_BLOCK.findall(solution_str) or _ANY_BLOCK.findall(solution_str)
    code = blocks[-1] if blocks else solution_str
    if not prompt_code:
        return code, bool(blocks)
    defines = entry_point is None or re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry_point)}\b",
                                               code, re.MULTILINE) is not None
    return (f"{prompt_code.rstrip()}\n\n\n{code}" if defines else prompt_code + code), bool(blocks)


def stub_functions(prompt_code: str) -> list[str]:
    """Names of the top-level functions of `prompt_code` that the answer must implement: those whose body is
    only a docstring, `pass` or `...` (the stub's other functions are given helpers). A ValueError if the
    stub does not parse (the harness could not run it either)."""
    try:
        tree = ast.parse(prompt_code)
    except SyntaxError as err:
        raise ValueError(f"extra_info['prompt_code'] is not valid Python (line {err.lineno}: {err.msg}); "
                         f"the harness runs it before the tests") from err

    def empty(statement: ast.stmt) -> bool:
        return isinstance(statement, ast.Pass) or (isinstance(statement, ast.Expr)
                                                   and isinstance(statement.value, ast.Constant)
                                                   and (statement.value.value is Ellipsis
                                                        or isinstance(statement.value.value, str)))

    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and all(empty(statement) for statement in node.body)]


def check_test_code(tests: str) -> None:
    """Raise unless `tests` (a row's test code) is Python that can fail: an assert, a raise or a call somewhere.
    Empty or comment-only test code runs to its end whatever the program does, so it would pass every program."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as err:
        raise ValueError(f"code ground truth is not valid Python test code (line {err.lineno}: {err.msg})") from None
    if not any(isinstance(node, ast.Assert | ast.Raise | ast.Call) for node in ast.walk(tree)):
        raise ValueError("code ground truth is test code with nothing that can fail (no assert, raise or call): it "
                         "would pass every program that runs; give asserts, or {'inputs': [...], 'outputs': [...]}")


def check_ground_truth(ground_truth: Any) -> None:
    """Raise unless `ground_truth` is cases (`parse_cases`) or test code that can fail (`check_test_code`)."""
    if parse_cases(ground_truth) is not None:
        return
    if not isinstance(ground_truth, str):
        raise ValueError(f"code ground truth must be test code (str) or {{'inputs', 'outputs'}}, "
                         f"got {type(ground_truth).__name__}")
    check_test_code(ground_truth)


def _run_tests(program: str, tests: str, limits: SandboxLimits, prompt_code: str | None,
               entry_point: str | None) -> tuple[bool, SandboxResult]:
    names = set(stub_functions(prompt_code)) if prompt_code else set()
    if entry_point:
        names.add(entry_point)
    result = run_python(program, tests=tests, limits=limits, test_setup=prompt_code or None,
                        program_names=names or None)
    return result.ok and result.tests is not None and result.tests.passed, result


def _local_runner(limits: SandboxLimits) -> Runner:
    def run(program: str, stdin: str, wall_time_s: float) -> SandboxResult:
        return run_python(program, stdin=stdin, limits=dataclasses.replace(limits, wall_time_s=wall_time_s))
    return run


def _remote_runner(endpoint: SandboxFusionEndpoint) -> Runner:
    def run(program: str, stdin: str, wall_time_s: float) -> SandboxResult:
        return endpoint.run_python(program, stdin=stdin, wall_time_s=wall_time_s)
    return run


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None, *,
                  format_score: float = 0.0, limits: SandboxLimits | None = None,
                  remote: SandboxFusionEndpoint | None = None, continuous: bool = False) -> dict[str, Any]:
    """Run the response's program against the row's tests in the sandbox.

    Args:
        solution_str: the model's response.
        ground_truth: test code to append, or stdin/stdout cases (see the module docstring).
        extra_info: the row's extra_info; `prompt_code` and `entry_point` are used when present.
        format_score: score of a wrong answer given in a fenced code block.
        limits: sandbox limits; default `DEFAULT_LIMITS` (the wall time covers all cases together).
        remote: a SandboxFusion server that runs the stdin/stdout and call-based cases instead of the local
            sandbox (verl's reward_model.sandbox_fusion.url). Test code always runs in the local harness: on a
            server the tests would share the program's process, where it can forge their verdict.
        continuous: score a wrong answer by the share of its first cases that pass (verl's PRIME code rows;
            see `code_cases`); test code has no cases to count and scores 0 or 1.

    Returns:
        {'score': 1.0 if every test passes, else the passing share of the cases (`continuous`), else
        `format_score` (fenced answer) or 0.0; 'acc': 1.0 or 0.0;
        'status': the sandbox status of the (first failing) run, or 'no_code' (empty response),
        'exited_before_tests' (exit 0 before the tests could call it), 'wrong_answer' (a test failed or a
        case's output differs)}.
    """
    if not solution_str.strip():
        return {"score": 0.0, "acc": 0.0, "status": "no_code"}
    extra_info = extra_info or {}
    program, fenced = extract_program(solution_str, extra_info.get("prompt_code"), extra_info.get("entry_point"))
    limits = limits or DEFAULT_LIMITS
    cases = parse_cases(ground_truth)
    fraction = 0.0
    if cases is not None:
        runner = _remote_runner(remote) if remote is not None else _local_runner(limits)
        outcome = run_cases(program, cases, runner, limits.wall_time_s, continuous=continuous)
        passed, fraction, result = outcome.all_passed, outcome.fraction, outcome.last_result
    elif isinstance(ground_truth, str):
        check_test_code(ground_truth)
        passed, result = _run_tests(program, ground_truth, limits, extra_info.get("prompt_code"),
                                    extra_info.get("entry_point"))
    else:
        raise ValueError(f"code ground truth must be test code (str) or {{'inputs', 'outputs'}}, "
                         f"got {type(ground_truth).__name__}")
    status = result.status if result is not None else ("ok" if passed else "timeout")
    if not passed and status == "ok":
        started = cases is not None or (result.tests is not None and result.tests.started)
        status = "wrong_answer" if started else "exited_before_tests"
    if passed:
        return {"score": 1.0, "acc": 1.0, "status": status}
    wrong = format_score if fenced else 0.0
    return {"score": max(fraction, wrong) if continuous else wrong, "acc": 0.0, "status": status}
