"""Prompt data for RL training: `RLHFDataset`, `collate_fn`, resumable samplers; `preprocess/` writes parquet.
"""

from __future__ import annotations

from hybridflow.utils.lazy import lazy_exports

# Public name -> the submodule holding it; loaded on first use (see utils/lazy.py: the config sections in this
# package import without torch).
_EXPORTS = {
    "DataFilesConfig": "config",
    "MultiturnConfig": "config",
    "RLHFDataConfig": "config",
    "SFTDataConfig": "config",
    "RLHFDataset": "rl_dataset",
    "collate_fn": "rl_dataset",
    "compute_position_ids": "rl_dataset",
    "StatefulSampler": "sampler",
    "build_sampler": "sampler",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
