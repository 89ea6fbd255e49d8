"""Supervised fine-tuning: the driver (`SFTTrainer`, `run_sft`) and its config checks; the worker is
`hybridflow.workers.SFTWorker`, the config `hybridflow.trainer.config.SFTConfig`."""

from hybridflow.trainer.sft.trainer import SFTTrainer, run_sft
from hybridflow.trainer.sft.validate import validate_sft_config

__all__ = ["SFTTrainer", "run_sft", "validate_sft_config"]
