"""Shared fixtures: one embedded Ray cluster per test session, started only by tests that ask for it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.fork_server import use_rank_preload

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster with 4 logical CPUs (workers of toy tests oversubscribe the 2 real cores)."""
    import ray

    # Ray workers import test modules (toy workers) by name: put the repo root on their path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Connected to Ray, scorer pools start their workers from the fork server: the one two-rank tests use
    use_rank_preload()
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A saved tiny Qwen2-VL (1 vision block, 2 text layers) with its tokenizer and image processor (~4 s)."""
    from hybridflow.models.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"), seed=0)


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A process group a test made in this process (a bf16 engine alone joins a one-rank group) is destroyed after
    it: the next test starts without one, as an engine's choice of layout depends on it."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_runtest_logreport(report):
    """With HYBRIDFLOW_TEST_FAILURE_LOG set, each failure's traceback is appended to that file as it happens
    (under xdist too: the controller sees every report), so a run stopped at a time limit keeps its failures."""
    log = os.environ.get("HYBRIDFLOW_TEST_FAILURE_LOG")
    if log and report.failed:
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
