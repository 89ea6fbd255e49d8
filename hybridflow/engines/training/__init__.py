"""Training engines: FSDP2 sharding, micro-batched forward/backward, log-probs, values, state dicts."""

from __future__ import annotations

from typing import Any

from hybridflow.utils.lazy import lazy_exports
from hybridflow.utils.registry import Registry

# Engines register by import path: the config section (`engines.training.config`) imports without torch.
TRAINING_ENGINES: Registry[Any] = Registry("training engine")
TRAINING_ENGINES.register_lazy("fsdp", "hybridflow.engines.training.fsdp:FSDPEngine")

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py).
_EXPORTS = {
    "FSDPEngine": "fsdp",
    "FSDPConfig": "config",
    "FSDPEngineConfig": "config",
    "FSDPModelConfig": "config",
    "OptimConfig": "config",
    "apply_fsdp2": "sharding",
    "build_fsdp_engine": "fsdp",
    "build_lr_scheduler": "optim",
    "build_optimizer": "optim",
    "compute_lr_multiplier": "optim",
}
__all__ = ["TRAINING_ENGINES", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
