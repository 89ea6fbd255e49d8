"""Split placement's weight sync: the buckets both sides plan alike, and a bucketed broadcast that delivers every
tensor bit for bit in one collective per bucket (a sender and two receivers, gloo, as threads of this process)."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridflow.single_controller.base.worker import find_free_port
from hybridflow.workers.weight_sync import (
    BUCKET_ALIGNMENT,
    WeightSyncGroup,
    bucket_size,
    describe_tensors,
    plan_buckets,
    tensor_bytes,
)


def test_buckets_fill_up_to_the_size_align_offsets_and_take_a_large_tensor_alone():
    info = [("a", (3,), "float32"), ("b", (5,), "bfloat16"), ("c", (100,), "float32"), ("d", (1,), "int64"),
            ("e", (2, 2), "float32")]
    assert [tensor_bytes(shape, dtype) for _, shape, dtype in info] == [12, 10, 400, 8, 16]
    buckets = plan_buckets(info, 64)
    # a: 0..12, b: 16..26, c is larger than a bucket (alone), d: 0..8, e: 16..32
    assert buckets == [[(0, 0), (1, 16)], [(2, 0)], [(3, 0), (4, 16)]]
    assert [bucket_size(info, bucket) for bucket in buckets] == [26, 400, 32]
    assert all(offset % BUCKET_ALIGNMENT == 0 for bucket in buckets for _, offset in bucket)
    assert plan_buckets(info, 10**9) == [[(0, 0), (1, 16), (2, 32), (3, 432), (4, 448)]]  # one broadcast
    assert [len(bucket) for bucket in plan_buckets(info, 1)] == [1, 1, 1, 1, 1]  # one tensor each
    assert plan_buckets([], 64) == []


@pytest.mark.parametrize(("bucket_bytes", "num_buckets"), [(2**20, 1), (64, 3), (1, 6)])
def test_a_bucketed_sync_delivers_every_tensor_bit_for_bit(bucket_bytes, num_buckets):
    torch.manual_seed(0)
    tensors = {"embed": torch.randn(4, 3), "norm": torch.randn(3).to(torch.bfloat16), "step": torch.tensor(7),
               "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0), "head": torch.randn(3, 5)}
    info = describe_tensors(tensors.items())
    port, world_size = find_free_port(), 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    outcome: dict[int, object] = {}

    def member(rank: int) -> None:
        try:
            group = WeightSyncGroup("127.0.0.1", port, rank, world_size, torch.device("cpu"), bucket_bytes)
            if rank == 0:
                outcome[rank] = (group.send(5, info, iter(tensors.items())), group.num_broadcasts)
            else:
                version = group.receive_version()
                received[rank] = {name: tensor.clone() for name, tensor in group.receive(info)}
                outcome[rank] = (version, group.num_broadcasts)
        except Exception as err:  # reported below, with the rank
            outcome[rank] = err

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(isinstance(value, Exception) for value in outcome.values()), outcome
    sent_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    assert outcome[0] == (sent_bytes, num_buckets)
    for rank in (1, 2):
        assert outcome[rank] == (5, num_buckets)
        assert list(received[rank]) == list(tensors)
        for name, tensor in tensors.items():
            got = received[rank][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name


def test_a_tensor_that_does_not_match_the_receivers_info_stops_the_sender():
    info = [("a", (2,), "float32")]
    group = WeightSyncGroup.__new__(WeightSyncGroup)  # the check runs before any collective of the tensor
    group.bucket_bytes, group.device = 64, torch.device("cpu")
    group.broadcast = lambda tensor: None
    with pytest.raises(RuntimeError, match=r"tensor 'a' \(3,\).*does not match the receivers' weight info"):
        group.send(1, info, iter([("a", torch.zeros(3))]))
