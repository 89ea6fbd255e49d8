"""The start-up check that `trainer.default_local_dir` (and the resume checkpoint) is one directory that the driver and
every worker process share: the probe helpers, the error it raises, the check on the embedded Ray cluster, and a
real two-node cluster whose second node has its own, private copy of the directory (a tmpfs mounted over it in a
private mount namespace), as a node without the shared filesystem has.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.trainer import checkpoint_dirs, checkpointing
from hybridflow.trainer.config.schema import RunConfig
from hybridflow.utils import shared_path
from hybridflow.utils.shared_path import PathView
from tests.conftest import REPO_ROOT
from tests.trainer.ray_nodes import ray_tmpdir, start_node  # noqa: F401 (a fixture: private RAY_TMPDIR, PYTHONPATH)


def committed_checkpoint(root: Path, step: int = 2) -> Path:
    """A committed `global_step_{step}` with a driver state, the pointer file beside it."""
    staging = checkpoint_dirs.staging_dir(root, step)
    (staging / "actor").mkdir()
    (staging / "actor" / "model_world_size_2_rank_0.pt").write_bytes(b"\x01" * 100)
    (staging / checkpointing.DRIVER_STATE).write_text('{"global_steps": %d}' % step)
    return checkpoint_dirs.commit_step(root, step, staging)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes."""
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


# ----------------------------------------------------------------------------- the probe helpers
def test_a_probe_reads_back_its_token_and_reports_a_missing_or_different_file(tmp_path):
    path = shared_path.write_probe(tmp_path, shared_path.probe_name("abc", "driver"), "abc")
    assert path.name == ".hybridflow-shared-dir-probe-abc.driver"
    assert shared_path.read_probe(path, "abc") is None
    assert "holds another token ('abc')" in shared_path.read_probe(path, "xyz")
    assert "does not exist" in shared_path.read_probe(tmp_path / "gone", "abc")


def test_a_probe_never_replaces_an_existing_file(tmp_path):
    existing = tmp_path / shared_path.probe_name("abc", "driver")
    existing.write_text("someone else's")
    with pytest.raises(FileExistsError):
        shared_path.write_probe(tmp_path, existing.name, "abc")
    assert existing.read_text() == "someone else's"


def test_a_worker_view_of_a_shared_dir_and_the_cleanup_leave_a_checkpoint_untouched(tmp_path):
    final = committed_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    shared_path.write_probe(tmp_path, shared_path.probe_name("t0", "driver"), "t0")
    view = shared_path.view_run_dir(tmp_path, "t0", final, rank=1, node_ip="10.0.0.2", node_id="ab12")
    assert view.driver_probe_error is None and view.write_error is None
    assert view.probe_name == f".hybridflow-shared-dir-probe-t0.ab12-{os.getpid()}"
    assert shared_path.read_probe(tmp_path / view.probe_name, "t0") is None
    assert view.resume_fingerprint == shared_path.tree_fingerprint(final) != "missing"
    assert len(shared_path.remove_probes(tmp_path, "t0")) == 2
    assert snapshot(tmp_path) == before, "only the probes were added and removed"
    assert checkpoint_dirs.list_steps(tmp_path) == [2] and checkpoint_dirs.latest_step(tmp_path) == 2


def test_a_worker_that_does_not_see_the_dir_reports_both_directions(tmp_path):
    view = shared_path.view_run_dir(tmp_path / "elsewhere", "t1", None, rank=3, node_ip="10.0.0.3", node_id="cd34")
    assert "does not exist there" in view.driver_probe_error
    assert view.probe_name is None and "cannot create a file in" in view.write_error
    assert view.resume_fingerprint is None
    assert view.describe() == f"rank 3 on node cd34 (ip 10.0.0.3, pid {os.getpid()})"


def test_the_fingerprint_tells_apart_copies_of_a_checkpoint(tmp_path):
    final = committed_checkpoint(tmp_path / "a")
    copy = tmp_path / "b" / final.name
    shutil.copytree(final, copy)
    assert shared_path.tree_fingerprint(final) == shared_path.tree_fingerprint(copy)
    (copy / checkpointing.DRIVER_STATE).write_text('{"global_steps": 3}')  # same size, another step
    assert shared_path.tree_fingerprint(final) != shared_path.tree_fingerprint(copy)
    assert shared_path.tree_fingerprint(tmp_path / "none") == "missing"


def test_the_error_names_the_key_the_path_each_rank_and_node_and_the_fix(tmp_path):
    shared_path.write_probe(tmp_path, shared_path.probe_name("t2", "driver"), "t2")
    good = shared_path.view_run_dir(tmp_path, "t2", None, rank=0, node_ip="10.0.0.1", node_id="aa11")
    blind = shared_path.view_run_dir(tmp_path / "local", "t2", None, rank=1, node_ip="10.0.0.2", node_id="bb22")
    lonely = PathView(2, "10.0.0.3", "cc33", 77, None, ".hybridflow-shared-dir-probe-t2.cc33-77", None, None)
    problems = checkpointing._run_dir_problems(tmp_path, "t2", {"hybridflow_global_pool": [good, blind, lonely]})
    message = checkpointing._shared_dirs_message(RunConfig(), tmp_path, None, problems, [])
    assert message.startswith(f"trainer.default_local_dir={str(tmp_path)!r} must be one directory that the driver")
    assert "Mount one shared filesystem (e.g. NFS) at that path on every node" in message
    assert "rank 0" not in message
    assert "rank 1 on node bb22 (ip 10.0.0.2" in message and "cannot read the driver's probe" in message
    assert "the driver cannot see the probe written by rank 2 on node cc33 (ip 10.0.0.3, pid 77) of " \
        "hybridflow_global_pool: " in message
    assert len(message.splitlines()) == 4  # the header, two lines for rank 1 (both directions), one for rank 2


def test_a_resume_checkpoint_that_differs_on_a_node_names_the_resume_key(tmp_path):
    final = committed_checkpoint(tmp_path)
    same = shared_path.view_run_dir(tmp_path, "t3", final, rank=0, node_ip="10.0.0.1", node_id="aa11")
    missing = shared_path.view_run_dir(tmp_path, "t3", tmp_path / "nope", rank=1, node_ip="10.0.0.2", node_id="bb22")
    problems = checkpointing._resume_dir_problems(final, {"pool": [same, missing]})
    assert len(problems) == 1 and problems[0].startswith("rank 1 on node bb22") and "no such directory" in problems[0]
    run = RunConfig(resume_mode="resume_path", resume_from_path=str(final))
    message = checkpointing._shared_dirs_message(run, tmp_path, final, [], problems)
    assert message.startswith(f"trainer.resume_from_path: the checkpoint {final} that the driver")
    shared_path.remove_probes(tmp_path, "t3")


# ----------------------------------------------------------------------------- on the embedded Ray cluster
@pytest.fixture(scope="module")
def two_workers(ray_cluster):
    """Two plain worker processes in one pool, as a trainer's pool is built."""
    from hybridflow.single_controller import Worker
    from hybridflow.single_controller.ray import RayClassWithInitArgs
    from hybridflow.trainer.scaffold import WorkerProcesses

    processes = WorkerProcesses(
        RunConfig(n_gpus_per_node=2, device="cpu"), RayClassWithInitArgs(Worker), name_prefix="shared_dir_check"
    )
    yield processes
    processes.shutdown()


def test_two_workers_on_one_node_pass_the_check_and_leave_nothing_behind(two_workers, tmp_path):
    final = committed_checkpoint(tmp_path)
    before = snapshot(tmp_path)
    checkpointing.check_shared_dirs(RunConfig(), tmp_path, final, [two_workers])
    assert snapshot(tmp_path) == before
    assert not list(tmp_path.glob(".hybridflow-*")), "no probe left"


def test_a_run_dir_the_driver_cannot_create_fails_naming_the_key(two_workers, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match=r"trainer.default_local_dir=.*file/run.*the driver cannot write there"):
        checkpointing.check_shared_dirs(RunConfig(), blocker / "run", None, [two_workers])


def test_local_mode_workers_are_not_probed(tmp_path):
    from hybridflow.single_controller import Worker
    from hybridflow.single_controller.ray import RayClassWithInitArgs
    from hybridflow.trainer.scaffold import WorkerProcesses

    run = RunConfig(local_mode=True)
    processes = WorkerProcesses(run, RayClassWithInitArgs(Worker), name_prefix="local")
    checkpointing.check_shared_dirs(run, tmp_path / "never_created", None, [processes])
    assert not (tmp_path / "never_created").exists()


# ----------------------------------------------------------------------------- a node without the shared directory
def private_mount_command() -> list[str] | None:
    """`unshare` arguments that give a process its own mount namespace (root, or an unprivileged user namespace),
    or None where this machine allows neither."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for command in ([unshare, "--mount", "--propagation", "private"],
                    [unshare, "--user", "--map-root-user", "--mount", "--propagation", "private"]):
        probe = subprocess.run([*command, "sh", "-c", "mount -t tmpfs none /mnt"], capture_output=True)
        if probe.returncode == 0:
            return command
    return None


DRIVER = """
import json, sys
from pathlib import Path
import ray
from hybridflow.single_controller import Worker
from hybridflow.single_controller.ray import RayClassWithInitArgs
from hybridflow.trainer import checkpointing
from hybridflow.trainer.config.schema import RunConfig
from hybridflow.trainer.scaffold import WorkerProcesses

ray.init(address=sys.argv[1])
private = [node["NodeID"] for node in ray.nodes() if node["Alive"] and "private_fs" in node["Resources"]]
run = RunConfig(nnodes=2, n_gpus_per_node=1, device="cpu")
processes = WorkerProcesses(run, RayClassWithInitArgs(Worker), name_prefix="hf_shared")
try:
    checkpointing.check_shared_dirs(run, Path(sys.argv[2]), None, [processes])
    error = None
except ValueError as err:
    error = str(err)
finally:
    processes.shutdown()
print("RESULT " + json.dumps({"private": private, "error": error}))
"""


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_a_node_with_its_own_copy_of_the_dir_stops_the_run_naming_its_rank_and_node(tmp_path, ray_tmpdir):
    from hybridflow.single_controller.base.worker import find_free_port
    from tests.trainer.ray_nodes import start_ray, stop_ray

    command = private_mount_command()
    if command is None:
        pytest.skip("no private mount namespace here (unshare needs root or unprivileged user namespaces)")
    shared = tmp_path / "shared"
    root = shared / "project" / "run"
    root.mkdir(parents=True)
    address = f"127.0.0.1:{find_free_port()}"
    ray_cli = Path(sys.executable).with_name("ray")
    # The second node sees an empty tmpfs at `shared`, with the run directory made again inside it: its own disk.
    private_node = (
        f"mount -t tmpfs none {shared} && mkdir -p {root} && exec {ray_cli} start --block --num-cpus=1 "
        f"--resources='{{\"private_fs\": 1}}' --address={address}"
    )
    nodes = [start_ray(ray_tmpdir / "head.log", "--head", f"--port={address.rsplit(':', 1)[1]}")]
    try:
        nodes.append(start_private_node(command, private_node, ray_tmpdir / "private.log"))
        result = subprocess.run([sys.executable, "-c", DRIVER, address, str(root)], cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=240)
    finally:
        for process in reversed(nodes):
            stop_ray(process)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stdout[-3000:] + result.stderr[-6000:]
    outcome = json.loads(lines[-1][len("RESULT "):])
    (private_node_id,) = outcome["private"]
    message = outcome["error"]
    assert message is not None, "the check passed though one node has its own copy of the directory"
    assert message.startswith(f"trainer.default_local_dir={str(root)!r} must be one directory"), message
    assert "Mount one shared filesystem (e.g. NFS)" in message
    problems = message.splitlines()[1:]
    assert len(problems) == 2, message  # only the private node's rank, in both directions
    assert f"on node {private_node_id} " in problems[0] and "cannot read the driver's probe" in problems[0]
    assert "does not exist there" in problems[0]
    assert problems[1].startswith("  - the driver cannot see the probe written by rank ")
    assert private_node_id in problems[1]
    assert sorted(path.name for path in root.iterdir()) == [], "no probe left on the driver's side"


def start_private_node(command: list[str], script: str, log: Path) -> subprocess.Popen:
    """A Ray worker node in its own mount namespace (`script` mounts, then execs `ray start --block`)."""
    return start_node([*command, "sh", "-c", script], log, "the private node")
