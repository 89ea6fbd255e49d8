"""`RewardModelWorker`: a learned reward model that scores each (prompt, response) with one number.

The model is a sequence- or token-classification checkpoint with one label; its output at a sequence's last
token is the score, placed on the last response token as `rm_scores` (bs, response_len). When the reward
model's tokenizer or chat template differ from the policy's, each response is decoded with the policy's
tokenizer and the conversation (`raw_prompt` + the response) is re-templated and re-tokenized for the reward
model, as verl does.

Under verl's reward loop (`reward_model.use_reward_loop=True`) the same worker serves the model as
`reward_model.rollout` says: every conversation re-templated, replicas of `tensor_model_parallel_size` ranks,
micro-batches of `max_num_batched_tokens` tokens, the `dtype` forward, and the weights on the host between scorings
(`free_cache_engine`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridflow.engines.rollout.memory_budget import MemoryBudget, module_bytes, rank_device_bytes
from hybridflow.engines.training import build_fsdp_engine
from hybridflow.models import load_tokenizer, resolve_model_path
from hybridflow.models.value_head import compute_token_level_scores
from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, Worker, make_nd_compute_dataproto_dispatch_fn, register
from hybridflow.workers.config import WorkerRuntimeConfig
from hybridflow.workers.reward_config import RewardModelWorkerConfig
from hybridflow.workers.process import prepare_worker_process

__all__ = [
    "RewardModelWorker", "check_serving_memory", "encode_chat", "same_tokenization", "template_for_reward_model",
]


def same_tokenization(a: Any, b: Any) -> bool:
    """Whether two tokenizers turn a conversation into the same ids (same vocabulary and chat template)."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def encode_chat(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of a whole conversation in `tokenizer`'s chat template."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_for_reward_model(
    raw_prompts: np.ndarray,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    input_tokenizer: Any,
    rm_tokenizer: Any,
    max_length: int | None,
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `position_ids` of each conversation in the RM's own template.

    raw_prompts: (bs,) chat message lists; responses / response_mask: (bs, response_len) policy ids and 0/1 mask.
    Sequences longer than `max_length` lose their start (the score is read at the end): `truncated` (bs,) float
    marks them, for the step's `reward_model/truncated_ratio`.
    """
    rows: list[list[int]] = []
    truncated: list[float] = []
    for messages, ids, mask in zip(raw_prompts, responses, response_mask):
        text = input_tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        chat = [*list(messages), {"role": "assistant", "content": text}]
        row = encode_chat(rm_tokenizer, chat)
        truncated.append(float(bool(max_length) and len(row) > max_length))
        rows.append(row[-max_length:] if max_length else row)
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), rm_tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, : len(row)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "truncated": torch.tensor(truncated)}


REWARD_MESH = "reward"
"""Dispatch mesh of the reward model's scoring: one data shard per data-parallel group."""


class RewardModelWorker(Worker):
    """Scores responses with the reward model; one instance per rank, sharded with FSDP2 over the group."""

    def __init__(self, config: RewardModelWorkerConfig, runtime: WorkerRuntimeConfig) -> None:
        super().__init__()
        self.config, self.runtime = config, runtime
        self.input_tokenizer: Any = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the reward model and tokenizers (collective when sharded); fails on a checkpoint without a head."""
        config, runtime = self.config, self.runtime
        model_path, self.tokenizer = prepare_worker_process(self, runtime, config.model)
        if config.model.input_tokenizer is not None:
            source = load_tokenizer(resolve_model_path(config.model.input_tokenizer))
            # verl's reward loop re-templates every conversation, even for a reward model of the policy's tokenizer
            if config.serves_in_reward_loop or not same_tokenization(source, self.tokenizer):
                self.input_tokenizer = source
        self.engine = build_fsdp_engine(model_path, config.engine_config(), model_kind="reward", tokenizer=self.tokenizer)
        if config.serves_in_reward_loop:
            check_serving_memory(self.engine.module, self.engine.device, config.rollout.gpu_memory_utilization)
            self._free_cache()
        layout = self.engine.layout  # tensor-parallel peers score the same rows
        self.register_dispatch_collect_info(
            REWARD_MESH, layout.dp_rank(self.rank), layout.dp, layout.is_collect(self.rank)
        )

    @property
    def retemplates(self) -> bool:
        """Whether responses are re-templated for the reward model's own tokenizer."""
        return self.input_tokenizer is not None

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(REWARD_MESH))
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores` (bs, response_len): each sequence's reward-model score on its last response token; and
        `rm_input_truncated` (bs,): 1.0 where the re-templated conversation lost its start to `max_length`."""
        response_mask = data.batch["response_mask"]
        if self.retemplates:
            if "raw_prompt" not in data.non_tensor_batch:
                raise KeyError("the reward model re-templates conversations and needs each row's raw_prompt")
            inputs = template_for_reward_model(
                data.non_tensor_batch["raw_prompt"], data.batch["responses"], response_mask,
                self.input_tokenizer, self.tokenizer, self.config.max_input_tokens,
            )
        else:
            inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        truncated = inputs.pop("truncated", torch.zeros(len(response_mask)))
        if self.config.offloads_between_scorings:
            self.engine.load_to_device(model=True, optimizer=False)
        scores = self.engine.compute_scores(inputs, **self._micro_batching(inputs["attention_mask"]))
        self._free_cache()
        return DataProto.from_dict({"rm_scores": compute_token_level_scores(scores, response_mask),
                                    "rm_input_truncated": truncated})

    def _micro_batching(self, attention_mask: torch.Tensor) -> dict[str, int | None]:
        """`compute_scores`' micro-batch arguments: the legacy worker's rows or token budget; the reward loop's
        token budget (stretched to hold its longest conversation, which vLLM would prefill in chunks), with at
        least one micro-batch per micro_batch_size_per_gpu rows when that is set."""
        rows = self.config.micro_batch_size_per_gpu
        if not self.config.serves_in_reward_loop:
            return {"micro_batch_size": rows or len(attention_mask), "max_token_len": self.config.forward_token_budget}
        longest = int(attention_mask.sum(-1).max()) if len(attention_mask) else 0
        return {
            "max_token_len": max(self.config.forward_token_budget, longest),
            "min_micro_batches": -(-len(attention_mask) // rows) if rows else 1,
        }

    def _free_cache(self) -> None:
        """The reward loop's free_cache_engine: the weights wait on the host between scorings (no-op on CPU)."""
        if self.config.offloads_between_scorings:
            self.engine.offload_to_cpu(model=True, optimizer=False)


def check_serving_memory(module: torch.nn.Module, device: torch.device, utilization: float) -> None:
    """ValueError naming reward_model.rollout.gpu_memory_utilization when this rank's weight shard and buffers
    (`memory_budget.module_bytes`) take more than that share of the rank's device (`rank_device_bytes`)."""
    try:
        MemoryBudget(utilization, rank_device_bytes(device), module_bytes(module))
    except ValueError as err:
        raise ValueError(f"reward model: reward_model.{err}") from err
