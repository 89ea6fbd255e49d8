"""Checkpoint files of the training engine: per-rank sharded state, RNG state, atomic writes.

Layout of a checkpoint directory (verl's names), one set per rank:
`model_world_size_{W}_rank_{r}.pt`, `optim_world_size_{W}_rank_{r}.pt`, `extra_state_world_size_{W}_rank_{r}.pt`
(lr scheduler + RNG), and `huggingface/` (config + tokenizer, written by rank 0) so the directory can be
exported to a full HF model later. Model and optimizer files hold this rank's DTensor shards.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.utils.device import get_device_name


def shard_file(directory: str | os.PathLike, kind: str, rank: int, world_size: int) -> Path:
    """Path of this rank's `kind` ('model', 'optim', 'extra_state') file in a checkpoint directory."""
    return Path(directory) / f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def save_atomic(obj: Any, path: Path) -> None:
    """torch.save to a temp file next to `path`, then rename: a killed save never leaves a torn file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_shard(path: Path) -> Any:
    """torch.load of a checkpoint file (tensors, DTensors, plain containers only), with a clear missing-file error."""
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint file {path} is missing; was the checkpoint written with the same world size "
            f"({path.name.split('_rank_')[0]})?"
        )
    with torch.serialization.safe_globals(_dtensor_placement_globals()):
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except (RuntimeError, EOFError, OSError) as err:  # truncated or corrupted on disk
            raise RuntimeError(
                f"checkpoint file {path} cannot be read ({type(err).__name__}: {str(err)[:200]}); it is truncated or "
                f"corrupted: resume from an earlier global_step_N (trainer.resume_mode=resume_path) or another copy"
            ) from err


def _dtensor_placement_globals() -> list[type]:
    """DTensor placements that a 2-D (FSDP x TP) shard pickles and that torch < 2.13's weights-only loader does
    not allow by default (`_StridedShard`)."""
    from torch.distributed.tensor import placement_types

    return [cls for cls in (getattr(placement_types, "_StridedShard", None),) if cls is not None]


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and accelerator) RNG states, as tensors and plain containers."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch_cpu": torch.get_rng_state(),
    }
    if get_device_name() == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state` returned."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and get_device_name() == "cuda":
        torch.cuda.set_rng_state(state["torch_cuda"])
