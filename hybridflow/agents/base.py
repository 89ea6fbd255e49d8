"""The agent-loop interface: one trajectory per call, as token ids with a response mask.

An agent loop receives one dataset row's chat messages and the row's other fields, talks to the generation
server (through `AsyncLLMServerManager`), and returns an `AgentLoopOutput`: the prompt ids, the response ids
(model tokens and tool/user tokens interleaved), a mask saying which response tokens the model generated
(1: trained) and which it did not (0: tool output, user feedback, template glue), and the sampled log-probs.
Loops register by name in `AGENT_LOOPS`; a row picks one with its `agent_name` field.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from hybridflow.agents.chat import ChatEncoder
from hybridflow.agents.server_manager import AsyncLLMServerManager
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.utils.registry import Registry
from hybridflow.engines.rollout.config import MultiTurnConfig


@dataclass
class AgentLoopOutput:
    """One trajectory. Lists of equal length for the response: ids, mask, log-probs."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    """1 for tokens the model generated (trained), 0 for tool/user/template tokens."""
    response_logprobs: list[float]
    """Log-prob of each model token when sampled (0.0 at mask-0 positions)."""
    num_turns: int = 0
    """Messages in the trajectory after the prompt (model turns + tool/user turns)."""
    metrics: dict[str, float] = field(default_factory=dict)
    reward_score: float | None = None
    """The last score the loop computed itself (an interaction's turn score). A record only: the reward manager
    scores every trajectory, and the turn scores reach the reward function as `extra_info['turn_scores']`
    (verl's agent loop would take it as the reward instead)."""
    truncated: bool = False
    """The response hit the length budget."""
    aborted: bool = False
    """The step's over-sampling ended it (`rollout.over_sample_rate`): the manager empties its response."""
    extra_fields: dict[str, Any] = field(default_factory=dict)
    """verl's per-trajectory extras (the tool agent's `tool_rewards`, each tool call's step reward, and
    `turn_scores`, each interaction turn's score): the reward managers merge them into the reward function's
    `extra_info`, as verl's do."""

    def __post_init__(self) -> None:
        lengths = {len(self.response_ids), len(self.response_mask), len(self.response_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                f"response_ids, response_mask and response_logprobs must have one entry per token, got "
                f"{len(self.response_ids)}, {len(self.response_mask)}, {len(self.response_logprobs)}"
            )

    def extend(self, ids: list[int], generated: bool, logprobs: list[float] | None = None) -> None:
        """Append response tokens: model tokens (mask 1, with their log-probs) or other tokens (mask 0)."""
        self.response_ids.extend(ids)
        self.response_mask.extend([1 if generated else 0] * len(ids))
        self.response_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


@dataclass
class AgentLoopContext:
    """What every loop of a run shares: the server client, the tokenizer, limits, tools and interactions."""

    server: AsyncLLMServerManager
    tokenizer: Any
    response_length: int
    """Response tokens per trajectory, all turns together."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    tools: dict[str, Any] = field(default_factory=dict)
    """Tool name -> `hybridflow.tools.BaseTool`."""
    interactions: dict[str, Any] = field(default_factory=dict)
    """Interaction name -> `hybridflow.agents.interactions.BaseInteraction`."""

    _encoders: dict[bool, ChatEncoder] = field(default_factory=dict, repr=False)

    def encoder(self, with_tools: bool) -> ChatEncoder:
        """The chat encoder (with or without the tools' schemas), built once: it renders the template to set up."""
        if with_tools not in self._encoders:
            schemas = [tool.get_openai_tool_schema().to_dict() for tool in self.tools.values()] if with_tools else None
            self._encoders[with_tools] = ChatEncoder(self.tokenizer, schemas)
        return self._encoders[with_tools]


class AgentLoopBase(abc.ABC):
    """One trajectory per `run`; instances are created per trajectory and may keep state. A loop returns once a turn
    comes back with `finish_reason == 'abort'` (over-sampling ended the step: every later request of the step is
    answered at once, empty; a trajectory that sends `MAX_REQUESTS_AFTER_ABORT` more fails the step)."""

    def __init__(self, context: AgentLoopContext) -> None:
        self.context = context

    @abc.abstractmethod
    async def run(self, messages: list[dict], sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        """Run the loop on a row's chat `messages`; kwargs are the row's other fields (`extra_info`,
        `tools_kwargs`, `interaction_kwargs`, `request_id`, ...)."""


AGENT_LOOPS: Registry[type[AgentLoopBase]] = Registry("agent loop")
