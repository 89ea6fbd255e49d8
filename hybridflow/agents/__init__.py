"""Agents: agent loops, tool-call parsers, interactions, the agent-loop manager and the rollout server client.

- `base.py`: `AgentLoopBase`, `AgentLoopOutput`, `AgentLoopContext`, the `AGENT_LOOPS` registry
- `single_turn.py` / `tool_agent.py`: the built-in loops `single_turn_agent` and `tool_agent`
- `chat.py`: incremental chat-template encoding (token-in-token-out)
- `tool_parsers.py`: `TOOL_PARSERS` (`hermes`)
- `interactions.py`: simulated users (`answer_feedback`), `load_interactions`
- `server_manager.py`: sticky, least-loaded routing of requests to the rollout replicas
- `manager.py`: `AgentLoopManager`, which the trainer uses as its generator when `rollout.mode=async`

Register a loop of your own with `@AGENT_LOOPS.register("my_agent")` on an `AgentLoopBase` subclass and set
the rows' `agent_name` field (or `actor_rollout_ref.rollout.agent.default_agent_loop`).
"""

from hybridflow.agents.base import AGENT_LOOPS, AgentLoopBase, AgentLoopContext, AgentLoopOutput
from hybridflow.agents.manager import AgentLoopManager

__all__ = ["AGENT_LOOPS", "AgentLoopBase", "AgentLoopContext", "AgentLoopManager", "AgentLoopOutput"]
