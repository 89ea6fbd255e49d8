"""The FSDP2 training engine: sharding, micro-batched forward/backward, log-probs/values, state dicts.

`FSDPEngine` wraps one HF model (a causal LM for actor/reference, a token classifier for critic/reward):

    engine = build_fsdp_engine(model_path, FSDPEngineConfig(...), model_kind="causal_lm")
    metrics = engine.train_batch(batch, loss_fn, temperature=1.0)   # one optimizer step
    engine.lr_scheduler_step()                                       # once per training step
    log_probs, entropy = engine.compute_log_prob(batch, temperature=1.0, calculate_entropy=True)

Inside a process group (Ray worker after `init_process_group`, or torchrun) every decoder layer and the root
module are sharded with `fully_shard` over a 1-D mesh of all ranks; every rank must then call every method
(they are collective) with the same number of micro-batches. Without a process group the module runs
unsharded with the same API.

Batches are `DataProto`s (or dicts / TensorDicts of tensors) with `input_ids`, `attention_mask`,
`position_ids` (bs, seq) and `responses` (bs, response_len): the responses are the last `response_len`
tokens of `input_ids`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.logprob import pack_sequences, unpack_sequences
from hybridflow.engines.training import checkpoint, ulysses
from hybridflow.engines.training.chunked_projection import chunked_log_probs
from hybridflow.engines.training.config import FSDPEngineConfig
from hybridflow.engines.training.mesh import ParallelLayout, TrainingMeshes, build_training_meshes
from hybridflow.engines.training.optim import build_lr_scheduler, build_optimizer
from hybridflow.engines.training.rank0_init import Rank0Weights, materialize_from_rank0, weights_of
from hybridflow.engines.training.prefix_sharing import build_shared_prompt_layout
from hybridflow.engines.training.tensor_parallel import apply_tensor_parallel
from hybridflow.engines.training.vocab_parallel import VocabShard, token_entropy, token_log_probs
from hybridflow.env import dist_local_rank
from hybridflow.models.loader import build_causal_lm, resolve_dtype, to_torch_dtype
from hybridflow.models.lora import (
    apply_lora,
    is_lora_model,
    lora_scaling_of,
    merge_lora_named_tensors,
    save_hf_model_from_state_dict,
    save_lora_adapter,
)
from hybridflow.models.value_head import build_value_model, compute_sequence_scores
from hybridflow.models.vision import concat_multi_modal_inputs
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_torch_device
from hybridflow.utils.flops import ForwardWork
from hybridflow.utils.seqlen_balancing import num_token_budget_partitions, partition_by_tokens

logger = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "value", "reward"]
Batch = Any  # DataProto, or a Mapping / TensorDict of tensors
LossFn = Callable[[dict[str, torch.Tensor], Batch], tuple[torch.Tensor, Mapping[str, float]]]


def apply_fsdp2(module: nn.Module, config: FSDPEngineConfig, device: torch.device, mesh: Any = None) -> nn.Module:
    """Shard every decoder layer (classes in `module._no_split_modules`) and then the root over `mesh` (default:
    a 1-D mesh of all ranks), in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    param_dtype = resolve_dtype(config.fsdp.dtype, device)
    mp_policy = MixedPrecisionPolicy(
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=to_torch_dtype(config.fsdp.reduce_dtype),
    )
    # Pinned memory needs an accelerator: CPUOffloadPolicy() fails on CPU-only hosts.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if config.fsdp.param_offload else OffloadPolicy()
    kwargs = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    layer_names = set(getattr(module, "_no_split_modules", None) or ())
    layers = [sub for sub in module.modules() if type(sub).__name__ in layer_names]
    if not layers:
        logger.warning("no decoder layers (%s) found in %s; sharding the root only", layer_names, type(module).__name__)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=config.fsdp.reshard_after_forward, **kwargs)
    # The root's parameters (embeddings, final norm, head) are needed again right after forward.
    fully_shard(module, reshard_after_forward=False, **kwargs)
    return module


def build_fsdp_engine(
    model_path: str | os.PathLike,
    config: FSDPEngineConfig,
    *,
    model_kind: ModelKind = "causal_lm",
    tokenizer: Any = None,
) -> FSDPEngine:
    """Load a model (catalogue name, directory or `.gguf`) in float32 and wrap it in an engine.

    In a process group of several ranks only rank 0 reads the checkpoint; the others build the architecture on
    the meta device and receive their shards from rank 0 (`rank0_init`). Alone, the process loads it itself.
    `model_kind='value'` loads a token-level value model (`build_value_model`) for critics and reward models.
    With `config.model.use_lora` the causal LM is wrapped in LoRA adapters (`apply_lora`) before sharding.
    """
    if model_kind not in ("causal_lm", "value", "reward"):
        raise ValueError(f"model_kind={model_kind!r} is not known; use 'causal_lm', 'value' or 'reward'")
    if config.model.use_lora and model_kind != "causal_lm":
        raise ValueError("LoRA (lora_rank > 0) is supported for causal LMs only, not value models")
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        module = _build_module(model_path, config, model_kind, empty=False)
        return FSDPEngine(module, config, model_kind=_engine_kind(model_kind), tokenizer=tokenizer)
    # Rank 0 reads the weights; every rank shards an empty twin (moving a loaded module to meta would untie its
    # tied embeddings).
    loaded = _build_module(model_path, config, model_kind, empty=False) if dist.get_rank() == 0 else None
    rank0_weights = weights_of(loaded) if loaded is not None else Rank0Weights()
    del loaded
    module = _build_module(model_path, config, model_kind, empty=True)
    return FSDPEngine(
        module, config, model_kind=_engine_kind(model_kind), tokenizer=tokenizer, rank0_weights=rank0_weights
    )


def _engine_kind(model_kind: str) -> ModelKind:
    """A reward model runs as a value model."""
    return "value" if model_kind == "reward" else model_kind


def _build_module(
    model_path: str | os.PathLike, config: FSDPEngineConfig, model_kind: str, *, empty: bool
) -> nn.Module:
    """The HF module of `model_kind` (with LoRA adapters when configured): loaded, or `empty` on the meta device."""
    model = config.model
    load = dict(dtype="float32", attn_implementation=config.attn_implementation,
                trust_remote_code=model.trust_remote_code, empty=empty)
    if model_kind == "causal_lm":
        module = build_causal_lm(model_path, **load)
    else:  # a reward model is a value model that must bring its trained head
        module = build_value_model(model_path, require_trained_head=model_kind == "reward", **load)
    if model.use_lora:
        with warnings.catch_warnings():  # an adapter's weights read into meta tensors: rank 0 sends them later
            warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model.*")
            module = apply_lora(
                module, lora_rank=model.lora_rank, lora_alpha=model.lora_alpha,
                target_modules=model.lora_target_modules, adapter_path=model.lora_adapter_path,
            )
    return module


class FSDPEngine:
    """Training engine for one model; see the module docstring for the batch format and collectives."""

    def __init__(
        self,
        module: nn.Module,
        config: FSDPEngineConfig,
        *,
        model_kind: ModelKind = "causal_lm",
        tokenizer: Any = None,
        rank0_weights: Rank0Weights | None = None,
    ) -> None:
        """Wrap `module` (float32 weights, identical on every rank; or, with `rank0_weights`, on the meta device on
        every rank, filled with rank 0's weights once sharded), build AdamW and the LR scheduler."""
        self.config = config
        self.model_kind = model_kind
        self.tokenizer = tokenizer
        self.is_sharded = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.is_sharded else 0
        self.world_size = dist.get_world_size() if self.is_sharded else 1
        self.device = get_torch_device(dist_local_rank())
        self.param_dtype = resolve_dtype(config.fsdp.dtype, self.device)
        if config.attn_implementation == "flash_attention_2" and self.device.type != "cuda":
            raise ValueError(
                f"model.override_config.attn_implementation='flash_attention_2' runs on CUDA only; this rank's device "
                f"is {self.device.type}: use sdpa"
            )
        self.lora_scaling = lora_scaling_of(module) if is_lora_model(module) else None
        if config.model.enable_gradient_checkpointing:
            enable_activation_checkpointing(module)
        layout = ParallelLayout(self.world_size, config.fsdp.tensor_parallel_size, config.ulysses_sequence_parallel_size)
        if layout.group_size > 1 and not self.is_sharded:
            raise RuntimeError(
                f"tensor_parallel_size={layout.tp} / ulysses_sequence_parallel_size={layout.sp} need a process group "
                "of that many ranks; this engine runs without one"
            )
        self.layout = layout
        if rank0_weights is not None and not self.is_sharded:
            raise RuntimeError("rank0_weights needs a process group: the other ranks receive rank 0's weights")
        if not (self.is_sharded and config.fsdp.param_offload) and rank0_weights is None:
            module.to(self.device)
        self.meshes: TrainingMeshes | None = build_training_meshes(self.device, layout) if self.is_sharded else None
        self.vocab_shard: VocabShard | None = None
        if self.meshes is not None and self.meshes.tp is not None:
            apply_tensor_parallel(module, self.meshes.tp)
            vocab_per_rank = module.config.vocab_size // layout.tp
            self.vocab_shard = VocabShard(self.meshes.tp.get_group(), self.meshes.tp.get_local_rank() * vocab_per_rank)
        self.sp_group = self.meshes.sp_group if self.meshes is not None else None
        if self.sp_group is not None:
            ulysses.enable_ulysses_attention(module, config.attn_implementation)
        self.module = apply_fsdp2(module, config, self.device, self.meshes.fsdp) if self.is_sharded else module
        if rank0_weights is not None:  # offloaded parameters live on the host
            host = torch.device("cpu")
            materialize_from_rank0(self.module, rank0_weights, host if config.fsdp.param_offload else self.device)
        self.head_chunk_size = self._fused_head_chunk_size()
        # tokens, attention pairs and projected positions computed since `pop_work`, by grad mode (for MFU)
        self._work = {mode: torch.zeros(3, dtype=torch.long, device=self.device) for mode in (False, True)}
        self.optimizer = build_optimizer(self.module, config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)

    # ------------------------------------------------------------------ forward
    def forward_micro_batch(
        self, micro_batch: Batch, *, temperature: float = 1.0, calculate_entropy: bool = False
    ) -> dict[str, torch.Tensor]:
        """One forward pass (with autograd if enabled by the caller).

        Returns, for causal LMs, `log_probs` (bs, response_len) of the response tokens under
        softmax(logits / temperature) and, if asked, `entropy` (bs, response_len); for value models `values`
        (bs, response_len), the value predicted at the token before each response token (verl's convention).
        """
        tensors = {key: _get(micro_batch, key).to(self.device) for key in _INPUT_KEYS}
        response_length = _get(micro_batch, "responses").size(1)
        if isinstance(micro_batch, DataProto) and "multi_modal_inputs" in micro_batch.non_tensor_batch:
            tensors.update(self._vision_inputs(micro_batch, tensors))
        if not self.config.share_prompts:
            lengths = tensors["attention_mask"].sum(-1)
            projected = tensors["attention_mask"][:, -response_length:].sum() if self.model_kind == "causal_lm" else 0
            self._count_work(lengths.sum(), (lengths * lengths).sum(), projected)
        with self._autocast():
            if self.config.share_prompts:
                return self._forward_shared_prompts(tensors, response_length, temperature, calculate_entropy)
            if self.config.model.use_remove_padding:
                return self._forward_packed(tensors, response_length, temperature, calculate_entropy)
            return self._forward_padded(tensors, response_length, temperature, calculate_entropy)

    def _vision_inputs(self, micro_batch: DataProto, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A vision-language micro-batch's images (its rows' pixel values and grids, concatenated in row order) and
        its (bs, 4, seq) position ids as the model takes them, (4, bs, seq); the padded forward only."""
        if self.config.model.use_remove_padding or self.config.share_prompts:
            raise ValueError(
                "vision-language batches run the padded forward only: set use_remove_padding=False and "
                "use_prefix_grouper=False"
            )
        images = concat_multi_modal_inputs(list(micro_batch.non_tensor_batch["multi_modal_inputs"]))
        images = {key: value.to(self.device) for key, value in images.items()}
        return {**images, "position_ids": tensors["position_ids"].transpose(0, 1)}

    def _forward_padded(
        self, tensors: dict[str, torch.Tensor], response_length: int, temperature: float, calculate_entropy: bool
    ) -> dict[str, torch.Tensor]:
        if self.model_kind == "value":
            logits = self.module(**tensors, use_cache=False).logits
            return {"values": logits[:, -response_length - 1 : -1, 0].float()}
        # Only the positions that predict response tokens are projected to the vocabulary.
        inputs = dict(tensors, use_cache=False)
        labels = tensors["input_ids"][:, -response_length:]
        rows = labels.shape
        if self.head_chunk_size is not None:
            log_probs, entropy = self._fused_head(
                inputs, response_length + 1, lambda hidden: hidden[:, :-1].reshape(-1, hidden.size(-1)),
                labels.reshape(-1), temperature, calculate_entropy,
            )
            return _with_entropy({"log_probs": log_probs.view(rows)}, entropy, lambda e: e.view(rows))
        logits = self.module(**inputs, logits_to_keep=response_length + 1).logits
        logits = logits[:, :-1].float() / temperature
        flat = logits.reshape(-1, logits.size(-1))
        out = {"log_probs": token_log_probs(flat, labels.reshape(-1), shard=self.vocab_shard).view(rows)}
        if calculate_entropy:
            out["entropy"] = token_entropy(flat, self.vocab_shard).view(rows)
        return out

    def _forward_packed(
        self, tensors: dict[str, torch.Tensor], response_length: int, temperature: float, calculate_entropy: bool
    ) -> dict[str, torch.Tensor]:
        ids, pos, keep = pack_sequences(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"])
        window = slice(-response_length - 1, -1)  # positions that predict the response tokens
        if self.sp_group is not None:
            return self._forward_packed_ulysses(ids, pos, keep, window, temperature, calculate_entropy)
        # No attention mask and use_cache=False: transformers derives a block-diagonal mask from the position ids.
        inputs = dict(input_ids=ids, position_ids=pos, use_cache=False)
        if self.model_kind == "value":
            return {"values": unpack_sequences(self.module(**inputs).logits[0, :, 0].float(), keep)[:, window]}
        # Project to the vocabulary only the packed positions that predict response tokens (the window's).
        in_window, kept = _window_positions(keep, window)
        next_ids = ids[0, (kept + 1).clamp(max=ids.size(1) - 1)]  # wrong only past a sequence's end: never used
        if self.head_chunk_size is not None:
            log_probs, entropy = self._fused_head(
                inputs, kept, lambda hidden: hidden[0], next_ids, temperature, calculate_entropy
            )
            scatter = lambda values: _scatter_window(values, in_window, window)  # noqa: E731
            return _with_entropy({"log_probs": scatter(log_probs)}, entropy, scatter)
        logits = self.module(**inputs, logits_to_keep=kept).logits[0].float() / temperature
        out = {"log_probs": _scatter_window(token_log_probs(logits, next_ids, shard=self.vocab_shard), in_window, window)}
        if calculate_entropy:
            out["entropy"] = _scatter_window(token_entropy(logits, self.vocab_shard), in_window, window)
        return out

    def _forward_packed_ulysses(
        self, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor, window: slice, temperature: float,
        calculate_entropy: bool,
    ) -> dict[str, torch.Tensor]:
        """The packed forward with the row split over the sequence-parallel group: each rank runs its slice
        (attention all-to-alls inside), projects its own kept positions, and the per-token results are gathered."""
        group, total = self.sp_group, ids.size(1)
        ids, pos = ulysses.pad_packed_row(ids, pos, dist.get_world_size(group))
        part = ulysses.local_slice(ids.size(1), group)
        inputs = dict(input_ids=ids[:, part], position_ids=pos[:, part], use_cache=False)
        with ulysses.ulysses_context(group, pos):
            if self.model_kind == "value":
                values = ulysses.gather_sequence(self.module(**inputs).logits[0, :, 0].float(), group)[:total]
                return {"values": unpack_sequences(values, keep)[:, window]}
            in_window, kept = _window_positions(keep, window)
            mine = (kept >= part.start) & (kept < part.stop)
            local = kept[mine] - part.start
            next_ids = ids[0, (kept[mine] + 1).clamp(max=total - 1)]
            if self.head_chunk_size is not None:
                log_probs, entropy = self._fused_head(
                    inputs, local, lambda hidden: hidden[0], next_ids, temperature, calculate_entropy, shard=None
                )
                projected = log_probs  # its backward gives the head's weight a gradient, zero without positions
            else:
                projected = self.module(**inputs, logits_to_keep=local).logits[0].float() / temperature
                log_probs = token_log_probs(projected, next_ids)
                entropy = token_entropy(projected) if calculate_entropy else None
        chunk = part.stop - part.start
        # A rank without kept positions still joins the head's gradient (FSDP reduces it on every rank).
        anchor = projected.sum() * 0.0

        def gathered(per_position: torch.Tensor) -> torch.Tensor:
            row = per_position.new_zeros(chunk).index_put((local,), per_position) + anchor
            return _scatter_window(ulysses.gather_sequence(row, group)[kept], in_window, window)

        return _with_entropy({"log_probs": gathered(log_probs)}, entropy, gathered)

    def _forward_shared_prompts(
        self, tensors: dict[str, torch.Tensor], response_length: int, temperature: float, calculate_entropy: bool
    ) -> dict[str, torch.Tensor]:
        """One packed row in which rows with the same prompt share one copy of it (`prefix_sharing`); only the
        positions that predict response tokens are projected to the vocabulary."""
        layout = build_shared_prompt_layout(
            tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], response_length
        )
        valid = layout.predictors >= 0
        # attention pairs as separate sequences count them (sum of squared lengths): 2 x causal pairs - tokens
        pairs = 2 * layout.attention_mask.sum() - layout.num_tokens
        self._count_work(layout.num_tokens, pairs, valid.sum() if self.model_kind == "causal_lm" else 0)
        inputs = dict(
            input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=layout.attention_mask,
            use_cache=False,
        )
        if self.model_kind == "value":
            values = self.module(**inputs).logits[0, :, 0].float()
            return {"values": torch.where(valid, values[layout.predictors.clamp(min=0)], 0.0)}
        keep = torch.unique(layout.predictors[valid]) if valid.any() else layout.predictors.new_zeros(1)
        rows = torch.searchsorted(keep, layout.predictors.clamp(min=0))  # (bs, response_len) -> kept row
        labels = tensors["input_ids"][:, -response_length:]
        if self.head_chunk_size is not None:  # one projected row per valid response token
            log_probs, entropy = self._fused_head(
                inputs, keep, lambda hidden: hidden[0, rows[valid]], labels[valid], temperature, calculate_entropy
            )
            scatter = lambda values: values.new_zeros(valid.shape).masked_scatter(valid, values)  # noqa: E731
            return _with_entropy({"log_probs": scatter(log_probs)}, entropy, scatter)
        logits = self.module(**inputs, logits_to_keep=keep).logits[0].float() / temperature  # (kept, vocab)
        picked = token_log_probs(logits, labels, rows=rows, shard=self.vocab_shard)
        out = {"log_probs": torch.where(valid, picked, 0.0)}
        if calculate_entropy:
            out["entropy"] = torch.where(valid, token_entropy(logits, self.vocab_shard)[rows], 0.0)
        return out

    def _count_work(self, num_tokens: Any, attention_pairs: Any, num_projected: Any) -> None:
        work = self._work[torch.is_grad_enabled()]
        work += torch.stack([torch.as_tensor(n, device=work.device) for n in (num_tokens, attention_pairs, num_projected)])

    def pop_work(self) -> dict[bool, ForwardWork]:
        """What the forwards computed since the last call (by this rank, for its data; tensor/sequence-parallel peers
        each count the whole micro-batch), keyed by whether autograd was on (training forwards, which have a
        backward); the counts restart at zero. For MFU: `hybridflow.utils.flops.compute_model_flops`."""
        popped = {mode: ForwardWork(*(int(n) for n in work.tolist())) for mode, work in self._work.items()}
        for work in self._work.values():
            work.zero_()
        return popped

    def _fused_head_chunk_size(self) -> int | None:
        """Rows per chunk of the fused vocabulary projection, or None for the plain head (logged once when the
        config asks for the fused one but this model's head is not a plain linear layer)."""
        if self.model_kind != "causal_lm" or not self.config.model.use_fused_kernels:
            return None
        if not isinstance(self._head(), nn.Linear):
            logger.warning(
                "use_fused_kernels: the output head is a %s, not a Linear (e.g. LoRA on lm_head); projecting all "
                "kept positions at once instead", type(self._head()).__name__,
            )
            return None
        return self.config.model.fused_kernel_options.chunk_size

    def _head(self) -> nn.Module:
        hf_module = self.module.get_base_model() if self.lora_scaling is not None else self.module
        return hf_module.get_output_embeddings()

    def _fused_head(
        self,
        inputs: dict[str, Any],
        logits_to_keep: int | torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
        labels: torch.Tensor,
        temperature: float,
        calculate_entropy: bool,
        shard: VocabShard | None | Literal["engine"] = "engine",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model with its head projecting one position per row; instead, inside the forward (where FSDP2 has gathered
        the head's weight), the head's input, cut to rows by `select` ((bs, kept, H) -> (N, H)), goes through
        `chunked_log_probs` with `labels` (N,). Returns log-probs (N,) and entropy (N,) or None."""
        shard = self.vocab_shard if shard == "engine" else shard
        result: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

        def project(head: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            (hidden,) = args
            weight, bias = (p.to_local() if isinstance(p, DTensor) else p for p in (head.weight, head.bias))
            result["out"] = chunked_log_probs(
                select(hidden), weight, labels, bias=bias, temperature=temperature,
                chunk_size=self.head_chunk_size, shard=shard, calculate_entropy=calculate_entropy,
            )
            # The head still runs, on one position per row: DTensor's tensor-parallel head cannot take zero rows.
            return (hidden[..., :1, :],)

        # prepend: before tensor parallel's input hook, so that `hidden` is this rank's plain tensor
        handle = self._head().register_forward_pre_hook(project, prepend=True)
        try:
            self.module(**inputs, logits_to_keep=logits_to_keep)
        finally:
            handle.remove()
        return result["out"]

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2's MixedPrecisionPolicy casts sharded modules; an unsharded module needs autocast instead.
        if self.is_sharded or self.param_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.param_dtype)

    # ------------------------------------------------------------------ training
    def train_batch(
        self,
        batch: Batch | Sequence[Batch],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        scale_by_rows: bool = True,
    ) -> dict[str, float]:
        """One optimizer step on `batch`, with gradient accumulation over micro-batches.

        Args:
            batch: this rank's data, split into `micro_batch_size_per_gpu` rows, or a list of micro-batches.
            loss_fn: `loss_fn(outputs, micro_batch) -> (loss, metrics)`, where `outputs` is what
                `forward_micro_batch` returns and `micro_batch` has been moved to the engine's device.
                The loss should be a mean over the micro-batch's sequences (or
                tokens); the engine weights it by `len(micro_batch) / len(batch)`, so the accumulated gradient
                is that of the mean over the whole batch. Across ranks FSDP averages gradients.
            temperature: logits are divided by it before log-probs/entropy (as the rollout sampled them).
            calculate_entropy: also compute `outputs['entropy']`.
            scale_by_rows: weight each micro-batch loss by its share of rows (see `loss_fn`). False backpropagates
                the losses as returned: for losses already normalised by global token/sequence counts.

        Returns:
            `loss` (weighted over micro-batches), `grad_norm` (before clipping), `lr` (used by this step),
            `num_skipped_steps` (1 when the grad norm was NaN/inf and the step was skipped), and the mean over
            micro-batches of each metric returned by `loss_fn`.
        """
        micro_batches = list(batch) if isinstance(batch, (list, tuple)) else self._split(batch, None)
        micro_batches = [_to_device(micro_batch, self.device) for micro_batch in micro_batches]
        num_rows = sum(_num_rows(mb) for mb in micro_batches)
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        collected: dict[str, list[float]] = defaultdict(list)
        for micro_batch in micro_batches:
            outputs = self.forward_micro_batch(
                micro_batch, temperature=temperature, calculate_entropy=calculate_entropy
            )
            loss, metrics = loss_fn(outputs, micro_batch)
            weight = _num_rows(micro_batch) / num_rows if scale_by_rows else 1.0
            (loss * weight).backward()
            total_loss += float(loss.detach()) * weight
            for key, value in metrics.items():
                collected[key].append(float(value))
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm, stepped = self._clip_and_step()
        result = {key: sum(values) / len(values) for key, values in collected.items()}
        result.update(loss=total_loss, grad_norm=grad_norm, lr=lr, num_skipped_steps=0 if stepped else 1)
        return result

    def _clip_and_step(self) -> tuple[float, bool]:
        max_norm = self.config.optim.clip_grad if self.config.optim.clip_grad > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if not math.isfinite(norm):
            logger.warning("grad norm is %s: skipping this optimizer step", norm)
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, True

    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one training step; returns the new learning rate."""
        self.lr_scheduler.step()
        return self.optimizer.param_groups[0]["lr"]

    # ------------------------------------------------------------------ inference
    @torch.no_grad()
    def compute_log_prob(
        self,
        batch: Batch,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        disable_adapter: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens, on CPU.

        Returns `log_probs` (bs, response_len) float32 under softmax(logits / temperature), and `entropy`
        (bs, response_len) or None. Positions after the end of a response hold meaningless values: mask them.
        Micro-batches hold `micro_batch_size` rows, or about `max_token_len` tokens (`split_micro_batches`).
        `disable_adapter=True` (LoRA engines) computes them with the frozen base weights only: the reference
        policy without a second model in memory.
        """
        if self.model_kind != "causal_lm":
            raise TypeError("compute_log_prob needs a causal LM engine; this one holds a value model")
        if disable_adapter and self.lora_scaling is None:
            raise ValueError("disable_adapter=True needs a LoRA engine (lora_rank > 0)")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len)
        with self.module.disable_adapter() if disable_adapter else contextlib.nullcontext():
            outs = [
                self.forward_micro_batch(mb, temperature=temperature, calculate_entropy=calculate_entropy)
                for mb in micro_batches
            ]
        log_probs = _in_row_order(torch.cat([out["log_probs"] for out in outs]).cpu(), order)
        entropy = _in_row_order(torch.cat([out["entropy"] for out in outs]).cpu(), order) if calculate_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def compute_values(
        self, batch: Batch, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> torch.Tensor:
        """Values (bs, response_len) float32 on CPU from a value model (critic / reward model)."""
        if self.model_kind != "value":
            raise TypeError("compute_values needs a value-model engine (model_kind='value')")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len)
        return _in_row_order(torch.cat([self.forward_micro_batch(mb)["values"] for mb in micro_batches]).cpu(), order)

    @torch.no_grad()
    def compute_scores(
        self, batch: Batch, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> torch.Tensor:
        """Reward-model scores (bs,) float32 on CPU: the value head's output at each sequence's last attended
        token (a sequence classifier's pooled logit). Needs `input_ids`, `attention_mask`, `position_ids`."""
        if self.model_kind != "value":
            raise TypeError("compute_scores needs a value-model engine (model_kind='value')")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len)
        scores = []
        for micro_batch in micro_batches:
            tensors = {key: _get(micro_batch, key).to(self.device) for key in _INPUT_KEYS}
            with self._autocast():
                if self.config.model.use_remove_padding:
                    ids, pos, keep = pack_sequences(
                        tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"]
                    )
                    packed = self.module(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :, 0].float()
                    token_scores = unpack_sequences(packed, keep)
                else:
                    token_scores = self.module(**tensors, use_cache=False).logits[..., 0].float()
            scores.append(compute_sequence_scores(token_scores, tensors["attention_mask"]))
        return _in_row_order(torch.cat(scores).cpu(), order)

    def split_micro_batches(
        self, batch: Batch, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> tuple[list[Batch], list[int] | None]:
        """This rank's micro-batches and the rows they hold in order (None: rows in their original order).

        With `max_token_len` (verl's `use_dynamic_bsz`), rows are grouped by token count into the number of
        micro-batches the fullest rank needs for about `max_token_len` tokens each: every rank runs the same
        number of forwards (FSDP's collectives pair them up). Otherwise groups of `micro_batch_size` rows.
        """
        if max_token_len is None:
            return self._split(batch, micro_batch_size), None
        lengths = _get(batch, "attention_mask").sum(-1).tolist()
        count = num_token_budget_partitions(lengths, max_token_len)
        if self.is_sharded:
            counts = torch.tensor([count], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            count = int(counts.item())
        partitions = partition_by_tokens(lengths, count)
        return [_select_rows(batch, rows) for rows in partitions], [row for rows in partitions for row in rows]

    def _split(self, batch: Batch, micro_batch_size: int | None) -> list[Batch]:
        size = micro_batch_size or self.config.micro_batch_size_per_gpu
        if isinstance(batch, DataProto):
            return batch.split(size)
        num_rows = _num_rows(batch)
        return [{key: batch[key][start : start + size] for key in batch.keys()} for start in range(0, num_rows, size)]

    # ------------------------------------------------------------------ weights and state
    def named_full_params(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, full tensor)` for each parameter, gathering one DTensor at a time (collective).

        Names are the HF names (`model.layers.0.mlp.up_proj.weight`); tied weights appear once. Tensors are
        on the engine device in the master dtype (float32); do not keep references longer than needed.
        LoRA engines yield the plain HF weights with the adapters merged (`W + scaling * B @ A`).
        """
        if self.lora_scaling is None:
            yield from self._named_module_params()
        else:
            yield from merge_lora_named_tensors(self._named_module_params(), self.lora_scaling)

    def _named_module_params(
        self, keep: Callable[[str], bool] = lambda name: True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters under the module's own names (peft names for LoRA), gathered one at a time."""
        for name, param in self.module.named_parameters():
            if not keep(name):
                continue
            if isinstance(param, DTensor):
                if param.device != self.device:  # CPU-offloaded shards are gathered on the compute device
                    param = param.to(self.device)
                yield name, param.full_tensor().detach()
            else:
                yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) model state dict on CPU on rank 0, `{}` elsewhere (collective)."""
        if not self.is_sharded:
            return {key: value.detach().cpu() for key, value in self.module.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.module, options=options)

    def save_hf_model(self, path: str | os.PathLike, tokenizer: Any = None) -> None:
        """Write a full HF model directory (config, safetensors, tokenizer) from rank 0 (collective).

        LoRA engines write the merged plain model (the base weights with the adapters folded in).
        """
        state_dict = self.full_state_dict()
        if self.rank == 0:
            path = Path(path)
            path.mkdir(parents=True, exist_ok=True)
            if self.lora_scaling is None:
                self.module.save_pretrained(path, state_dict=state_dict)
            else:
                save_hf_model_from_state_dict(state_dict, self.module.config, path, scaling=self.lora_scaling)
            if (tokenizer or self.tokenizer) is not None:
                (tokenizer or self.tokenizer).save_pretrained(path)
        self._barrier()

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Save this rank's model and optimizer shards, LR scheduler and RNG state (collective).

        LoRA engines also write `lora_adapter/` (peft's adapter_config.json + adapter weights) from rank 0.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        rank, world = self.rank, self.world_size
        checkpoint.save_atomic(self.module.state_dict(), checkpoint.shard_file(path, "model", rank, world))
        checkpoint.save_atomic(self.optimizer.state_dict(), checkpoint.shard_file(path, "optim", rank, world))
        extra = {
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": checkpoint.get_rng_state(),
            "layout": {"tensor_parallel_size": self.layout.tp, "ulysses_sequence_parallel_size": self.layout.sp},
        }
        checkpoint.save_atomic(extra, checkpoint.shard_file(path, "extra_state", rank, world))
        if self.rank == 0:
            self.module.config.save_pretrained(path / "huggingface")
            if self.tokenizer is not None:
                self.tokenizer.save_pretrained(path / "huggingface")
        if self.lora_scaling is not None:
            adapter = {name: t.cpu() for name, t in self._named_module_params(lambda name: ".lora_" in name)}
            if self.rank == 0:
                save_lora_adapter(self.module, adapter, path / "lora_adapter")
        self._barrier()

    def load_checkpoint(self, path: str | os.PathLike, *, load_optimizer: bool = True) -> None:
        """Restore what `save_checkpoint` wrote with the same world size; resuming is bit-exact."""
        path = Path(path)
        rank, world = self.rank, self.world_size
        extra = checkpoint.load_shard(checkpoint.shard_file(path, "extra_state", rank, world))
        saved = extra.get("layout", {"tensor_parallel_size": 1, "ulysses_sequence_parallel_size": 1})
        if saved["tensor_parallel_size"] != self.layout.tp:  # shards of another split do not fit this one's
            raise ValueError(
                f"checkpoint {path} was written with tensor_parallel_size={saved['tensor_parallel_size']}, this engine "
                f"uses {self.layout.tp}: resume with the same layout, or export it (hybridflow merge) and start from "
                "the exported model"
            )
        self.module.load_state_dict(checkpoint.load_shard(checkpoint.shard_file(path, "model", rank, world)))
        if load_optimizer:
            self.optimizer.load_state_dict(checkpoint.load_shard(checkpoint.shard_file(path, "optim", rank, world)))
        self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        checkpoint.set_rng_state(extra["rng"])
        self._barrier()

    def offload_to_cpu(self, *, model: bool = True, optimizer: bool = True) -> None:
        """Move parameters/gradients and/or optimizer state to CPU (no-op on CPU hosts)."""
        self._move(torch.device("cpu"), model=model, optimizer=optimizer)

    def load_to_device(self, *, model: bool = True, optimizer: bool = True) -> None:
        """Undo `offload_to_cpu`."""
        self._move(self.device, model=model, optimizer=optimizer)

    def _move(self, device: torch.device, *, model: bool, optimizer: bool) -> None:
        if self.device.type == "cpu":
            return
        if model and not self.config.fsdp.param_offload:
            self.module.to(device)
        if optimizer:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)

    def _barrier(self) -> None:
        if self.is_sharded:
            dist.barrier()


_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def _get(batch: Batch, key: str) -> torch.Tensor:
    if isinstance(batch, DataProto):
        return batch.batch[key]
    return batch[key]


def _to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, DataProto):  # a shallow copy: the caller's batch stays where it is
        return DataProto(
            batch=batch.batch.to(device), non_tensor_batch=batch.non_tensor_batch, meta_info=batch.meta_info
        )
    return {key: batch[key].to(device) for key in batch.keys()}


def _with_entropy(
    out: dict[str, torch.Tensor], entropy: torch.Tensor | None, shape: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`out` with `entropy`, reshaped by `shape`, when it was computed."""
    if entropy is not None:
        out["entropy"] = shape(entropy)
    return out


def _window_positions(keep: torch.Tensor, window: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (row, position) entries of a packed batch predict response tokens (`in_window`, (bs, seq) bool), and
    their indices in the packed row (ascending: the packed row's row-major order)."""
    packed_index = torch.cumsum(keep.flatten(), 0).view(keep.shape) - 1
    in_window = torch.zeros_like(keep)
    in_window[:, window] = keep[:, window]
    return in_window, packed_index[in_window]


def _scatter_window(values: torch.Tensor, in_window: torch.Tensor, window: slice) -> torch.Tensor:
    """Per-position `values` of the kept packed positions back to (bs, response_len); others are 0."""
    return values.new_zeros(in_window.shape).masked_scatter(in_window, values)[:, window]


def _select_rows(batch: Batch, rows: list[int]) -> Batch:
    if isinstance(batch, DataProto):
        return batch.select_idxs(rows)
    index = torch.tensor(rows, dtype=torch.long)
    return {key: batch[key][index] for key in batch.keys()}


def _in_row_order(values: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """`values` whose row i belongs to original row `order[i]`, put back in the original row order."""
    if order is None:
        return values
    restored = torch.empty_like(values)
    restored[torch.tensor(order, dtype=torch.long)] = values
    return restored


def _num_rows(batch: Batch) -> int:
    return _get(batch, "input_ids").size(0)


def enable_activation_checkpointing(module: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, under either name transformers has given
    the switch (`activation_checkpointing_enable` in 5.23; only `gradient_checkpointing_enable` in 5.17)."""
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
