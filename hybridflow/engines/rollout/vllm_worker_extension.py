"""Methods hybridflow adds to vLLM's GPU workers (`worker_extension_cls`), called by name through
`LLM.collective_rpc`.

Why a named method: vLLM >= 0.10 refuses to send a Python function through `collective_rpc` unless insecure
(pickle) serialization is switched on (`VLLM_ALLOW_INSECURE_SERIALIZATION=1`). A method of a class that vLLM
mixes into its worker class (the `worker_extension_cls` engine argument, a qualified name that each worker
imports) is called by its name instead.

The method names carry a `hybridflow_` prefix: vLLM asserts that an extension adds no attribute its worker
class already has (vllm 0.32's GPU worker has its own `update_weights`).

This module imports only the standard library at run time (torch for type hints only), so a vLLM worker process can
import it cheaply (importing it runs `hybridflow/engines/rollout/__init__.py`, which is already loaded where
the rollout runs vLLM in its own process, as it does on GPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "FINGERPRINTS_METHOD", "HybridflowWorkerExtension", "WEIGHTS_METHOD", "WORKER_EXTENSION_CLS", "load_named_tensors",
    "parameter_fingerprints",
]

WORKER_EXTENSION_CLS = "hybridflow.engines.rollout.vllm_worker_extension.HybridflowWorkerExtension"
"""The `worker_extension_cls` engine argument."""
WEIGHTS_METHOD = "hybridflow_load_weights"
"""Name of the `collective_rpc` method that loads `(hf_name, tensor)` pairs into the worker's model."""
FINGERPRINTS_METHOD = "hybridflow_weight_fingerprints"
"""Name of the `collective_rpc` method that reports the worker's parameters' shapes, dtypes and sums."""


class WeightLoadingModel(Protocol):
    """What vLLM's model classes offer: `load_weights` takes HF-named tensors (fusing q/k/v, gate/up, sharding
    over tensor-parallel ranks, converting dtype) and returns the names of the parameters it loaded."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str] | None: ...


def load_named_tensors(model: WeightLoadingModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load `(hf_name, full_tensor)` pairs into `model` in place; return how many pairs went in.

    The pairs are streamed through (an iterator is consumed once, never materialised), so the caller's peak
    memory is one tensor. An empty input is an error: it means the caller's weights went missing.
    """
    count = 0

    def counted() -> Iterable[tuple[str, torch.Tensor]]:
        nonlocal count
        for name, tensor in named_tensors:
            count += 1
            yield name, tensor

    model.load_weights(counted())
    if count == 0:
        raise ValueError("hybridflow_load_weights got no tensors; the rollout's update_weights received none")
    return count


def parameter_fingerprints(
    model, names: Iterable[str] | None = None
) -> dict[str, tuple[tuple[int, ...], str, float | None]]:
    """`(shape, dtype name, float32 sum)` of `model`'s parameters by vLLM's names: every parameter without its sum
    when `names` is None (the layout), else the named ones with it. Plain Python values: the answer may cross a
    process boundary."""
    import torch  # here: the module imports only the standard library

    wanted = None if names is None else set(names)
    out = {}
    for name, param in model.named_parameters():
        if wanted is None or name in wanted:
            total = None if wanted is None else float(param.detach().sum(dtype=torch.float32))
            out[name] = (tuple(param.shape), str(param.dtype).removeprefix("torch."), total)
    return out


class HybridflowWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (`worker_extension_cls`); `self` is then the vLLM worker."""

    def hybridflow_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named tensors into this worker's model (see `load_named_tensors`); return the count.

        With the engine in the caller's process (the GPU path: `distributed_executor_backend=
        "external_launcher"`), `named_tensors` arrives as the caller's own object: no copy, no serialization.
        """
        return load_named_tensors(self.model_runner.get_model(), named_tensors)  # type: ignore[attr-defined]

    def hybridflow_weight_fingerprints(self, names: list[str] | None = None) -> dict:
        """This worker's parameters' fingerprints (see `parameter_fingerprints`), computed where they live."""
        return parameter_fingerprints(self.model_runner.get_model(), names)  # type: ignore[attr-defined]
