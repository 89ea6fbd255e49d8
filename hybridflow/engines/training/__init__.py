"""Training engines: FSDP2 sharding, micro-batched forward/backward, log-probs, values, state dicts."""

from hybridflow.engines.training.config import FSDPConfig, FSDPEngineConfig, FSDPModelConfig, OptimConfig
from hybridflow.engines.training.fsdp import FSDPEngine, apply_fsdp2, build_fsdp_engine
from hybridflow.engines.training.optim import build_lr_scheduler, build_optimizer, compute_lr_multiplier
from hybridflow.utils.registry import Registry

TRAINING_ENGINES: Registry[type[FSDPEngine]] = Registry("training engine")
TRAINING_ENGINES.register("fsdp", FSDPEngine)

__all__ = [
    "TRAINING_ENGINES",
    "FSDPEngine",
    "FSDPConfig",
    "FSDPEngineConfig",
    "FSDPModelConfig",
    "OptimConfig",
    "apply_fsdp2",
    "build_fsdp_engine",
    "build_lr_scheduler",
    "build_optimizer",
    "compute_lr_multiplier",
]
