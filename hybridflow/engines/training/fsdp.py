"""The FSDP2 training engine: building and sharding, the micro-batched optimizer step, log-probs/values, state dicts.

`FSDPEngine` wraps one HF model (a causal LM for actor/reference, a token classifier for critic/reward):

    engine = build_fsdp_engine(model_path, FSDPEngineConfig(...), model_kind="causal_lm")
    metrics = engine.train_batch(batch, loss_fn, temperature=1.0)   # one optimizer step
    engine.lr_scheduler_step()                                       # once per training step
    log_probs, entropy = engine.compute_log_prob(batch, temperature=1.0, calculate_entropy=True)

Inside a process group (Ray worker after `init_process_group`, or torchrun) the ranks form the meshes of
`mesh.build_training_meshes` (data parallel x tensor parallel, or x Ulysses sequence parallel, or x expert
parallel for MoE models); `sharding.apply_fsdp2` shards every decoder layer and the root module with `fully_shard`
over the data-parallel (`fsdp`) mesh, and expert-parallel experts over their own. Every rank must then call
every method (they are collective) with the same number of micro-batches. Without a process group the module runs
unsharded with the same API, unless it sets `param_offload` on an accelerator: it then joins a one-rank group, since
offload is FSDP2's.

The forward layouts (padded, packed, shared-prompt, Ulysses) live in `layouts`, the output head in `head`, batch
handling in `batches`. Batches are `DataProto`s (a dict or TensorDict of tensors is wrapped at entry) with `input_ids`,
`attention_mask`, `position_ids` (bs, seq) and `responses` (bs, response_len): the responses are the last
`response_len` tokens of `input_ids`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.engines.training import attention_masks, ulysses
from hybridflow.engines.training.batches import INPUT_KEYS, as_data_proto, get, in_row_order, num_rows, partition_units
from hybridflow.engines.training.batches import reduce_metrics, response_width, select_rows, split, to_device
from hybridflow.engines.training.batches import token_budget_units
from hybridflow.engines.training.config import FSDPEngineConfig
from hybridflow.engines.training.engine_module import build_engine_module
from hybridflow.engines.training.engine_state import ENGINE_PARTS, load_engine_state, save_engine_state
from hybridflow.engines.training.expert_parallel import apply_expert_parallel
from hybridflow.engines.training.head import TokenStats, build_head
from hybridflow.engines.training.forward_check import check_engine_forward
from hybridflow.engines.training.layouts import ForwardModel, LayoutName, Plan, forward_layout, host_copies
from hybridflow.engines.training.layouts import plan_micro_batches, token_values, vision_inputs
from hybridflow.engines.training.mesh import ParallelLayout, TrainingMeshes, build_training_meshes
from hybridflow.engines.training.moe import add_router_loss, build_moe_routing, moe_forward
from hybridflow.engines.training.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_over_meshes
from hybridflow.engines.training.prefix_sharing import compute_prompt_groups
from hybridflow.engines.training.sharding import (
    apply_fsdp2, check_one_rank_lora, enable_activation_checkpointing, join_group_for_param_offload,
)
from hybridflow.engines.training.rank0_init import Rank0Weights, materialize_from_rank0, weights_of
from hybridflow.engines.training.tensor_parallel import apply_tensor_parallel
from hybridflow.engines.training.vocab_parallel import VocabShard
from hybridflow.env import dist_local_rank
from hybridflow.models.config import cuda_only_attn_error
from hybridflow.models.loader import resolve_dtype
from hybridflow.models.lora import expert_adapters_of, is_lora_model, lora_scaling_of
from hybridflow.models.lora import merge_lora_named_tensors
from hybridflow.models.lora import save_hf_model_from_state_dict
from hybridflow.models.value_head import compute_sequence_scores
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_torch_device
from hybridflow.utils.flops import ForwardWork
from hybridflow.utils.seqlen_balancing import num_token_budget_partitions

logger = logging.getLogger(__name__)

ModelKind = Literal["causal_lm", "value", "reward"]
LossFn = Callable[[dict[str, torch.Tensor], DataProto], tuple[torch.Tensor, Mapping[str, float | torch.Tensor]]]


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
        module = build_engine_module(model_path, config, model_kind, empty=False)
        return FSDPEngine(module, config, model_kind=_engine_kind(model_kind), tokenizer=tokenizer)
    # Rank 0 reads the weights; every rank shards an empty twin (moving a loaded module to meta would untie its
    # tied embeddings).
    loaded = build_engine_module(model_path, config, model_kind, empty=False) if dist.get_rank() == 0 else None
    rank0_weights = weights_of(loaded) if loaded is not None else Rank0Weights()
    del loaded
    module = build_engine_module(model_path, config, model_kind, empty=True)
    return FSDPEngine(
        module, config, model_kind=_engine_kind(model_kind), tokenizer=tokenizer, rank0_weights=rank0_weights
    )


def _engine_kind(model_kind: str) -> ModelKind:
    """A reward model runs as a value model."""
    return "value" if model_kind == "reward" else model_kind


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
        self.device = get_torch_device(dist_local_rank())
        join_group_for_param_offload(config, self.device)  # an unsharded module has no offload of its own
        self.is_sharded = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.is_sharded else 0
        self.world_size = dist.get_world_size() if self.is_sharded else 1
        self.param_dtype = resolve_dtype(config.fsdp.compute_dtype, self.device)
        self.weight_dtype = resolve_dtype(config.fsdp.weight_dtype, self.device)  # master weights (model_dtype)
        self.shards_on_host = self.is_sharded and config.fsdp.param_offload  # FSDP2 CPU offload: params, grads, step
        attn_error = cuda_only_attn_error(config.attn_implementation, self.device.type)
        if attn_error is not None:
            raise ValueError(f"model.{attn_error}")
        self.lora_scaling = lora_scaling_of(module) if is_lora_model(module) else None
        self.lora_experts = {} if self.lora_scaling is None else expert_adapters_of(module, self.lora_scaling)
        check_one_rank_lora(
            self.lora_scaling is not None, self.is_sharded, self.world_size, self.device, self.param_dtype
        )
        if config.model.enable_gradient_checkpointing:
            enable_activation_checkpointing(module)
        layout = ParallelLayout(
            self.world_size, config.fsdp.tensor_parallel_size, config.ulysses_sequence_parallel_size,
            config.fsdp.expert_parallel_size, config.fsdp.fsdp_size,
        )
        if (layout.group_size > 1 or layout.ep > 1) and not self.is_sharded:
            raise RuntimeError(
                f"tensor_parallel_size={layout.tp} / ulysses_sequence_parallel_size={layout.sp} / expert_parallel_size="
                f"{layout.ep} need a process group of that many ranks; this engine runs without one"
            )
        self.layout = layout
        if rank0_weights is not None and not self.is_sharded:
            raise RuntimeError("rank0_weights needs a process group: the other ranks receive rank 0's weights")
        if not self.shards_on_host and rank0_weights is None:
            module.to(self.device)
        self.meshes: TrainingMeshes | None = build_training_meshes(self.device, layout) if self.is_sharded else None
        self.vocab_shard: VocabShard | None = None
        if self.meshes is not None and self.meshes.tp is not None:
            apply_tensor_parallel(module, self.meshes.tp)
            vocab_per_rank = module.config.vocab_size // layout.tp
            self.vocab_shard = VocabShard(self.meshes.tp.get_group(), self.meshes.tp.get_local_rank() * vocab_per_rank)
        if self.meshes is not None and self.meshes.ep is not None:
            apply_expert_parallel(module, self.meshes.ep, self.meshes.ep_tp)
        self.sp_group = self.meshes.sp_group if self.meshes is not None else None
        if self.sp_group is not None:
            ulysses.enable_ulysses_attention(module, config.attn_implementation)
        self.module = (
            apply_fsdp2(module, config, self.device, self.meshes.fsdp, self.meshes.efsdp) if self.is_sharded else module
        )
        if rank0_weights is not None:  # offloaded parameters live on the host
            host = torch.device("cpu")
            materialize_from_rank0(self.module, rank0_weights, host if self.shards_on_host else self.device)
        self.head = None
        if model_kind == "causal_lm":
            self.head = build_head(
                self.module, is_lora=self.lora_scaling is not None, fused=config.model.use_fused_kernels,
                chunk_size=config.model.fused_kernel_options.chunk_size, shard=self.vocab_shard,
            )
        self.head_chunk_size = self.head.chunk_size if self.head is not None else None
        text_config = self.module.config.get_text_config()
        self.forward_model = ForwardModel(
            self.module, model_kind == "value", self.head, self.sp_group,
            attn_kernel=text_config._attn_implementation,
            prebuilt_masks=self.sp_group is None and attention_masks.takes_prebuilt_mask(text_config),
            # FSDP2 computes in its parameter dtype; an unsharded module keeps float32 weights under autocast
            mask_dtype=self.param_dtype if self.is_sharded else torch.float32,
        )
        self.moe = build_moe_routing(self.module) if model_kind == "causal_lm" else None  # None: dense
        # tokens, attention pairs and projected positions computed since `pop_work`, by grad mode (for MFU)
        self._work = {False: ForwardWork(), True: ForwardWork()}
        self.optimizer = build_optimizer(self.module, config.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, config)
        check_engine_forward(self)  # the layout and fused head against the model's own padded forward

    # ------------------------------------------------------------------ forward
    @property
    def layout_name(self) -> LayoutName:
        """The forward layout this engine's config asks for (`layouts`)."""
        if self.config.share_prompts:
            return "shared_prompts"
        return "packed" if self.config.model.use_remove_padding else "padded"

    def plan_micro_batches(
        self,
        micro_batches: Sequence[DataProto],
        *,
        layout: LayoutName | None = None,
        response_length: int | None = None,
    ) -> list[Plan]:
        """Host-built plans of `micro_batches` in this engine's layout (or `layout`): `layouts.plan_micro_batches`."""
        return plan_micro_batches(
            layout or self.layout_name, [as_data_proto(mb) for mb in micro_batches], self.device,
            projects=self.model_kind == "causal_lm", response_length=response_length,
        )

    def forward_micro_batch(
        self,
        micro_batch: DataProto,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        calculate_sum_pi_squared: bool = False,
        plan: Plan | None = None,
    ) -> dict[str, torch.Tensor]:
        """One forward pass (with autograd if enabled by the caller), in the layout of `plan` (default: planned here).

        Returns, for causal LMs, `log_probs` (bs, response_len) of the response tokens under
        softmax(logits / temperature) and, if asked, `entropy` and `sum_pi_squared` (sum_v pi_v^2 of each position,
        not differentiable) (bs, response_len); for value models `values`
        (bs, response_len), the value predicted at the token before each response token (verl's convention).
        """
        micro_batch = as_data_proto(micro_batch)
        plan = plan if plan is not None else self.plan_micro_batches([micro_batch])[0]
        tensors = {key: get(micro_batch, key).to(self.device, non_blocking=True) for key in INPUT_KEYS}
        if "multi_modal_inputs" in micro_batch.non_tensor_batch:
            if plan.layout == "shared_prompts" or self.sp_group is not None:
                raise ValueError(
                    "vision-language batches run the padded or packed forward, on whole sequences: set "
                    "use_prefix_grouper=False and ulysses_sequence_parallel_size=1"
                )
            tensors.update(vision_inputs(micro_batch.non_tensor_batch["multi_modal_inputs"], tensors, self.device))
        self._count_work(plan.work)
        with self._autocast():
            stats = TokenStats(entropy=calculate_entropy, sum_pi_squared=calculate_sum_pi_squared)
            forward = lambda: forward_layout(self.forward_model, tensors, plan, temperature, stats)
            return moe_forward(self.moe, micro_batch, tensors, plan, forward)

    def _count_work(self, work: ForwardWork) -> None:
        mode = torch.is_grad_enabled()
        done = self._work[mode]
        self._work[mode] = ForwardWork(
            done.num_tokens + work.num_tokens, done.attention_pairs + work.attention_pairs,
            done.num_projected + work.num_projected,
        )

    def pop_work(self) -> dict[bool, ForwardWork]:
        """What the forwards computed since the last call (by this rank, for its data; tensor/sequence-parallel peers
        each count the whole micro-batch), keyed by whether autograd was on (training forwards, which have a
        backward); the counts restart at zero. For MFU: `hybridflow.utils.flops.compute_model_flops`."""
        popped, self._work = self._work, {False: ForwardWork(), True: ForwardWork()}
        return popped

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2's MixedPrecisionPolicy casts sharded modules; an unsharded module needs autocast instead (unless its
        # weights are in the compute dtype already).
        if self.is_sharded or self.param_dtype in (torch.float32, self.weight_dtype):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.param_dtype)

    # ------------------------------------------------------------------ training
    def train_batch(
        self,
        batch: DataProto | Sequence[DataProto],
        loss_fn: LossFn,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        scale_by_rows: bool = True,
        summed_metrics: Collection[str] = (),
    ) -> dict[str, float]:
        """One optimizer step on `batch`, with gradient accumulation over micro-batches.

        The micro-batch loop does not wait on the device: layouts are planned on the host before it, losses and
        metrics stay device tensors and reach the host once, after the optimizer step.

        Args:
            batch: this rank's data, split into `micro_batch_size_per_gpu` rows, or a list of micro-batches.
            loss_fn: `loss_fn(outputs, micro_batch) -> (loss, metrics)`, where `outputs` is what
                `forward_micro_batch` returns and `micro_batch` has been moved to the engine's device.
                The loss should be a mean over the micro-batch's sequences (or
                tokens); the engine weights it by `len(micro_batch) / len(batch)`, so the accumulated gradient
                is that of the mean over the whole batch. Across ranks FSDP averages gradients. Metrics are
                floats or 0-dim tensors (tensors keep the loop free of host synchronisations).
            temperature: logits are divided by it before log-probs/entropy (as the rollout sampled them).
            calculate_entropy: also compute `outputs['entropy']`.
            scale_by_rows: weight each micro-batch loss by its share of rows (see `loss_fn`). False backpropagates
                the losses as returned: for losses already normalised by global token/sequence counts.
            summed_metrics: `loss_fn` metrics that are each micro-batch's share of the step's value (a loss
                normalised by global counts): summed over the micro-batches, not averaged, so the logged value does
                not depend on how the batch was cut.

        Returns:
            `loss` (weighted over micro-batches), `grad_norm` (before clipping), `lr` (used by this step),
            `num_skipped_steps` (1 when the grad norm was NaN/inf and the step was skipped), and the mean over
            micro-batches of each metric returned by `loss_fn`.
        """
        if isinstance(batch, (list, tuple)):
            micro_batches = [as_data_proto(micro_batch) for micro_batch in batch]
        else:
            micro_batches = self._split(as_data_proto(batch), None)
        plans = self.plan_micro_batches(micro_batches)
        micro_batches = [to_device(micro_batch, self.device) for micro_batch in micro_batches]
        total_rows = sum(num_rows(mb) for mb in micro_batches)
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = torch.zeros((), device=self.device)
        collected: dict[str, list[Any]] = defaultdict(list)
        for micro_batch, plan in zip(micro_batches, plans):
            with self._saved_activations():
                outputs = self.forward_micro_batch(
                    micro_batch, temperature=temperature, calculate_entropy=calculate_entropy, plan=plan
                )
                loss, metrics = add_router_loss(
                    loss_fn(outputs, micro_batch), outputs, 1 if scale_by_rows else len(plans)
                )
            weight = num_rows(micro_batch) / total_rows if scale_by_rows else 1.0
            (loss * weight).backward()
            total_loss += loss.detach() * weight
            for key, value in metrics.items():
                collected[key].append(value)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm, stepped = self._clip_and_step()
        result = reduce_metrics({**collected, "loss": [total_loss]}, summed_metrics)
        result.update(grad_norm=grad_norm, lr=lr, num_skipped_steps=0 if stepped else 1)
        return result

    def _saved_activations(self) -> contextlib.AbstractContextManager:
        """Where a training forward keeps what its backward needs: host memory with model.enable_activation_offload
        (pinned on accelerators, so the copies back can overlap), else where it was computed."""
        if not self.config.model.enable_activation_offload:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def _clip_and_step(self) -> tuple[float, bool]:
        max_norm = self.config.optim.clip_grad if self.config.optim.clip_grad > 0 else math.inf
        norm = float(clip_grad_norm_over_meshes(self.module.parameters(), max_norm))
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
        batch: DataProto,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        disable_adapter: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens, on CPU: `compute_token_stats`' `log_probs` and `entropy`
        (bs, response_len) or None."""
        stats = self.compute_token_stats(
            batch, temperature=temperature, calculate_entropy=calculate_entropy, micro_batch_size=micro_batch_size,
            max_token_len=max_token_len, disable_adapter=disable_adapter,
        )
        return stats["log_probs"], stats.get("entropy")

    @torch.no_grad()
    def compute_token_stats(
        self,
        batch: DataProto,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        calculate_sum_pi_squared: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        disable_adapter: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Per-token statistics of the response tokens, on CPU.

        Returns `log_probs` (bs, response_len) float32 under softmax(logits / temperature), and `entropy` and
        `sum_pi_squared` (bs, response_len) when asked. Positions after the end of a response hold meaningless
        values: mask them. Micro-batches hold `micro_batch_size` rows, or about `max_token_len` tokens
        (`split_micro_batches`). `disable_adapter=True` (LoRA engines) computes them with the frozen base weights
        only: the reference policy without a second model in memory.
        """
        if self.model_kind != "causal_lm":
            raise TypeError("compute_log_prob needs a causal LM engine; this one holds a value model")
        if disable_adapter and self.lora_scaling is None:
            raise ValueError("disable_adapter=True needs a LoRA engine (lora_rank > 0)")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len)
        plans = self.plan_micro_batches(micro_batches)
        with self.module.disable_adapter() if disable_adapter else contextlib.nullcontext():
            outs = [
                self.forward_micro_batch(
                    mb, temperature=temperature, calculate_entropy=calculate_entropy,
                    calculate_sum_pi_squared=calculate_sum_pi_squared, plan=plan,
                )
                for mb, plan in zip(micro_batches, plans)
            ]
        return {name: in_row_order(torch.cat([out[name] for out in outs]).cpu(), order) for name in outs[0]}

    @torch.no_grad()
    def compute_values(
        self, batch: DataProto, *, micro_batch_size: int | None = None, max_token_len: int | None = None
    ) -> torch.Tensor:
        """Values (bs, response_len) float32 on CPU from a value model (critic / reward model)."""
        if self.model_kind != "value":
            raise TypeError("compute_values needs a value-model engine (model_kind='value')")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len)
        plans = self.plan_micro_batches(micro_batches)
        values = [self.forward_micro_batch(mb, plan=plan)["values"] for mb, plan in zip(micro_batches, plans)]
        return in_row_order(torch.cat(values).cpu(), order)

    @torch.no_grad()
    def compute_scores(
        self, batch: DataProto, *, micro_batch_size: int | None = None, max_token_len: int | None = None,
        min_micro_batches: int = 1,
    ) -> torch.Tensor:
        """Reward-model scores (bs,) float32 on CPU: the value head's output at each sequence's last attended
        token (a sequence classifier's pooled logit). Needs `input_ids`, `attention_mask`, `position_ids`.
        With `max_token_len`, at least `min_micro_batches` micro-batches of about that many tokens."""
        if self.model_kind != "value":
            raise TypeError("compute_scores needs a value-model engine (model_kind='value')")
        self.module.eval()
        micro_batches, order = self.split_micro_batches(batch, micro_batch_size, max_token_len, min_micro_batches)
        layout = "packed" if self.config.model.use_remove_padding else "padded"
        plans = self.plan_micro_batches(micro_batches, layout=layout, response_length=0)
        scores = []
        for micro_batch, plan in zip(micro_batches, plans):
            tensors = {key: get(micro_batch, key).to(self.device, non_blocking=True) for key in INPUT_KEYS}
            self._count_work(plan.work)
            with self._autocast():
                token_scores = token_values(self.forward_model, tensors, plan)
            scores.append(compute_sequence_scores(token_scores, tensors["attention_mask"]))
        return in_row_order(torch.cat(scores).cpu(), order)

    def split_micro_batches(
        self, batch: DataProto, micro_batch_size: int | None = None, max_token_len: int | None = None,
        min_micro_batches: int = 1,
    ) -> tuple[list[DataProto], list[int] | None]:
        """This rank's micro-batches and the rows they hold in order (None: rows in their original order).

        With `max_token_len` (verl's `use_dynamic_bsz`), rows are grouped by token count into the number of
        micro-batches the fullest rank needs for about `max_token_len` tokens each: every rank runs the same
        number of forwards (FSDP's collectives pair them up), and at least `min_micro_batches` (at most one per
        row). Otherwise groups of `micro_batch_size` rows. Shared-prompt engines keep each prompt group in one
        micro-batch and count its prompt once.
        """
        batch = as_data_proto(batch)
        if max_token_len is None:
            return self._split(batch, micro_batch_size), None
        (mask, ids), width = host_copies([get(batch, "attention_mask"), get(batch, "input_ids")]), response_width(batch)
        groups = compute_prompt_groups(ids, mask, width) if self.config.share_prompts and width else None
        units, tokens = token_budget_units(
            mask[:, : mask.shape[1] - width].sum(-1).tolist(), mask[:, mask.shape[1] - width :].sum(-1).tolist(),
            groups, max_token_len,
        )
        count = min(max(num_token_budget_partitions(tokens, max_token_len), min_micro_batches), len(units))
        if self.is_sharded:
            counts = torch.tensor([count], device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
            count = int(counts.item())
        partitions = partition_units(units, tokens, count)
        return [select_rows(batch, rows) for rows in partitions], [row for rows in partitions for row in rows]

    def _split(self, batch: DataProto, micro_batch_size: int | None) -> list[DataProto]:
        return split(batch, micro_batch_size or self.config.micro_batch_size_per_gpu)

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
            yield from merge_lora_named_tensors(self._named_module_params(), self.lora_scaling, self.lora_experts)

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

    def save_checkpoint(self, path: str | os.PathLike, contents: Collection[str] = ENGINE_PARTS) -> None:
        """Save this rank's shards of `contents` (model, optimizer, extra: LR scheduler and RNG) and the layout,
        config and tokenizer (collective; `engine_state`). LoRA engines also write `lora_adapter/` with the model."""
        save_engine_state(self, path, contents)

    def load_checkpoint(self, path: str | os.PathLike, *, contents: Collection[str] = ENGINE_PARTS) -> None:
        """Restore the `contents` parts `save_checkpoint` wrote, with the same layout; resuming all is bit-exact."""
        load_engine_state(self, path, contents)

    @property
    def sharding_group_size(self) -> int:
        """Ranks one FSDP2 sharding group spans: fsdp_size under hybrid sharding, else the whole mesh."""
        return self.layout.sharding_group_size

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
        if optimizer and not self.shards_on_host:  # the optimizer steps on the host: its state stays beside the shards
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and key != "step":
                        state[key] = value.to(device, non_blocking=True)

    def _barrier(self) -> None:
        if self.is_sharded:
            dist.barrier()
