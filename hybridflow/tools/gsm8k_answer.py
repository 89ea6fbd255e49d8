"""The `gsm8k_answer` tool: the model submits its final answer to a GSM8K problem and is told its score.

The tool verl's multi-turn GSM8K examples name (`verl.tools.gsm8k_tool.Gsm8kTool`, which hybridflow's tools loader
maps here): the same function, `calc_gsm8k_reward(answer)`, and reply (`Current parsed answer='42' reward=1.0`).
The answer is scored like a GSM8K response ending in `#### <answer>` (`rewards.score.gsm8k`, flexible extraction);
each call's step reward is 0 when the score rose and -0.05 otherwise (a resubmission that is no better), and
`calc_reward` gives the last score. Each trajectory's instance needs the problem's answer: the row's
`extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`, as verl's GSM8K preprocessing writes it.
"""

from __future__ import annotations

from typing import Any

from hybridflow.rewards.score.gsm8k import compute_score
from hybridflow.tools.base import BaseTool, ToolInstance
from hybridflow.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["NO_GAIN_PENALTY", "Gsm8kAnswerTool"]

NO_GAIN_PENALTY = -0.05
"""verl's step reward for an answer that scores no higher than the trajectory's previous one."""


class Gsm8kAnswerTool(BaseTool):
    """Scores a submitted GSM8K answer against the problem's ground truth (see the module docstring)."""

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        """`calc_gsm8k_reward(answer: string)`, verl's schema."""
        return OpenAIFunctionToolSchema.with_string_argument(
            "calc_gsm8k_reward",
            "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is "
            "incorrect or not correctly parsed)",
            "answer", "The model's answer to the GSM8K math problem, must be a digits",
        )

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A trajectory's instance; `ground_truth` (or verl's nested `create_kwargs.ground_truth`) is required."""
        ground_truth = kwargs.get("ground_truth", (kwargs.get("create_kwargs") or {}).get("ground_truth"))
        if ground_truth is None:
            raise ValueError(
                f"tool {self.name!r} needs the problem's answer: give each row "
                f"extra_info.tools_kwargs.{self.name}.create_kwargs.ground_truth (verl's GSM8K preprocessing does)"
            )
        instance_id = await super().create(instance_id, ground_truth=str(ground_truth))
        self.instance(instance_id).state["reward"] = 0.0
        return instance_id

    async def invoke(self, instance: ToolInstance, parameters: dict[str, Any],
                     **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        answer = str(parameters["answer"])
        submitted = answer if answer.startswith("#### ") else "#### " + answer
        reward = compute_score(submitted, instance.create_kwargs["ground_truth"], method="flexible")
        step_reward = 0.0 if reward > instance.state["reward"] else NO_GAIN_PENALTY
        instance.state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The score of the trajectory's last submitted answer (0.0 before any)."""
        return float(self.instance(instance_id).state["reward"])
