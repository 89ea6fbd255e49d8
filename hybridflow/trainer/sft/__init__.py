"""Supervised fine-tuning: the driver (`SFTTrainer`, `run_sft`) and its config checks; the worker is
`hybridflow.workers.SFTWorker`, the config `hybridflow.trainer.config.SFTConfig`."""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Loaded on first use, so that `hybridflow sft`'s command module and its checks import without torch (a config
# error prints before the runtime loads, as `hybridflow train`'s does).
_EXPORTS = {"SFTTrainer": "trainer", "run_sft": "trainer", "validate_sft_config": "validate"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
