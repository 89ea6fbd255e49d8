"""Weight delivery verified, not assumed (issue 31): after every hand-over to a rollout engine, a cheap fingerprint of
what was handed over is compared with what the engine now serves.

The fingerprint is the sum of a fixed sample of tensors (`SAMPLE_SIZE`, spread evenly over the engine's
parameter names), each cast to the engine's dtype first so that equal weights give equal sums. The sending side's
sums are taken as the tensors stream past (no second copy of the model); the serving side's by
`rollout.weight_fingerprints(names)` after the update, where the weights live (the hf and native engines from their
own modules; vLLM in its worker, through hybridflow's worker extension). A rollout that skipped or half-applied an
update (stale weights) differs and the hand-over raises `WeightDeliveryError` naming the tensor, the rank and the policy version.
Under the native rollout's tensor parallelism `named_weights()` reassembles each full tensor from the group's
shards (collective), so a rank that kept its old shard is caught on every rank of the group. A tensor an engine
exposes in another shape than the one handed over is not compared.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from hybridflow.engines.rollout.base import tensor_sum

logger = logging.getLogger(__name__)

WEIGHT_VERSION_KEY = "rollout_weight_version"
"""(bs,) int64 column the rollout stamps on every generated batch: the policy version (actor updates) of the weights
that sampled each row (`trainer.guards.versions` checks it)."""

SAMPLE_SIZE = 8
RTOL = 1e-6
"""Relative tolerance of a sum (the same values summed on another device may round differently)."""


class WeightDeliveryError(RuntimeError):
    """The rollout engine does not serve the weights it was handed."""


def pick_sample(names: list[str], size: int = SAMPLE_SIZE) -> list[str]:
    """`size` names spread evenly over `names` (all of them when fewer), always the first and the last."""
    if len(names) <= size:
        return list(names)
    step = (len(names) - 1) / (size - 1)
    return [names[round(index * step)] for index in range(size)]


class WeightDeliveryCheck:
    """One rollout engine's check: which tensors to fingerprint, and the sums of the current hand-over."""

    def __init__(self, rollout: Any, rank: int) -> None:
        self.rollout, self.rank = rollout, rank
        try:
            layout = rollout.weight_fingerprints()
        except NotImplementedError:
            logger.warning("%s does not expose its weights: weight hand-overs to it are not verified",
                           type(rollout).__name__)
            layout = {}
        sample = pick_sample(sorted(layout))
        self.expected_shapes = {name: layout[name][:2] for name in sample}
        self.sent: dict[str, float] = {}
        self.arrived = 0

    @property
    def enabled(self) -> bool:
        return bool(self.expected_shapes)

    def record(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `named_tensors` through, fingerprinting the sampled ones (in the serving dtype) on the way."""
        self.sent, self.arrived = {}, 0
        for name, tensor in named_tensors:
            expected = self.expected_shapes.get(name)
            if expected is not None:
                self.arrived += 1
                if tuple(tensor.shape) == expected[0]:  # else the engine holds a shard of it: not compared
                    self.sent[name] = tensor_sum(tensor, expected[1])
            yield name, tensor

    def verify(self, version: int) -> dict[str, float]:
        """Compare the engine's sampled tensors with what `record` saw; raise on a mismatch. Metrics of the check."""
        if not self.enabled:
            return {}
        if not self.arrived:
            raise WeightDeliveryError(
                f"rank {self.rank}: the hand-over of policy version {version} carried none of the rollout's sampled "
                f"tensors ({sorted(self.expected_shapes)}): its names do not match the engine's, so the engine keeps "
                "its old weights"
            )
        served = self.rollout.weight_fingerprints(self.sent)
        for name, sent in self.sent.items():
            found = served[name][2]
            if abs(found - sent) > RTOL * max(abs(sent), abs(found), 1.0):
                raise WeightDeliveryError(
                    f"rank {self.rank}: the rollout ({type(self.rollout).__name__}) does not serve the weights of policy "
                    f"version {version} it was handed: tensor {name!r} sums to {found!r} in the engine but "
                    f"{sent!r} in the hand-over (it kept stale weights or loaded them only in part). Check the "
                    "rollout's update_weights (names, LoRA merge, tensor-parallel slicing)"
                )
        return {"rollout/weights_checked": float(len(self.sent)), "rollout/weights_version": float(version)}
