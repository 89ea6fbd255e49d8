"""Token log-probs, entropy and sum of squared probabilities from logits split over the vocabulary (tensor
parallel), without gathering them.

Each tensor-parallel rank holds `logits[..., start:start + V/tp]`. The forward reduces max, sum-exp and the picked
logit over the group; the backward is local (each rank's gradient for its own vocabulary slice), because every
rank computes the same loss from the same reduced values: a summing all-reduce in the backward would count it
`tp` times. With `group=None` the plain single-process functions are used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.algorithms.entropy import entropy_from_logits, sum_pi_squared_from_logits
from hybridflow.engines.logprob import compute_log_probs_from_logits

__all__ = ["VocabShard", "token_entropy", "token_log_probs", "token_sum_pi_squared"]


class VocabShard:
    """Where this rank's logits sit in the vocabulary: its process group and first vocabulary id."""

    def __init__(self, group: dist.ProcessGroup, vocab_start: int) -> None:
        self.group = group
        self.vocab_start = vocab_start


def _logsumexp(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """log sum exp over the whole vocabulary (no autograd)."""
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - peak.unsqueeze(-1)).exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    return peak + sum_exp.log()


class _ParallelLogProbs(torch.autograd.Function):
    """log softmax(logits)[rows, labels] for vocabulary-split `logits` (N, V/tp)."""

    @staticmethod
    def forward(ctx, logits, rows, labels, shard: VocabShard):  # type: ignore[override]
        lse = _logsumexp(logits, shard.group)  # (N,)
        local = labels - shard.vocab_start
        owned = (local >= 0) & (local < logits.size(-1))
        local = local.clamp(0, logits.size(-1) - 1)
        picked = torch.where(owned, logits[rows, local], 0.0)
        dist.all_reduce(picked, group=shard.group)
        ctx.save_for_backward(logits, lse, rows, local, owned)
        return picked - lse[rows]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, lse, rows, local, owned = ctx.saved_tensors
        # d/dx_j of (x_label - lse) = 1[j = label] - softmax_j, summed over the outputs that read row i.
        row_grad = torch.zeros(logits.size(0), dtype=grad.dtype, device=grad.device).index_add_(
            0, rows.flatten(), grad.flatten()
        )
        grad_logits = -(logits - lse.unsqueeze(-1)).exp() * row_grad.unsqueeze(-1)
        # full indices, zero where another rank holds the label (no boolean-mask gather: it waits on the device)
        grad_logits.index_put_((rows, local), torch.where(owned, grad, 0.0).to(grad_logits.dtype), accumulate=True)
        return grad_logits, None, None, None


class _ParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) per row for vocabulary-split `logits` (N, V/tp)."""

    @staticmethod
    def forward(ctx, logits, shard: VocabShard):  # type: ignore[override]
        lse = _logsumexp(logits, shard.group)
        probs = (logits - lse.unsqueeze(-1)).exp()
        mean_logit = (probs * logits).sum(dim=-1)
        dist.all_reduce(mean_logit, group=shard.group)
        entropy = lse - mean_logit
        ctx.save_for_backward(logits, lse, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        logits, lse, entropy = ctx.saved_tensors
        log_probs = logits - lse.unsqueeze(-1)
        # dH/dx_j = -p_j (log p_j + H)
        return -grad.unsqueeze(-1) * log_probs.exp() * (log_probs + entropy.unsqueeze(-1)), None


def token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor | None = None, shard: VocabShard | None = None
) -> torch.Tensor:
    """log softmax(logits)[rows, labels] in float32.

    logits: (N, V) (or this rank's (N, V/tp) with `shard`); labels: (...) int64; rows: (...) int64 row of each
    label (default: label i reads row i, labels of shape (N,)) -> (...) float32.
    """
    logits = logits.float()
    if shard is None:
        if rows is None:
            return compute_log_probs_from_logits(logits, labels)
        return logits[rows, labels] - torch.logsumexp(logits, dim=-1)[rows]
    if rows is None:
        rows = torch.arange(logits.size(0), device=logits.device)
    return _ParallelLogProbs.apply(logits, rows, labels, shard)


def token_entropy(logits: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) per row in nats, float32: (N, V) or (N, V/tp) with `shard` -> (N,)."""
    if shard is None:
        return entropy_from_logits(logits.float())
    return _ParallelEntropy.apply(logits.float(), shard)


@torch.no_grad()
def token_sum_pi_squared(logits: torch.Tensor, shard: VocabShard | None = None) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 per row, float32, not differentiable: (N, V) or (N, V/tp) with `shard` -> (N,).
    Split over the vocabulary, each rank sums exp(2 (x_v - lse)) over its slice under the whole vocabulary's
    log-sum-exp, and the slices' sums are added."""
    logits = logits.float()
    if shard is None:
        return sum_pi_squared_from_logits(logits)
    lse = _logsumexp(logits, shard.group)
    squares = (2.0 * (logits - lse.unsqueeze(-1))).exp().sum(dim=-1)
    dist.all_reduce(squares, group=shard.group)
    return squares
