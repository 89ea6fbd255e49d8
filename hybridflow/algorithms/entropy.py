"""Token entropy of the policy from its logits, and the entropy bonus term.

`H = logsumexp(z) - sum_v softmax(z)_v z_v` (equal to `-sum p log p`, without materialising `log p`).
The chunked variant processes rows in float32 blocks so that the peak extra memory is one
(chunk_size, vocab) block instead of a full copy of the logits.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.loss_agg import agg_loss

__all__ = [
    "entropy_from_logits", "entropy_from_logits_with_chunking", "compute_entropy_loss", "sum_pi_squared_from_logits",
]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution `softmax(logits)` over the last dimension.

    Args:
        logits: (..., vocab_size), e.g. (bs, response_len, vocab_size).

    Returns:
        (...,) in the dtype of `logits`, e.g. (bs, response_len).
    """
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """`sum_v softmax(logits)_v^2` over the last dimension, `exp(logsumexp(2 z) - 2 logsumexp(z))` (no probabilities
    materialised; verl's `calculate_sum_pi_squared_from_logits`, read by the optimal-token-baseline estimator).

    Args:
        logits: (..., vocab_size).

    Returns:
        (...,) in the dtype of `logits`, in (0, 1].
    """
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """Memory-light `entropy_from_logits`: rows are processed `chunk_size` at a time in float32.

    Args:
        logits: (..., vocab_size); leading dimensions are flattened into rows (verl takes (num_tokens,
            vocab_size) here; that case is unchanged).
        chunk_size: rows per block.

    Returns:
        (...,) float32. Differentiable: each block keeps its own graph.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    lead_shape = logits.shape[:-1]
    rows = logits.reshape(-1, logits.shape[-1])
    chunks = [entropy_from_logits(rows[i : i + chunk_size].float()) for i in range(0, rows.shape[0], chunk_size)]
    entropy = torch.cat(chunks) if chunks else rows.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(lead_shape)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """Aggregated token entropy (the actor subtracts `entropy_coeff` times this).

    Args:
        logits: (bs, response_len, vocab_size).
        response_mask: (bs, response_len).
        loss_agg_mode: see `agg_loss`.

    Returns:
        0-dim tensor.
    """
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
