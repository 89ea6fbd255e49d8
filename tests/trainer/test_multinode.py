"""Multi-node Ray: a tiny GRPO step with `trainer.nnodes=2 trainer.n_gpus_per_node=1` on two raylets of this machine,
once on `ray.cluster_utils.Cluster` (joined through `ray_kwargs.ray_init.address`) and once on a cluster started
with `ray start` as the README says (joined through RAY_ADDRESS). Two raylets on one host are two Ray nodes (distinct
node ids); separate hosts were not tested.

The trainer runs as `python -m hybridflow.trainer.main_ppo` in a subprocess: a process joins one Ray cluster, and this
one may hold the test session's. Each cluster records its address in a private RAY_TMPDIR, not in /tmp/ray, where
any `ray.init()` on this machine would find and join it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.single_controller.base.worker import find_free_port
from tests.conftest import REPO_ROOT
from tests.tiny_runs import build_workspace
from tests.trainer.placement_runs import overrides
from tests.trainer.ray_nodes import ray_tmpdir, start_ray, stop_ray  # noqa: F401  (fixtures)

# One rank on each of two nodes, one GRPO step (the rest as in test_placement: 4 prompts x 2 samples, KL loss).
TWO_NODES = ("trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=1")
RANK_LINE = re.compile(r"rank (\d+): node ([0-9a-f]+), ip (\S+), pid (\d+)")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return build_workspace(tmp_path_factory.mktemp("multinode"), train_size=8, test_size=2)


def train(workspace: Path, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[str, dict]:
    """Run the trainer CLI on the two-node step; its output and the step's metrics."""
    command = [sys.executable, "-m", "hybridflow.trainer.main_ppo", *overrides(workspace, run_dir), *TWO_NODES, *extra]
    result = subprocess.run(
        command, env={**os.environ, **(env or {})}, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = {key: value for record in records if record["step"] == 1 for key, value in record.items()}
    return output, step


def rank_nodes(output: str) -> dict[int, tuple[str, int]]:
    """Each rank's (Ray node id, pid), from the placement the trainer logs when its workers start."""
    return {int(rank): (node, int(pid)) for rank, node, _, pid in RANK_LINE.findall(output)}


def assert_trained(step: dict) -> None:
    assert step["actor/grad_norm"] > 0 and "actor/pg_loss" in step and "critic/score/mean" in step
    bad = {key: value for key, value in step.items() if isinstance(value, float) and not math.isfinite(value)}
    assert not bad, f"non-finite metrics: {bad}"


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_grpo_step_runs_one_rank_on_each_node_of_a_two_node_cluster(workspace, ray_tmpdir):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    address = cluster.address
    try:
        cluster.add_node(num_cpus=1)
        node_ids = {node.node_id for node in cluster.list_all_nodes()}
        output, step = train(workspace, workspace / "cluster", f"ray_kwargs.ray_init.address={address}")
    finally:
        cluster.shutdown()
    assert f"joined the Ray cluster at {address}: 2 alive nodes" in output
    ranks = rank_nodes(output)
    assert sorted(ranks) == [0, 1], output[-6000:]
    assert {node for node, _ in ranks.values()} == node_ids, "each rank on its own node of this cluster"
    assert_trained(step)


# Without an address the driver starts its own cluster, though `ray start` recorded one where ray.init() looks.
EMBEDDED = """
import logging, ray
from hybridflow.trainer.config.schema import RayInitConfig
from hybridflow.trainer.scaffold import init_ray
logging.basicConfig(level=logging.INFO)
init_ray(RayInitConfig(num_cpus=1), world_size=1)
print("gcs address", ray.get_runtime_context().gcs_address)
print("worker niceness", ray.get(ray.remote(lambda: __import__("os").nice(0)).remote()))
ray.shutdown()
"""


@pytest.mark.slow  # the default suite's time budget; run with -m slow
def test_grpo_step_joins_a_ray_start_cluster_through_ray_address(workspace, ray_tmpdir):
    """The README's commands: `ray start --head`, `ray start --address` (a second node), RAY_ADDRESS."""
    port = find_free_port()
    address = f"127.0.0.1:{port}"
    nodes = [start_ray(ray_tmpdir / "head.log", "--head", f"--port={port}")]
    try:
        nodes.append(start_ray(ray_tmpdir / "worker.log", f"--address={address}"))
        output, step = train(workspace, workspace / "ray_start", env={"RAY_ADDRESS": address})
        embedded = subprocess.run([sys.executable, "-c", EMBEDDED], capture_output=True, text=True, timeout=120)
    finally:
        for process in reversed(nodes):
            stop_ray(process)
    assert f"joined the Ray cluster at {address}: 2 alive nodes" in output
    ranks = rank_nodes(output)
    assert sorted(ranks) == [0, 1] and len({node for node, _ in ranks.values()}) == 2, output[-6000:]
    # The cluster's own logs hold both ranks' worker processes: the job ran there, not on an embedded cluster.
    worker_logs = {path.name for path in ray_tmpdir.glob("ray/session_*/logs/worker-*.out")}
    for _, pid in ranks.values():
        assert any(name.endswith(f"-{pid}.out") for name in worker_logs), (pid, sorted(worker_logs))
    assert_trained(step)
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    assert "started an embedded Ray cluster" in embedded.stderr and "gcs address" in embedded.stdout
    assert not embedded.stdout.split("gcs address")[1].split()[0].endswith(f":{port}"), "it joined the ray start cluster"
    assert "worker niceness 0" in embedded.stdout, "the embedded cluster's workers compete with other processes"


# ----------------------------------------------------------------------------- placement on the session cluster
def test_a_pool_on_more_nodes_than_the_cluster_has_fails_at_once_saying_what_it_needs(ray_cluster):
    from hybridflow.single_controller.ray import RayResourcePool

    start = time.perf_counter()
    with pytest.raises(RuntimeError) as info:
        RayResourcePool([1, 1], name_prefix="global_pool").get_placement_group()
    assert time.perf_counter() - start < 5, "no waiting for nodes that are not there"
    message = str(info.value)
    for words in ("'global_pool' needs 2 distinct Ray node(s) with {'CPU': 1.0} each", "only 1 node(s)",
                  "The cluster has 1 alive node: node ", "{'CPU': 4.0}", "RAY_ADDRESS"):
        assert words in message, f"{words!r} missing from: {message}"


def test_a_pool_that_fits_but_finds_the_cpus_taken_fails_after_the_timeout(ray_cluster, monkeypatch):
    from hybridflow.single_controller.ray import RayResourcePool, base

    monkeypatch.setattr(base, "PLACEMENT_TIMEOUT_S", 1.0)
    holder = RayResourcePool([3])  # 3 of the 4 CPUs
    holder.get_placement_group()
    try:
        with pytest.raises(RuntimeError, match=r"needs 1 distinct Ray node\(s\) with \{'CPU': 2.0\} each .* not "
                                               r"placed within 1 s, as other jobs hold resources: free now"):
            RayResourcePool([2], name_prefix="second").get_placement_group()
    finally:
        holder.release()


def test_node_ranks_and_the_dry_run_show_each_node():
    from hybridflow.single_controller.ray import node_ranks
    from hybridflow.trainer.config import load_config
    from hybridflow.trainer.placement import describe_placement

    assert node_ranks([2, 2, 1]) == [range(0, 2), range(2, 4), range(4, 5)]
    lines = describe_placement(load_config(["trainer.nnodes=3", "trainer.n_gpus_per_node=2"])).splitlines()
    assert lines[1].split()[:7] == ["global_pool", "6", "processes", "(3", "nodes", "x", "2)"]
    assert lines[2:5] == ["    node 0: ranks 0-1", "    node 1: ranks 2-3", "    node 2: ranks 4-5"]
    assert "distinct Ray node" in lines[5] and "the cluster needs 3 nodes" in lines[5]


def test_the_embedded_cluster_starts_its_workers_unniced_and_a_joined_one_keeps_its_own(monkeypatch):
    """Ray nices its workers to 15 by default; the embedded cluster's run at 0 (the slow test above checks a real
    worker's niceness), and joining a cluster by address passes no system config."""
    import ray

    from hybridflow.trainer.config.schema import RayInitConfig
    from hybridflow.trainer.scaffold import init_ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr("hybridflow.trainer.scaffold.describe_cluster", lambda: "")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    init_ray(RayInitConfig(num_cpus=1), world_size=1)
    init_ray(RayInitConfig(address="10.0.0.1:6379"), world_size=1)
    assert calls[0]["address"] == "local" and calls[0]["_system_config"] == {"worker_niceness": 0}
    assert calls[1]["address"] == "10.0.0.1:6379" and "_system_config" not in calls[1]
