"""`single_turn_agent`: one model turn, the same trajectory the batch rollout produces."""

from __future__ import annotations

import dataclasses
from typing import Any

from hybridflow.agents.base import AGENT_LOOPS, AgentLoopBase, AgentLoopOutput
from hybridflow.engines.rollout.base import SamplingParams


@AGENT_LOOPS.register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """Render the prompt, generate once, return the tokens (all mask 1)."""

    async def run(self, messages: list[dict], sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = self.context.encoder(with_tools=False).encode_prompt(messages)
        params = dataclasses.replace(sampling_params, max_new_tokens=self.context.response_length)
        out = await self.context.server.generate(kwargs["request_id"], prompt_ids, params)
        result = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=[], response_mask=[], response_logprobs=[])
        result.extend(out.token_ids, generated=True, logprobs=out.log_probs)
        result.num_turns = 1
        result.truncated = out.finish_reason == "length"
        return result
