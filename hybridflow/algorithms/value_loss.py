"""The critic's clipped value loss (PPO, as in verl's `compute_value_loss`)."""

from __future__ import annotations

import torch

from hybridflow.algorithms.loss_agg import agg_loss
from hybridflow.algorithms.masked import clip_by_value, masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: `0.5 * agg(max((v - R)^2, (clip(v, V_old - c, V_old + c) - R)^2))`.

    Args:
        vpreds: (bs, response_len) current value predictions (carry the gradient).
        returns: (bs, response_len) targets from the advantage estimator.
        values: (bs, response_len) values at rollout time (the clipping centre).
        response_mask: (bs, response_len).
        cliprange_value: clip range `c` (`critic.cliprange_value`).
        loss_agg_mode: see `agg_loss` (`critic.loss_agg_mode`).
        dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: global-batch
            normalisation, passed to `agg_loss` (defaults reproduce verl).

    Returns:
        (vf_loss, vf_clipfrac): 0-dim tensors; `vf_clipfrac` is the masked share of tokens where the
        clipped term is the larger one.
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(
        clipped_vf_losses, response_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac
