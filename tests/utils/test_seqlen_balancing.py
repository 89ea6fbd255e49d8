"""Token balancing over ranks: equal-size partitions, near-equal token sums, verl's metrics."""

from __future__ import annotations

import random

import pytest

from hybridflow.utils.seqlen_balancing import (
    balanced_group_partitions,
    balanced_partitions,
    num_token_budget_partitions,
    partition_by_tokens,
    partition_stats,
)


def test_partitions_are_equal_sized_cover_every_row_and_balance_tokens():
    lengths = [100, 90, 10, 5, 60, 50, 40, 45]
    partitions = balanced_partitions(lengths, 2)
    assert sorted(row for part in partitions for row in part) == list(range(8))
    assert [len(part) for part in partitions] == [4, 4]
    assert [sum(lengths[row] for row in part) for part in partitions] == [200, 200]
    sorted_lengths = sorted(lengths, reverse=True)  # plain halves: 300 and 100 tokens
    stats = partition_stats(sorted_lengths, balanced_partitions(sorted_lengths, 2), 2)
    assert (stats["global_seqlen/max"], stats["global_seqlen/min"], stats["global_seqlen/minmax_diff"]) == (300, 100, 200)
    assert stats["global_seqlen/balanced_max"] == stats["global_seqlen/balanced_min"] == 200


def test_random_batches_balance_far_better_than_plain_chunks():
    rng = random.Random(0)
    for _ in range(20):
        lengths = sorted((rng.randint(1, 500) for _ in range(64)), reverse=True)
        stats = partition_stats(lengths, balanced_partitions(lengths, 4), 4)
        assert stats["global_seqlen/balanced_max"] - stats["global_seqlen/balanced_min"] <= 500
        assert stats["global_seqlen/balanced_max"] <= stats["global_seqlen/max"]


def test_rows_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="7 rows cannot be split into 2 equal partitions"):
        balanced_partitions([1] * 7, 2)


def test_token_budget_micro_batches():
    lengths = [300, 100, 250, 50, 200, 100]  # 1000 tokens
    assert num_token_budget_partitions(lengths, 400) == 3
    groups = partition_by_tokens(lengths, 3)
    assert sorted(row for group in groups for row in group) == list(range(6))
    assert sorted(sum(lengths[row] for row in group) for group in groups) == [300, 350, 350]
    assert len(partition_by_tokens(lengths, 6)) == 6 and all(partition_by_tokens(lengths, 6))
    with pytest.raises(ValueError, match="a sequence of 300 tokens does not fit the micro-batch token budget of 299"):
        num_token_budget_partitions(lengths, 299)
    with pytest.raises(ValueError, match="6 rows cannot fill 7 non-empty micro-batches"):
        partition_by_tokens(lengths, 7)


def test_group_partitions_keep_each_group_on_one_rank_and_balance():
    lengths = [10, 12, 50, 52, 30, 31, 20, 22]
    groups = ["a", "a", "b", "b", "c", "c", "d", "d"]
    partitions = balanced_group_partitions(lengths, groups, 2)
    for partition in partitions:
        owners = [groups[row] for row in partition]
        assert all(owners.count(owner) == 2 for owner in owners)  # whole groups, kept contiguous
    sums = sorted(sum(lengths[row] for row in partition) for partition in partitions)
    assert sums == [103, 124]  # group totals a 22, b 102, c 61, d 42: {a, b} / {c, d} is the best equal split
    assert balanced_group_partitions(lengths, groups, 3) is None  # 4 groups over 3 ranks
    assert balanced_group_partitions(lengths, ["a"] * 3 + ["b"] * 5, 2) is None  # unequal groups
