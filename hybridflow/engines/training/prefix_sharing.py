"""Shared-prompt packing: the `n` responses of a GRPO group go through the model with one copy of their prompt.

A micro-batch's rows are grouped by identical prompt tokens. Each group becomes one segment of a single packed
row, `[prompt, r1, r2, ..., rn]`; every response's position ids continue from the prompt's, and a block mask
lets each response attend to the prompt and to itself only. Each token's hidden state is then exactly what a
separate forward of `[prompt, r_i]` gives, so log-probs, values and gradients are the same while the prompt is
computed once per group instead of `n` times (verl's `use_prefix_grouper`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SharedPromptLayout", "build_shared_prompt_layout"]


@dataclass(frozen=True)
class SharedPromptLayout:
    """One packed row for a micro-batch, and where each response token's prediction comes from."""

    input_ids: torch.Tensor
    """(1, total) int64: each distinct prompt once, followed by the real tokens of every response sharing it."""
    position_ids: torch.Tensor
    """(1, total) int64: the rows' own position ids (responses continue their prompt's)."""
    attention_mask: torch.Tensor
    """(1, 1, total, total) bool, True = may attend: causal, within a group, a response sees the prompt and itself."""
    predictors: torch.Tensor
    """(bs, response_len) int64: index in the packed row of the token whose output predicts that response token
    (the last prompt token for the first one); -1 for padding, which predicts nothing."""
    num_rows: int
    """Rows of the micro-batch."""

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed row (what the model computes)."""
        return int(self.input_ids.size(1))


def build_shared_prompt_layout(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, response_length: int
) -> SharedPromptLayout:
    """The shared-prompt packing of a batch in the rollout layout (left-padded prompts, right-padded responses).

    input_ids, attention_mask, position_ids: (bs, prompt_len + response_length); a column is a real token where
    `attention_mask` is 1. Rows whose real prompt tokens are equal share one copy of them.
    """
    prompt_length = input_ids.size(1) - response_length
    ids_rows, pos_rows, mask_rows = input_ids.tolist(), position_ids.tolist(), attention_mask.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for row in range(len(ids_rows)):
        prompt = tuple(t for t, m in zip(ids_rows[row][:prompt_length], mask_rows[row][:prompt_length]) if m)
        groups.setdefault(prompt, []).append(row)
    ids, positions, group_of, owner_of = [], [], [], []  # owner: the row a response token belongs to, -1 = prompt
    predictors = torch.full((len(ids_rows), response_length), -1, dtype=torch.long)
    for group_index, rows in enumerate(groups.values()):
        first = rows[0]
        prompt_cols = [c for c in range(prompt_length) if mask_rows[first][c]]
        ids += [ids_rows[first][c] for c in prompt_cols]
        positions += [pos_rows[first][c] for c in prompt_cols]
        group_of += [group_index] * len(prompt_cols)
        owner_of += [-1] * len(prompt_cols)
        last_prompt = len(ids) - 1 if prompt_cols else -1
        for row in rows:
            previous = last_prompt
            for col in range(prompt_length, prompt_length + response_length):
                if not mask_rows[row][col]:
                    continue
                predictors[row, col - prompt_length] = previous
                previous = len(ids)
                ids.append(ids_rows[row][col])
                positions.append(pos_rows[row][col])
                group_of.append(group_index)
                owner_of.append(row)
    group = torch.tensor(group_of)
    owner = torch.tensor(owner_of)
    index = torch.arange(len(ids))
    allowed = (
        (index[None, :] <= index[:, None])
        & (group[None, :] == group[:, None])
        & ((owner[None, :] == -1) | (owner[None, :] == owner[:, None]))
    )
    device = input_ids.device
    return SharedPromptLayout(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([positions], dtype=torch.long, device=device),
        attention_mask=allowed[None, None].to(device),
        predictors=predictors.to(device),
        num_rows=len(ids_rows),
    )
