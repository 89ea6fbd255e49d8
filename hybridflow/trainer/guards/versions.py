"""Which weights produced each sample: the rollout stamps `rollout_weight_version` on every sample it generates
(the policy version of the weights it served, recorded at each hand-over), and the trainers check it: the
synchronous trainer with `WeightVersionWatch`, the off-policy trainers with `check_served_version` (each batch, or
each chunk of a partial rollout, against the version the trainer synced to the rollout before launching it).

In an on-policy run (colocated or split placement) a step's samples all come from one version, and after an
actor update the next step's come from a newer one. A rollout that keeps serving old weights (a hand-over that
never happened, an adapter that was dropped) would otherwise train on stale samples without a sign; here it
stops the run at the next step, naming the versions.
"""

from __future__ import annotations

import torch

from hybridflow.workers.weight_check import WEIGHT_VERSION_KEY

__all__ = ["StaleWeightsError", "WEIGHT_VERSION_KEY", "WeightVersionWatch", "check_served_version", "served_versions"]


def served_versions(data) -> torch.Tensor | None:
    """The `rollout_weight_version` column of a rollout's output or a trainer batch (a DataProto); None when the
    rollout path stamps none."""
    return data.batch[WEIGHT_VERSION_KEY] if WEIGHT_VERSION_KEY in data.batch.keys() else None


class StaleWeightsError(RuntimeError):
    """The rollout served weights other than the actor's latest."""


class WeightVersionWatch:
    """Follows the served versions of an on-policy run: one version per step, newer after each actor update."""

    def __init__(self) -> None:
        self.served: int | None = None  # the version of the last step's samples
        self.updated_since = False  # an actor update happened after those samples

    def mark_update(self) -> None:
        """The actor's weights changed: the next samples must come from a newer version."""
        self.updated_since = True

    def observe(self, step: int, versions: torch.Tensor | None) -> dict[str, float]:
        """Check this step's `rollout_weight_version` column (None: the rollout path stamps none, nothing to
        check); returns `rollout/weight_version`. Raises `StaleWeightsError` naming the versions."""
        if versions is None or versions.numel() == 0:
            return {}
        low, high = int(versions.min()), int(versions.max())
        if low != high:
            raise StaleWeightsError(
                f"step {step}: the samples of one on-policy step came from weight versions {low} to {high}; some "
                "rollout replica did not receive the actor's latest weights"
            )
        if self.served is not None and self.updated_since and low <= self.served:
            raise StaleWeightsError(
                f"step {step}: the rollout still served weight version {low} after the actor's update (the last "
                f"step's samples came from version {self.served}): the hand-over of the new weights did not reach "
                "the rollout, which would train on stale samples without a sign"
            )
        self.served, self.updated_since = low, False
        return {"rollout/weight_version": float(low)}


def check_served_version(where: str, served: torch.Tensor | None, expected: int) -> None:
    """Off-policy generation: every sample of `served` (a `rollout_weight_version` column; None when the rollout path
    stamps none) must come from `expected`, the policy version the trainer last synced to the rollout before it
    launched the generation. Staleness is counted from `expected`, so a hand-over that never reached the rollout
    would make it wrong without a sign. Raises `StaleWeightsError` naming `where` and the versions."""
    if served is None or served.numel() == 0:
        return
    low, high = int(served.min()), int(served.max())
    if low != expected or high != expected:
        found = str(low) if low == high else f"{low} to {high}"
        raise StaleWeightsError(
            f"{where}: the rollout served weight version {found}, but the trainer synced version {expected} to it "
            "before launching this generation: a weight hand-over did not reach the rollout, and the samples' "
            "staleness would be counted wrong"
        )
