"""The code interpreter tool: output of a run in the sandbox, failures reported as text, limits from config."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridflow.sandbox import SandboxLimits
from hybridflow.tools.code_interpreter import CodeInterpreterTool
from tests.tools.helpers import run

SMALL_LIMITS = {"cpu_time_s": 2.0, "wall_time_s": 2.0, "memory_mb": 256}


def execute(tool: CodeInterpreterTool, *codes: str) -> list[tuple]:
    async def calls():
        instance_id = await tool.create()
        results = [await tool.execute(instance_id, {"code": code}) for code in codes]
        await tool.release(instance_id)
        return results

    return run(calls())


def test_prints_and_failures():
    tool = CodeInterpreterTool({"type": "native", "limits": SMALL_LIMITS})
    (ok, _, ok_metrics), (silent, _, _), (raised, _, raised_metrics) = execute(
        tool, "print(6 * 7)\nprint('done')", "x = 1", "print('start')\nraise ValueError('bad value')")
    assert ok.text == "42\ndone"
    assert ok_metrics["error"] is False and ok_metrics["status"] == "ok" and ok_metrics["latency_s"] > 0
    assert silent.text == "(no output; use print() to show values)"
    assert raised.text.startswith("start\n[stderr]\nTraceback")
    assert "ValueError: bad value" in raised.text
    assert raised.text.endswith("[status: error, exit code: 1]")
    assert raised_metrics["error"] is True and raised_metrics["status"] == "error"


def test_timeout_is_reported():
    tool = CodeInterpreterTool({"limits": {"cpu_time_s": 1.0, "wall_time_s": 1.0}})
    [(response, _, metrics)] = execute(tool, "print('spinning', flush=True)\nwhile True:\n    pass")
    assert metrics["error"] is True and metrics["status"] == "timeout"
    assert "[status: timeout" in response.text
    assert metrics["latency_s"] < 10


def test_output_is_truncated_but_keeps_the_status():
    tool = CodeInterpreterTool({"limits": SMALL_LIMITS, "max_output_chars": 120, "stderr_tail_chars": 30})
    (long_ok, _, _), (long_fail, _, _) = execute(
        tool, "print('x' * 5000)", "print('y' * 5000)\nraise RuntimeError('z' * 500)")
    assert len(long_ok.text) == 120 and long_ok.text.startswith("xxx")
    assert long_ok.text.endswith("...[truncated; 5000 characters in all]")
    assert len(long_fail.text) <= 120 and long_fail.text.endswith("[status: error, exit code: 1]")
    assert "[stderr, last part]\n..." + "z" * 20 in long_fail.text


def test_bad_limits_name_the_field():
    with pytest.raises(ValueError, match=r"tool 'code_interpreter': invalid config.limits \{'cpu_seconds': 1\}"):
        CodeInterpreterTool({"limits": {"cpu_seconds": 1}})


def test_call_timeout_kills_the_sandbox_and_must_exceed_its_wall_time(tmp_path, monkeypatch):
    """A call past the tool's timeout_s (here shorter than the program's run, as when it queued for a slot)
    returns an error at once, and the cancelled run's sandbox is killed and removed."""
    assert CodeInterpreterTool({}).timeout_s == 120.0  # waits for a sandbox slot count too
    with pytest.raises(ValueError, match=r"config.timeout_s=5 must exceed config.limits.wall_time_s=10"):
        CodeInterpreterTool({"timeout_s": 5, "limits": {"wall_time_s": 10}})
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    tool = CodeInterpreterTool({"timeout_s": 1.5, "limits": {"cpu_time_s": 1.0, "wall_time_s": 1.0}})
    tool.limits = SandboxLimits(cpu_time_s=20.0, wall_time_s=20.0)  # as if the sandbox itself would not stop it

    async def call_then_watch():
        start = time.monotonic()
        result = await tool.execute(await tool.create(), {"code": "import time\ntime.sleep(30)"})
        returned_s = time.monotonic() - start
        while list(tmp_path.iterdir()) and time.monotonic() - start < 15:  # the cancelled run cleans up behind
            await asyncio.sleep(0.05)
        return result, returned_s, time.monotonic() - start

    (response, _, metrics), returned_s, cleaned_s = run(call_then_watch())
    assert metrics["timeout"] is True and "took longer than 1.5 s" in response.text
    assert returned_s < 1.5 + 2.0, returned_s  # the caller does not wait for the clean-up
    assert list(tmp_path.iterdir()) == [] and cleaned_s < 15  # the sandbox was killed and removed, not left running
