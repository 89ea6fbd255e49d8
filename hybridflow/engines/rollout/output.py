"""The rollout output layout (see `hybridflow.engines.rollout.base`), assembled in one place.

Every backend (`hf`, `native`, `vllm`) and the agent-loop manager call `build_rollout_output`, so the driver
and the workers see one layout whoever generated the batch.

Position ids follow one rule: response column j has position `last prompt position + 1 + j`
(`compute_response_position_ids`). Responses are right-padded, so their real tokens (model tokens, and for
agent loops tool/user tokens too) are the leading columns and get consecutive positions after the prompt's,
exactly as in generation. Pad columns get positions as well, but attention 0: the training engine's padded
forward masks them out and its packed forward (`pack_sequences`) drops them, so their values never matter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybridflow.engines.logprob import compute_response_position_ids
from hybridflow.protocol import DataProto


def build_rollout_output(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_position_ids: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    pad_token_id: int,
    *,
    attention_response_mask: torch.Tensor | None = None,
    non_tensor: Mapping[str, Any] | None = None,
    meta_info: Mapping[str, Any] | None = None,
) -> DataProto:
    """A rollout's output `DataProto` with its tensors on CPU.

    Args:
        prompt_ids, prompt_mask: (bs, prompt_len) int64, left-padded prompts.
        prompt_position_ids: (bs, prompt_len), or (bs, 4, prompt_len) for M-RoPE models (vision-language).
        responses: (bs, response_len) int64; columns outside `attention_response_mask` become `pad_token_id`.
        response_mask: (bs, response_len) int, 1 on tokens the model sampled (the ones trained on).
        log_probs: (bs, response_len) float, sampled-token log-probs; zeroed where `response_mask` is 0.
        pad_token_id: the id written into pad columns of `responses`.
        attention_response_mask: (bs, response_len) int, 1 on every real response token (model, tool and
            user tokens), right-padded; None: `response_mask` (every real token was sampled).
        non_tensor: per-row arrays for `non_tensor_batch`.
        meta_info: carried over as is.

    Raises:
        ValueError: shapes disagree, the response attention is not right-padded, or `response_mask` marks a
            token that is not attended.
    """
    attention = response_mask if attention_response_mask is None else attention_response_mask
    _check_layout(prompt_ids, prompt_mask, prompt_position_ids, responses, response_mask, log_probs, attention)
    prompt_ids, prompt_mask, prompt_position_ids = prompt_ids.cpu(), prompt_mask.cpu(), prompt_position_ids.cpu()
    response_mask, log_probs, attention = response_mask.cpu().long(), log_probs.cpu(), attention.cpu()
    responses = torch.where(attention.bool(), responses.cpu(), pad_token_id)
    response_positions = compute_response_position_ids(prompt_position_ids, responses.size(1))
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, attention.to(prompt_mask.dtype)], dim=1),
        "position_ids": torch.cat([prompt_position_ids, response_positions], dim=-1),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs.float() * response_mask,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(non_tensor or {}), meta_info=dict(meta_info or {}))


def _check_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    prompt_position_ids: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    attention: torch.Tensor,
) -> None:
    """ValueError naming the first way the inputs break `build_rollout_output`'s contract."""
    positions = prompt_position_ids
    positions_shape = (positions.size(0), positions.size(-1)) if positions.dim() == 3 else tuple(positions.shape)
    prompt_shapes = {tuple(prompt_ids.shape), tuple(prompt_mask.shape), positions_shape}
    response_shapes = {tuple(t.shape) for t in (responses, response_mask, log_probs, attention)}
    if len(prompt_shapes) != 1 or len(response_shapes) != 1:
        raise ValueError(
            f"prompt tensors must share one shape and response tensors another, got {sorted(prompt_shapes)} "
            f"and {sorted(response_shapes)}"
        )
    if prompt_ids.size(0) != responses.size(0):
        raise ValueError(f"{prompt_ids.size(0)} prompt rows but {responses.size(0)} response rows")
    attended = attention.bool()
    if (attended[:, 1:] & ~attended[:, :-1]).any():
        raise ValueError("the response attention mask must be right-padded (real tokens first, then pad)")
    if (response_mask.bool() & ~attended).any():
        raise ValueError("response_mask marks tokens that attention_response_mask does not attend")


def build_output_for_prompts(
    prompts: DataProto,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    log_probs: torch.Tensor,
    pad_token_id: int,
    n: int = 1,
    attention_response_mask: torch.Tensor | None = None,
) -> DataProto:
    """`build_rollout_output` for a batch rollout: `n` responses per row of `prompts` (rows interleaved: prompt 0
    n times, then prompt 1, ...), whose prompt tensors, per-sample data and meta info are repeated to match.
    `attention_response_mask` as in `build_rollout_output` (agent loops: tool tokens attended, not trained)."""
    if n > 1:
        prompts = prompts.repeat(n, interleave=True)
    return build_rollout_output(
        prompts.batch["input_ids"],
        prompts.batch["attention_mask"],
        prompts.batch["position_ids"],
        responses,
        response_mask,
        log_probs,
        pad_token_id,
        attention_response_mask=attention_response_mask,
        non_tensor=prompts.non_tensor_batch,
        meta_info=prompts.meta_info,
    )
