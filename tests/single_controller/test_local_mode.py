"""Local mode: workers in the driver's process give the same results as on Ray (same API)."""

from __future__ import annotations

import os

import pytest
import torch

from hybridflow.protocol import DataProto
from hybridflow.single_controller import WorkerError
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs, create_colocated_worker_cls
from tests.single_controller.toy_workers import ActorRole, AllReduceWorker, CriticRole


def test_local_group_runs_in_this_process_with_a_gloo_group_of_one():
    group = LocalWorkerGroup(RayClassWithInitArgs(AllReduceWorker, scale=10), world_size=1)
    assert group.init_model() == [1]
    assert group.all_reduce_rank() == [10.0]  # all_reduce over one rank: 1 * 10 + rank 0
    assert group.get_pid() == [os.getpid()]
    out = group.double(DataProto.from_dict({"x": torch.arange(3)}))
    assert out.batch["y"].tolist() == [0, 2, 4]


def test_local_group_with_two_ranks_matches_ray_results_for_data_methods():
    group = LocalWorkerGroup(RayClassWithInitArgs(AllReduceWorker), world_size=2)
    # the same values the Ray tests expect
    assert group.add([1, 2], y=[3, 4]) == [4, 106]
    out = group.double(DataProto.from_dict({"x": torch.arange(5)}))
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert group.row_sum(DataProto.from_dict({"x": torch.arange(4)})) == [
        {"sum": 1, "rank": 0},
        {"sum": 5, "rank": 1},
    ]
    # non-blocking calls resolve eagerly in local mode and still chain
    assert group.add_one(group.double_async(DataProto.from_dict({"x": torch.arange(4)}))).batch["z"].tolist() == [
        1,
        3,
        5,
        7,
    ]


def test_local_mode_refuses_collectives_across_ranks_with_a_clear_error():
    group = LocalWorkerGroup(RayClassWithInitArgs(AllReduceWorker), world_size=2)
    with pytest.raises(WorkerError, match="local mode runs all 2 ranks in one process"):
        group.init_model()


def test_local_colocated_roles_split_like_ray():
    fused = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ActorRole), "critic": RayClassWithInitArgs(CriticRole, offset=100)}
    )
    groups = LocalWorkerGroup(fused, world_size=2).spawn(["actor", "critic"])
    data = DataProto.from_dict({"x": torch.arange(4)})
    assert groups["actor"].act(data).batch["a"].tolist() == [10, 11, 12, 13]
    assert groups["critic"].judge(data).batch["v"].tolist() == [100, 101, 102, 103]
    assert groups["actor"].pid() == [os.getpid()] * 2


def test_local_error_names_rank_and_method():
    group = LocalWorkerGroup(RayClassWithInitArgs(AllReduceWorker), world_size=2)
    with pytest.raises(WorkerError, match=r"rank 1 failed in 'fail_on'.*boom from rank 1"):
        group.fail_on(1)


def test_an_async_register_method_is_run_to_completion_like_verls():
    """verl registers some `async def` worker methods; they returned coroutines never awaited here (and could not be
    pickled back from a Ray actor)."""
    import asyncio

    from hybridflow.single_controller.base import Dispatch, Worker, register

    class AsyncWorker(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        async def double(self, data: DataProto) -> DataProto:
            await asyncio.sleep(0)
            return DataProto.from_dict(tensors={"y": data.batch["x"] * 2})

    group = LocalWorkerGroup(RayClassWithInitArgs(AsyncWorker), world_size=2)
    out = group.double(DataProto.from_dict(tensors={"x": torch.arange(4.0)}))
    assert out.batch["y"].tolist() == [0.0, 2.0, 4.0, 6.0]

    async def from_a_loop():
        return group.double(DataProto.from_dict(tensors={"x": torch.arange(2.0)}))

    with pytest.raises(WorkerError, match="async @register method called from a running event loop"):
        asyncio.run(from_a_loop())


def _verl_split(worker_group, *args, **kwargs):
    """verl's form of a dispatch function: each argument split into one entry per rank."""
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {key: [value + rank for rank in range(n)] for key, value in kwargs.items()}


def _verl_sum(worker_group, outputs):
    return sum(outputs)


def test_verl_style_custom_dispatch_modes_by_name_attribute_and_dict():
    """verl's register_dispatch_mode takes `dispatch_fn(wg, *args, **kwargs) -> (args, kwargs)` and
    `collect_fn(wg, outputs)`, names the mode `Dispatch.<name>`, and @register takes a dict of the two."""
    from hybridflow.single_controller.base import Dispatch, Worker, register, register_dispatch_mode

    register_dispatch_mode("VERL_SPLIT_SUM", _verl_split, _verl_sum)

    class SplitWorker(Worker):
        @register(dispatch_mode=Dispatch.VERL_SPLIT_SUM)
        def scaled(self, x: int, offset: int = 0) -> int:
            return x * 10 + offset

        @register(dispatch_mode={"dispatch_fn": _verl_split, "collect_fn": _verl_sum})
        def scaled_again(self, x: int, offset: int = 0) -> int:
            return x * 10 + offset

    group = LocalWorkerGroup(RayClassWithInitArgs(SplitWorker), world_size=2)
    assert group.scaled(1, offset=5) == (10 + 5) + (10 + 6)
    assert group.scaled_again(2, offset=0) == 20 + 21
