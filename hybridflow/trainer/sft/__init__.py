"""Supervised fine-tuning: typed config (verl's SFT keys), `SFTWorker` on the FSDP2 engine, `SFTTrainer`."""

from hybridflow.trainer.sft.config import SFTConfig, validate_sft_config
from hybridflow.trainer.sft.trainer import SFTTrainer, run_sft
from hybridflow.trainer.sft.worker import SFTWorker

__all__ = ["SFTConfig", "SFTTrainer", "SFTWorker", "run_sft", "validate_sft_config"]
