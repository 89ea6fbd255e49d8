"""The `native` rollout: continuous batching over a preallocated KV cache with a compact Llama-family forward.

Same constructor and output layout as the `hf` backend (the worker builds either by name), same log-prob
definition (raw logits / temperature, before top-k/top-p). See `batcher.py` for the scheduling, `model.py`
for the forward and `kv_cache.py` for the cache layout.

With a tensor-parallel mesh of k ranks (`tp_mesh`, the worker's `rollout.tensor_model_parallel_size`) the k ranks
decode one replica together: each holds its own shard of the weights (`tensor_parallel.py`), is given the same
prompts and the same sampling seed, and returns the same output. `update_weights` keeps only this rank's shard of
each full tensor it is handed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from hybridflow.engines.rollout.base import (
    ABORTED_ROWS_KEY,
    BaseRollout,
    SamplingParams,
    completions_needed,
    place_rollout_model,
    sleep_rollout_model,
    wake_up_rollout_model,
)
from hybridflow.engines.rollout.memory_budget import rollout_memory_budget
from hybridflow.engines.rollout.native.batcher import ContinuousBatcher, RequestSource, serving_capacity_within
from hybridflow.engines.rollout.native.decode_graph import CPU_SPAN_MULTIPLE
from hybridflow.engines.rollout.native.kernels import check_kernel_mode, load_cpu_kernels
from hybridflow.engines.rollout.native.kv_cache import KVCache
from hybridflow.engines.rollout.native.model import LlamaFamilyForward
from hybridflow.engines.rollout.output import build_output_for_prompts
from hybridflow.engines.rollout.tensor_parallel import (
    RolloutTensorParallel,
    load_rollout_weights,
    place_sharded_model,
    rollout_weights_of,
)
from hybridflow.models.loader import prepare_tokenizer
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)

ACCELERATOR_DONE_CHECK_INTERVAL = 8
"""Decode steps between checks for finished sequences on an accelerator: a check waits for the device, so the
host cannot queue the next steps meanwhile; a sequence that ends costs at most 7 idle steps of its slot."""


def unpad_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each row's kept tokens and positions (`keep`: (rows, width) bool), as views of two flat tensors: one mask
    index per tensor for all rows, not one per row. -> ([(len_i,) int64], [(len_i,) int64])."""
    sizes = keep.sum(1).tolist()
    return list(input_ids[keep].split(sizes)), list(position_ids[keep].split(sizes))


def interleaved_copies(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> int:
    """k when the rows are k consecutive copies of each prompt (`DataProto.repeat(k, interleave=True)`), else 1.

    k is the run length of the first row's copies; every block of k rows must then be k equal rows (ids, mask and
    positions) and the row count a multiple of k."""
    rows = input_ids.shape[0]
    if rows < 2:
        return 1
    same_as_first = ((input_ids == input_ids[:1]) & (attention_mask == attention_mask[:1])).all(dim=1)
    same_as_first &= (position_ids == position_ids[:1]).flatten(1).all(dim=1)
    differs = (~same_as_first).nonzero()
    k = int(differs[0]) if differs.numel() else rows
    if k < 2 or rows % k:
        return 1
    for tensor in (input_ids, attention_mask, position_ids):
        blocks = tensor.reshape(rows // k, k, *tensor.shape[1:])
        if not bool((blocks == blocks[:, :1]).all()):
            return 1
    return k


class NativeRollout(BaseRollout):
    """Generation with hybridflow's own decode loop over an HF Llama/Qwen2 model in this process (whole, or this
    rank's tensor-parallel shard)."""

    supports_streaming = True

    def __init__(
        self,
        model: nn.Module | str | os.PathLike,
        tokenizer,
        sampling_params: SamplingParams,
        *,
        val_sampling_params: SamplingParams | None = None,
        max_num_seqs: int = 64,
        max_prefill_tokens: int = 4096,
        num_threads: int | None = None,
        dtype: str | torch.dtype = "float32",
        kernels: str = "auto",
        tp_mesh=None,
        memory_utilization: float | None = None,
        done_check_interval: int | None = None,
        cuda_graphs: bool = True,
        compile_decode: bool = False,
        over_sample_rate: float = 0.0,
    ) -> None:
        """
        Args:
            model: a Llama/Qwen2 causal LM (may be shared with the training engine), or a catalogue name /
                directory / `.gguf` file to load in `dtype`.
            tokenizer: gives the eos (response end) and pad ids.
            sampling_params: used for training rollouts.
            val_sampling_params: used when `prompts.meta_info['validate']` is true; default greedy.
            max_num_seqs: KV-cache slots, i.e. sequences decoded together (continuous batching refills them).
            max_prefill_tokens: padded prompt tokens per prefill forward.
            num_threads: torch intra-op threads while generating; None keeps the process setting.
            kernels: decode-step kernels on CPU: `auto` (the compiled AVX2 kernels when they build here,
                else torch ops), `cpu` (require them) or `torch` (see `native/kernels.py`).
            tp_mesh: this rank's tensor-parallel group, a 1-D `DeviceMesh` (None or size 1: no tensor
                parallelism). Every rank of it must make the same calls with the same arguments and the same
                torch RNG state. The rollout then holds its own shard of `model` (sliced from it, or read slice by
                slice from a checkpoint) and never shares the trainer's module.
            memory_utilization: share of this device's memory the weights and the KV cache may take
                (`rollout.gpu_memory_utilization`): a call then holds at most as many cache slots as fit; None: no
                limit beyond `max_num_seqs`.
            done_check_interval: decode steps between checks for finished sequences (each check waits for the
                device). None: 1 on CPU, where the check costs nothing and frees slots at once, and
                `ACCELERATOR_DONE_CHECK_INTERVAL` on accelerators. Outputs do not depend on it.
            cuda_graphs: on CUDA, replay the decode step from CUDA graphs captured per batch bucket
                (`native/decode_graph.py`; not under tensor parallelism). Other devices run the same
                static-shape step eagerly.
            compile_decode: run the decode step through `torch.compile` (inductor fuses its elementwise work:
                fewer kernels per step, and fewer nodes per captured graph). Opt-in, an A/B for a GPU run
                (`benchmarks/gpu_profile.py`, section decode); it needs the torch-ops step (`kernels="torch"` on CPU).
            over_sample_rate: training calls (not `validate`) end once int(rows * (1 - rate)) rows have ended; the
                rest keep no tokens and are flagged in `__aborted__` (verl's over-sampling, `rollout.over_sample_rate`
                with mode=sync). 0: every row runs to its end.
        """
        check_kernel_mode(kernels)
        if max_num_seqs < 1 or max_prefill_tokens < 1:
            raise ValueError(
                f"max_num_seqs and max_prefill_tokens must be >= 1, got {max_num_seqs} and {max_prefill_tokens}"
            )
        self.tp = RolloutTensorParallel.from_mesh(tp_mesh) if tp_mesh is not None and tp_mesh.size() > 1 else None
        if self.tp is None:
            self.model, self.device = place_rollout_model(model, dtype)
        else:
            self.model, self.device = place_sharded_model(model, dtype, self.tp)
        self.tokenizer = prepare_tokenizer(tokenizer)
        self.sampling_params = sampling_params
        self.val_sampling_params = val_sampling_params or sampling_params.greedy()
        self.over_sample_rate = over_sample_rate
        self.num_threads = num_threads
        cpu_kernels = load_cpu_kernels(kernels) if self.device.type == "cpu" else None
        self.forward = LlamaFamilyForward(self.model, cpu_kernels, self.tp)
        dtype = next(self.model.parameters()).dtype
        self.cache = KVCache(
            self.forward.num_layers, self.forward.num_kv_heads, self.forward.head_dim, dtype, self.device,
            latent_values=self.forward.latent_values,
        )
        default_interval = 1 if self.device.type == "cpu" else ACCELERATOR_DONE_CHECK_INTERVAL
        # Expert routing has data-dependent shapes: MoE models decode eagerly.
        graphs = cuda_graphs and self.device.type == "cuda" and self.tp is None and not self.forward.has_moe
        self.batcher = ContinuousBatcher(
            self.forward,
            self.cache,
            max_num_seqs,
            max_prefill_tokens,
            done_check_interval=done_check_interval if done_check_interval is not None else default_interval,
            graphs=graphs,
            span_multiple=None if graphs else CPU_SPAN_MULTIPLE,  # graphs: one span, the whole cache
            compiled=compile_decode,
        )
        self.memory_budget = rollout_memory_budget(self.model, self.device, memory_utilization)
        self.last_stats: dict[str, float] = {}
        """Timings of the last `generate_sequences` call (see `GenerationResult.stats`)."""

    @classmethod
    def kwargs_from_config(cls, config: Any) -> dict[str, Any]:
        """The rollout keys this engine reads as vLLM does: `enforce_eager` (True turns the CUDA-graph decode off;
        None and False leave it on), and, where set (else the engine's own defaults: 64 slots, 4096-token prefill
        chunks), `max_num_seqs` (the KV-cache slots, sequences decoded together) and `max_num_batched_tokens` (the
        tokens one prefill chunk takes)."""
        kwargs: dict[str, Any] = {"cuda_graphs": not config.enforce_eager}
        defaults = {field.name: field.default for field in dataclasses.fields(config)}
        if config.max_num_seqs != defaults["max_num_seqs"]:
            kwargs["max_num_seqs"] = config.max_num_seqs
        if config.max_num_batched_tokens != defaults["max_num_batched_tokens"]:
            kwargs["max_prefill_tokens"] = config.max_num_batched_tokens
        return kwargs

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """See `BaseRollout.generate_sequences`."""
        params = self.resolve_sampling_params(prompts.meta_info)
        # Prompts are trimmed and measured on the host and reach the device with the prefill (one transfer per
        # prefill chunk): on an accelerator each per-prompt mask index or int() of a device tensor waits for the
        # device (the H200 profile of 2026-11-28 counted about 3.5 such waits per prompt).
        prompt_ids = prompts.batch["input_ids"].cpu()
        prompt_mask = prompts.batch["attention_mask"].cpu()
        prompt_pos = prompts.batch["position_ids"].cpu()
        keep = prompt_mask.bool()
        if not keep.any(dim=1).all():
            empty = (~keep.any(dim=1)).nonzero().flatten().tolist()
            raise ValueError(f"prompt rows {empty} have no tokens (attention_mask all 0); drop them before generating")
        stop_ids = self._stop_ids(params)
        sequence_len = int(keep.sum(1).max()) + params.max_new_tokens
        # The trainer repeats each prompt n times (verl's layout): generate each distinct prompt once with n
        # samples instead, so that its prefill runs once and its samples share it (rows keep their order).
        # When the copies' samples do not fit in the slots at once, every row is prefilled on its own.
        max_seqs = self._slots_within_budget(sequence_len, params.n)
        copies = interleaved_copies(prompt_ids, prompt_mask, prompt_pos)
        if copies * params.n > self.batcher.slot_limit(max_seqs):
            copies = 1
        distinct = slice(None, None, copies)
        prompt_list, position_list = unpad_rows(prompt_ids[distinct], prompt_pos[distinct], keep[distinct])
        rate = 0.0 if prompts.meta_info.get("validate", False) else self.over_sample_rate
        with self._threads():
            result = self.batcher.generate(
                prompt_list,
                position_list,
                dataclasses.replace(params, n=copies * params.n),
                stop_ids,
                self.tokenizer.pad_token_id,
                max_seqs=max_seqs,
                finish_after=completions_needed(len(prompts) * params.n, rate) if rate > 0 else None,
            )
        self.last_stats = result.stats
        output = build_output_for_prompts(
            prompts, result.tokens, result.response_mask(), result.log_probs, self.tokenizer.pad_token_id, params.n
        )
        if result.aborted is not None:
            output.non_tensor_batch[ABORTED_ROWS_KEY] = result.aborted.numpy()
        return output

    def serve(
        self,
        source: RequestSource,
        params: SamplingParams,
        max_len: int,
        max_seqs: int | None = None,
        prefix_reuse: bool = True,
    ) -> dict[str, float]:
        """Continuous batching of streamed requests for the generation server (`ContinuousBatcher.serve`). Under
        tensor parallelism every rank of the group calls it with a source giving the same requests at the same
        steps (the server's leader and followers, `engines/rollout/server.py`)."""
        stop_ids = self._stop_ids(params)
        pad_id = self.tokenizer.pad_token_id
        budget = self._slots_within_budget(max_len, 1)
        if budget is not None:
            within = serving_capacity_within(budget, prefix_reuse)
            if within < 1:
                raise ValueError(
                    f"rollout.gpu_memory_utilization={self.memory_budget.utilization} leaves room for {budget} cache "
                    f"slot(s) of {max_len} tokens; the generation server needs one to decode and one to park "
                    "(prefix reuse): raise gpu_memory_utilization or shorten the sequences"
                )
            max_seqs = min(max_seqs or self.batcher.max_num_seqs, within)
        with self._threads():
            return self.batcher.serve(params, stop_ids, pad_id, max_len, source, max_seqs, prefix_reuse)

    def _slots_within_budget(self, sequence_len: int, n: int) -> int | None:
        """Cache slots of `sequence_len` tokens that fit in the memory budget (None: no budget). A cache already
        longer from an earlier call counts at its length, since it only grows."""
        if self.memory_budget is None:
            return None
        per_slot = self.cache.bytes_per_token * max(sequence_len, self.cache.max_len)
        return self.memory_budget.max_sequences(per_slot, needed=n)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        """Token ids that end a response: eos, then the request's stop tokens (deduplicated)."""
        return list(dict.fromkeys([self.tokenizer.eos_token_id, *params.stop_token_ids]))

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        previous = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    # ------------------------------------------------------------------ weights and memory
    def named_weights(self, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The rollout model's parameters by HF name (those in `names` when given); under tensor parallelism the
        full tensors reassembled from the group's shards, one at a time (collective: every rank of the group must
        iterate them)."""
        return rollout_weights_of(self.model, self.tp, names)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each `(name, full tensor)` into the parameter or buffer of that HF name, in place; under tensor
        parallelism only this rank's shard of it (sliced as it arrives, so one full tensor is alive at a time)."""
        num_loaded = load_rollout_weights(self.model, named_tensors, self.tp)
        self.forward.release()  # rope tables follow `inv_freq` if it was among the tensors
        logger.debug("native rollout: updated %d tensors", num_loaded)

    def sleep(self) -> None:
        """Free the KV cache, rope tables and decode graphs; on accelerators also move the weights to CPU and empty
        the device cache (unless they are the trainer's own: see `compute_empty_cache_on_sleep`)."""
        self.cache.release()
        self.forward.release()
        self.batcher.decode.reset()
        sleep_rollout_model(self.model, self.device, self.shares_training_weights)

    def wake_up(self) -> None:
        """Reallocate the KV cache (same shape as before `sleep`) and move the weights back."""
        wake_up_rollout_model(self.model, self.device, self.shares_training_weights)
        self.cache.restore()

    def wake_up_weights(self) -> None:
        """Move the weights back and leave the KV cache freed until `wake_up` (a staged wake-up)."""
        wake_up_rollout_model(self.model, self.device, self.shares_training_weights)

