"""Reward-model training from preferences: the Bradley-Terry loss and building (chosen, rejected) pairs from
verifier-scored samples. Pure functions (torch / standard library)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["bradley_terry_loss", "preference_pairs"]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """`-mean log sigmoid(r_chosen - r_rejected)` over pairs, with the pair accuracy (`r_chosen > r_rejected`)
    and mean margin. chosen, rejected: (pairs,) scores."""
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    metrics = {"rm/accuracy": float((margin > 0).float().mean()), "rm/margin": float(margin.detach().mean())}
    return loss, metrics


def preference_pairs(
    groups: Sequence[str], scores: Sequence[float], max_pairs_per_group: int = 2
) -> list[tuple[int, int]]:
    """(chosen, rejected) sample indices: within each group (same prompt), a higher-scored sample against a
    lower-scored one, best against worst first, each sample used at most once, at most `max_pairs_per_group`."""
    by_group: dict[str, list[int]] = {}
    for index, group in enumerate(groups):
        by_group.setdefault(group, []).append(index)
    pairs: list[tuple[int, int]] = []
    for members in by_group.values():
        ranked = sorted(members, key=lambda index: -scores[index])  # stable: ties keep sample order
        high, low = 0, len(ranked) - 1
        taken = 0
        while high < low and taken < max_pairs_per_group and scores[ranked[high]] > scores[ranked[low]]:
            pairs.append((ranked[high], ranked[low]))
            high, low, taken = high + 1, low - 1, taken + 1
    return pairs
