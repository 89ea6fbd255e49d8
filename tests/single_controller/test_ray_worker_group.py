"""RayWorkerGroup on local Ray with CPU workers: gloo collectives, every dispatch mode, futures, colocation, failures."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoFuture
from hybridflow.single_controller import CONTROL_GROUP, WorkerError
from hybridflow.single_controller.ray import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    create_colocated_worker_cls,
)
from tests.single_controller.toy_workers import ActorRole, AllReduceWorker, CriticRole, GatedServer, RendezvousProbe


@pytest.fixture(scope="module")
def group(ray_cluster):
    import ray

    pool = RayResourcePool([2])
    # verl's own lines wrap the class: RayClassWithInitArgs(cls=ray.remote(W))
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(cls=ray.remote(AllReduceWorker), scale=10), name_prefix="toy")
    assert wg.init_model() == [2, 2]
    wg.test_pool = pool  # for a second group on the same pool
    yield wg
    wg.shutdown()
    pool.release()  # the placement group outlives its actors: a leak would starve later tests of CPUs


def test_all_reduce_over_gloo_gives_rank_dependent_values(group):
    # all_reduce(1 + 2) = 3, times scale 10, plus the rank
    assert group.all_reduce_rank() == [30.0, 31.0]


def test_all_to_all_and_dp_compute_take_one_entry_per_rank(group):
    assert group.add([1, 2], y=[3, 4]) == [4, 106]
    assert group.square([3, 5]) == [9, 25]
    with pytest.raises(ValueError, match="one entry per rank"):
        group.square([3])


def test_dp_compute_proto_pads_chunks_and_unpads(group):
    out = group.double(DataProto.from_dict({"x": torch.arange(5)}))
    assert out.batch["y"].tolist() == [0, 2, 4, 6, 8]
    # 5 rows padded to 6: ranks get 3 rows each; the padded row is dropped again
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.meta_info["metrics"] == {"rows": [3, 3]}


def test_dp_compute_proto_with_func_ships_the_function(group):
    out = group.apply(torch.neg, DataProto.from_dict({"x": torch.arange(4)}))
    assert out.batch["y"].tolist() == [0, -1, -2, -3]


def test_dp_compute_metric_collects_per_rank_outputs(group):
    assert group.row_sum(DataProto.from_dict({"x": torch.arange(4)})) == [
        {"sum": 1, "rank": 0},
        {"sum": 5, "rank": 1},
    ]


def test_rank_zero_execution(group):
    assert group.rank_zero_only() == 0


def test_nd_mesh_dispatch_with_one_rank_per_dp_group(group):
    out = group.mesh_tag(DataProto.from_dict({"x": torch.arange(4)}))
    assert out.batch["x"].tolist() == [0, 1, 2, 3]
    assert out.batch["rank"].tolist() == [0, 0, 1, 1]


def test_non_blocking_future_chains_into_next_call(group):
    start = time.perf_counter()
    future = group.double_async(DataProto.from_dict({"x": torch.arange(4)}))
    returned_after = time.perf_counter() - start
    assert isinstance(future, DataProtoFuture)
    assert returned_after < 0.2  # the workers sleep 0.2 s; the driver did not wait
    out = group.add_one(future)  # each worker resolves its own chunk of the future
    assert out.batch["z"].tolist() == [1, 3, 5, 7]
    assert future.get().batch["y"].tolist() == [0, 2, 4, 6]


def test_worker_exception_names_rank_method_and_remote_traceback(group):
    with pytest.raises(WorkerError) as info:
        group.fail_on(1)
    message = str(info.value)
    assert "rank 1" in message and "'fail_on'" in message
    assert "boom from rank 1" in message and "toy_workers.py" in message
    assert group.add([1, 1], [0, 0]) == [1, 101]  # the group still works afterwards


def test_ranks_start_together_and_learn_the_rendezvous_before_their_first_call(ray_cluster):
    """Every rank is constructed at once (rank 1 could not know rank 0's address in `__init__`: rank 0 chooses it
    after its own construction); the address reaches it before `init_model`, and the gloo group forms."""
    pool = RayResourcePool([2], num_cpus_per_worker=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(RendezvousProbe), name_prefix="rendezvous")
    try:
        (master_at_init_0, master_0, total_0), (master_at_init_1, master_1, total_1) = wg.rendezvous_seen()
        assert master_at_init_0 is None and master_at_init_1 is None
        assert master_0 == master_1 is not None and total_0 == total_1 == 2.0
    finally:
        wg.shutdown()
        pool.release()


def test_tensor_parallel_peers_share_a_shard_and_one_is_collected(ray_cluster):
    pool = RayResourcePool([4], num_cpus_per_worker=0.5)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(AllReduceWorker), name_prefix="mesh4")
    try:
        assert wg.init_model() == [4, 4, 4, 4]
        out = wg.mesh_tag(DataProto.from_dict({"x": torch.arange(6)}))
        # tp=2: ranks (0,1) form dp rank 0 and (2,3) dp rank 1; ranks 0 and 2 are collected
        assert out.batch["x"].tolist() == [0, 1, 2, 3, 4, 5]
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]
    finally:
        wg.shutdown()
        pool.release()


def test_colocated_roles_share_a_process_and_split_into_groups(ray_cluster):
    fused = create_colocated_worker_cls(
        {"actor": RayClassWithInitArgs(ActorRole), "critic": RayClassWithInitArgs(CriticRole, offset=100)}
    )
    pool = RayResourcePool([2])
    wg = RayWorkerGroup(pool, fused, name_prefix="coloc")
    try:
        groups = wg.spawn(["actor", "critic"])
        actor_pids, critic_pids = groups["actor"].pid(), groups["critic"].pid()
        assert actor_pids == critic_pids and len(set(actor_pids)) == 2
        data = DataProto.from_dict({"x": torch.arange(4)})
        assert groups["actor"].act(data).batch["a"].tolist() == [10, 11, 12, 13]
        assert groups["critic"].judge(data).batch["v"].tolist() == [100, 101, 102, 103]
        assert not hasattr(groups["actor"], "judge")
    finally:
        wg.shutdown()
        pool.release()


def test_resource_pool_manager_maps_roles_and_rejects_unknown_pools():
    manager = ResourcePoolManager({"global": [2], "rollout": [1]}, {"actor": "global", "gen": "rollout"})
    assert manager.roles_by_pool() == {"global": ["actor"], "rollout": ["gen"]}
    with pytest.raises(ValueError, match="undefined pools"):
        ResourcePoolManager({"global": [2]}, {"critic": "missing"})


def test_killed_worker_fails_the_call_quickly(ray_cluster):
    pool = RayResourcePool([2])
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(AllReduceWorker), name_prefix="doomed")
    try:
        start = time.perf_counter()
        with pytest.raises(WorkerError) as info:
            wg.die_on(0)  # rank 0 exits; rank 1 would sleep 30 s
        assert time.perf_counter() - start < 15
        assert "rank 0" in str(info.value) and "died" in str(info.value)
        with pytest.raises(WorkerError, match="died"):
            wg.rank_zero_only()  # a dead worker keeps failing fast
    finally:
        wg.shutdown()
        pool.release()


def test_a_control_group_call_runs_while_every_request_thread_waits(ray_cluster):
    """The rollout replicas' aborts (over_sample_rate) run in `CONTROL_GROUP`: with the one request thread taken and
    a second request queued behind it, the release still runs at once, and both requests see it."""
    pool = RayResourcePool([1])
    cls = RayClassWithInitArgs(GatedServer)
    cls.update_options({"max_concurrency": 1, "concurrency_groups": {CONTROL_GROUP: 1}})
    group = RayWorkerGroup(pool, cls, name_prefix="gated")
    try:
        wait = group.direct_callers("wait_for_release")[0]
        release = group.direct_callers("release", CONTROL_GROUP)[0]

        async def scenario():
            first, second = asyncio.ensure_future(wait(20.0)), asyncio.ensure_future(wait(0.5))
            await asyncio.sleep(1.0)  # both sent: the first holds the only request thread
            start = time.perf_counter()
            await release()
            return await first, await second, time.perf_counter() - start

        first, second, release_s = asyncio.run(scenario())
    finally:
        group.shutdown()
        pool.release()
    assert first and second and release_s < 10.0  # the release did not wait out the first request's 20 s


def test_a_second_worker_group_colocates_on_a_pool(group):
    """verl makes several worker groups on one pool (its default max_colocate_count=10, also hybridflow's now); with
    one actor per rank's CPU share the second group waited for a CPU that never came. The fixture's group is built
    from verl's wrapped class, `RayClassWithInitArgs(cls=ray.remote(W))`, which was refused."""
    second = RayWorkerGroup(group.test_pool, RayClassWithInitArgs(AllReduceWorker, scale=2), name_prefix="second")
    try:
        assert second.init_model() == [2, 2]
        assert second.all_reduce_rank() == [6.0, 7.0] and group.all_reduce_rank() == [30.0, 31.0]
    finally:
        second.shutdown()
