"""Tensor parallelism of a Llama-family model with DTensor (`parallelize_module`), composable with FSDP2.

The plan (`hybridflow.models.parallel_plan`) splits attention heads and the MLP column-/row-wise, and the
embedding and the head over the vocabulary; the head's output stays split (each rank returns its vocabulary
slice of the logits, for `vocab_parallel`). Every other parameter (norms, a value head) becomes a replicated
DTensor on the same mesh, so that after `fully_shard` over the data-parallel mesh all parameters live on one
2-D (dp, tp) mesh: the optimizer and gradient clipping then treat them alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from hybridflow.models.parallel_plan import check_tp_layout, tp_plan_for

__all__ = ["apply_tensor_parallel"]


def _style(style: str, module: nn.Module) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if isinstance(module, nn.Embedding):  # vocabulary rows split, the looked-up vectors summed over ranks
        return RowwiseParallel(input_layouts=Replicate())
    return ColwiseParallel(output_layouts=Shard(-1))  # the head: each rank keeps its vocabulary slice


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Parallelize `module` (a HF causal LM or token classifier of the Llama family) over `tp_mesh`, in place."""
    config = module.config
    plan = tp_plan_for(config.model_type)
    check_tp_layout(config, tp_mesh.size(), "fsdp_config.tensor_parallel_size")
    embeddings = module.get_input_embeddings()
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    tied = head is not None and head.weight is embeddings.weight
    styles = {
        name: _style(plan[name.rsplit(".", 1)[-1]], sub)
        for name, sub in module.named_modules()
        if name and name.rsplit(".", 1)[-1] in plan and isinstance(sub, (nn.Linear, nn.Embedding))
    }
    parallelize_module(module, tp_mesh, styles)
    if tied:  # both split the vocabulary rows (Shard(0)), so one DTensor serves both again
        head.weight = embeddings.weight
    for sub in module.modules():
        if any(not isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
            distribute_module(sub, tp_mesh, _replicate_params, _inputs_to_replicate, _outputs_to_local)
    return module


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        if not isinstance(param, DTensor):
            replicated = nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]), param.requires_grad)
            module.register_parameter(param_name, replicated)


def _inputs_to_replicate(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _outputs_to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs
