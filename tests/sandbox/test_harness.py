"""hybridflow.sandbox test harness: the verdict of `run_python(program, tests=...)` comes from a separate process
the program cannot reach, so no program can forge it (attack 4 in docs/reliability.md)."""

from __future__ import annotations

import math
import uuid

import pytest

from hybridflow.sandbox import SandboxLimits, HarnessVerdict, _harness, run_python
from tests.sandbox.namespaces import processes_in, require_namespaces

SECRET = f"expected-{uuid.uuid4().hex}"
TESTS = f"""
SECRET = {SECRET!r}
def check(candidate):
    assert candidate(1, 2) == 3, SECRET
    assert candidate(20, 22) == 42
check(add)
"""
LIMITS = dict(cpu_time_s=2.0, wall_time_s=4.0, memory_mb=256, max_processes=8)


@pytest.fixture(params=["namespaces", "none"])
def limits(request, tmp_path, monkeypatch) -> SandboxLimits:
    """The limits of one isolation mode; afterwards no harness or program process may be left."""
    if request.param == "namespaces":
        require_namespaces()
    root = tmp_path / "sandboxes"
    root.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(root))
    yield SandboxLimits(isolation=request.param, **LIMITS)
    assert processes_in(root) == [] and list(root.iterdir()) == []


def test_codec_round_trip():
    value = [None, True, 3, -2.5, math.inf, "é\ud800", b"\x00", 1 + 2j, (1, (2,)), {3, 4}, frozenset({5}),
             {(1, "a"): [1.0]}, 10 ** 5000, {"k": {"nested": ()}}]
    kept = []
    tree = _harness.encode(value, lambda obj: kept.append(obj) or len(kept))
    decoded = _harness.decode(tree, lambda ref: pytest.fail("no references expected"))
    assert decoded == value and type(decoded[8]) is tuple and type(decoded[9]) is set
    assert math.isnan(_harness.decode(_harness.encode(math.nan, None), None))


def test_codec_keeps_objects_as_references_and_refuses_malformed_trees():
    class Sneaky(int):
        def __eq__(self, other):
            return True

    kept = []
    tree = _harness.encode([Sneaky(1), object()], lambda obj: kept.append(obj) or len(kept))
    assert tree == {"l": [{"r": 1}, {"r": 2}]}  # an int subclass is not plain data: its __eq__ stays home
    with pytest.raises(TypeError, match="plain data only"):
        _harness.encode(lambda: 1, None)
    for bad in ([1], {"l": [], "t": []}, {"zz": []}, {"r": "1"}, {"d": [[1]]}, {"c": ["1", 2]}):
        with pytest.raises(ValueError, match="malformed"):
            _harness.decode(bad, lambda ref: ref)


def test_verdicts(limits):
    right = run_python("def add(x, y):\n    return x + y", tests=TESTS, limits=limits)
    assert right.ok and right.tests == HarnessVerdict(passed=True, started=True, detail=""), right
    wrong = run_python("def add(x, y):\n    return x - y", tests=TESTS, limits=limits)
    assert wrong.ok and wrong.tests.started and not wrong.tests.passed
    assert wrong.tests.detail == f"AssertionError: {SECRET}"  # the trainer sees why; the program never did
    early = run_python("def add(x, y):\n    return x + y\nimport sys\nsys.exit(0)", tests=TESTS, limits=limits)
    assert early.ok and early.tests == HarnessVerdict(False, False, "the program ended before the tests started")
    broken = run_python("def add(x, y) return", tests=TESTS, limits=limits)
    assert broken.status == "error" and not broken.tests.passed and not broken.tests.started
    assert run_python("print(1)", limits=limits).tests is None


def test_objects_exceptions_and_helpers_cross_the_pipe(limits):
    program = ("class Solution:\n    def twice(self, xs):\n        return [2 * x for x in xs]\n"
               "def helper(n):\n    return {'n': (n, float(n))}\n"
               "def picky(n):\n    if n < 0:\n        raise ValueError('negative')\n    return n\n")
    tests = ("assert Solution().twice([1, 2]) == [2, 4]\nassert helper(3) == {'n': (3, 3.0)}\n"
             "try:\n    picky(-1)\nexcept ValueError as err:\n    assert str(err) == 'negative'\n"
             "else:\n    raise AssertionError('no error')\nassert picky(n=5) == 5\n")
    result = run_python(program, tests=tests, limits=limits)
    assert result.tests == HarnessVerdict(True, True, ""), result
    missing = run_python("x = 1", tests="assert undefined_name(1) == 1", limits=limits)
    assert missing.tests.detail == "NameError: name 'undefined_name' is not defined"


# Wrong solutions (add returns 0) that try to earn a pass anyway, or look for the tests' SECRET (by its shape,
# so that their own source does not hold it).
FORGERIES = {
    "print_markers": "print('hybridflow-tests-passed', 'OK', 'passed', True)\n",
    "verdict_json_on_every_fd": (
        "import json, os\nverdict = {'tests': {'passed': True, 'started': True, 'detail': ''}}\n"
        "line = (json.dumps(verdict) + '\\n').encode()\n"
        "for fd in range(0, 256):\n    try:\n        os.write(fd, line)\n    except OSError:\n        pass\n"),
    "frames_and_getframe": (
        "import re, sys\nfound = []\nframe = sys._getframe()\nwhile frame is not None:\n"
        "    for scope in (frame.f_globals, frame.f_locals):\n"
        "        found += [v for v in scope.values() if isinstance(v, str) and re.search(SHAPE, v)]\n"
        "    found += [c for c in frame.f_code.co_consts if isinstance(c, str) and re.search(SHAPE, c)]\n"
        "    frame = frame.f_back\nprint('FOUND' if found else 'nothing', found)\n"),
    "own_fds_and_proc_self": (
        "import os, re\nfound = False\nfor fd in range(0, 64):\n    try:\n        os.set_blocking(fd, False)\n"
        "        found |= re.search(SHAPE.encode(), os.read(fd, 1 << 20)) is not None\n    except OSError:\n"
        "        pass\nfor name in ('cmdline', 'environ', 'maps'):\n"
        "    found |= re.search(SHAPE.encode(), open(f'/proc/self/{name}', 'rb').read()) is not None\n"
        "print('FOUND' if found else 'nothing')\n"),
    "gc_objects": "import gc, re\nprint([o for o in gc.get_objects() if isinstance(o, str) and re.search(SHAPE, o)])\n",
    "always_equal_result": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(x, y):\n    return Anything()\n"),
    "equal_int_subclass": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                           "def add(x, y):\n    return Int(0)\n"),
    "kill_everyone": ("import os, signal\nfor sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):\n"
                      "    try:\n        os.kill(-1, sig)\n    except OSError:\n        pass\n"),
    "answer_the_harness_itself": (
        "import os, json, threading\ndef answer():\n    for fd in range(3, 64):\n        try:\n"
        "            os.write(fd, (json.dumps({'v': 3}) + '\\n').encode())\n        except OSError:\n"
        "            pass\nthreading.Thread(target=answer).start()\n"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_forged_verdicts_fail(case, limits):
    program = "SHAPE = 'expected-' + '[0-9a-f]' + '{32}'\ndef add(x, y):\n    return 0\n" + FORGERIES[case]
    result = run_python(program, tests=TESTS, limits=limits)
    assert result.tests is None or not result.tests.passed, result
    assert "FOUND" not in result.stdout and SECRET not in result.stdout + result.stderr
    control = run_python(program.replace("return 0", "return x + y", 1), tests=TESTS, limits=limits)
    if case in ("print_markers", "frames_and_getframe"):
        assert control.tests.passed, control  # the same program with a right `add` passes: the attempt is inert
    if case == "frames_and_getframe":  # the search works: a secret in the program's own process is found
        planted = run_python(f"HIDDEN = {SECRET!r}\n" + program, limits=limits)
        assert planted.stdout.startswith("FOUND"), planted


def test_setup_helpers_are_the_referees_and_only_declared_names_come_from_the_program(limits):
    setup = "def scale(x):\n    return 10 * x\ndef solve(x):\n    '''the stub'''\n"
    tests = "assert solve(2) == scale(2)\n"
    forged = "def scale(x):\n    return 0\ndef solve(x):\n    return 0\n"
    result = run_python(forged, tests=tests, test_setup=setup, program_names=["solve"], limits=limits)
    assert result.tests.started and not result.tests.passed, result  # the setup's scale(2) == 20
    honest = run_python(setup + "def solve(x):\n    return 20\n", tests=tests, test_setup=setup,
                        program_names=["solve"], limits=limits)
    assert honest.tests == HarnessVerdict(True, True, ""), honest
    hidden = run_python("def other():\n    return 1\n", tests="assert other() == 1", program_names=["solve"],
                        limits=limits)
    assert hidden.tests.detail == "NameError: name 'other' is not defined"
    broken = run_python("x = 1", tests="pass", test_setup="def (", limits=limits)
    assert not broken.tests.passed and broken.tests.detail.startswith("test setup: SyntaxError")


@pytest.mark.parametrize("statement", ["raise StopIteration", "raise StopAsyncIteration", "raise SystemExit(0)",
                                       "raise KeyboardInterrupt", "raise GeneratorExit", "__import__('os')._exit(0)"])
def test_control_flow_exceptions_from_the_program_fail_the_call(statement):
    """`map` takes a StopIteration as the end of its input and `except Exception` would swallow the rest, so
    neither may reach the tests as itself; an ordinary error still does (the last check)."""
    program = f"def f(x):\n    if x > 1:\n        {statement}\n    return x\n"
    tests = ("assert all(map(lambda x: f(x) == x, [1, 2, 3]))\n"
             "try:\n    f(5)\nexcept Exception:\n    pass\n")
    result = run_python(program, tests=tests, limits=SandboxLimits(**LIMITS))
    assert result.tests.started and not result.tests.passed, result
    assert result.tests.detail.startswith(("ProgramRaised", "ProgramEnded")), result.tests.detail
    assert run_python("def f(x):\n    return x\n", tests=tests, limits=SandboxLimits(**LIMITS)).tests.passed
    caught = run_python("def f(x):\n    raise ValueError(x)\n", tests="try:\n    f(1)\nexcept ValueError:\n    pass\n",
                        limits=SandboxLimits(**LIMITS))
    assert caught.tests.passed, caught


def test_program_objects_have_no_truth_value_and_no_comparison(limits):
    program = "def f():\n    return object()\n"
    for tests in ("assert f()", "assert f() != 1", "assert not (f() == 1)"):
        result = run_python(program, tests=tests, limits=limits)
        assert not result.tests.passed and result.tests.detail.startswith("TypeError"), (tests, result)
