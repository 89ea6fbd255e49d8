"""A hung worker-group call explains itself: the timeout's error names where each rank waits, and every rank's
Python stacks are in a file beside it (`single_controller.ray.hang_stacks`)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from hybridflow.single_controller import Dispatch, Worker, WorkerTimeoutError, register
from hybridflow.single_controller.base.stacks import innermost_frames
from hybridflow.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup


class HangingWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed(backend="gloo")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hang(self) -> None:
        """Rank 1 loops in Python; rank 0 waits in a barrier that rank 1 never enters."""
        if self.rank == 1:
            sleep_loop_that_never_ends()
        else:
            barrier_the_peer_never_enters()


def sleep_loop_that_never_ends() -> None:
    while True:
        time.sleep(0.1)


def barrier_the_peer_never_enters() -> None:
    dist.barrier()
    torch.zeros(1)


@pytest.fixture
def group(ray_cluster, tmp_path):
    pool = RayResourcePool([2], name_prefix="hang_pool")
    workers = RayWorkerGroup(
        pool, RayClassWithInitArgs(HangingWorker), name_prefix="hang", rpc_timeout_s=3.0, stack_dump_dir=str(tmp_path)
    )
    workers.init_model()
    yield workers
    workers.shutdown()
    pool.release()


def test_a_timeout_names_the_frame_each_hung_rank_waits_in(group, tmp_path):
    with pytest.raises(WorkerTimeoutError) as info:
        group.hang()
    message = str(info.value)
    print(message)
    summary = message.split("Where each rank waits", 1)[1]
    rank0, rank1 = summary.split("\n  rank 0: ", 1)[1].split("\n  rank 1: ", 1)
    assert "barrier_the_peer_never_enters" in rank0 and "hang (" in rank0
    assert rank1.startswith("sleep_loop_that_never_ends"), rank1
    (path,) = tmp_path.glob("hang_stacks_hang_hang_*.txt")
    assert str(path) in message
    text = path.read_text()
    assert "===== rank 0" in text and "===== rank 1" in text
    assert "barrier_the_peer_never_enters" in text and "sleep_loop_that_never_ends" in text


def test_innermost_frames_pick_the_worker_thread_of_a_faulthandler_dump():
    dump = (
        'Thread 0x01 (most recent call first):\n  File "/x/threading.py", line 3 in wait\n\n'
        'Current thread 0x02 (most recent call first):\n  File "/w/a.py", line 7 in inner\n'
        '  File "/w/a.py", line 9 in outer\n  File "/ray/default_worker.py", line 1 in <module>\n'
    )
    assert innermost_frames(dump, 2) == ["inner (a.py:7)", "outer (a.py:9)"]
    assert innermost_frames("no frames") == []
