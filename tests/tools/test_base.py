"""BaseTool lifecycle: separate per-instance state, validation errors as text, metrics, the TOOLS registry."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hybridflow.tools import TOOLS, BaseTool, OpenAIFunctionToolSchema, ToolError, ToolInstance, ToolResponse
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
