"""Dispatch/collect functions on their own (no Ray): concrete splits, custom modes, registration errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller import Dispatch, register, register_dispatch_mode
from hybridflow.single_controller.base.decorator import Dispatched, get_dispatch_mode, get_method_spec


@dataclass
class FakeGroup:
    world_size: int
    info: list | None = None

    def query_dispatch_info(self, mesh_name):
        return self.info


def test_one_to_all_replicates_arguments():
    dispatched = get_dispatch_mode(Dispatch.ONE_TO_ALL).dispatch_fn(FakeGroup(3), (1,), {"k": 2})
    assert dispatched.args == [(1,)] * 3 and dispatched.kwargs == [{"k": 2}] * 3


def test_dp_compute_proto_pads_to_world_size_and_collect_unpads():
    mode = get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    data = DataProto.from_dict({"x": torch.arange(3)}, {"tag": ["a", "b", "c"]})
    dispatched = mode.dispatch_fn(FakeGroup(2), (data,), {})
    assert dispatched.pad_size == 1
    assert [part[0].batch["x"].tolist() for part in dispatched.args] == [[0, 1], [2, 0]]
    assert list(dispatched.args[1][0].non_tensor_batch["tag"]) == ["c", "a"]
    merged = mode.collect_fn(FakeGroup(2), [part[0] for part in dispatched.args], dispatched)
    assert merged.batch["x"].tolist() == [0, 1, 2]


def test_dp_compute_proto_rejects_non_proto_and_unequal_lengths():
    mode = get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    with pytest.raises(TypeError, match="DataProto or DataProtoFuture"):
        mode.dispatch_fn(FakeGroup(2), ([1, 2],), {})
    a, b = DataProto.from_dict({"x": torch.arange(2)}), DataProto.from_dict({"x": torch.arange(4)})
    with pytest.raises(ValueError, match="same length"):
        mode.dispatch_fn(FakeGroup(2), (a, b), {})


def test_custom_dispatch_mode_is_usable_in_register():
    def dispatch_reversed(group, args, kwargs):
        n = group.world_size
        return Dispatched(args=[(args[0][n - 1 - i],) for i in range(n)], kwargs=[{}] * n)

    def collect_sum(group, outputs, dispatched):
        return sum(outputs)

    name = register_dispatch_mode("test_reversed_sum", dispatch_reversed, collect_sum)
    mode = get_dispatch_mode(name)
    assert mode.dispatch_fn(FakeGroup(2), ([10, 20],), {}).args == [(20,), (10,)]
    assert mode.collect_fn(FakeGroup(2), [1, 2], None) == 3

    @register(dispatch_mode=name)
    def method(self, x):
        return x

    assert get_method_spec(method).dispatch_mode == name
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode("test_reversed_sum", dispatch_reversed, collect_sum)


def test_unknown_dispatch_or_execute_mode_fails_at_decoration():
    with pytest.raises(KeyError, match="unknown dispatch mode 'bogus'.*dp_compute_proto"):
        register(dispatch_mode="bogus")
    with pytest.raises(ValueError, match="execute_mode"):
        register(execute_mode="some")


def test_a_padded_batch_must_come_back_one_row_per_row():
    """With 3 rows over 2 ranks the last row is padding; a method that returns one summary row per rank made the
    unpad drop rank 1's real row. Unpadded batches may return any number of rows."""
    mode = get_dispatch_mode(Dispatch.DP_COMPUTE_PROTO)
    summary = lambda rank: DataProto.from_dict({"s": torch.tensor([float(rank)])})  # noqa: E731
    padded = mode.dispatch_fn(FakeGroup(2), (DataProto.from_dict({"x": torch.arange(3)}),), {})
    with pytest.raises(ValueError, match=r"returned \[1, 1\] rows from ranks given \[2, 2\]: the batch was padded "
                                         r"by 1 rows to split over 2 ranks"):
        mode.collect_fn(FakeGroup(2), [summary(0), summary(1)], padded)
    even = mode.dispatch_fn(FakeGroup(2), (DataProto.from_dict({"x": torch.arange(4)}),), {})
    assert mode.collect_fn(FakeGroup(2), [summary(0), summary(1)], even).batch["s"].tolist() == [0.0, 1.0]


def test_rank_zero_execution_takes_only_replicated_arguments():
    """RANK_ZERO with a splitting mode ran rank 0's share alone and returned it as the whole result."""
    with pytest.raises(ValueError, match=r"execute_mode=Execute.RANK_ZERO runs rank 0 alone, but dispatch_mode="
                                         r"'dp_compute_proto' gives each rank its own share"):
        register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode="rank_zero")
    assert get_method_spec(register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode="rank_zero")(lambda self: 0))


def test_a_future_that_does_not_split_over_the_next_call_says_what_to_do():
    from hybridflow.protocol import DataProtoFuture

    future = DataProtoFuture(collect_fn=DataProto.concat, futures=[])
    take = future.chunk(2)[0].dispatch_fn
    assert take(DataProto.from_dict({"x": torch.arange(4)})).batch["x"].tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"a blocking=False result of 3 rows cannot be split over the 2 ranks .* "
                                         r"Call the producing method with blocking=True"):
        take(DataProto.from_dict({"x": torch.arange(3)}))
