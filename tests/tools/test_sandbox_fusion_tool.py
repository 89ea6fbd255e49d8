"""verl's SandboxFusionTool, built from verl's tools YAML: the model's code runs on the server (a stand-in that
speaks the run_code API), the reply shows what it printed or why it failed, calls in flight stay within
rate_limit, and a server that cannot run the code is an error reply, never a stalled loop."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import time

import pytest

from hybridflow.tools import load_tools
from tests.sandbox.sandbox_fusion_server import server  # noqa: F401 (a fixture)

VERL_CONFIG = """\
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "{url}"
      num_workers: 4
      enable_global_rate_limit: true
      rate_limit: {rate_limit}
      default_timeout: 30
      default_language: "python"
      memory_limit_mb: 256
      type: native
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
              description: "The code to execute."
          required: ["code"]
"""


def build(tmp_path, url: str, rate_limit: int = 10):
    path = tmp_path / "tools.yaml"
    path.write_text(VERL_CONFIG.format(url=url, rate_limit=rate_limit))
    return load_tools(str(path))["code_interpreter"]


async def call(tool, code: str):
    instance = await tool.create()
    try:
        return await tool.execute(instance, {"code": code})
    finally:
        await tool.release(instance)


def test_verl_s_tools_file_runs_code_on_the_server(tmp_path, server) -> None:
    tool = build(tmp_path, server.url)
    response, reward, metrics = asyncio.run(call(tool, "print(6 * 7)"))
    assert response.text == "42" and reward == 0.0 and not metrics["error"] and metrics["status"] == "ok"
    [request] = server.requests
    assert request["memory_limit_MB"] == 256 and request["run_timeout"] == 30 and request["language"] == "python"
    response, _, metrics = asyncio.run(call(tool, "raise ValueError('bad input')"))
    assert metrics["error"] and "ValueError: bad input" in response.text and "[status: error" in response.text


def test_an_unreachable_server_is_an_error_reply(tmp_path) -> None:
    tool = build(tmp_path, "http://127.0.0.1:9/run_code")
    response, _, metrics = asyncio.run(call(tool, "print(1)"))
    assert metrics["error"] and "could not be run" in response.text and "sandbox_fusion.url" not in metrics


def test_calls_in_flight_stay_within_the_rate_limit(tmp_path, server) -> None:
    in_flight, peak, lock = [0], [0], threading.Lock()
    original = server.run

    def slow_run(body):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.2)
        with lock:
            in_flight[0] -= 1
        return original(body)

    server.run = slow_run
    tool = build(tmp_path, server.url, rate_limit=2)

    async def many():
        return await asyncio.gather(*(call(tool, f"print({i})") for i in range(6)))

    replies = asyncio.run(many())
    assert [r[0].text for r in replies] == [str(i) for i in range(6)] and peak[0] == 2
    # the next step's agent loops run on another event loop: the limit holds there too
    assert [r[0].text for r in asyncio.run(many())] == [str(i) for i in range(6)] and peak[0] == 2


@pytest.mark.parametrize("config, message", [
    ("{}", "sandbox_fusion_url is not set"),
    ("{sandbox_fusion_url: 'localhost:8080'}", "must be an http:// or https://"),
    ("{sandbox_fusion_url: 'http://x/run_code', rate_limit: 0}", "rate_limit=0 must be > 0"),
    ("{sandbox_fusion_url: 'http://x/run_code', default_timeout: 200}", "must exceed config.default_timeout=200"),
])
def test_bad_configs_are_refused(tmp_path, config: str, message: str) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent(f"""\
        tools:
          - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
            config: {config}
        """))
    with pytest.raises(ValueError, match=message):
        load_tools(str(path))
