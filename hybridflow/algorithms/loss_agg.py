"""Loss aggregation: how a (bs, response_len) per-token loss becomes the scalar that is backpropagated.

One function, `agg_loss`, with verl's modes and argument names. With the global counts given (the
number of valid tokens / sequences in the whole mini-batch across all data-parallel ranks), the
result is invariant to micro-batching and to the data-parallel size: summing the losses of all
micro-batches of one rank, then averaging the gradients across `dp_size` ranks (as FSDP/DDP do),
gives exactly the gradient of the loss computed on the whole mini-batch at once.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.config import LOSS_AGG_MODES, LossAggMode
from hybridflow.algorithms.masked import masked_sum

__all__ = ["LossAggMode", "LOSS_AGG_MODES", "agg_loss"]


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar.

    Modes (`L` = loss_mat, `M` = loss_mask, `T` = batch_num_tokens, `B` = global_batch_size,
    sums over this micro-batch; `dp_size` undoes the gradient averaging across data-parallel ranks):

    - `token-mean`: `sum(L*M) / T * dp_size`  (every token of the mini-batch weighs the same)
    - `token-sum`: `sum(L*M) * dp_size`  (no normalisation)
    - `seq-mean-token-sum`: `sum_i(sum_t L*M) / B * dp_size`
    - `seq-mean-token-mean`: `sum_i(sum_t L*M / (sum_t M + 1e-8)) / B * dp_size`
    - `seq-mean-token-sum-norm`: `seq-mean-token-sum / loss_scale_factor` (Dr. GRPO; the factor
      defaults to `response_len`, set it to a constant to keep it fixed across steps)

    Sequences whose mask is all zero count in neither `T` nor `B`.

    Args:
        loss_mat: (bs, response_len) per-token loss of this micro-batch.
        loss_mask: (bs, response_len) 0/1 mask.
        loss_agg_mode: one of `LOSS_AGG_MODES`.
        dp_size: data-parallel world size (number of ranks whose gradients are averaged).
        batch_num_tokens: valid tokens in the global mini-batch (all micro-batches, all ranks).
            `None` uses this micro-batch's count (only allowed with `dp_size == 1`).
        global_batch_size: non-empty sequences in the global mini-batch. `None` uses this
            micro-batch's count (only allowed with `dp_size == 1`).
        loss_scale_factor: divisor for `seq-mean-token-sum-norm`; `None` uses `response_len`.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: unknown mode, or `dp_size > 1` without the global count the mode needs.

    verl conformance: same formulas and argument names as verl's `agg_loss`. Two small differences:
    `token-sum` is an addition, and a micro-batch count of zero (all tokens masked) is clamped to 1, so
    a fully masked micro-batch gives 0 instead of verl's NaN.
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            _require_single_rank(dp_size, "batch_num_tokens", loss_agg_mode)
            batch_num_tokens = loss_mask.sum().clamp(min=1)
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        seq_num_tokens = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, axis=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (seq_num_tokens + 1e-8)
        seq_mask = (seq_num_tokens > 0).to(seq_losses.dtype)
        if global_batch_size is None:
            _require_single_rank(dp_size, "global_batch_size", loss_agg_mode)
            global_batch_size = seq_mask.sum().clamp(min=1)
        loss = masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; known: {list(LOSS_AGG_MODES)}")


def _require_single_rank(dp_size: int, arg: str, mode: str) -> None:
    if dp_size > 1:
        raise ValueError(
            f"agg_loss(loss_agg_mode={mode!r}) with dp_size={dp_size} needs the global `{arg}`; "
            "pass the count over the whole mini-batch on all ranks"
        )
