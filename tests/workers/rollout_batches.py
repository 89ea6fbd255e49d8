"""The prompt batch and comparison that the actor-rollout worker tests share."""

from __future__ import annotations

import torch

from hybridflow.protocol import DataProto


PROMPT_LEN, RESPONSE_LEN, BATCH = 8, 6, 4


def prompts() -> DataProto:
    ids = torch.randint(5, 200, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids})


def masked_max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())
