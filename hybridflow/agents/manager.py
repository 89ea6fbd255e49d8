"""`AgentLoopManager`: runs a batch's agent loops concurrently and returns the batch rollout's layout.

    manager = AgentLoopManager(actor_rollout_group, rollout_config, tokenizer, response_length)
    output = manager.generate_sequences(prompts)   # same keys as `actor_rollout.generate_sequences`

Per call: wake the replicas' generation servers (the actor's weights are handed over first), run one loop per
row (`agent_name` field, else the configured default) with at most `agent.max_concurrent_loops` in flight,
then put the servers to sleep. Rows need their chat messages in `raw_prompt` (`data.return_raw_chat=True`).
The output holds `prompts` (left-padded to the longest prompt), `responses` (right-padded to
`response_length`), `response_mask` (1 only on model tokens), `input_ids`, `attention_mask` (1 on every real
token, tool output included), `position_ids`, `rollout_log_probs`, and per-row `__num_turns__`; metrics
(`num_turns/*`, `tool_calls/*`, tool error rate and latency, server batching) go to `meta_info['metrics']`.
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
from hybridflow.engines.rollout.base import SamplingParams
from hybridflow.protocol import DataProto
from hybridflow.workers.config import RolloutConfig


def sampling_params_from_config(rollout: RolloutConfig, response_length: int, validate: bool) -> SamplingParams:
    """The per-request sampling parameters of training (or validation) rollouts."""
    source = rollout.val_kwargs if validate else rollout
    greedy = not source.do_sample or source.temperature == 0
    return SamplingParams(
        temperature=1.0 if greedy else source.temperature,
        top_p=source.top_p,
        top_k=source.top_k,
        max_new_tokens=response_length,
        do_sample=not greedy,
    )


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
        self.context = AgentLoopContext(
            server=AsyncLLMServerManager(worker_group.direct_callers("generate_tokens")),
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
        params = sampling_params_from_config(self.rollout, self.response_length, prompts.meta_info.get("validate", False))
        wake = self.worker_group.wake_up_rollout_server()
        try:
            outputs = asyncio.run(self._run_all(prompts, params))
        finally:
            server_stats = self.worker_group.sleep_rollout_server()
        output = build_output(outputs, self.tokenizer.pad_token_id, self.response_length)
        metrics = agent_metrics(outputs)
        metrics["timing_s/update_weights"] = float(np.mean([w["timing_s/update_weights"] for w in wake]))
        for key in ("num_batches", "mean_batch_size", "prefix_reuse"):  # prefix_reuse: continuous servers only
            values = [stats[f"rollout_server/{key}"] for stats in server_stats if f"rollout_server/{key}" in stats]
            if values:
                metrics[f"rollout_server/{key}"] = float(np.mean(values))
        output.meta_info["metrics"] = metrics
        return output

    async def _run_all(self, prompts: DataProto, params: SamplingParams) -> list[AgentLoopOutput]:
        limit = asyncio.Semaphore(self.rollout.agent.max_concurrent_loops)
        rows = prompts.non_tensor_batch

        async def run_row(index: int) -> AgentLoopOutput:
            fields = {key: values[index] for key, values in rows.items() if key != "raw_prompt"}
            name = fields.pop("agent_name", None) or self.default_agent
            loop = AGENT_LOOPS.get(str(name))(self.context)
            fields["request_id"] = uuid.uuid4().hex
            async with limit:
                return await loop.run(list(rows["raw_prompt"][index]), params, **fields)

        return list(await asyncio.gather(*(run_row(i) for i in range(len(prompts)))))


def build_output(outputs: Sequence[AgentLoopOutput], pad_token_id: int, response_length: int) -> DataProto:
    """Pad the trajectories into the batch rollout's tensor layout (see the module docstring)."""
    bs = len(outputs)
    prompt_width = max(len(o.prompt_ids) for o in outputs)
    prompts = torch.full((bs, prompt_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((bs, prompt_width), dtype=torch.long)
    responses = torch.full((bs, response_length), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros((bs, response_length), dtype=torch.long)
    response_mask = torch.zeros((bs, response_length), dtype=torch.long)
    log_probs = torch.zeros((bs, response_length), dtype=torch.float32)
    for row, out in enumerate(outputs):
        if len(out.response_ids) > response_length:
            raise ValueError(f"agent loop returned {len(out.response_ids)} response tokens > {response_length}")
        n_prompt, n_response = len(out.prompt_ids), len(out.response_ids)
        prompts[row, prompt_width - n_prompt :] = torch.tensor(out.prompt_ids)
        prompt_mask[row, prompt_width - n_prompt :] = 1
        responses[row, :n_response] = torch.tensor(out.response_ids, dtype=torch.long)
        response_attention[row, :n_response] = 1
        response_mask[row, :n_response] = torch.tensor(out.response_mask, dtype=torch.long)
        log_probs[row, :n_response] = torch.tensor(out.response_logprobs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs * response_mask,
    }
    num_turns = np.array([o.num_turns for o in outputs], dtype=np.int64)
    return DataProto.from_dict(tensors=tensors, non_tensors={"__num_turns__": num_turns})


def agent_metrics(outputs: Sequence[AgentLoopOutput]) -> dict[str, float]:
    """num_turns/{mean,max,min}, tool_calls/{mean,max}, tool/error_rate, tool/latency_s, agent/truncated."""
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
        "agent/truncated": float(np.mean([o.truncated for o in outputs])),
    }
    if calls.sum() > 0:
        metrics["tool/error_rate"] = errors / float(calls.sum())
        metrics["tool/latency_s"] = latency / float(calls.sum())
    per_tool: dict[str, list[float]] = {}
    for out in outputs:
        for key, value in out.metrics.items():
            if key.startswith("tool_latency_s/"):
                per_tool.setdefault(key.split("/", 1)[1], []).append(value / out.metrics[f"tool_calls/{key.split('/', 1)[1]}"])
    for name, values in per_tool.items():
        metrics[f"tool/{name}/latency_s"] = float(np.mean(values))
    return metrics
