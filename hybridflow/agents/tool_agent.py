"""`tool_agent`: multi-turn generation with tool calls and an optional interaction (simulated user).

Each round: generate a model turn (mask 1) -> parse tool calls (hermes format by default) -> run them
concurrently -> append the tool messages (mask 0) -> generate again. Malformed calls, tool failures and calls
past the tool's `timeout_s` go back to the model as tool messages; they never end the run. Without tool calls
the interaction, if the row names one, answers (mask 0) or ends the trajectory. Limits:
`multi_turn.max_assistant_turns`, `max_user_turns`, `max_parallel_calls`, `max_tokens_per_turn`, and the
response budget over all turns (the last segment is cut and `truncated` set).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from hybridflow.agents.base import AGENT_LOOPS, AgentLoopBase, AgentLoopOutput
from hybridflow.agents.chat import ChatEncoder
from hybridflow.agents.tool_parsers import TOOL_PARSERS
from hybridflow.engines.rollout.base import ABORTED, SamplingParams
from hybridflow.tools.schemas import FunctionCall

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # the failures (by kind and class) already warned about in this process


def truncate_text(text: str, max_chars: int, side: str) -> str:
    """Cut `text` to `max_chars` characters, dropping the `side` part ('left', 'middle' or 'right')."""
    if len(text) <= max_chars:
        return text
    marker = "...(truncated)..."
    keep = max(max_chars - len(marker), 0)
    if side == "left":
        return marker + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + marker
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


@AGENT_LOOPS.register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """See the module docstring. Row fields used: `request_id`, `tools_kwargs` (tool name -> create kwargs),
    `interaction_kwargs` (with `name` choosing the interaction)."""

    async def run(self, messages: list[dict], sampling_params: SamplingParams, **kwargs: Any) -> AgentLoopOutput:
        cfg = self.context.multi_turn
        self.encoder: ChatEncoder = self.context.encoder(with_tools=bool(self.context.tools))
        self.parser = TOOL_PARSERS.get(cfg.format)()
        self.messages = list(messages)
        self.metrics: dict[str, float] = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_latency_s": 0.0}
        self.tool_rewards: list[float] = []  # each run call's step reward, in call order (verl's tool_rewards)
        self.turn_scores: list[float] = []  # each interaction turn's score (verl's turn_scores)
        self.tool_instances = await self._create_tools(kwargs.get("tools_kwargs") or {})
        interaction, interaction_id = await self._start_interaction(kwargs.get("interaction_kwargs") or {})
        prompt_ids = self.encoder.encode_prompt(self.messages)
        out = AgentLoopOutput(prompt_ids=prompt_ids, response_ids=[], response_mask=[], response_logprobs=[])
        assistant_turns = user_turns = 0
        try:
            while cfg.max_assistant_turns is None or assistant_turns < cfg.max_assistant_turns:
                budget = self.context.response_length - len(out.response_ids)
                if cfg.max_tokens_per_turn is not None:
                    budget = min(budget, cfg.max_tokens_per_turn)
                params = dataclasses.replace(sampling_params, max_new_tokens=budget)
                turn = await self.context.server.generate(kwargs["request_id"], prompt_ids + out.response_ids, params)
                if turn.finish_reason == ABORTED:  # over-sampling ended the step: the manager empties this row
                    break
                out.extend(turn.token_ids, generated=True, logprobs=turn.log_probs)
                assistant_turns += 1
                turn_text = self.context.tokenizer.decode(turn.token_ids, skip_special_tokens=False)
                # Parse with special tokens kept: some tokenizers make <tool_call> a special token.
                parsed = self.parser.parse(turn_text)
                content = parsed.content.replace(self.context.tokenizer.eos_token or "", "").strip()
                self.messages.append({"role": "assistant", "content": content})
                if len(out.response_ids) >= self.context.response_length:
                    out.truncated = True
                    break
                if (parsed.calls or parsed.errors) and self.context.tools:
                    followup = await self._run_tools(parsed.calls, parsed.errors)
                elif interaction is not None and (cfg.max_user_turns is None or user_turns < cfg.max_user_turns):
                    done, reply, score, meta = await interaction.generate_response(interaction_id, self.messages)
                    if isinstance(meta, dict) and meta.get("score_error"):
                        self.metrics["interaction_score_errors"] = self.metrics.get("interaction_score_errors", 0) + 1
                        _warn_once(f"score_error:{type(interaction).__name__}",
                                   f"{type(interaction).__name__}: {meta['score_error']}; that turn scores 0 (counted "
                                   "in interaction/score_errors; first error only)")
                    out.reward_score = score
                    self.turn_scores.append(score)
                    if done:
                        break
                    followup = [{"role": "user", "content": reply}]
                    user_turns += 1
                else:
                    break
                self.messages.extend(followup)
                if not self._append_followup(out, self.encoder.encode_followup(followup, turn_text)):
                    break
        finally:
            await self._release(interaction, interaction_id)
        out.num_turns = len(self.messages) - len(messages)  # model, tool and user messages after the prompt
        out.metrics = {**self.metrics, "assistant_turns": assistant_turns, "user_turns": user_turns}
        out.extra_fields = {"tool_rewards": list(self.tool_rewards), "turn_scores": list(self.turn_scores)}
        return out

    def _append_followup(self, out: AgentLoopOutput, ids: list[int]) -> bool:
        """Append non-model tokens; False (and truncated) if they do not leave room for another model token."""
        room = self.context.response_length - len(out.response_ids)
        if len(ids) >= room:
            out.extend(ids[:room], generated=False)
            out.truncated = True
            return False
        out.extend(ids, generated=False)
        return True

    # ------------------------------------------------------------------ tools
    async def _create_tools(self, tools_kwargs: dict[str, Any]) -> dict[str, str]:
        instances = {}
        for name, tool in self.context.tools.items():
            create_kwargs = (tools_kwargs.get(name) or {}).get("create_kwargs", {})
            instances[name] = await tool.create(**create_kwargs)
        return instances

    async def _run_tools(self, calls: list[FunctionCall], parse_errors: list[str]) -> list[dict]:
        limit = self.context.multi_turn.max_parallel_calls
        errors = [f"Error: {message}" for message in parse_errors] + [
            f"Error: at most {limit} tool calls per turn; call {call.name!r} was not run." for call in calls[limit:]
        ]
        outcomes = await asyncio.gather(*(self._call_tool(call) for call in calls[:limit]))
        results = [text for text, _ in outcomes]
        self.tool_rewards.extend(reward for _, reward in outcomes if reward is not None)
        # Malformed and over-limit calls are attempted calls that failed: counted in both.
        self.metrics["tool_calls"] += len(errors)
        self.metrics["tool_errors"] += len(errors)
        cfg = self.context.multi_turn
        return [
            {"role": "tool", "content": truncate_text(text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)}
            for text in [*results, *errors]
        ]

    async def _call_tool(self, call: FunctionCall) -> tuple[str, float | None]:
        """The tool's reply for the model and its step reward (None for a call that reached no tool)."""
        self.metrics["tool_calls"] += 1
        tool = self.context.tools.get(call.name)
        if tool is None:
            self.metrics["tool_errors"] += 1
            return f"Error: unknown tool {call.name!r}; available tools: {sorted(self.context.tools)}", None
        start = time.perf_counter()
        response, reward, tool_metrics = await tool.execute(self.tool_instances[call.name], call.arguments)
        elapsed = time.perf_counter() - start
        self.metrics["tool_latency_s"] += elapsed
        self.metrics[f"tool_latency_s/{call.name}"] = self.metrics.get(f"tool_latency_s/{call.name}", 0.0) + elapsed
        self.metrics[f"tool_calls/{call.name}"] = self.metrics.get(f"tool_calls/{call.name}", 0) + 1
        if tool_metrics.get("error"):
            self.metrics["tool_errors"] += 1
        if tool_metrics.get("status") == "server_error":  # the tool's service failed, not the model's call
            self.metrics["tool_server_errors"] = self.metrics.get("tool_server_errors", 0) + 1
            _warn_once(f"server_error:{call.name}", f"tool {call.name!r} could not reach its service: {response.text}; "
                       "the model got that as the tool's reply (counted in tool/server_errors; first error only)")
        if tool_metrics.get("timeout"):  # the tool's config.timeout_s; the model got an error message
            self.metrics["tool_timeouts"] += 1
        return response.text, float(reward)

    # ------------------------------------------------------------------ interaction and clean-up
    async def _start_interaction(self, interaction_kwargs: dict[str, Any]) -> tuple[Any, str | None]:
        name = interaction_kwargs.get("name")
        if name is None and self.context.interactions:
            raise ValueError(  # as verl's loop; the config check refuses such rows before Ray starts
                "interactions are configured (actor_rollout_ref.rollout.multi_turn.interaction_config_path) but the "
                "row's extra_info.interaction_kwargs names none ('name')"
            )
        if name is None:
            return None, None
        interaction = self.context.interactions.get(name)
        if interaction is None:
            raise ValueError(
                f"row's interaction_kwargs.name={name!r} is not configured; known: {sorted(self.context.interactions)} "
                "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)"
            )
        fields = {key: value for key, value in interaction_kwargs.items() if key != "name"}
        return interaction, await interaction.start_interaction(**fields)

    async def _release(self, interaction: Any, interaction_id: str | None) -> None:
        for name, instance_id in self.tool_instances.items():
            await self.context.tools[name].release(instance_id)
        if interaction is not None:
            await interaction.finalize_interaction(interaction_id)


def _warn_once(key: str, message: str) -> None:
    """Warn `message` the first time `key` (a kind of failure and the class it came from) is seen in this process:
    each occurrence is counted in the step's metrics, and the log keeps the first one's words."""
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)
