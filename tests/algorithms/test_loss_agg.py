"""agg_loss: hand values for every mode and micro-batch / data-parallel invariance with global counts."""

import pytest
import torch

from hybridflow.algorithms import LOSS_AGG_MODES, agg_loss

# The anchor example.
L = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 6.0]])
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 3.25),  # (1 + 2 + 4 + 6) / 4 tokens
        ("token-sum", 13.0),  # 1 + 2 + 4 + 6
        ("seq-mean-token-sum", 6.5),  # sequence sums 3 and 10 -> mean 6.5
        ("seq-mean-token-mean", 3.25),  # sequence means 3/2 and 10/2 -> (1.5 + 5) / 2
        ("seq-mean-token-sum-norm", 6.5 / 3),  # seq-mean-token-sum / response_len (3)
    ],
)
def test_modes_by_hand(mode, expected):
    assert agg_loss(L, M, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_loss_scale_factor():
    # 6.5 / 2
    assert agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=2).item() == pytest.approx(3.25)


def test_global_counts_and_dp_size():
    # token-mean with the global count 8 over 2 ranks: 13 / 8 * 2
    assert agg_loss(L, M, "token-mean", dp_size=2, batch_num_tokens=8).item() == pytest.approx(3.25)
    # seq-mean-token-sum with 4 global sequences over 2 ranks: 13 / 4 * 2
    assert agg_loss(L, M, "seq-mean-token-sum", dp_size=2, global_batch_size=4).item() == pytest.approx(6.5)
    # token-sum is multiplied by dp_size (gradients are averaged across ranks)
    assert agg_loss(L, M, "token-sum", dp_size=2).item() == pytest.approx(26.0)


def test_fully_masked_rows_do_not_count_as_sequences():
    m = torch.cat([M, torch.zeros(1, 3)])
    l_mat = torch.cat([L, torch.full((1, 3), 99.0)])
    assert agg_loss(l_mat, m, "seq-mean-token-mean").item() == pytest.approx(3.25)
    assert agg_loss(l_mat, m, "seq-mean-token-sum").item() == pytest.approx(6.5)


def test_fully_masked_micro_batch_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert agg_loss(L, torch.zeros_like(M), mode).item() == 0.0


def test_errors():
    with pytest.raises(ValueError, match="known"):
        agg_loss(L, M, "token-median")
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(L, M, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        agg_loss(L, M, "seq-mean-token-mean", dp_size=2)


def _global_counts(mask):
    return {"batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum()}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_invariance(mode):
    torch.manual_seed(0)
    loss_mat = torch.randn(8, 5)
    mask = (torch.rand(8, 5) > 0.4).float()
    mask[3] = 0  # an empty sequence
    full = agg_loss(loss_mat, mask, mode)
    counts = _global_counts(mask)
    for micro in (1, 2, 3):
        summed = sum(agg_loss(loss_mat[i : i + micro], mask[i : i + micro], mode, **counts) for i in range(0, 8, micro))
        assert summed.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_data_parallel_invariance(mode):
    # 2 ranks x 2 micro-batches: each rank sums its micro-batch losses; DDP/FSDP then average the ranks.
    torch.manual_seed(1)
    loss_mat = torch.randn(8, 5)
    mask = (torch.rand(8, 5) > 0.3).float()
    full = agg_loss(loss_mat, mask, mode)
    counts = _global_counts(mask)
    rank_losses = []
    for rank_rows in (range(0, 4), range(4, 8)):
        rows = list(rank_rows)
        micro_batches = (rows[:2], rows[2:])
        rank_losses.append(sum(agg_loss(loss_mat[r], mask[r], mode, dp_size=2, **counts) for r in micro_batches))
    assert (sum(rank_losses) / 2).item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
