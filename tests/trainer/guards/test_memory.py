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
    read_memory_report("here")
    before = read_memory_report("here")
    block = torch.ones(100 * 2**20 // 4)  # 100 MiB, freed before the report
    del block
    report = read_memory_report("here")
    assert report.peak_rss_bytes - before.rss_bytes > 90 * 2**20
    assert report.rss_bytes < report.peak_rss_bytes
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
