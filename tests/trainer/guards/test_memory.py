"""The memory watch: a worker that keeps allocating is warned about at 90% of the budget and stopped before it
passes it, with the process that grew and the step it grew from named."""

from __future__ import annotations

import logging
import mmap
from types import SimpleNamespace

import pytest
import torch

from hybridflow.single_controller import Dispatch, Worker, register
from hybridflow.single_controller.local import LocalWorkerGroup
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer.guards.memory import (
    GB,
    MemoryWatch,
    MemoryWatchConfig,
    compute_growth,
    compute_memory_level,
)
from hybridflow.utils.process_memory import read_memory_report

CHUNK_MB = 40


class GrowingWorker(Worker):
    """Keeps every block it allocates, as a leak across steps would."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[mmap.mmap] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def grow(self, mb: int) -> None:
        # Fresh anonymous pages: in a long test process the allocator may hand back memory that earlier tests
        # freed but that is still resident, and the resident set would then not grow (seen in the full suite).
        block = mmap.mmap(-1, mb * 2**20)
        torch.frombuffer(block, dtype=torch.uint8).fill_(1)  # written, so resident
        self.kept.append(block)


def test_memory_level_and_growth_hand_computed():
    assert compute_memory_level(80, 100, 0.9) == "ok"
    assert compute_memory_level(90, 100, 0.9) == "warn"
    assert compute_memory_level(100, 100, 0.9) == "stop"
    # lowest peak before the last report was 5 at step 2; now 9
    assert compute_growth([(1, 6), (2, 5), (3, 7), (4, 9)]) == (2, 5, 9)
    assert compute_growth([(1, 6)]) == (1, 6, 6)


def test_peak_rss_counts_a_temporary_allocation_and_restarts_each_report():
    read_memory_report("here")  # restarts the peak
    # 100 MiB mapped, touched page by page, and unmapped before the report: an anonymous mapping of its own, since
    # a malloc'd block may come from (and go back to) memory the process already holds, which moves no peak
    size = 100 * 2**20
    region = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        region[offset] = 1
    region.close()
    report = read_memory_report("here")
    # Against the resident size after the free, not before the allocation: the process's other memory may shrink
    # in between (measured: 24 MB less in one CI run, which made a before/after comparison fail).
    assert report.peak_rss_bytes - report.rss_bytes > 90 * 2**20
    assert read_memory_report("here").peak_rss_bytes < report.peak_rss_bytes  # the peak was reset


def test_a_worker_that_keeps_allocating_is_warned_about_then_stopped(caplog):
    group = LocalWorkerGroup(RayClassWithInitArgs(GrowingWorker), world_size=1)
    pool = SimpleNamespace(name="hybridflow_global_pool", group=group)
    baseline = read_memory_report("here").rss_bytes
    budget_gb = (baseline + 10.5 * CHUNK_MB * 2**20) / GB  # warn after about 9.5 blocks, stop after 10.5
    watch = MemoryWatch(MemoryWatchConfig(host_memory_budget_gb=budget_gb, warn_fraction=0.9))
    caplog.set_level(logging.WARNING, logger="hybridflow.trainer.guards.memory")
    error, step = None, 0
    while error is None:
        step += 1
        assert step < 40, "the budget was never reached"
        group.grow(CHUNK_MB)
        metrics, error = watch.observe(step, [pool])
        assert metrics["memory/peak_rss_gb/max"] > baseline / GB
        assert 0 < metrics[f"memory/node_{group.memory_report()[0].node_ip}/budget_used"] < 2
        if error is None:
            assert metrics[f"memory/node_{group.memory_report()[0].node_ip}/budget_used"] < 1
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "90% of the memory budget reached" in warnings[0], warnings
    message = str(error)
    print(message)
    assert f"at step {step}" in message and "hybridflow_global_pool rank 0" in message
    assert "from " in message and " GB at step 1 to " in message  # it grew from its first step on
    assert "trainer.guards.memory.host_memory_budget_gb" in message


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="host_memory_budget_gb"):
        MemoryWatchConfig(host_memory_budget_gb=0)
    with pytest.raises(ValueError, match="warn_fraction"):
        MemoryWatchConfig(warn_fraction=1.5)


class SpikingWorker(Worker):
    """Allocates fresh pages block after block within one call, as a step that would not end would."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def spike(self, total_mb: int, chunk_mb: int) -> int:
        import time

        blocks = []
        for _ in range(total_mb // chunk_mb):
            block = mmap.mmap(-1, chunk_mb * 2**20)
            torch.frombuffer(block, dtype=torch.uint8).fill_(1)
            blocks.append(block)
            time.sleep(0.02)
        return len(blocks)


def test_the_within_step_watch_stops_the_largest_process_only_at_the_budget(monkeypatch):
    from hybridflow.utils import memory_watchdog
    from hybridflow.utils.memory_watchdog import MemoryWatchdog

    sizes = {1: 3 * 2**30, 2: 2**30}
    monkeypatch.setattr(memory_watchdog, "resident_bytes", sizes.get)
    monkeypatch.setattr(memory_watchdog.os, "getpid", lambda: 1)
    assert not MemoryWatchdog(5 * 2**30, [1, 2]).check_once()  # under the budget
    over = MemoryWatchdog(4 * 2**30, [1, 2])
    assert over.check_once() and "pid 1 3.22 GB, pid 2 1.07 GB" in over.message and "(pid 1, the largest)" in over.message
    sizes[2] = 4 * 2**30
    assert not MemoryWatchdog(4 * 2**30, [1, 2]).check_once()  # over, but pid 2's watch stops pid 2's call


def test_a_call_that_grows_past_the_budget_is_stopped_inside_the_step_and_the_worker_lives_on(ray_cluster):
    from hybridflow.single_controller import WorkerError
    from hybridflow.single_controller.ray import RayResourcePool, RayWorkerGroup
    from hybridflow.trainer.guards.memory import arm_within_step_watch
    from hybridflow.utils.memory_watchdog import resident_bytes

    pool = RayResourcePool([1], num_cpus_per_worker=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SpikingWorker), name_prefix="spiking")
    try:
        pid = group.process_info[0].pid
        budget_gb = (resident_bytes(pid) + 300 * 2**20) / GB
        config = MemoryWatchConfig(host_memory_budget_gb=budget_gb, poll_interval_s=0.05)
        assert arm_within_step_watch([SimpleNamespace(group=group)], config) == 1
        with pytest.raises(WorkerError, match=r"WorkerMemoryBudgetError.*memory budget of .* GB "
                                              r"\(trainer.guards.memory.host_memory_budget_gb\)") as info:
            group.spike(3000, 20)  # 3 GB, stopped after about 300 MB
        assert f"pid {pid}" in str(info.value)
        assert group.check_alive(30) == 1
        assert resident_bytes(pid) < budget_gb * GB, "the stopped call's memory was freed"
        assert group.spike(40, 20) == [2], "the worker takes calls again"
    finally:
        group.shutdown()
        pool.release()


def test_local_mode_arms_nothing_and_starts_no_ray(monkeypatch):
    """Local mode has no Ray actors to watch; `ray.get([])` there started a Ray instance of its own, in a mode
    documented as running without Ray."""
    import ray

    from hybridflow.single_controller.local import LocalWorkerGroup
    from hybridflow.trainer.guards.memory import arm_within_step_watch

    def no_ray(*args, **kwargs):
        raise AssertionError("local mode called into Ray")

    monkeypatch.setattr(ray, "get", no_ray)
    local = SimpleNamespace(group=object.__new__(LocalWorkerGroup))
    assert arm_within_step_watch([local], MemoryWatchConfig(host_memory_budget_gb=1.0)) == 0


def test_a_watch_armed_off_the_main_thread_ends_the_process_instead_of_raising():
    """Threaded actors (the agent loops' servers) run calls off the main thread, where no signal handler can be
    installed: the watch then stops by ending the process."""
    import threading

    from hybridflow.utils.memory_watchdog import MemoryWatchdog

    modes = []
    watch = MemoryWatchdog(float("inf"), [], interval_s=60)
    thread = threading.Thread(target=lambda: modes.append(watch.start()))
    thread.start()
    thread.join()
    watch.stop()
    assert modes == ["exit"]
