"""`AgentLoopManager`: runs a batch's agent loops concurrently and returns the batch rollout's layout.

    manager = AgentLoopManager(actor_rollout_group, rollout_config, tokenizer, response_length)
    output = manager.generate_sequences(prompts)   # same keys as `actor_rollout.generate_sequences`

Per call: wake the replicas' generation servers (the actor's weights are handed over first), run one loop per
row (`agent_name` field, else the configured default) with at most `agent.max_concurrent_loops` in flight,
then put the servers to sleep. Rows need their chat messages in `raw_prompt` (`data.return_raw_chat=True`).
The output holds `prompts` (left-padded to `rollout.prompt_length`, as verl's agent loop pads them), `responses`
(right-padded to `response_length`), `response_mask` (1 only on model tokens), `input_ids`, `attention_mask` (1 on
every real token, tool output included), `position_ids` (response positions continue the prompt's over every real
token), `rollout_log_probs`, and per-row `__num_turns__` and `__tool_calls__`; metrics
(`num_turns/*`, `tool_calls/*`, tool error rate and latency, server batching) go to `meta_info['metrics']`.

Over-sampling (verl's `rollout.over_sample_rate` r > 0, training batches only): once int(N * (1 - r)) of the N
loops have returned, the replicas abort what is left (`GenerationServer.abort`, called in the workers'
`CONTROL_GROUP`). A loop whose request was aborted ends; its row keeps its prompt but gets an empty response
(`response_mask` all 0: no loss), as verl pads aborted requests, and is flagged in `__aborted__` (verl's metric
`response/aborted_ratio` counts the empty responses). Its reward is the reward function's for an empty response,
and it stays in its group's advantage statistics (verl's behaviour); the step's time is no longer set by its
slowest trajectories.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import hybridflow.agents.single_turn  # noqa: F401  (registers single_turn_agent)
import hybridflow.agents.tool_agent  # noqa: F401  (registers tool_agent)
from hybridflow.agents.base import AGENT_LOOPS, AgentLoopContext, AgentLoopOutput
from hybridflow.agents.server_manager import AsyncLLMServerManager
from hybridflow.engines.rollout.base import ABORTED_ROWS_KEY, SamplingParams, completions_needed
from hybridflow.engines.rollout.output import build_output_for_prompts
from hybridflow.engines.rollout.server import build_prompt_batch
from hybridflow.protocol import DataProto
from hybridflow.single_controller import CONTROL_GROUP
from hybridflow.engines.rollout.config import RolloutConfig


class AgentLoopManager:
    """See the module docstring."""

    def __init__(
        self,
        worker_group: Any,
        rollout: RolloutConfig,
        tokenizer: Any,
        response_length: int,
        tools: dict[str, Any] | None = None,
        interactions: dict[str, Any] | None = None,
    ) -> None:
        self.worker_group = worker_group
        self.rollout = rollout
        self.tokenizer = tokenizer
        self.response_length = response_length
        default = "tool_agent" if rollout.multi_turn.enable else rollout.agent.default_agent_loop
        AGENT_LOOPS.get(default)  # an unknown name fails here, listing the known loops
        self.default_agent = default
        # A tensor-parallel replica takes requests (and aborts) on its first rank only (the others follow it).
        self.leaders = slice(None, None, rollout.tensor_model_parallel_size)
        self.abort_callers = worker_group.direct_callers("abort_generation", CONTROL_GROUP)[self.leaders]
        self.context = AgentLoopContext(
            server=AsyncLLMServerManager(worker_group.direct_callers("generate_tokens")[self.leaders]),
            tokenizer=tokenizer,
            response_length=response_length,
            multi_turn=rollout.multi_turn,
            tools=dict(tools or {}),
            interactions=dict(interactions or {}),
        )

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One trajectory per row of `prompts` (rows already repeated n times by the trainer)."""
        if "raw_prompt" not in prompts.non_tensor_batch:
            raise KeyError(
                "agent loops need each row's chat messages in non_tensor_batch['raw_prompt']: set "
                "data.return_raw_chat=True"
            )
        validate = prompts.meta_info.get("validate", False)
        base = SamplingParams.from_config(self.rollout.val_kwargs if validate else self.rollout, self.response_length)
        params = base.with_overrides(prompts.meta_info)  # e.g. ReMax's greedy baseline: do_sample=False
        wake = self.worker_group.wake_up_rollout_server()
        over_sampled = 0.0 if validate else self.rollout.over_sample_rate
        try:
            outputs = asyncio.run(self._run_all(prompts, params, completions_needed(len(prompts), over_sampled)))
        finally:
            # a tensor-parallel replica's stats are its leader's (the followers take no requests of their own)
            server_stats = self.worker_group.sleep_rollout_server()[self.leaders]
        output = build_output(outputs, self.tokenizer.pad_token_id, self.response_length, self.rollout.prompt_length)
        metrics = agent_metrics(outputs)
        metrics["timing_s/update_weights"] = float(np.mean([w["timing_s/update_weights"] for w in wake]))
        for key in ("num_batches", "mean_batch_size", "prefix_reuse"):  # prefix_reuse: continuous servers only
            values = [stats[f"rollout_server/{key}"] for stats in server_stats if f"rollout_server/{key}" in stats]
            if values:
                metrics[f"rollout_server/{key}"] = float(np.mean(values))
        output.meta_info["metrics"] = metrics
        return output

    async def _run_all(self, prompts: DataProto, params: SamplingParams, needed: int) -> list[AgentLoopOutput]:
        """Every row's loop; once `needed` of them have returned, the replicas abort the rest (over-sampling)."""
        limit = asyncio.Semaphore(self.rollout.agent.max_concurrent_loops)
        rows = prompts.non_tensor_batch
        request_ids = [uuid.uuid4().hex for _ in range(len(prompts))]
        server = self.context.server
        server.aborted.clear()

        async def run_row(index: int) -> AgentLoopOutput:
            fields = {key: values[index] for key, values in rows.items() if key != "raw_prompt"}
            name = fields.pop("agent_name", None) or self.default_agent
            loop = AGENT_LOOPS.get(str(name))(self.context)
            fields["request_id"] = request_ids[index]
            async with limit:
                try:
                    return await loop.run(list(rows["raw_prompt"][index]), params, **fields)
                except Exception as err:  # a bug in the loop or its tools: stop the step, naming the row
                    raise RuntimeError(
                        f"agent loop {name!r} raised on row {index} of the batch: {type(err).__name__}: {err}. "
                        "Model output must never raise (a malformed turn is reported to the model); fix the loop, "
                        "its tool or its interaction"
                    ) from err

        tasks = [asyncio.ensure_future(run_row(i)) for i in range(len(prompts))]
        if needed < len(tasks):
            pending, returned = set(tasks), 0
            while returned < needed:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                returned += len(done)
            await asyncio.gather(*(abort() for abort in self.abort_callers))
        try:
            outputs = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # the other rows' loops (and their tool calls) stop with the step
                task.cancel()
            raise
        for output, request_id in zip(outputs, request_ids):
            if request_id in server.aborted:
                output.aborted = True
        return outputs


def build_output(
    outputs: Sequence[AgentLoopOutput], pad_token_id: int, response_length: int, prompt_length: int = 0
) -> DataProto:
    """The trajectories in the batch rollout's layout (see the module docstring), through the one assembly
    every rollout backend uses (`build_output_for_prompts`): prompts left-padded to `prompt_length` (or the
    longest, if longer), responses right-padded to `response_length`, tool/user tokens attended but outside
    `response_mask`."""
    outputs = [_emptied(out) if out.aborted else out for out in outputs]
    prompts = build_prompt_batch([out.prompt_ids for out in outputs], pad_token_id, prompt_length)
    prompts.non_tensor_batch[ABORTED_ROWS_KEY] = np.array([out.aborted for out in outputs], dtype=bool)
    extra_fields = np.empty(len(outputs), dtype=object)  # one dict per row (np.array would make a 2-D array)
    extra_fields[:] = [dict(out.extra_fields) for out in outputs]
    prompts.non_tensor_batch["tool_extra_fields"] = extra_fields
    prompts.non_tensor_batch["__num_turns__"] = np.array([out.num_turns for out in outputs], dtype=np.int64)
    prompts.non_tensor_batch["__tool_calls__"] = np.array(
        [out.metrics.get("tool_calls", 0) for out in outputs], dtype=np.int64
    )
    responses, attention, response_mask, log_probs = _pad_responses(outputs, pad_token_id, response_length)
    return build_output_for_prompts(
        prompts, responses, response_mask, log_probs, pad_token_id, attention_response_mask=attention
    )


def _emptied(output: AgentLoopOutput) -> AgentLoopOutput:
    """An aborted trajectory as verl pads it: its prompt, no response (nothing to train on), no loop score."""
    return AgentLoopOutput(
        prompt_ids=output.prompt_ids, response_ids=[], response_mask=[], response_logprobs=[],
        num_turns=output.num_turns, metrics=output.metrics, aborted=True,
    )


def _pad_responses(
    outputs: Sequence[AgentLoopOutput], pad_token_id: int, response_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad each trajectory's response to `response_length`.

    Returns responses (bs, response_length) int64, attention (1 on every real token), response_mask (1 on
    model tokens) and log-probs (float32), all (bs, response_length).
    """
    bs = len(outputs)
    responses = torch.full((bs, response_length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((bs, response_length), dtype=torch.long)
    response_mask = torch.zeros((bs, response_length), dtype=torch.long)
    log_probs = torch.zeros((bs, response_length), dtype=torch.float32)
    for row, out in enumerate(outputs):
        length = len(out.response_ids)
        if length > response_length:
            raise ValueError(f"agent loop returned {length} response tokens > {response_length}")
        responses[row, :length] = torch.tensor(out.response_ids, dtype=torch.long)
        attention[row, :length] = 1
        response_mask[row, :length] = torch.tensor(out.response_mask, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(out.response_logprobs, dtype=torch.float32)
    return responses, attention, response_mask, log_probs


def agent_metrics(outputs: Sequence[AgentLoopOutput]) -> dict[str, float]:
    """num_turns/{mean,max,min}, tool_calls/{mean,max,used_ratio} (used_ratio: the share of trajectories that
    called a tool), tool/error_rate, tool/timeouts (calls stopped at their tool's timeout_s, summed over the
    batch), tool/latency_s, agent/truncated, and where any happened interaction/score_errors (turns whose
    interaction scorer failed) and tool/server_errors (tool calls whose service could not be reached), summed over
    the batch."""
    turns = np.array([o.num_turns for o in outputs], dtype=np.float64)
    calls = np.array([o.metrics.get("tool_calls", 0) for o in outputs], dtype=np.float64)
    errors = float(sum(o.metrics.get("tool_errors", 0) for o in outputs))
    latency = float(sum(o.metrics.get("tool_latency_s", 0.0) for o in outputs))
    metrics = {
        "num_turns/mean": float(turns.mean()),
        "num_turns/max": float(turns.max()),
        "num_turns/min": float(turns.min()),
        "tool_calls/mean": float(calls.mean()),
        "tool_calls/max": float(calls.max()),
        "tool_calls/used_ratio": float((calls > 0).mean()),
        "agent/truncated": float(np.mean([o.truncated for o in outputs])),
    }
    for key, name in (("interaction_score_errors", "interaction/score_errors"), ("tool_server_errors", "tool/server_errors")):
        counts = [o.metrics[key] for o in outputs if key in o.metrics]
        if counts:  # an interaction's scorer failed (the turn scored 0), a tool's service could not be reached
            metrics[name] = float(sum(counts))
    if calls.sum() > 0:
        metrics["tool/error_rate"] = errors / float(calls.sum())
        metrics["tool/latency_s"] = latency / float(calls.sum())
        metrics["tool/timeouts"] = float(sum(o.metrics.get("tool_timeouts", 0) for o in outputs))
    per_tool: dict[str, list[float]] = {}
    for out in outputs:
        for key, value in out.metrics.items():
            if key.startswith("tool_latency_s/"):
                per_tool.setdefault(key.split("/", 1)[1], []).append(value / out.metrics[f"tool_calls/{key.split('/', 1)[1]}"])
    for name, values in per_tool.items():
        metrics[f"tool/{name}/latency_s"] = float(np.mean(values))
    return metrics


def agent_columns(batch: DataProto) -> dict[str, list[float]]:
    """Per-sample agent figures of an agent-loop batch, validated like the score (`val-aux/<source>/<key>/...`):
    `num_turns`, `tool_calls` and `tool_used` (1.0 where the sample called a tool at least once). Empty for
    batches of other rollouts."""
    columns: dict[str, list[float]] = {}
    if "__num_turns__" in batch.non_tensor_batch:
        columns["num_turns"] = [float(v) for v in batch.non_tensor_batch["__num_turns__"]]
    if "__tool_calls__" in batch.non_tensor_batch:
        calls = [float(v) for v in batch.non_tensor_batch["__tool_calls__"]]
        columns["tool_calls"] = calls
        columns["tool_used"] = [float(c > 0) for c in calls]
    return columns
