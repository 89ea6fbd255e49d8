"""The `gsm8k_answer` tool: verl's GSM8K tool file loads unchanged and builds it; answers are scored like a GSM8K
response, with verl's replies and step rewards; a row without the problem's answer is refused naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hybridflow.tools import TOOLS
from hybridflow.tools.gsm8k_answer import NO_GAIN_PENALTY, Gsm8kAnswerTool
from hybridflow.tools.loader import load_tools

VERL_TOOLS_FILE = """tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""


def test_verl_s_tools_file_builds_the_tool(tmp_path: Path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(VERL_TOOLS_FILE)
    tools = load_tools(path)
    assert list(tools) == ["calc_gsm8k_reward"] and isinstance(tools["calc_gsm8k_reward"], Gsm8kAnswerTool)
    assert TOOLS.get("gsm8k_answer") is Gsm8kAnswerTool
    assert Gsm8kAnswerTool().name == "calc_gsm8k_reward"  # the default schema is verl's too


def test_answers_are_scored_with_verl_s_replies_and_step_rewards():
    tool = Gsm8kAnswerTool()

    async def trajectory():
        instance = await tool.create(create_kwargs={"ground_truth": "72"})  # verl's tools_kwargs form
        calls = [await tool.execute(instance, {"answer": answer}) for answer in ("70", "72", "#### 72", "72.0")]
        return calls, await tool.calc_reward(instance)

    calls, final = asyncio.run(trajectory())
    assert [response.text for response, _, _ in calls] == [
        "Current parsed answer='70' reward=0.0", "Current parsed answer='72' reward=1.0",
        "Current parsed answer='#### 72' reward=1.0", "Current parsed answer='72.0' reward=1.0"]
    # the first wrong answer and the resubmissions do not raise the score
    assert [step for _, step, _ in calls] == [NO_GAIN_PENALTY, 0.0, NO_GAIN_PENALTY, NO_GAIN_PENALTY]
    assert final == 1.0


def test_two_trajectories_are_scored_apart():
    tool = Gsm8kAnswerTool()

    async def two():
        first, second = await tool.create(ground_truth=5), await tool.create(ground_truth="6")
        await tool.execute(first, {"answer": "5"})
        await tool.execute(second, {"answer": "5"})
        return await tool.calc_reward(first), await tool.calc_reward(second)

    assert asyncio.run(two()) == (1.0, 0.0)


def test_a_row_without_the_problem_s_answer_is_refused():
    with pytest.raises(ValueError, match=r"extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth"):
        asyncio.run(Gsm8kAnswerTool().create())
