"""Worker processes that hang, stop or die: each stops the driver promptly with an error naming the worker group,
the rank and the method, instead of blocking it forever (`trainer.rpc_timeout_s`, `trainer.heartbeat_timeout_s`)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from hybridflow.single_controller import WorkerError, WorkerTimeoutError
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer.config.schema import RunConfig
from hybridflow.trainer.scaffold import WorkerProcesses, heartbeat
from tests.single_controller.toy_workers import AllReduceWorker


@pytest.fixture
def processes(ray_cluster, tmp_path):
    """Two toy ranks in a gloo group, started the way trainers start theirs, with a 3 s RPC timeout (a hung call's
    stacks go to the run directory, here under tmp_path)."""
    run = RunConfig(n_gpus_per_node=2, rpc_timeout_s=3.0, device="cpu", default_local_dir=str(tmp_path / "run"))
    workers = WorkerProcesses(run, RayClassWithInitArgs(AllReduceWorker), name_prefix="chaos")
    workers.group.init_model()
    yield workers
    workers.shutdown()


def kill_later(pid: int, delay_s: float, sig: int = signal.SIGKILL) -> list[float]:
    """Send `sig` to `pid` after `delay_s` from a thread; the list gets the time it was sent."""
    sent: list[float] = []

    def send() -> None:
        os.kill(pid, sig)
        sent.append(time.monotonic())

    threading.Timer(delay_s, send).start()
    return sent


def test_a_hung_rank_is_stopped_by_the_rpc_timeout_naming_it(processes, tmp_path):
    group = processes.group
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        group.stall_before_all_reduce(1)  # rank 1 hangs; rank 0 waits for it inside the all-reduce
    elapsed = time.monotonic() - start
    assert 3.0 <= elapsed < 10.0, elapsed
    print(f"the hung call stopped {elapsed:.2f} s after it started (rpc_timeout_s=3)")
    message = str(info.value)
    pid = group.process_info[1][1]
    assert "worker group 'chaos'" in message and "'stall_before_all_reduce'" in message
    assert f"ranks 0 (pid" in message and f"1 (pid {pid} on" in message and "within 3 s" in message
    assert "trainer.rpc_timeout_s" in message
    assert f"all threads in {tmp_path / 'run'}/hang_stacks_chaos_stall_before_all_reduce_" in message
    assert info.value.ranks == [0, 1]
    # Between calls the heartbeat finds the same: the ranks do not answer (still inside the hung call).
    with pytest.raises(WorkerTimeoutError, match=r"timed out in 'heartbeat'.*trainer.heartbeat_timeout_s"):
        heartbeat([processes], timeout_s=1.0)


def test_a_rank_killed_inside_a_collective_stops_the_call_at_once(processes):
    group = processes.group
    pid = group.process_info[1][1]
    sent = kill_later(pid, 0.5)
    with pytest.raises(WorkerError) as info:
        group.stall_before_all_reduce(1)  # rank 1 is killed while rank 0 waits for it in the all-reduce
    detected_s = time.monotonic() - sent[0]
    assert detected_s < 5.0, f"the death was noticed only after {detected_s:.1f} s"
    print(f"the call failed {detected_s:.3f} s after the SIGKILL")
    message = str(info.value)
    assert "worker rank 1 of worker group 'chaos' failed in 'stall_before_all_reduce'" in message
    assert "its process died" in message and f"pid: {pid}" in message
    with pytest.raises(WorkerError, match=r"rank 1 .* failed in 'heartbeat': its process died"):
        heartbeat([processes], timeout_s=5.0)


def test_a_stopped_worker_fails_the_heartbeat(processes):
    group = processes.group
    assert heartbeat([processes], timeout_s=10.0) == {"workers/alive": 2.0}
    pid = group.process_info[0][1]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match=rf"rank 0 \(pid {pid} on .*\) did not answer within 1 s"):
            heartbeat([processes], timeout_s=1.0)
        assert time.monotonic() - start < 5.0
        # Direct calls (agent loops' requests to one server rank) have the same limit.
        with pytest.raises(WorkerTimeoutError, match=r"timed out in 'add': rank 0 \(pid .*within 3 s"):
            asyncio.run(group.direct_callers("add")[0](1, 0))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert group.add([1, 2], [0, 0]) == [1, 102]  # answered again once continued
