"""Pure tensor helpers of the engines, against hand-computed values."""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.entropy import entropy_from_logits
from hybridflow.engines.logprob import (
    compute_log_probs_from_logits,
    compute_response_mask,
    compute_response_position_ids,
    pack_sequences,
    unpack_sequences,
)


def test_log_probs_and_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -math.inf, -math.inf]])
    labels = torch.tensor([2, 0])
    expected = torch.tensor([-math.log(4), math.log(0.75)])
    torch.testing.assert_close(compute_log_probs_from_logits(logits, labels), expected)
    uniform = entropy_from_logits(logits[:1])
    torch.testing.assert_close(uniform, torch.tensor([math.log(4)]))


def test_response_mask_stops_after_first_eos():
    responses = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 2, 2], [5, 9, 3, 3]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    assert torch.equal(compute_response_mask(responses, [2, 9]), expected)


def test_response_position_ids_continue_prompt():
    prompt_pos = torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]])
    assert torch.equal(compute_response_position_ids(prompt_pos, 3), torch.tensor([[2, 3, 4], [4, 5, 6]]))


def test_pack_unpack_roundtrip():
    ids = torch.tensor([[0, 4, 5], [6, 7, 0]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    pos = torch.tensor([[0, 0, 1], [0, 1, 1]])
    packed_ids, packed_pos, keep = pack_sequences(ids, mask, pos)
    assert packed_ids.tolist() == [[4, 5, 6, 7]] and packed_pos.tolist() == [[0, 1, 0, 1]]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert unpack_sequences(values, keep).tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
