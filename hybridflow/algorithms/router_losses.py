"""Mixture-of-experts router losses and routing metrics: pure functions of the routers' logits and choices.

Shapes: L MoE layers, T tokens, E routed experts, k experts per token. `token_mask` (T,) marks the real tokens
(1) against padding (0). Every function reduces over the masked tokens only.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "compute_load_balancing_loss", "compute_router_z_loss", "compute_tokens_per_expert", "compute_router_entropy",
    "compute_dropped_token_fraction", "compute_router_metrics",
]


def _mask(token_mask: torch.Tensor | None, num_tokens: int, like: torch.Tensor) -> torch.Tensor:
    if token_mask is None:
        return like.new_ones(num_tokens, dtype=torch.float32)
    return token_mask.reshape(-1).to(device=like.device, dtype=torch.float32)


def compute_load_balancing_loss(
    router_logits: torch.Tensor, selected: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss as transformers computes it (`load_balancing_loss_func`), so that
    the model config's `router_aux_loss_coef` means the same here:

        E * sum_e f_e * P_e,   f_e = (assignments to e) / tokens,   P_e = mean router probability of e,

    with f and P summed over layers before the product (uniform routing gives k). router_logits: (L, T, E) float;
    selected: (L, T, k) int64, the experts chosen -> () float32 (differentiable through the probabilities)."""
    mask = _mask(token_mask, router_logits.size(1), router_logits)
    probs = torch.softmax(router_logits.float(), dim=-1)
    total = mask.sum() * router_logits.size(0)
    tokens_per_expert = compute_tokens_per_expert(selected, num_experts, token_mask).sum(0) / total
    prob_per_expert = (probs * mask[None, :, None]).sum(dim=(0, 1)) / total
    return num_experts * (tokens_per_expert * prob_per_expert).sum()


def compute_router_z_loss(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over layers and real tokens of
    logsumexp(logits)^2. router_logits: (L, T, E) -> () float32."""
    mask = _mask(token_mask, router_logits.size(1), router_logits)
    z = torch.logsumexp(router_logits.float(), dim=-1).square()  # (L, T)
    return (z * mask).sum() / (mask.sum() * router_logits.size(0)).clamp(min=1.0)


def compute_tokens_per_expert(
    selected: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Assignments per expert and layer. selected: (L, T, k) int64 -> (L, E) float32 (sums to k * real tokens)."""
    mask = _mask(token_mask, selected.size(1), selected)
    k = selected.size(-1)
    weights = mask.repeat_interleave(k).expand(selected.size(0), -1).contiguous()
    counts = torch.zeros(selected.size(0), num_experts, device=selected.device)
    return counts.scatter_add(1, selected.reshape(selected.size(0), -1), weights)


def compute_router_entropy(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over real tokens of the entropy (nats) of each layer's router distribution softmax(logits).
    router_logits: (L, T, E) -> (L,) float32."""
    mask = _mask(token_mask, router_logits.size(1), router_logits)
    logp = torch.log_softmax(router_logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # (L, T)
    return (entropy * mask).sum(-1) / mask.sum().clamp(min=1.0)


def compute_dropped_token_fraction(tokens_per_expert: torch.Tensor, capacity_factor: float) -> torch.Tensor:
    """The share of assignments over each expert's capacity ceil(capacity_factor * assignments / E) (GShard's
    token dropping), per layer. tokens_per_expert: (L, E) -> (L,) float32 in [0, 1]."""
    total = tokens_per_expert.sum(-1)
    capacity = torch.ceil(capacity_factor * total / tokens_per_expert.size(-1))
    dropped = (tokens_per_expert - capacity[:, None]).clamp(min=0).sum(-1)
    return dropped / total.clamp(min=1.0)


def compute_router_metrics(
    router_logits: torch.Tensor,
    selected: torch.Tensor,
    num_experts: int,
    token_mask: torch.Tensor | None = None,
    capacity_factor: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-step routing metrics (0-dim tensors): for each layer i, `moe/layer_{i}/tokens_per_expert_max` and
    `_mean` (assignments), `moe/tokens_per_expert_max_over_mean` (the worst layer's imbalance, 1 is balanced),
    `moe/router_entropy` (mean over layers, nats; log E is uniform) and, with `capacity_factor`,
    `moe/dropped_token_fraction`. Shapes as in `compute_load_balancing_loss`."""
    with torch.no_grad():
        counts = compute_tokens_per_expert(selected, num_experts, token_mask)
        metrics: dict[str, torch.Tensor] = {}
        for layer in range(counts.size(0)):
            metrics[f"moe/layer_{layer}/tokens_per_expert_max"] = counts[layer].max()
            metrics[f"moe/layer_{layer}/tokens_per_expert_mean"] = counts[layer].mean()
        ratio = counts.max(-1).values / counts.mean(-1).clamp(min=1e-12)
        metrics["moe/tokens_per_expert_max_over_mean"] = ratio.max()
        metrics["moe/router_entropy"] = compute_router_entropy(router_logits, token_mask).mean()
        if capacity_factor is not None:
            if not math.isfinite(capacity_factor) or capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
            metrics["moe/dropped_token_fraction"] = compute_dropped_token_fraction(counts, capacity_factor).mean()
    return metrics
