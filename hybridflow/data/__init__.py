"""Prompt data for RL training: `RLHFDataset`, `collate_fn`, resumable samplers; `preprocess/` writes parquet."""

from hybridflow.data.config import DataFilesConfig, MultiturnConfig, RLHFDataConfig, SFTDataConfig
from hybridflow.data.rl_dataset import RLHFDataset, collate_fn, compute_position_ids
from hybridflow.data.sampler import StatefulSampler, build_sampler

__all__ = [
    "RLHFDataset",
    "DataFilesConfig",
    "MultiturnConfig",
    "RLHFDataConfig",
    "SFTDataConfig",
    "StatefulSampler",
    "build_sampler",
    "collate_fn",
    "compute_position_ids",
]
