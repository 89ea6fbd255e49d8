"""Token log-probs and entropy from the final hidden states, projected to the vocabulary a chunk of rows at a time.

The plain path has the model project every kept position at once: (N, V) float32 logits, plus the softmax
temporaries that autograd keeps for the backward (several (N, V) tensors). `chunked_log_probs` takes the hidden
states (N, H) and the head's weight (V, H) instead. It computes the logits of `chunk_size` rows at a time, keeps
only per-row results (log-prob, log-sum-exp, entropy: (N,) each), and recomputes each chunk's logits in the
backward. The head's peak memory drops from O(N x V) to O(chunk_size x V), for one more (chunk x H x V) matmul
per chunk in a training pass (none in a no-grad pass). This is Liger's fused linear cross-entropy and verl's
`FusedLinearForPPO` (its `use_fused_kernels` torch backend), returning per-token log-probs and entropy rather than
a loss, because the engine's loss functions take per-token values.

Tensor parallel: with a `VocabShard` the weight is this rank's vocabulary slice (V/tp, H). The log-sum-exp,
the picked logit and the entropy's mean logit are reduced over the shard's group as in `vocab_parallel`. The
hidden states' gradient is summed over the group, because each rank holds only its slice's share of it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.engines.training.vocab_parallel import VocabShard

__all__ = ["chunked_log_probs", "chunked_token_stats", "project_logits"]


def project_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None = None
) -> torch.Tensor:
    """hidden @ weight.T + bias in float32, as the head module computes it, soft-capped as
    `softcap * tanh(x / softcap)` when the model caps its logits (Gemma-2's `final_logit_softcapping`)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(C, H) -> (C, V) `project_logits` / temperature; with a soft cap, also tanh(x / softcap), whose derivative
    the backward needs."""
    logits = project_logits(hidden, weight, bias, softcap)
    if softcap is None:
        return logits / temperature, None
    return logits / temperature, logits / softcap


def _label_columns(labels: torch.Tensor, width: int, shard: VocabShard | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column in this rank's logits (clamped into range) and whether this rank holds it."""
    if shard is None:
        return labels, torch.ones_like(labels, dtype=torch.bool)
    local = labels - shard.vocab_start
    owned = (local >= 0) & (local < width)
    return local.clamp(0, width - 1), owned


def _forward_chunk(
    logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard | None, with_entropy: bool, with_sum_pi_squared: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log-prob of each row's label, log-sum-exp and (optionally) entropy and sum of squared probabilities of
    (C, V) logits: (C,) each."""
    if shard is None:  # the same ops as compute_log_probs_from_logits / entropy_from_logits
        lse = torch.logsumexp(logits, dim=-1)
        log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1) if with_entropy else None
        squares = (torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * lse).exp() if with_sum_pi_squared else None
        return log_probs, lse, entropy, squares
    group = shard.group
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    lse = peak + sum_exp.log()
    columns, owned = _label_columns(labels, logits.size(-1), shard)
    picked = torch.where(owned, logits.gather(-1, columns.unsqueeze(-1)).squeeze(-1), 0.0)
    sums = [picked]
    if with_entropy:  # E_p[logit] = sum_v exp(x_v - lse) x_v, summed over the slices
        sums.append(((logits - lse.unsqueeze(-1)).exp() * logits).sum(dim=-1))
    if with_sum_pi_squared:  # sum_v exp(2 (x_v - lse)), summed over the slices
        sums.append((2.0 * (logits - lse.unsqueeze(-1))).exp().sum(dim=-1))
    reduced = torch.stack(sums)
    dist.all_reduce(reduced, group=group)
    entropy = lse - reduced[1] if with_entropy else None
    return reduced[0] - lse, lse, entropy, reduced[-1] if with_sum_pi_squared else None


class _ChunkedLogProbs(torch.autograd.Function):
    """(log-probs, entropy, sum of squared probabilities) of `labels` under softmax(hidden @ weight.T + bias) /
    temperature, chunk by chunk; the sum of squares is not differentiable (a no-grad statistic)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden, weight, bias, labels, temperature, chunk_size, shard, with_entropy, with_sum_pi_squared, softcap
    ):
        ctx.set_materialize_grads(False)
        num_rows = hidden.size(0)
        log_probs = hidden.new_empty(num_rows, dtype=torch.float32)
        lse = hidden.new_empty(num_rows, dtype=torch.float32)
        entropy = hidden.new_empty(num_rows, dtype=torch.float32) if with_entropy else None
        squares = hidden.new_empty(num_rows, dtype=torch.float32) if with_sum_pi_squared else None
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits, _ = _chunk_logits(hidden[rows], weight, bias, temperature, softcap)
            log_probs[rows], lse[rows], chunk_entropy, chunk_squares = _forward_chunk(
                logits, labels[rows], shard, with_entropy, with_sum_pi_squared
            )
            if with_entropy:
                entropy[rows] = chunk_entropy
            if with_sum_pi_squared:
                squares[rows] = chunk_squares
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.shard, ctx.softcap = temperature, chunk_size, shard, softcap
        device_type = hidden.device.type  # the backward recomputes the logits under the forward's autocast
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        if squares is not None:
            ctx.mark_non_differentiable(squares)
        return log_probs, entropy, squares

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, _grad_squares):  # type: ignore[override]
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        temperature, chunk_size, shard = ctx.temperature, ctx.chunk_size, ctx.shard
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]  # a frozen head (LoRA) needs no weight grad
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_bias else None
        if grad_log_probs is None and grad_entropy is None:
            return _grads_out(grad_hidden, grad_weight, grad_bias, weight, bias)
        device_type, enabled, dtype = ctx.autocast
        # The two GEMMs per chunk run in the forward's compute dtype (bf16 under autocast), as autocast runs the
        # backward of a plain linear head: float32 master weights would otherwise send them to the slow
        # non-tensor-core float32 kernels (a third of a 0.5B model's update time on an H100, gpu_profile). The
        # weight is cast once; autocast's own cast of it, per chunk, would give the same logits.
        compute_dtype = dtype if enabled and weight.dtype == torch.float32 else weight.dtype
        compute_weight = weight.detach().to(compute_dtype)
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            chunk_hidden = hidden[rows]
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                logits, squashed = _chunk_logits(chunk_hidden, compute_weight, bias, temperature, ctx.softcap)
            grad_logits = _grad_logits(
                logits, labels[rows], lse[rows],
                None if entropy is None else entropy[rows],
                None if grad_log_probs is None else grad_log_probs[rows],
                None if grad_entropy is None else grad_entropy[rows],
                shard,
            )
            grad_logits = grad_logits.div_(temperature)  # d(x / T) / dx
            if squashed is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
                grad_logits.mul_(1 - squashed * squashed)
            grad_logits = grad_logits.to(compute_dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ compute_weight
            if grad_weight is not None and grad_weight.dtype == compute_dtype:
                grad_weight.addmm_(grad_logits.t(), chunk_hidden.to(compute_dtype))
            elif grad_weight is not None:  # low-precision products: accumulate the chunks in float32
                grad_weight.add_((grad_logits.t() @ chunk_hidden.to(compute_dtype)).float())
            if grad_bias is not None:
                grad_bias.add_(grad_logits.float().sum(dim=0))
        if grad_hidden is not None and shard is not None:
            dist.all_reduce(grad_hidden, group=shard.group)  # each rank's vocabulary slice contributes its part
        return _grads_out(grad_hidden, grad_weight, grad_bias, weight, bias)


def _grads_out(grad_hidden, grad_weight, grad_bias, weight, bias) -> tuple:
    """The backward's return: gradients of hidden, weight and bias in their dtypes, None for the other inputs."""
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
    return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _grad_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    shard: VocabShard | None,
) -> torch.Tensor:
    """Gradient of the chunk's outputs with respect to its (C, V) logits, computed in place of `logits`.

    d log p_label / d x_j = 1[j = label] - p_j;  d H / d x_j = -p_j (log p_j + H).
    """
    log_p = logits.sub_(lse.unsqueeze(-1))
    probs = log_p.exp()
    grad = torch.zeros_like(probs) if grad_log_probs is None else probs * -grad_log_probs.unsqueeze(-1)
    if grad_log_probs is not None:
        columns, owned = _label_columns(labels, logits.size(-1), shard)
        rows = torch.arange(labels.size(0), device=labels.device)
        # Full indices, zero where another rank holds the label: a boolean-mask gather would wait on the device.
        grad.index_put_((rows, columns), torch.where(owned, grad_log_probs, 0.0), accumulate=True)
    if grad_entropy is not None:
        grad.sub_(log_p.add_(entropy.unsqueeze(-1)).mul_(probs).mul_(grad_entropy.unsqueeze(-1)))
    return grad


def chunked_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    shard: VocabShard | None = None,
    calculate_entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` (and entropy) under softmax((hidden @ weight.T + bias) / temperature), float32; with
    `softcap`, the logits are capped first (softcap * tanh(logits / softcap)).

    hidden: (N, H); weight: (V, H), or this rank's (V/tp, H) with `shard`; bias: (V,) / (V/tp,) or None;
    labels: (N,) int64 vocabulary ids -> log_probs (N,), entropy (N,) or None. Differentiable in hidden, weight and
    bias; no (N, V) tensor is kept between forward and backward.
    """
    stats = chunked_token_stats(
        hidden, weight, labels, bias=bias, temperature=temperature, chunk_size=chunk_size, shard=shard,
        calculate_entropy=calculate_entropy, softcap=softcap,
    )
    return stats["log_probs"], stats.get("entropy")


def chunked_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    shard: VocabShard | None = None,
    calculate_entropy: bool = False,
    calculate_sum_pi_squared: bool = False,
    softcap: float | None = None,
) -> dict[str, torch.Tensor]:
    """`chunked_log_probs` as a dict: `log_probs`, and `entropy` and `sum_pi_squared` (N,) when asked (each row's
    sum of squared probabilities, from the same chunk's logits; not differentiable)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be (N, H) and labels (N,), got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    log_probs, entropy, squares = _ChunkedLogProbs.apply(
        hidden, weight, bias, labels, temperature, chunk_size, shard, calculate_entropy, calculate_sum_pi_squared,
        softcap,
    )
    stats = {"log_probs": log_probs, "entropy": entropy, "sum_pi_squared": squares}
    return {name: value for name, value in stats.items() if value is not None}
