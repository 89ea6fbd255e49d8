"""PF-PPO's policy filtration (Zhang et al. 2024, "Policy Filtration in RLHF to Fine-Tune LLM for Code Generation";
verl's `compute_pf_ppo_reweight_data`): resample a batch with replacement, each sample weighted by its reward
score, so that the update sees mostly the samples whose reward is most reliable."""

from __future__ import annotations

import torch

WEIGHT_FLOOR = 1e-8
"""Added to every weight (and its floor), so that a batch of zero scores resamples uniformly."""


@torch.no_grad()
def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """Sampling weights (bs,) of the samples' summed reward scores (bs,).

    pow: |score|^weight_pow; max_min: 1 for the batch's highest and lowest scores, else 0; max_random: 0.4 for the
    highest, else 0.1. Every weight is at least WEIGHT_FLOOR.
    """
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown PF-PPO reweight_method {reweight_method!r}; known: pow, max_min, max_random")
    return (weights + WEIGHT_FLOOR).clamp(min=WEIGHT_FLOOR)


def pf_ppo_resample_indices(
    scores: torch.Tensor, reweight_method: str, weight_pow: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Indices (bs,) of a resampled batch of the same size, drawn with replacement by `pf_ppo_weights`."""
    weights = pf_ppo_weights(scores.float(), reweight_method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
