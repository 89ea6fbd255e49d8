"""What both off-policy trainers do around a generation: draw a prompt batch with the sampler position a resumed run
starts from, and tag each trained sample with the version of the weights that sampled it and its staleness."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.protocol import DataProto
from hybridflow.trainer.generation import build_prompts


@dataclass
class Generation:
    """A prompt batch drawn for training step `step`, from its draw until it is trained on."""

    step: int
    batch: DataProto
    """The prompt rows, repeated rollout.n times (one `uid` per prompt)."""
    data_position: dict[str, Any]
    """The sampler state before this batch was drawn (where a resumed run starts again)."""
    policy_version: int
    """The rollout's weights when it was drawn (actor updates)."""
    rollout: Any = None
    """The generation in flight: a `DataProtoFuture` (one call) or a `PartialRollout` (chunks)."""
    output: DataProto | None = None
    """The rollout's finished output (set once the generation is done)."""
    wait_s: float = 0.0
    """Time the producer waited before it could draw this batch (the staleness gate)."""
    gen_s: float = 0.0
    """Time spent in this batch's generation calls."""


def draw_generation(
    step: int, batches: Iterator[dict], sampler: Any, n: int, *, pass_rows: bool, policy_version: int
) -> tuple[Generation, DataProto]:
    """Draw the next prompt batch for `step`, recording `sampler`'s position first; returns the `Generation` and the
    prompts to send the rollout (`trainer/generation.py` `build_prompts`)."""
    position = sampler.state_dict()
    batch, prompts = build_prompts(next(batches), n, pass_rows=pass_rows, validate=False)
    return Generation(step, batch, position, policy_version), prompts


def tag_staleness(batch: DataProto, staleness: torch.Tensor, versions: dict[str, torch.Tensor]) -> dict[str, float]:
    """Store each sample's `staleness` and version `versions` columns ((bs,) int64 each, e.g.
    `rollout_policy_version`) in `batch`; returns `rollout/staleness/{mean,min,max}`."""
    for key, column in versions.items():
        batch.batch[key] = column
    batch.batch["staleness"] = staleness
    values = staleness.float()
    return {
        "rollout/staleness/mean": float(values.mean()),
        "rollout/staleness/min": float(values.min()),
        "rollout/staleness/max": float(values.max()),
    }
