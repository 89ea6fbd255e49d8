"""Rollout tensor parallelism: the collectives of the forward and the sharded model a replica's ranks read.

Both engines that split a replica use it: the native engine calls the collectives from its own forward
(`native/model.py`); the hf engine runs transformers' own forward on the sharded module, into which
`install_hf_collectives` hooks the same collectives.

A rollout tensor-parallel group of k ranks decodes one replica together (Megatron's layout, the plan of
`hybridflow.models.parallel_plan`): each rank holds 1/k of the query and key/value heads (q/k/v split on the
output features), of the MLP (gate/up on the output features, down on the input features) and of the vocabulary
(embedding rows and head rows). The forward then needs three collectives per layer-free step and two per layer:
- after o_proj and after down_proj, the partial products are summed over the group (all-reduce);
- the embedding lookup: each rank looks up the ids in its vocabulary rows (zero elsewhere), summed over the group;
- the head: each rank's vocabulary slice of the logits is gathered, so that every rank samples from the same
  full logits (with the same RNG state: the worker seeds peers alike) and the peers stay in lock-step.

The model is an HF module built on the meta device whose split parameters are then allocated at their shard
shape and filled one tensor at a time (from safetensors slices, which read only this rank's block), so no rank
holds the full model.

A mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE) also splits its experts, whole, over the group: expert
parallelism over the tensor-parallel ranks (`rollout.expert_parallel_size` equal to the group's size). Each rank
holds E / k experts; every rank routes the same tokens (the router is replicated), runs its own experts on the
routes that reach them, and an all-reduce sums the partial outputs (transformers' `AllReduceEP`, which needs no
token exchange and reads no split size back to the host). Shared experts are replicated.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybridflow.engines.rollout.base import copy_named_tensors
from hybridflow.models.moe_shape import moe_shape_of
from hybridflow.models.parallel_plan import Style, check_rollout_tp_layout, kv_heads_per_rank, kv_replicas, module_style
from hybridflow.models.parallel_plan import param_shard_dim
from hybridflow.models.parallel_plan import rollout_plan_for
from hybridflow.models.reshard import named_full_from_shards, named_shards, param_blocks, shard_shape

logger = logging.getLogger(__name__)

TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
"""The setting named in layout errors."""


@dataclass(frozen=True)
class RolloutTensorParallel:
    """This rank's place in its rollout tensor-parallel group and the group's collectives."""

    mesh: object
    """The group's 1-D `DeviceMesh` (the `rollout_tp` dim of the worker's rollout mesh)."""
    rank: int
    size: int

    @classmethod
    def from_mesh(cls, mesh) -> RolloutTensorParallel:
        if mesh.ndim != 1:
            raise ValueError(f"the rollout's tensor-parallel mesh must be 1-D, got {mesh.ndim} dims")
        return cls(mesh=mesh, rank=mesh.get_local_rank(), size=mesh.size())

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    @property
    def is_leader(self) -> bool:
        """Whether this rank is the group's first, which takes a generation server's requests for the replica."""
        return self.rank == 0

    def broadcast_from_leader(self, value: object = None) -> object:
        """The leader's `value` (any picklable object) on every rank of the group; the others pass nothing."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum of each rank's `partial` (any shape), on every rank."""
        partial = partial.contiguous()
        dist.all_reduce(partial, group=self.group)
        return partial

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: weight (vocab // size, hidden) this rank's rows; ids (...) int64 -> (..., hidden).

        Exact: each id's row is non-zero on one rank only, so the sum adds zeros to it.
        """
        rows = weight.shape[0]
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        x = weight[local.clamp(0, rows - 1)].masked_fill_(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The full logits from each rank's vocabulary slice: (rows, vocab // size) -> (rows, vocab)."""
        logits = logits.contiguous()
        rows, width = logits.shape
        gathered = torch.empty((self.size * rows, width), dtype=logits.dtype, device=logits.device)
        _all_gather_single(gathered, logits, group=self.group)  # rank r's slice in rows [r * rows, ...)
        return gathered.view(self.size, rows, width).permute(1, 0, 2).reshape(rows, self.size * width)


# torch 2.13 deprecates all_gather_into_tensor for all_gather_single, which torch 2.11 (the GPU machines') lacks.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def build_sharded_causal_lm(
    source: nn.Module | str | os.PathLike, dtype: torch.dtype, tp: RolloutTensorParallel, device: torch.device
) -> nn.Module:
    """This rank's shard of a Llama-family causal LM, in eval mode on `device`.

    source: a full HF module (its tensors are sliced; the caller owns it) or a catalogue name / directory /
    `.gguf` file. Safetensors checkpoints are read one slice at a time; other formats (GGUF, .bin) are loaded
    whole first, then sliced (a transient full copy, logged).
    """
    from transformers import AutoModelForCausalLM

    from hybridflow.models.loader import load_model_config

    config = source.config if isinstance(source, nn.Module) else load_model_config(source)
    plan = rollout_plan_for(config.model_type)
    check_rollout_tp_layout(config, tp.size, TP_KEY)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    replicas = kv_replicas(config, tp.size)
    _allocate_shards(model, plan, tp.size, dtype, device, replicas)
    loaded: list[str] = []
    if isinstance(source, nn.Module):
        shards = named_shards(source.state_dict().items(), plan, tp.rank, tp.size, replicas)
    else:
        shards = _checkpoint_shards(source, dtype, plan, tp, set(model.state_dict()), replicas)
    copy_named_tensors(model, _recording(shards, loaded))
    targets = model.state_dict(keep_vars=True)
    written = {id(targets[name]) for name in loaded}
    missing = [name for name, tensor in targets.items() if id(tensor) not in written]
    if missing:
        raise ValueError(f"{source}: no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if moe_shape_of(config) is not None:
        split_experts_over_group(model, tp)
    _set_local_kv_groups(model, config, tp.size)
    return model.eval()


def _set_local_kv_groups(model: nn.Module, config, tp_size: int) -> None:
    """Each attention module's query heads per key/value head on this rank (transformers reads
    `num_key_value_groups` to repeat the keys): the model's ratio, or this rank's query heads over its one
    replicated key/value head when the group has more ranks than key/value heads."""
    groups = (config.num_attention_heads // tp_size) // kv_heads_per_rank(config, tp_size)
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = groups


def install_hf_collectives(model: nn.Module, plan: dict[str, Style], tp: RolloutTensorParallel) -> int:
    """Make transformers' forward of a sharded module (`build_sharded_causal_lm`) compute the full model's outputs:
    the vocabulary-split embedding looks its ids up across the group, each row-wise Linear's partial products are
    summed over the group (its bias, held whole by every rank, added once), and the head's vocabulary slices of
    the logits are gathered, so that every rank samples from the same full logits. Column-wise Linears need
    nothing: attention and the MLP run on this rank's heads and width. Returns the number of hooked modules."""
    hooked = 0
    for name, module in model.named_modules():
        style = module_style(name, plan) if name else None
        if style == "vocab" and isinstance(module, nn.Embedding):
            module.forward = _VocabParallelLookup(module, tp)
        elif style == "vocab" and isinstance(module, nn.Linear):
            module.register_forward_hook(_GatherVocab(tp))
        elif style == "rowwise" and isinstance(module, nn.Linear):
            module.register_forward_hook(_SumPartials(tp))
        else:
            continue
        hooked += 1
    if not hooked:
        raise ValueError(f"no module of {type(model).__name__} matches the tensor-parallel plan {sorted(plan)}")
    return hooked


class _VocabParallelLookup:
    """An embedding's forward over this rank's vocabulary rows (`RolloutTensorParallel.embed`)."""

    def __init__(self, module: nn.Embedding, tp: RolloutTensorParallel) -> None:
        self.module, self.tp = module, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed(self.module.weight, ids)


class _GatherVocab:
    """Forward hook of the head: (..., vocab / k) logits -> (..., vocab)."""

    def __init__(self, tp: RolloutTensorParallel) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args, logits: torch.Tensor) -> torch.Tensor:
        *lead, width = logits.shape
        return self.tp.gather_vocab(logits.reshape(-1, width)).view(*lead, width * self.tp.size)


class _SumPartials:
    """Forward hook of a row-wise Linear: its partial products summed over the group, its bias added once."""

    def __init__(self, tp: RolloutTensorParallel) -> None:
        self.tp = tp

    def __call__(self, module: nn.Linear, args, output: torch.Tensor) -> torch.Tensor:
        if module.bias is None:
            return self.tp.all_reduce(output)
        return self.tp.all_reduce(output - module.bias) + module.bias


def place_sharded_model(
    model: nn.Module | str | os.PathLike, dtype: str | torch.dtype, tp: RolloutTensorParallel
) -> tuple[nn.Module, torch.device]:
    """This rank's shard of `model` (`build_sharded_causal_lm`) on this rank's device, and the device: in the
    module's own dtype, or `dtype` for a checkpoint."""
    from hybridflow.env import dist_local_rank
    from hybridflow.models.loader import to_torch_dtype
    from hybridflow.utils.device import get_torch_device

    device = get_torch_device(dist_local_rank())
    torch_dtype = next(model.parameters()).dtype if isinstance(model, nn.Module) else to_torch_dtype(dtype)
    return build_sharded_causal_lm(model, torch_dtype, tp, device), device


def split_experts_over_group(model: nn.Module, tp: RolloutTensorParallel) -> None:
    """Make each experts module (its weights already this rank's E / k experts) take global expert ids: routes to
    other ranks' experts are masked, and the partial outputs are summed over the group (`AllReduceEP`)."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    dispatch = EpDispatchExpertsParallel()
    experts = [module for name, module in model.named_modules() if name.endswith(".experts")]
    if not experts:
        raise ValueError(f"found no experts modules in {type(model).__name__} to split over the rollout group")
    for module in experts:
        num_experts = next(module.parameters()).shape[0]  # the local count: the weights are this rank's block
        module.num_experts = num_experts
        module._is_expert_parallel = True  # the experts' forward then skips the masked routes
        dispatch.install_forward(module, ep_mesh=tp.mesh, tp_mesh=tp.mesh, ep_implementation="all_reduce")


def _recording(named: Iterable[tuple[str, torch.Tensor]], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """`named` as is, appending each name to `names` as it passes."""
    for name, tensor in named:
        names.append(name)
        yield name, tensor


def rollout_weights_of(
    model: nn.Module, tp: RolloutTensorParallel | None, names: Collection[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """A rollout engine's parameters by HF name (those in `names` when given): the module's own, or under tensor
    parallelism (`tp` not None) the full tensors reassembled from the group's shards, one at a time (collective:
    every rank of the group must iterate the same names)."""
    own = ((name, param) for name, param in model.named_parameters() if names is None or name in names)
    if tp is None:
        return own
    plan, replicas = rollout_plan_for(model.config.model_type), kv_replicas(model.config, tp.size)
    return named_full_from_shards(own, plan, tp.mesh, replicas)


def load_rollout_weights(
    model: nn.Module, named_full: Iterable[tuple[str, torch.Tensor]], tp: RolloutTensorParallel | None
) -> int:
    """Copy each `(hf_name, full tensor)` into a rollout engine's module, in place (one at a time); under tensor
    parallelism (`tp` not None) only this rank's shard of it. Returns how many. KeyError for an unknown name,
    ValueError for a shape mismatch."""
    if tp is not None:
        plan, replicas = rollout_plan_for(model.config.model_type), kv_replicas(model.config, tp.size)
        named_full = named_shards(named_full, plan, tp.rank, tp.size, replicas)
    return copy_named_tensors(model, named_full)


def _allocate_shards(
    model: nn.Module, plan: dict[str, Style], size: int, dtype: torch.dtype, device, replicas: int
) -> None:
    """Replace the meta parameters by empty ones of their shard shape (tied ones stay tied), and the persistent
    buffers (e.g. DeepSeek-V3's router score bias) by empty ones that the checkpoint fills; rebuild the rotary
    embedding, whose `inv_freq` is a non-persistent buffer that no checkpoint restores."""
    allocated: dict[int, nn.Parameter] = {}
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if id(param) not in allocated:
            dim, _, blocks = param_blocks(name, plan, 0, size, replicas)
            shape = shard_shape(param.shape, dim, blocks)
            allocated[id(param)] = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        setattr(owner, attr, allocated[id(param)])
    persistent = set(model.state_dict())
    for name, buffer in list(model.named_buffers()):
        if name in persistent:
            owner_name, _, attr = name.rpartition(".")
            shape = shard_shape(buffer.shape, param_shard_dim(name, plan), size)
            model.get_submodule(owner_name).register_buffer(attr, torch.empty(shape, dtype=buffer.dtype, device=device))
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config).to(device)


def _checkpoint_shards(
    source: str | os.PathLike, dtype: torch.dtype, plan: dict[str, Style], tp: RolloutTensorParallel,
    module_names: set[str], replicas: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(hf_name, this rank's shard)` of each tensor of a checkpoint, read slice by slice from safetensors files
    whose tensor names are the module's (`module_names`); other checkpoints are loaded whole once, then sliced."""
    from hybridflow.models.loader import build_causal_lm, split_model_location

    directory, gguf = split_model_location(source)
    files = sorted(Path(directory).glob("*.safetensors")) if gguf is None else []
    reason = "has no safetensors files" if not files else None
    if files and not _names_in(files) <= module_names:  # e.g. per-expert tensors that transformers fuses on load
        reason = "stores tensors under other names than the module's (transformers converts them on load)"
    if reason is not None:
        logger.warning("rollout: %s %s; loading the full model once to slice this rank's shard", source, reason)
        full = build_causal_lm(source, dtype=dtype).state_dict().items()
        yield from named_shards(full, plan, tp.rank, tp.size, replicas)
        return
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)  # reads only the indexed block
                shape = piece.get_shape()
                index = [slice(None)] * len(shape)
                dim, block, blocks = param_blocks(name, plan, tp.rank, tp.size, replicas)
                if dim is not None:
                    length = shard_shape(shape, dim, blocks)[dim]
                    index[dim] = slice(block * length, (block + 1) * length)
                yield name, piece[tuple(index)]


def _names_in(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names
