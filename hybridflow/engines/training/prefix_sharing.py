"""Shared-prompt packing: the `n` responses of a GRPO group go through the model with one copy of their prompt.

A micro-batch's rows are grouped by identical prompt tokens. Each group becomes one row of the forward,
`[prompt, r1, r2, ..., rn]`, padded so that every row's prompt ends in the same column (the columns the head
projects then line up across rows) and to the longest row; every response's position ids continue from the
prompt's, and a block mask lets each response attend to the prompt and to itself only. The layout keeps that mask
as two vectors (each token's group and owning row), so building it costs memory linear in tokens; the dense mask
that sdpa/eager attention take is expanded on the device by the forward, one (L, L) block per group (G x L^2 for
G groups of at most L tokens, against T^2 for all T tokens in one row: at a 16k-token budget of 8 groups, 33 MB
instead of 268 MB). Each token's hidden state is then exactly what a separate forward of `[prompt, r_i]` gives, so
log-probs, values and gradients are the same while the prompt is computed once per group instead of `n` times
(verl's `use_prefix_grouper`).

The layout is built on the host from host copies of the micro-batch (numpy; no device synchronisation) and its
index tensors are moved to the device without blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.utils.device import to_device_async

__all__ = ["SharedPromptLayout", "build_shared_prompt_layout", "compute_prompt_groups"]


@dataclass(frozen=True)
class SharedPromptLayout:
    """The forward rows of a micro-batch, one per prompt group, and where each response token's prediction comes
    from. Positions are flat indices into the (groups, length) rows, row-major."""

    input_ids: torch.Tensor
    """(groups, length) int64: a group's prompt once, then the real tokens of every response sharing it; padded."""
    position_ids: torch.Tensor
    """(groups, length) int64: the rows' own position ids (responses continue their prompt's); 0 on padding."""
    segment: torch.Tensor
    """(groups * length,) int64: the prompt group of each position, -1 on padding."""
    owner: torch.Tensor
    """(groups * length,) int64: the row a response token belongs to, -1 for prompt tokens, -2 on padding. With
    `segment` this is the whole attention pattern in O(tokens) memory: `attention_mask()` expands it on the device
    for the forward."""
    predictors: torch.Tensor
    """(bs, response_len) int64 on the host: position of the token whose output predicts that response token (the
    last prompt token for the first one); -1 for padding, which predicts nothing."""
    valid_index: torch.Tensor
    """(n,) int64: flat index in (bs * response_len) of each real response token, row-major."""
    predictor_of_valid: torch.Tensor
    """(n,) int64: position of the token predicting each of them."""
    kept: torch.Tensor
    """(k,) int64: the columns of the rows that hold a predicting position, ascending (the model's
    `logits_to_keep`: it projects these columns of every row; as the prompts end in one column, k is at most the
    longest group's response tokens)."""
    kept_row_of_valid: torch.Tensor
    """(n,) int64: each real response token's row in the projected (groups * k) positions."""
    num_rows: int
    response_length: int
    num_tokens: int
    """Real tokens in the forward rows (what the model computes; padding excluded)."""
    attention_pairs: int
    """Attention pairs counted as separate sequences count them (sum of squared lengths): per group
    P^2 + sum_i (2 r_i P + r_i^2) for a prompt of P tokens and responses of r_i tokens."""

    @property
    def groups(self) -> int:
        return int(self.input_ids.size(0))

    @property
    def length(self) -> int:
        """Columns per forward row: the longest group's tokens."""
        return int(self.input_ids.size(1))

    def allowed(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Whether position q may attend to kv (flat positions, elementwise over index tensors; both in one row):
        causal, within a group, and a response sees its prompt and itself. A padding position sees the padding
        before it and itself, so no softmax row is empty. `attention_mask()` is this over every pair of a row;
        flex_attention's block mask evaluates it block by block."""
        seg, own = self.segment, self.owner
        return (kv <= q) & (seg[kv] == seg[q]) & ((own[kv] == -1) | (own[kv] == own[q]))

    def attention_mask(self) -> torch.Tensor:
        """(groups, 1, length, length) bool, True = may attend (`allowed` within each row). Built where the layout
        lives, from `segment` and `owner`, when the forward needs it (sdpa and eager attention take a dense mask;
        the layout itself stays linear in tokens)."""
        index = torch.arange(self.groups * self.length, device=self.segment.device).view(self.groups, self.length)
        return self.allowed(index[:, :, None], index[:, None, :])[:, None]

    @property
    def num_predicted(self) -> int:
        """Response tokens predicted (positions the head projects, one per token)."""
        return int(self.valid_index.numel())


def compute_prompt_groups(
    input_ids: np.ndarray | torch.Tensor, attention_mask: np.ndarray | torch.Tensor, response_length: int
) -> np.ndarray:
    """Which rows share their prompt: a group index per row, groups numbered in order of first appearance.

    input_ids, attention_mask: (bs, prompt_len + response_length) host arrays -> (bs,) int64.
    """
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask).astype(bool)
    prompt_length = ids.shape[1] - response_length
    # Left-padded equal prompts have equal padding too: rows with equal keys share a prompt.
    keys = np.where(mask[:, :prompt_length], ids[:, :prompt_length], -1)
    if keys.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    _, first_row, group_of_row = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    rank_of_group = np.argsort(np.argsort(first_row, kind="stable"))  # by first appearance
    return rank_of_group[group_of_row.reshape(-1)].astype(np.int64)


def build_shared_prompt_layout(
    input_ids: np.ndarray | torch.Tensor,
    attention_mask: np.ndarray | torch.Tensor,
    position_ids: np.ndarray | torch.Tensor,
    response_length: int,
    *,
    device: torch.device | str = "cpu",
) -> SharedPromptLayout:
    """The shared-prompt rows of a batch in the rollout layout (left-padded prompts, right-padded responses).

    input_ids, attention_mask, position_ids: (bs, prompt_len + response_length) host arrays (or CPU tensors); a
    column is a real token where `attention_mask` is nonzero. Rows whose real prompt tokens are equal share one
    copy of them, in one forward row per group. The layout's tensors are put on `device`.
    """
    ids, mask, pos = (np.asarray(a) for a in (input_ids, attention_mask, position_ids))
    mask = mask.astype(bool)
    bs, seq = ids.shape
    prompt_length = seq - response_length
    group_of_row = compute_prompt_groups(ids, mask, response_length)
    num_groups = int(group_of_row.max()) + 1 if bs else 0
    packed_ids, packed_pos, group_of, owner_of = [], [], [], []  # owner: the row a response token belongs to
    group_lengths: list[int] = []  # each group's tokens: its prompt, then its responses
    group_prompts: list[int] = []
    predictors = np.full((bs, response_length), -1, dtype=np.int64)
    offset, pairs = 0, 0
    for group in range(num_groups):
        group_start = offset
        rows = np.flatnonzero(group_of_row == group)
        prompt_cols = np.flatnonzero(mask[rows[0], :prompt_length])
        num_prompt = len(prompt_cols)
        group_prompts.append(num_prompt)
        packed_ids.append(ids[rows[0], prompt_cols])
        packed_pos.append(pos[rows[0], prompt_cols])
        group_of.append(np.full(num_prompt, group))
        owner_of.append(np.full(num_prompt, -1))
        offset += num_prompt
        pairs += num_prompt * num_prompt
        last_prompt = offset - 1 if num_prompt else -1
        for row in rows:
            cols = np.flatnonzero(mask[row, prompt_length:])
            count = len(cols)
            packed = offset + np.arange(count)
            predictors[row, cols] = np.concatenate([[last_prompt], packed[:-1]])[:count]
            packed_ids.append(ids[row, prompt_length + cols])
            packed_pos.append(pos[row, prompt_length + cols])
            group_of.append(np.full(count, group))
            owner_of.append(np.full(count, row))
            offset += count
            pairs += 2 * count * num_prompt + count * count
        group_lengths.append(offset - group_start)
    num_tokens = offset
    # Every group's prompt ends in the same column (shorter prompts are left-padded), so the columns that predict
    # response tokens line up across rows and the head projects few columns besides them.
    longest_prompt = max(group_prompts, default=0)
    shifts = [longest_prompt - prompt for prompt in group_prompts]
    length = max((shift + n for shift, n in zip(shifts, group_lengths)), default=0)
    # Packed order -> (group, column) positions: each group's tokens are contiguous in packed order.
    flat_of_packed = np.concatenate(
        [g * length + shift + np.arange(n) for g, (shift, n) in enumerate(zip(shifts, group_lengths))]
        or [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)

    def rows_of(values: list[np.ndarray], pad: int) -> np.ndarray:
        flat = np.full(num_groups * length, pad, dtype=np.int64)
        if values:
            flat[flat_of_packed] = np.concatenate(values)
        return flat

    real = predictors >= 0
    predictors[real] = flat_of_packed[predictors[real]]
    valid_index = np.flatnonzero(real.reshape(-1))
    predictor_of_valid = predictors.reshape(-1)[valid_index]
    kept, column_rank = np.unique(predictor_of_valid % max(length, 1), return_inverse=True)
    kept_row_of_valid = (predictor_of_valid // max(length, 1)) * len(kept) + column_rank.reshape(-1)
    device = torch.device(device)
    put = lambda array: to_device_async(array, device)  # noqa: E731

    return SharedPromptLayout(
        input_ids=put(rows_of(packed_ids, 0).reshape(num_groups, length)),
        position_ids=put(rows_of(packed_pos, 0).reshape(num_groups, length)),
        segment=put(rows_of(group_of, -1)),
        owner=put(rows_of(owner_of, -2)),
        predictors=torch.from_numpy(predictors),
        valid_index=put(valid_index),
        predictor_of_valid=put(predictor_of_valid),
        kept=put(kept if len(kept) else np.zeros(1, dtype=np.int64)),
        kept_row_of_valid=put(kept_row_of_valid.astype(np.int64)),
        num_rows=bs,
        response_length=response_length,
        num_tokens=num_tokens,
        attention_pairs=pairs,
    )
