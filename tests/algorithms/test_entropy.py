"""Entropy from logits, plain and chunked."""

import math

import pytest
import torch

from hybridflow.algorithms import compute_entropy_loss, entropy_from_logits, entropy_from_logits_with_chunking


def test_entropy_by_hand():
    # uniform over 4 -> ln 4; p = (0.25, 0.75) -> -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.5623351
    assert entropy_from_logits(torch.zeros(1, 4)).tolist() == pytest.approx([math.log(4)])
    two = torch.tensor([[0.0, math.log(3.0)]])
    assert entropy_from_logits(two).item() == pytest.approx(0.5623351, abs=1e-6)


def test_chunked_matches_plain_in_value_and_gradient():
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 5, 11)).requires_grad_(True)
    plain = entropy_from_logits(logits)
    chunked = entropy_from_logits_with_chunking(logits, chunk_size=3)
    assert chunked.shape == (2, 5) and chunked.dtype == torch.float32
    assert torch.allclose(plain, chunked, atol=1e-6)
    (g_plain,) = torch.autograd.grad(plain.sum(), logits)
    (g_chunk,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.allclose(g_plain, g_chunk, atol=1e-6)
    # bf16 logits are computed in float32
    assert entropy_from_logits_with_chunking(logits.detach().bfloat16(), 4).dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits_with_chunking(logits, 0)


def test_entropy_loss_is_aggregated():
    logits = torch.zeros(1, 3, 4)  # every token ln 4
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert compute_entropy_loss(logits, mask).item() == pytest.approx(math.log(4))
    assert compute_entropy_loss(logits, mask, "token-sum").item() == pytest.approx(2 * math.log(4))
