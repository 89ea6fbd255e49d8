"""BaseTool lifecycle: separate per-instance state, validation errors as text, metrics, the TOOLS registry."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from hybridflow.tools import TOOLS, BaseTool, OpenAIFunctionToolSchema, ToolError, ToolInstance, ToolResponse
from hybridflow.tools.base import DEFAULT_TIMEOUT_S
from tests.tools.helpers import run

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo a word a number of times.",
        "parameters": {"type": "object", "required": ["word"],
                       "properties": {"word": {"type": "string"}, "times": {"type": "integer"}}},
    },
}


class CountingEchoTool(BaseTool):
    """Echoes `word`; the trajectory reward is the number of successful calls of that instance."""

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        if parameters["word"] == "boom":
            raise ToolError("the word 'boom' is not allowed")
        await asyncio.sleep(0.01)  # let the other instance's call interleave
        instance.state["ok_calls"] = instance.state.get("ok_calls", 0) + 1
        return ToolResponse(text=parameters["word"] * parameters.get("times", 1)), 0.5, {"chars": 1}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.instance(instance_id).state.get("ok_calls", 0))


def test_two_concurrent_instances_keep_separate_state():
    tool = CountingEchoTool({}, OpenAIFunctionToolSchema.from_dict(ECHO_SCHEMA))

    async def trajectory(num_calls: int) -> tuple[str, float, list[str]]:
        instance_id = await tool.create(ground_truth="x")
        texts = []
        for _ in range(num_calls):
            response, reward, metrics = await tool.execute(instance_id, {"word": "ab", "times": 2})
            assert reward == 0.5 and metrics["error"] is False and metrics["chars"] == 1
            assert metrics["latency_s"] >= 0.01
            texts.append(response.text)
        result = await tool.calc_reward(instance_id), texts
        assert tool.instance(instance_id).create_kwargs == {"ground_truth": "x"}
        await tool.release(instance_id)
        return instance_id, *result

    async def both():
        return await asyncio.gather(trajectory(3), trajectory(1))

    (id_a, reward_a, texts_a), (id_b, reward_b, texts_b) = run(both())
    assert id_a != id_b and len(id_a) == 32  # uuid4 hex
    assert (reward_a, reward_b) == (3.0, 1.0)
    assert texts_a == ["abab"] * 3 and texts_b == ["abab"]
    assert tool._instances == {}


def test_model_mistakes_come_back_as_error_text_not_exceptions():
    tool = CountingEchoTool({}, ECHO_SCHEMA)  # a dict schema is accepted too

    async def calls():
        instance_id = await tool.create("traj-1")
        results = [await tool.execute(instance_id, params) for params in
                   ({}, {"word": "a", "color": "red"}, {"word": 3, "times": "2"}, {"word": "boom"}, {"word": "hi"})]
        return results, tool.instance(instance_id)

    results, instance = run(calls())
    texts = [response.text for response, _, _ in results]
    assert texts[0] == "Error from tool 'echo': invalid arguments: missing required argument 'word'"
    assert texts[1] == ("Error from tool 'echo': invalid arguments: unknown argument 'color'; "
                        "known arguments: ['times', 'word']")
    assert texts[2] == ("Error from tool 'echo': invalid arguments: argument 'word' must be of type string, "
                        "got integer; argument 'times' must be of type integer, got string")
    assert texts[3] == "Error from tool 'echo': the word 'boom' is not allowed"
    assert texts[4] == "hi"
    assert [metrics["error"] for _, _, metrics in results] == [True, True, True, True, False]
    assert [reward for _, reward, _ in results] == [0.0, 0.0, 0.0, 0.0, 0.5]
    assert all(metrics["latency_s"] >= 0 for _, _, metrics in results)
    assert (instance.num_calls, instance.num_errors) == (5, 4)


def test_instance_misuse_is_an_error_for_the_caller():
    tool = CountingEchoTool({}, ECHO_SCHEMA)

    async def misuse():
        await tool.create("a")
        with pytest.raises(ValueError, match="already has an instance 'a'"):
            await tool.create("a")
        await tool.release("a")
        await tool.release("a")  # releasing twice is harmless
        with pytest.raises(KeyError, match="no instance 'a'; call create"):
            await tool.execute("a", {"word": "x"})

    run(misuse())


def test_registry_lists_builtins_and_needs_a_schema():
    assert {"calculator", "code_interpreter", "search"} <= set(TOOLS.names())
    assert TOOLS.get("calculator").__name__ == "CalculatorTool"
    with pytest.raises(ValueError, match="CountingEchoTool has no default tool_schema; pass one"):
        CountingEchoTool({})
    assert CountingEchoTool({}, ECHO_SCHEMA).get_openai_tool_schema().to_dict() == ECHO_SCHEMA


class StallingTool(BaseTool):
    """`word='stall'` blocks a worker thread for 30 s (off the event loop, as tools must); other words echo."""

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        if parameters["word"] == "stall":
            await asyncio.to_thread(self.unstall.wait, 30.0)
        if parameters["word"] == "own_timeout":
            raise TimeoutError("the tool's own timeout, not the call's")
        return ToolResponse(text=parameters["word"]), 0.0, {}

    def __init__(self, config: dict[str, Any], tool_schema: dict[str, Any]) -> None:
        super().__init__(config, tool_schema)
        self.unstall = threading.Event()


def test_a_call_past_its_timeout_returns_an_error_and_the_loop_keeps_running():
    tool = StallingTool({"timeout_s": 0.5}, ECHO_SCHEMA)
    assert tool.timeout_s == 0.5 and CountingEchoTool({}, ECHO_SCHEMA).timeout_s == DEFAULT_TIMEOUT_S

    async def scenario():
        instance_id = await tool.create()
        ticks, echoes = [], []

        async def other_loop():  # another trajectory's tool calls, while one call stalls
            while len(ticks) < 100:
                response, _, metrics = await tool.execute(instance_id, {"word": "hi"})
                echoes.append((response.text, metrics["timeout"]))
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        other = asyncio.create_task(other_loop())
        start = time.monotonic()
        stalled = await tool.execute(instance_id, {"word": "stall"})
        elapsed = time.monotonic() - start
        tool.unstall.set()  # release the abandoned worker thread (asyncio.run waits for it when it closes the loop)
        ticks_during = [t for t in ticks if t < start + elapsed]
        other.cancel()
        return stalled, elapsed, ticks_during, echoes

    (response, reward, metrics), elapsed, ticks_during, echoes = run(scenario())
    assert response.text == ("Error from tool 'echo': the call took longer than 0.5 s and was stopped; "
                             "try a smaller input")
    assert metrics["timeout"] is True and metrics["error"] is True and reward == 0.0
    assert 0.5 <= elapsed < 0.5 + 2.0, elapsed  # generous margin for a loaded 2-core host
    assert len(ticks_during) >= 5 and all(echo == ("hi", False) for echo in echoes)  # the others went on


def test_a_timeout_error_raised_by_the_tool_is_not_a_call_timeout():
    tool = StallingTool({"timeout_s": 5}, ECHO_SCHEMA)

    async def call():
        return await tool.execute(await tool.create(), {"word": "own_timeout"})

    response, reward, metrics = run(call())  # the tool's own error: the model is told; not our call timeout
    assert "the tool failed: TimeoutError: the tool's own timeout" in response.text
    assert (reward, metrics["error"], metrics["timeout"]) == (0.0, True, False)


class RaisingTool(BaseTool):
    async def invoke(self, instance, parameters, **kwargs):
        if parameters["word"] == "zero":
            return 1 / 0
        return 42


def test_a_tool_that_raises_tells_the_model_and_one_that_breaks_its_contract_is_named(caplog):
    """verl's loop turns a tool's exception into a reply (the model's arguments may have caused it); it used to end
    the agent loop, and with it the step. A wrong return value is the tool's bug: named, with the contract."""
    tool = RaisingTool({}, ECHO_SCHEMA)

    async def call(word):
        return await tool.execute(await tool.create(), {"word": word})

    response, _, metrics = run(call("zero"))
    assert "the tool failed: ZeroDivisionError: division by zero" in response.text and metrics["error"]
    assert "first traceback" in caplog.text
    with pytest.raises(TypeError, match=r"tool 'echo' \(RaisingTool.invoke\) must return \(ToolResponse, reward as a "
                                        r"number, metrics dict\); it returned 42"):
        run(call("other"))


@pytest.mark.parametrize("bad", [0, -1, "10", float("nan"), True])
def test_timeout_s_is_checked(bad):
    with pytest.raises(ValueError, match="config.timeout_s must be a number of seconds > 0"):
        StallingTool({"timeout_s": bad}, ECHO_SCHEMA)
