"""`hybridflow merge` / `python -m hybridflow.engines.training.merge`: a sharded training checkpoint -> a plain HF
directory (it reads the shard format that `checkpoint.py` beside it writes).

Reads what `FSDPEngine.save_checkpoint` wrote (RL actor `global_step_N/actor`, critic-free; or an SFT
`global_step_N`): the per-rank model shards `model_world_size_{W}_rank_{r}.pt` (DTensor shards along dim 0,
or whole tensors for one rank), `huggingface/` (config + tokenizer) and, for LoRA runs, `lora_adapter/`
(whose adapters are merged into the base weights). Writes config, safetensors, generation config and tokenizer
that `transformers.AutoModelForCausalLM.from_pretrained(target_dir)` loads. Optimizer shards are not read.

    hybridflow merge --local_dir checkpoints/run/global_step_100/actor --target_dir exported/step100

verl's spelling `python -m hybridflow.model_merger merge --backend fsdp --local_dir ... --target_dir ...` works as
well, including verl's quickstart target, the checkpoint's own `huggingface/` directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridflow.engines.training import checkpoint
from hybridflow.models.lora import LoraScaling, has_lora_weights, load_adapter_config, save_hf_model_from_state_dict

logger = logging.getLogger(__name__)

HF_SUBDIR = "huggingface"
ADAPTER_SUBDIR = "lora_adapter"
_MODEL_SHARD = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def find_checkpoint_dir(local_dir: str | os.PathLike) -> Path:
    """The directory holding the model shards: `local_dir` itself, or its `actor/` (an RL `global_step_N`)."""
    local_dir = Path(local_dir)
    for candidate in (local_dir, local_dir / "actor"):
        if candidate.is_dir() and any(_MODEL_SHARD.match(entry.name) for entry in candidate.iterdir()):
            return candidate
    raise FileNotFoundError(
        f"--local_dir {local_dir} holds no model_world_size_W_rank_R.pt shards (nor does {local_dir / 'actor'}); "
        "point it at a checkpoint written by the trainer (e.g. global_step_N/actor)"
    )


def shard_world_size(ckpt_dir: Path) -> int:
    """The world size the shards were written with; every rank's file must be present."""
    found: dict[int, set[int]] = {}
    for entry in ckpt_dir.iterdir():
        match = _MODEL_SHARD.match(entry.name)
        if match:
            found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    if len(found) != 1:
        raise ValueError(f"{ckpt_dir} mixes shards of several world sizes {sorted(found)}; keep one set")
    world_size, ranks = next(iter(found.items()))
    missing = sorted(set(range(world_size)) - ranks)
    if missing:
        raise FileNotFoundError(f"{ckpt_dir}: model shards of ranks {missing} (of world size {world_size}) are missing")
    return world_size


def load_full_state_dict(ckpt_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Full CPU tensors under the module's names, assembled from every rank's model shard."""
    import torch.distributed.tensor  # noqa: F401  (registers DTensor for torch.load(weights_only=True))

    ckpt_dir = Path(ckpt_dir)
    world_size = shard_world_size(ckpt_dir)
    files = [checkpoint.shard_file(ckpt_dir, "model", rank, world_size) for rank in range(world_size)]
    shards = [checkpoint.load_shard(path) for path in files]
    full = {}
    for name in shards[0]:
        full[name] = _assemble(name, [shard[name] for shard in shards])
    return full


def _assemble(name: str, pieces: list) -> torch.Tensor:
    """One full tensor from each rank's piece (rank order): replicas, FSDP2 shards along dim 0 (torch.chunk
    sizes), or a 2-D (dp, tp) mesh where tensor parallelism splits a dim and FSDP2 shards each split again."""
    from torch.distributed.tensor import DTensor

    first = pieces[0]
    if not isinstance(first, DTensor):
        return first.detach()
    mesh = first.device_mesh.mesh
    if mesh.dim() > 2:
        raise ValueError(f"{name}: {mesh.dim()}-D device mesh placements {first.placements} are not supported")
    if mesh.dim() == 1:
        full = _combine(name, [pieces[int(rank)].to_local() for rank in mesh.tolist()], first.placements[0])
    else:
        outer, inner = first.placements
        strided = type(outer).__name__ == "_StridedShard"  # FSDP2 over a tensor-parallel split: inner first
        if strided or not (_dim(outer) is not None and _dim(outer) == _dim(inner)):
            rows = [_combine(name, [pieces[int(r)].to_local() for r in column.tolist()], outer) for column in mesh.T]
            full = _combine(name, rows, inner)
        else:  # plain Shard on both mesh dims of one tensor dim: the outer split comes first
            rows = [_combine(name, [pieces[int(r)].to_local() for r in row.tolist()], inner) for row in mesh]
            full = _combine(name, rows, outer)
    if tuple(full.shape) != tuple(first.shape):
        raise ValueError(f"{name}: shards assemble to {tuple(full.shape)}, expected {tuple(first.shape)}")
    return full.detach()


def _dim(placement) -> int | None:
    return getattr(placement, "dim", None)


def _combine(name: str, parts: list[torch.Tensor], placement) -> torch.Tensor:
    """Undo one mesh dimension's placement: concatenate shards along their dim, or take one replica."""
    from torch.distributed.tensor import Replicate

    if isinstance(placement, Replicate):
        return parts[0]
    if _dim(placement) is None:
        raise ValueError(f"{name}: placement {placement} is not supported (expected Shard or Replicate)")
    return torch.cat(parts, dim=_dim(placement))


_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$")


def check_target_dir(target_dir: str | os.PathLike, hf_dir: Path | None = None) -> tuple[Path, bool]:
    """`target_dir` as a Path, and whether the export goes into the checkpoint's own `huggingface/` directory
    (`hf_dir`, which holds its config and tokenizer: verl's quickstart merges there). Raises if the target exists
    and is not an empty directory, unless it is that directory without model weights yet."""
    target = Path(target_dir)
    if hf_dir is not None and target.is_dir() and target.resolve() == hf_dir.resolve():
        weights = sorted(entry.name for entry in target.iterdir() if _WEIGHT_FILE.match(entry.name))
        if weights:
            raise FileExistsError(f"--target_dir {target} already holds model weights {weights}; nothing is written "
                                  "over them: choose a new directory")
        return target, True
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"--target_dir {target} exists and is not empty; choose a new directory or empty it "
                              "(or the checkpoint's own huggingface/ directory, which holds no weights)")
    return target, False


def merge_checkpoint(
    local_dir: str | os.PathLike, target_dir: str | os.PathLike, *, dtype: str | None = None
) -> Path:
    """Export the checkpoint in `local_dir` to a plain HF model directory `target_dir` (see the module doc).

    Args:
        local_dir: the checkpoint directory (or an RL `global_step_N` holding `actor/`).
        target_dir: a new or empty directory, written via a temporary sibling and renamed when complete; or the
            checkpoint's own `huggingface/` directory (verl's quickstart), which gets the weight files beside the
            config and tokenizer it keeps as they are.
        dtype: 'float32' | 'bfloat16' | 'float16' to cast the weights; None keeps the training dtype.

    Returns:
        `target_dir` as a Path.
    """
    from transformers import AutoConfig

    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    ckpt_dir = find_checkpoint_dir(local_dir)
    hf_dir = ckpt_dir / HF_SUBDIR
    target, in_place = check_target_dir(target_dir, hf_dir)
    shard_world_size(ckpt_dir)  # every rank's shard is present
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"{hf_dir / 'config.json'} is missing: the checkpoint has no model config")
    state_dict = load_full_state_dict(ckpt_dir)
    scaling = None
    if has_lora_weights(state_dict):
        if not (ckpt_dir / ADAPTER_SUBDIR).is_dir():
            raise FileNotFoundError(f"{ckpt_dir} holds LoRA weights but no {ADAPTER_SUBDIR}/adapter_config.json")
        scaling = LoraScaling.from_adapter_config(load_adapter_config(ckpt_dir / ADAPTER_SUBDIR))
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if staging.exists():
        shutil.rmtree(staging)
    try:
        config = AutoConfig.from_pretrained(hf_dir)
        save_hf_model_from_state_dict(
            state_dict, config, staging, scaling=scaling, dtype=_DTYPES[dtype] if dtype else None
        )
        if in_place:  # the weights (and generation config) join the config and tokenizer, which stay as saved
            for entry in staging.iterdir():
                if not (target / entry.name).exists():
                    os.replace(entry, target / entry.name)
        else:
            for entry in hf_dir.iterdir():  # tokenizer files (the config was just written by save_pretrained)
                if entry.is_file() and entry.name != "config.json":
                    shutil.copy2(entry, staging / entry.name)
            if target.exists():
                target.rmdir()  # empty (checked above); os.replace needs the name free or an empty directory
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    logger.info("wrote %s (from %d checkpoint tensors%s)", target, len(state_dict), ", LoRA merged" if scaling else "")
    return target


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """`[merge] --local_dir DIR --target_dir DIR [--backend fsdp] [--dtype D]`."""
    argv = list(argv)
    if argv and argv[0] == "merge":  # verl's `model_merger merge ...` spelling
        argv = argv[1:]
    parser = argparse.ArgumentParser(prog="hybridflow merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--local_dir", required=True, help="checkpoint directory (e.g. global_step_N/actor)")
    parser.add_argument("--target_dir", required=True, help="new or empty output directory for the HF model")
    parser.add_argument("--backend", default="fsdp", choices=["fsdp"], help="checkpoint format (verl compatible)")
    parser.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="cast weights (default: keep)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the export; user errors print one line and exit with code 1."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        target = merge_checkpoint(args.local_dir, args.target_dir, dtype=args.dtype)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"hybridflow merge: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
