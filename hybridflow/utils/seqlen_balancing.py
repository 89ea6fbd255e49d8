"""Token balancing: of a batch over data-parallel ranks (verl's `trainer.balance_batch`), and of a rank's rows
over micro-batches cut by a token budget (verl's `use_dynamic_bsz`).

The driver splits a batch into equal row chunks, one per rank, and every rank waits for the slowest one; with
responses of very different lengths one rank can get most of the tokens. `balanced_partitions` groups the rows
into equal-size partitions with near-equal token sums, and the driver reorders the batch so that rank i's chunk
is partition i.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = [
    "balanced_group_partitions",
    "balanced_partitions",
    "num_token_budget_partitions",
    "partition_by_tokens",
    "partition_stats",
]


def balanced_partitions(lengths: Sequence[int], num_partitions: int) -> list[list[int]]:
    """Row indices split into `num_partitions` partitions of equal size whose `lengths` sums are near equal.

    Greedy longest-first: each row, longest first, joins the lightest partition that still has room. Within a
    partition, indices are in ascending order. `len(lengths)` must be a multiple of `num_partitions`.
    """
    if num_partitions < 1 or len(lengths) % num_partitions:
        raise ValueError(f"{len(lengths)} rows cannot be split into {num_partitions} equal partitions")
    capacity = len(lengths) // num_partitions
    partitions: list[list[int]] = [[] for _ in range(num_partitions)]
    heap = [(0, index) for index in range(num_partitions)]  # (token sum, partition), lightest first
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, index = heapq.heappop(heap)
        partitions[index].append(row)
        if len(partitions[index]) < capacity:
            heapq.heappush(heap, (total + lengths[row], index))
    return [sorted(partition) for partition in partitions]


def balanced_group_partitions(
    lengths: Sequence[int], group_ids: Sequence[object], num_partitions: int
) -> list[list[int]] | None:
    """Like `balanced_partitions`, but the rows of a group (a prompt's samples) stay together and in order, so a
    rank can share their prompt; None when the groups cannot be spread evenly (unequal sizes or a count that
    `num_partitions` does not divide)."""
    groups: dict[object, list[int]] = {}
    for row, group in enumerate(group_ids):
        groups.setdefault(group, []).append(row)
    members = list(groups.values())
    if len(members) % num_partitions or len({len(rows) for rows in members}) != 1:
        return None
    totals = [sum(lengths[row] for row in rows) for rows in members]
    return [
        [row for index in partition for row in members[index]]
        for partition in balanced_partitions(totals, num_partitions)
    ]


def partition_stats(lengths: Sequence[int], partitions: Sequence[Sequence[int]], num_partitions: int) -> dict[str, float]:
    """verl's `global_seqlen/*` metrics: token sums per rank for plain equal chunks (`min`, `max`, `minmax_diff`)
    and for `partitions` (`balanced_min`, `balanced_max`), and the mean."""
    chunk = len(lengths) // num_partitions
    plain = [sum(lengths[i * chunk:(i + 1) * chunk]) for i in range(num_partitions)]
    balanced = [sum(lengths[row] for row in partition) for partition in partitions]
    return {
        "global_seqlen/min": float(min(plain)),
        "global_seqlen/max": float(max(plain)),
        "global_seqlen/minmax_diff": float(max(plain) - min(plain)),
        "global_seqlen/balanced_min": float(min(balanced)),
        "global_seqlen/balanced_max": float(max(balanced)),
        "global_seqlen/mean": float(sum(plain) / num_partitions),
    }


def num_token_budget_partitions(lengths: Sequence[int], max_tokens: int) -> int:
    """How many micro-batches of about `max_tokens` tokens the rows of `lengths` need (ceil of the total over the
    budget); a row longer than the budget is an error."""
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens does not fit the micro-batch token budget of {max_tokens}")
    return max(1, -(-sum(lengths) // max_tokens))


def partition_by_tokens(lengths: Sequence[int], num_partitions: int) -> list[list[int]]:
    """Row indices in exactly `num_partitions` non-empty groups with near-equal token sums (longest row first into
    the lightest group); indices ascending within a group. Data-parallel ranks must run the same number of
    micro-batches (FSDP's collectives), so the caller takes the largest count any rank needs."""
    if not 1 <= num_partitions <= len(lengths):
        raise ValueError(f"{len(lengths)} rows cannot fill {num_partitions} non-empty micro-batches")
    partitions: list[list[int]] = [[] for _ in range(num_partitions)]
    heap = [(0, index) for index in range(num_partitions)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, index = heapq.heappop(heap)
        partitions[index].append(row)
        heapq.heappush(heap, (total + lengths[row], index))
    return [sorted(partition) for partition in partitions]
