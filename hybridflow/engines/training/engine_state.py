"""A training engine's checkpoint directory: which parts it holds and how they are written and read back.

Parts (verl's `checkpoint.save_contents` / `load_contents`): `model` (this rank's parameter shards; a LoRA engine
also writes its adapter as a peft directory), `optimizer` (this rank's optimizer state) and `extra` (the LR
scheduler and RNG states). Every checkpoint also holds `layout.json` (the parallel layout its shards were cut
for) and, under `huggingface/`, the model's config and tokenizer. A full HF copy of the weights (`hf_model`) is
the engine's `save_hf_model`, written beside it by the worker.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from hybridflow.engines.training import checkpoint
from hybridflow.models.lora import save_lora_adapter

FSDPEngine = Any  # `fsdp.FSDPEngine`, which imports this module

__all__ = ["ENGINE_PARTS", "LAYOUT_FILE", "load_engine_state", "save_engine_state", "saved_parts"]

ENGINE_PARTS = ("model", "optimizer", "extra")
LAYOUT_FILE = "layout.json"
_SHARD_KIND = {"model": "model", "optimizer": "optim", "extra": "extra_state"}
RESUME_OTHER_LAYOUT = (
    "resume with the same layout (trainer.nnodes, trainer.n_gpus_per_node and the fsdp_config's sizes), or export it "
    "(hybridflow merge) and start a new run from the exported model"
)


def saved_parts(path: str | os.PathLike) -> set[str]:
    """The parts (of `ENGINE_PARTS`) whose rank-0 shard a checkpoint directory holds, at any world size."""
    directory = Path(path)
    return {part for part, kind in _SHARD_KIND.items() if any(directory.glob(f"{kind}_world_size_*_rank_0.pt"))}


def save_engine_state(engine: FSDPEngine, path: str | os.PathLike, contents: Collection[str] = ENGINE_PARTS) -> None:
    """Write this rank's shards of the `contents` parts, and (rank 0) the layout, config and tokenizer
    (collective: LoRA adapters are gathered)."""
    unknown = sorted(set(contents) - set(ENGINE_PARTS))
    if unknown:
        raise ValueError(f"unknown checkpoint parts {unknown}; known: {list(ENGINE_PARTS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank, world = engine.rank, engine.world_size
    if "model" in contents:
        checkpoint.save_atomic(engine.module.state_dict(), checkpoint.shard_file(path, "model", rank, world))
    if "optimizer" in contents:
        checkpoint.save_atomic(engine.optimizer.state_dict(), checkpoint.shard_file(path, "optim", rank, world))
    if "extra" in contents:
        extra = {"lr_scheduler": engine.lr_scheduler.state_dict(), "rng": checkpoint.get_rng_state(),
                 "layout": engine.layout.record()}
        checkpoint.save_atomic(extra, checkpoint.shard_file(path, "extra_state", rank, world))
    if rank == 0:
        (path / LAYOUT_FILE).write_text(json.dumps(engine.layout.record()))
        engine.module.config.save_pretrained(path / "huggingface")
        if engine.tokenizer is not None:
            engine.tokenizer.save_pretrained(path / "huggingface")
    if engine.lora_scaling is not None and "model" in contents:
        adapter = {name: t.cpu() for name, t in engine._named_module_params(lambda name: ".lora_" in name)}
        if rank == 0:
            save_lora_adapter(engine.module, adapter, path / "lora_adapter")
    engine._barrier()


def _saved_layout(engine: FSDPEngine, path: Path) -> dict[str, int]:
    """The layout a checkpoint was written with: `layout.json`, or (older checkpoints) the extra state's record,
    where before fsdp_size was recorded the shards spanned all ranks."""
    if (path / LAYOUT_FILE).is_file():
        return json.loads((path / LAYOUT_FILE).read_text())
    extra = checkpoint.load_shard(checkpoint.shard_file(path, "extra_state", engine.rank, engine.world_size))
    return {"fsdp_size": engine.world_size, **extra.get("layout", {})}


def load_engine_state(engine: FSDPEngine, path: str | os.PathLike, contents: Collection[str] = ENGINE_PARTS) -> None:
    """Restore the `contents` parts that `save_engine_state` wrote, with the same layout; resuming all three is
    bit-exact. A part the directory lacks raises `FileNotFoundError` naming it."""
    path = Path(path)
    rank, world = engine.rank, engine.world_size
    missing = [part for part in contents if part in ENGINE_PARTS and part not in saved_parts(path)]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} holds no {missing} (it holds {sorted(saved_parts(path))}: see its "
            "checkpoint.save_contents); load only what it holds with checkpoint.load_contents"
        )
    mismatch = engine.layout.shard_mismatch(_saved_layout(engine, path))
    if mismatch is not None:  # shards of another split do not fit this one's
        raise ValueError(f"checkpoint {path} was written with {mismatch}: {RESUME_OTHER_LAYOUT}")
    if "model" in contents:
        engine.module.load_state_dict(checkpoint.load_shard(checkpoint.shard_file(path, "model", rank, world)))
    if "optimizer" in contents:
        engine.optimizer.load_state_dict(checkpoint.load_shard(checkpoint.shard_file(path, "optim", rank, world)))
    if "extra" in contents:
        extra = checkpoint.load_shard(checkpoint.shard_file(path, "extra_state", rank, world))
        engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        checkpoint.set_rng_state(extra["rng"])
    engine._barrier()
