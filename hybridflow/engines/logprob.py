"""Pure tensor functions shared by engines: token log-probs from logits, response masks, sequence packing.

Entropy from logits is `hybridflow.algorithms.entropy.entropy_from_logits`.

Both the training engine and the rollout engines compute sampled-token log-probs with
`compute_log_probs_from_logits(logits / temperature, tokens)` on float32 logits, so that they agree.
"""

from __future__ import annotations

import torch


def compute_log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] in float32.

    logits: (..., vocab) float; labels: (...) int64 -> (...) float32.
    """
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def compute_response_position_ids(prompt_position_ids: torch.Tensor, response_length: int) -> torch.Tensor:
    """Position ids of response tokens continuing the prompt's last position (each row of M-RoPE ids too: text
    after the image continues every row by one, as in generation).

    prompt_position_ids: (bs, prompt_len) or (bs, rows, prompt_len) int64 -> (bs, [rows,] response_length) int64.
    """
    steps = torch.arange(1, response_length + 1, device=prompt_position_ids.device, dtype=prompt_position_ids.dtype)
    return prompt_position_ids[..., -1:] + steps


def compute_response_mask(responses: torch.Tensor, eos_token_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
    """1 for response tokens up to and including the first eos token, 0 after it.

    responses: (bs, response_len) int64 -> (bs, response_len) int64.
    """
    eos = torch.tensor(list(eos_token_ids), device=responses.device, dtype=responses.dtype)
    is_eos = torch.isin(responses, eos).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos
    return (eos_before == 0).long()


def pack_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop pad tokens and concatenate the sequences of a batch into one row.

    input_ids, attention_mask, position_ids: (bs, seq) ->
    packed_ids (1, total) int64, packed_position_ids (1, total) int64, keep (bs, seq) bool.
    Position ids must restart at 0 in each sequence: with `use_cache=False` and no attention mask,
    transformers then builds a block-diagonal causal mask, so sequences do not attend to each other.
    """
    keep = attention_mask.bool()
    return input_ids[keep].unsqueeze(0), position_ids[keep].unsqueeze(0), keep


def unpack_sequences(packed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_sequences` for per-token values; pad positions get 0.

    packed: (total,) float; keep: (bs, seq) bool -> (bs, seq) float.
    """
    return packed.new_zeros(keep.shape).masked_scatter(keep, packed)
