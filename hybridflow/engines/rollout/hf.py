"""The `hf` rollout: transformers' `generate` on left-padded batches with a KV cache.

Reported log-probs (`rollout_log_probs`) are computed from the model's raw logits divided by the temperature,
before top-k/top-p filtering: that is the distribution the training engine scores with
`compute_log_prob(temperature=...)`, so the two agree (to float rounding) on the same weights. The tokens
themselves are sampled from the filtered distribution, exactly as `generate` would.

Vision-language prompts (a `multi_modal_inputs` column, see `hybridflow.data.multimodal`) pass their rows'
`pixel_values` and `image_grid_thw`, concatenated in row order, to `generate`, which computes the M-RoPE
positions itself; the returned batch keeps the column and the (bs, 4, seq) position ids, continued over the
response.

With a tensor-parallel mesh of k ranks (`tp_mesh`, the worker's `rollout.tensor_model_parallel_size`) the k ranks
generate one replica together: each holds its shard of the heads, the MLP and the vocabulary (the native engine's
plan and sharded build, `engines/rollout/tensor_parallel.py`), and transformers' own forward runs on it with the
group's collectives hooked in (`install_hf_collectives`). The peers get the same prompts and the same RNG state
(the worker seeds them alike), sample the same tokens from the same gathered logits, and return the same output.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterable, Iterator

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hybridflow.engines.logprob import compute_response_mask
from hybridflow.engines.rollout.base import (
    ABORTED_ROWS_KEY,
    BaseRollout,
    SamplingParams,
    completions_needed,
    place_rollout_model,
    sleep_rollout_model,
    wake_up_rollout_model,
)
from hybridflow.engines.rollout.memory_budget import kv_bytes_per_token_of, rollout_memory_budget
from hybridflow.engines.rollout.output import build_output_for_prompts
from hybridflow.engines.rollout.tensor_parallel import (
    RolloutTensorParallel,
    install_hf_collectives,
    load_rollout_weights,
    place_sharded_model,
    rollout_weights_of,
)
from hybridflow.models.loader import prepare_tokenizer
from hybridflow.models.moe import ROUTED_EXPERTS_KEY, moe_shape_of, record_routing
from hybridflow.models.parallel_plan import kv_heads_per_rank, rollout_plan_for
from hybridflow.models.vision import multi_modal_model_inputs
from hybridflow.protocol import DataProto
from hybridflow.utils.flops import text_config

logger = logging.getLogger(__name__)


class SampledLogProbRecorder(LogitsProcessor):
    """Records log softmax(raw_logits / temperature) of each sampled token, without changing the scores.

    Must run first in the processor list (before any warper). At step k+1 the token sampled at step k is the
    last column of `input_ids`; the last step's token is read from the final sequences in `finish`.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.records: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending is not None:
            self.records.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """generated: (bs, T) the new tokens -> (bs, T) float32 log-probs."""
        num_tokens = generated.size(1)
        if len(self.records) < num_tokens and self.pending is not None:
            step = len(self.records)
            self.records.append(self.pending.gather(1, generated[:, step : step + 1]).squeeze(1))
        assert len(self.records) >= num_tokens, (len(self.records), num_tokens)
        if num_tokens == 0:
            return generated.new_zeros(generated.shape, dtype=torch.float32)
        return torch.stack(self.records[:num_tokens], dim=1)


class FinishAfter(StoppingCriteria):
    """Stops a `generate` call once `needed` of its rows have ended (an eos or stop token), for over-sampling; the
    rows still running then are `unfinished_rows`. Every rank of a tensor-parallel replica sees the same tokens and
    stops at the same step."""

    def __init__(self, prompt_len: int, eos_ids: list[int], needed: int, max_new_tokens: int) -> None:
        self.prompt_len, self.needed, self.max_new_tokens = prompt_len, needed, max_new_tokens
        self.eos = torch.tensor(eos_ids)
        self.stopped = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        ended = self._ended(input_ids[:, self.prompt_len :])
        self.stopped = int(ended.sum()) >= self.needed  # one host sync per step, as generate's own check
        return torch.full_like(ended, self.stopped)

    def unfinished_rows(self, generated: torch.Tensor) -> torch.Tensor:
        """(bs,) bool: the rows this criterion cut (none if it never stopped the call, or if the call ended at its
        length limit anyway)."""
        if not self.stopped or generated.size(1) >= self.max_new_tokens:
            return torch.zeros(len(generated), dtype=torch.bool, device=generated.device)
        return ~self._ended(generated)

    def _ended(self, generated: torch.Tensor) -> torch.Tensor:
        return torch.isin(generated, self.eos.to(generated.device)).any(dim=-1)


class HFRollout(BaseRollout):
    """Generation with transformers' `generate` on this process's HF model, or on its shard of a tensor-parallel
    replica."""

    runs_peft_modules = True  # transformers' generate runs the peft layers

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        tokenizer,
        sampling_params: SamplingParams,
        *,
        val_sampling_params: SamplingParams | None = None,
        micro_batch_size: int | None = None,
        dtype: str | torch.dtype = "float32",
        memory_utilization: float | None = None,
        tp_mesh=None,
        over_sample_rate: float = 0.0,
    ) -> None:
        """
        Args:
            model: a causal LM, or a catalogue name / directory / `.gguf` file to load in `dtype`.
            tokenizer: gives the eos (response end) and pad ids.
            sampling_params: used for training rollouts.
            val_sampling_params: used when `prompts.meta_info['validate']` is true; default greedy.
            micro_batch_size: prompts per `generate` call (after repetition by n); None: all at once.
            memory_utilization: share of this device's memory the weights and the calls' KV caches may take
                (`rollout.gpu_memory_utilization`): calls then hold at most as many rows as fit; None: no limit.
            tp_mesh: this rank's tensor-parallel group, a 1-D `DeviceMesh` (None or size 1: no tensor
                parallelism). Every rank of it must make the same calls with the same arguments and the same
                torch RNG state. The rollout then holds its own shard of `model` (sliced from it, or read slice by
                slice from a checkpoint) and never shares the trainer's module.
            over_sample_rate: each training `generate` call (not `validate`) stops once int(rows * (1 - rate)) of its
                rows have ended; the rest keep no tokens and are flagged in `__aborted__` (verl's over-sampling,
                `rollout.over_sample_rate` with mode=sync). 0: every row runs to its end.
        """
        self.tp = RolloutTensorParallel.from_mesh(tp_mesh) if tp_mesh is not None and tp_mesh.size() > 1 else None
        if self.tp is None:
            self.model, self.device = place_rollout_model(model, dtype)
        else:
            self.model, self.device = place_sharded_model(model, dtype, self.tp)
            install_hf_collectives(self.model, rollout_plan_for(self.model.config.model_type), self.tp)
        self.memory_budget = rollout_memory_budget(self.model, self.device, memory_utilization)
        weights_dtype = next(self.model.parameters()).dtype
        # KV cache of every position (under tensor parallelism this rank's share of the heads), plus the last
        # position's logits (model dtype, gathered whole) and their fp32 copy
        tp_size = self.tp.size if self.tp is not None else 1
        self._kv_bytes_per_token = kv_bytes_per_token_of(self.model.config, weights_dtype)
        if tp_size > 1:  # this rank's heads: a share, or one replicated head when the group has more ranks
            heads = kv_heads_per_rank(self.model.config, tp_size)
            self._kv_bytes_per_token = self._kv_bytes_per_token * heads // self.model.config.num_key_value_heads
        self._logits_bytes_per_row = text_config(self.model.config).vocab_size * (weights_dtype.itemsize + 4)
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.sampling_params = sampling_params
        self.val_sampling_params = val_sampling_params or sampling_params.greedy()
        self.micro_batch_size = micro_batch_size
        self.over_sample_rate = over_sample_rate
        # Router replay (R3): record each position's experts as `routed_experts` (MoE models only).
        self.record_routed_experts = False
        # Sampling is defined by SamplingParams alone, not by defaults shipped in the checkpoint.
        self.model.generation_config = GenerationConfig()

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See `BaseRollout.generate_sequences`."""
        params = self.resolve_sampling_params(prompts.meta_info)
        if params.n > 1:
            prompts = prompts.repeat(params.n, interleave=True)
        rows = self._rows_per_call(prompts.batch["input_ids"].size(1) + params.max_new_tokens, len(prompts))
        chunks = prompts.split(rows) if rows < len(prompts) else [prompts]
        rate = 0.0 if prompts.meta_info.get("validate", False) else self.over_sample_rate
        parts = [self._generate(chunk, params, rate) for chunk in chunks]
        responses, response_mask, log_probs, routed, aborted = (
            torch.cat(columns) if columns[0] is not None else None for columns in zip(*parts)
        )
        output = build_output_for_prompts(prompts, responses, response_mask, log_probs, self.tokenizer.pad_token_id)
        if routed is not None:
            output.batch[ROUTED_EXPERTS_KEY] = routed
        if aborted is not None:
            output.non_tensor_batch[ABORTED_ROWS_KEY] = aborted.cpu().numpy()
        return output

    def _rows_per_call(self, sequence_len: int, num_rows: int) -> int:
        """Rows per `generate` call: `micro_batch_size`, and no more than the memory budget holds."""
        rows = self.micro_batch_size or num_rows
        if self.memory_budget is not None:
            per_row = self._kv_bytes_per_token * sequence_len + self._logits_bytes_per_row
            rows = min(rows, self.memory_budget.max_sequences(per_row))
        return max(rows, 1)

    @torch.no_grad()
    def _generate(self, prompts: DataProto, params: SamplingParams, over_sample_rate: float = 0.0) -> tuple:
        """One `generate` call: (responses, response_mask, log_probs), each (bs, max_new_tokens), the
        `routed_experts` (bs, prompt_len + max_new_tokens, layers, k) when recording them (else None), and with
        `over_sample_rate` the (bs,) bool rows it ended with no tokens (else None)."""
        prompt_ids = prompts.batch["input_ids"].to(self.device)
        eos_ids = list(dict.fromkeys([self.tokenizer.eos_token_id, *params.stop_token_ids]))
        pad_id = self.tokenizer.pad_token_id
        recorder = SampledLogProbRecorder(params.log_prob_temperature)
        shape = moe_shape_of(self.model.config) if self.record_routed_experts else None
        finish = None
        if over_sample_rate > 0:
            needed = completions_needed(len(prompt_ids), over_sample_rate)
            finish = FinishAfter(prompt_ids.size(1), eos_ids, needed, params.max_new_tokens)
        with record_routing(self.model) if shape is not None else contextlib.nullcontext() as routing:
            sequences = self.model.generate(
                **self._model_inputs(prompts),
                generation_config=self._generation_config(params, eos_ids, pad_id),
                logits_processor=self._logits_processors(params, recorder),
                stopping_criteria=StoppingCriteriaList([finish] if finish is not None else []),
            )
        generated = sequences[:, prompt_ids.size(1) :]
        seq_len = prompt_ids.size(1) + params.max_new_tokens
        routed = routing.routed_experts(len(prompt_ids), seq_len, shape.num_experts) if shape is not None else None
        responses, mask, log_probs = self._pad_responses(generated, recorder.finish(generated), params, eos_ids, pad_id)
        aborted = None
        if finish is not None:
            aborted = finish.unfinished_rows(generated)
            responses[aborted], mask[aborted], log_probs[aborted] = pad_id, 0, 0.0
        return responses, mask, log_probs, routed, aborted

    def _model_inputs(self, prompts: DataProto) -> dict[str, torch.Tensor]:
        """ids, mask and position ids of a text batch; for images, ids, mask and the rows' multi-modal inputs (the
        model derives its M-RoPE positions from the image tokens, equal to the prompts' `position_ids[:, 1:]`)."""
        inputs = {key: prompts.batch[key] for key in ("input_ids", "attention_mask")}
        images = prompts.non_tensor_batch.get("multi_modal_inputs")
        if images is None:
            inputs["position_ids"] = prompts.batch["position_ids"]
        else:
            inputs.update(multi_modal_model_inputs(list(images), inputs["input_ids"], self.model.config.image_token_id))
        return {key: value.to(self.device) for key, value in inputs.items()}

    @staticmethod
    def _generation_config(params: SamplingParams, eos_ids: list[int], pad_id: int) -> GenerationConfig:
        # Sampling warpers are passed explicitly (after the recorder), so generate must create none itself.
        neutral_warpers = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if params.do_sample else {}
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=params.do_sample,
            num_beams=1,
            eos_token_id=eos_ids,
            pad_token_id=pad_id,
            use_cache=True,
            **neutral_warpers,
        )

    @staticmethod
    def _logits_processors(params: SamplingParams, recorder: SampledLogProbRecorder) -> LogitsProcessorList:
        processors = LogitsProcessorList([recorder])
        if params.do_sample:
            processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                processors.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=params.top_p))
        return processors

    @staticmethod
    def _pad_responses(
        generated: torch.Tensor, log_probs: torch.Tensor, params: SamplingParams, eos_ids: list[int], pad_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad `generate`'s new tokens to `max_new_tokens` and cut them after the first eos.

        generated, log_probs: (bs, num_new) -> responses, response_mask, log_probs: (bs, max_new_tokens).
        """
        bs, num_new = generated.shape
        length = params.max_new_tokens
        responses = generated.new_full((bs, length), pad_id)
        responses[:, :num_new] = generated
        padded_log_probs = log_probs.new_zeros((bs, length))
        padded_log_probs[:, :num_new] = log_probs
        produced = (torch.arange(length, device=generated.device) < num_new).long()
        response_mask = compute_response_mask(responses, eos_ids) * produced
        return responses, response_mask, padded_log_probs

    # ------------------------------------------------------------------ weights and memory
    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The rollout model's parameters by HF name (those in `names` when given); under tensor parallelism the
        full tensors reassembled from the group's shards, one at a time (collective: every rank of the group must
        iterate them)."""
        return rollout_weights_of(self.model, self.tp, names)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each `(name, tensor)` into the parameter or buffer of that HF name (casting dtype/device); under
        tensor parallelism only this rank's shard of it."""
        num_loaded = load_rollout_weights(self.model, named_tensors, self.tp)
        logger.debug("hf rollout: updated %d tensors", num_loaded)

    def sleep(self) -> None:
        """Move the weights to CPU and free the accelerator cache, unless they are the trainer's; no-op on CPU."""
        sleep_rollout_model(self.model, self.device, self.shares_training_weights)

    def wake_up(self) -> None:
        """Move the weights back to the accelerator (no-op on CPU hosts and for the trainer's own weights)."""
        wake_up_rollout_model(self.model, self.device, self.shares_training_weights)
