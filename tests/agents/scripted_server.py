"""A scripted generation server and the agent-loop context around it, for the agent-loop tests."""

from __future__ import annotations

import json

from hybridflow.agents.base import AgentLoopContext
from hybridflow.agents.server_manager import AsyncLLMServerManager
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.engines.rollout.config import MultiTurnConfig
from hybridflow.engines.rollout.server import TokenOutput


PARAMS = SamplingParams(max_new_tokens=512)


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class ScriptedServer:
    """Answers each request with the next scripted text (+ eos), recording the prompts it was sent."""

    def __init__(self, tokenizer, turns: list[str], eos: bool = True) -> None:
        self.tokenizer, self.turns, self.eos = tokenizer, list(turns), eos
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def __call__(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> TokenOutput:
        self.prompts.append(list(prompt_ids))
        text = self.turns.pop(0) if self.turns else "I am done."
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = ids + [self.tokenizer.eos_token_id] if self.eos else ids
        ids = ids[: params.max_new_tokens]
        self.outputs.append(ids)
        reason = "length" if len(ids) == params.max_new_tokens else "stop"
        return TokenOutput(ids, [-0.5] * len(ids), reason)


def context(tokenizer, server, response_length=512, tools=None, interactions=None, **multi_turn) -> AgentLoopContext:
    return AgentLoopContext(
        server=AsyncLLMServerManager([server]),
        tokenizer=tokenizer,
        response_length=response_length,
        multi_turn=MultiTurnConfig(enable=True, **multi_turn),
        tools=tools or {},
        interactions=interactions or {},
    )
