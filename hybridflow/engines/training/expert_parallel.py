"""Expert parallelism (EP) of a mixture-of-experts model: each rank of an `ep` group holds E / ep whole experts, and
every MoE layer sends each (token, expert) pair to the expert's rank with an all-to-all and brings the result back
with a second one.

transformers ships both halves, and this module only fits them to the engine's meshes:
- each MoE family's config carries its expert-parallel plan (`base_model_ep_plan`: the experts' weights
  `grouped_gemm`, i.e. `Shard(0)` over the experts; the experts module `ep_dispatch_experts`);
- `transformers.distributed.expert_parallel.apply_expert_parallelism` shards the weights and installs the
  dispatch (`AllToAllEP` in training: `all_to_all_single`, which gloo runs on CPU and NCCL on GPUs).

FSDP2 then shards each rank's experts over `efsdp` (the ranks that hold the same experts: world / ep of them), and
everything else over all ranks, as transformers' own `apply_fully_sharded_data_parallelism` does. An expert's
gradient sums the tokens of every data-parallel rank that routed to it (the all-to-all's backward brings them
home), so it is divided by the world size, like the dense weights' averaged gradients (`apply_expert_fsdp`).

The rank layout: `(efsdp, ep)` with the `ep` ranks consecutive, so an EP group sits on one node when a node holds
a multiple of ep ranks (the all-to-all then stays on NVLink).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hybridflow.models.parallel_plan import check_ep_layout

__all__ = ["apply_expert_parallel", "apply_expert_fsdp", "experts_modules", "expert_plan_of"]

EXPERTS_STYLE = "ep_dispatch_experts"


def expert_plan_of(module: nn.Module) -> dict[str, str]:
    """The model's expert-parallel plan, its wildcards expanded to the names of this module's own submodules and
    parameters (a causal LM's `model.layers.3.mlp.experts`, a value model's backbone alike; DeepSeek-V3's dense
    first layers have no experts and get no entry).

    The order is the config's: the weights are sharded before their experts module's dispatch is installed, which
    reads the per-rank expert count that sharding sets (the other way round, the dispatch counts all experts as
    local and the received tokens' expert ids are wrong)."""
    names = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_modules()]
    plan = {}
    for key, style in module.config.base_model_ep_plan.items():
        pattern = re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$")
        plan.update((name, style) for name in names if pattern.search(name))
    return plan


def experts_modules(module: nn.Module) -> Iterator[nn.Module]:
    """The experts modules that `apply_expert_parallel` split (their weights live on the expert mesh)."""
    for sub in module.modules():
        if getattr(sub, "_is_expert_parallel", False):
            yield sub


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh, ep_tp_mesh: DeviceMesh) -> nn.Module:
    """Split `module`'s experts over `ep_mesh` and route their tokens with all-to-all, in place (before FSDP2).

    ep_tp_mesh: a size-1 mesh of this rank alone (transformers' EP dispatch also splits a tensor-parallel group's
    shared batch; the engine does not combine EP with TP)."""
    check_ep_layout(module.config, ep_mesh.size(), "fsdp_config.expert_parallel_size")
    plan = expert_plan_of(module)
    if not any(style == EXPERTS_STYLE for style in plan.values()):
        raise ValueError(f"found no experts modules in {type(module).__name__} to split over the expert-parallel mesh")
    transformers_expert_parallelism()(module, ep_mesh, ep_tp_mesh, plan, ep_implementation="all_to_all")
    return module


def transformers_expert_parallelism():
    """transformers' `apply_expert_parallelism`, imported when a run asks for EP: the module is new in transformers
    5.23 (the pinned version), and older installs (5.17 on the lent GPU machines) must still import the engine."""
    try:
        from transformers.distributed.expert_parallel import apply_expert_parallelism
    except ImportError as err:
        import transformers

        raise RuntimeError(
            f"expert_parallel_size > 1 needs transformers.distributed.expert_parallel (transformers >= 5.23, the "
            f"version pyproject.toml pins); this environment has transformers {transformers.__version__}"
        ) from err
    return apply_expert_parallelism


def apply_expert_fsdp(module: nn.Module, efsdp_mesh: DeviceMesh, world_size: int, **fully_shard_kwargs) -> None:
    """Shard each experts module over `efsdp_mesh` (the ranks holding the same experts), before its layer is
    sharded over all ranks, so that its weights form their own FSDP2 unit on the expert mesh.

    Gradients: the dense weights' are averaged over all `world_size` ranks; an expert's gradient already sums the
    tokens of every rank (all-to-all backward), and the reduce over efsdp sums the copies, so it is divided by
    `world_size` too. FSDP2 applies a divide factor other than the group size through PREMUL_SUM, which gloo
    rejects, so the reduce sums and FSDP2 divides after it (transformers does the same)."""
    for experts in experts_modules(module):
        fully_shard(experts, mesh=efsdp_mesh, **fully_shard_kwargs)
        experts.set_gradient_divide_factor(float(world_size))
        if efsdp_mesh.size() > 1:  # with one copy there is no reduce, and FSDP2 divides locally
            experts.set_force_sum_reduction_for_comms(True)

