"""verl's SFT lines under torchrun, with the module name changed (`torchrun --nproc_per_node=N -m
hybridflow.trainer.fsdp_sft_trainer ...`): rank 0 drives N workers on Ray, the other ranks exit, and a layout that
disagrees with torchrun's is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridflow.trainer.torchrun_launch import (
    TorchrunLaunch, clear_torchrun_environment, driver_overrides, torchrun_launch)
from tests.trainer.sft.conftest import sft_overrides

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def test_torchrun_s_environment_gives_the_launch_and_nothing_else_does():
    assert torchrun_launch({"RANK": "0", "WORLD_SIZE": "2"}) is None  # a Ray worker's variables, not torchrun's
    launch = torchrun_launch({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert launch == TorchrunLaunch(rank=3, world_size=8, local_world_size=4) and launch.nnodes == 2


def test_the_layout_follows_torchrun_unless_the_line_disagrees():
    one_node = TorchrunLaunch(rank=0, world_size=4, local_world_size=4)
    assert driver_overrides(one_node, ["data.train_batch_size=8"])[-2:] == ["trainer.nnodes=1",
                                                                           "trainer.n_gpus_per_node=4"]
    assert driver_overrides(one_node, ["trainer.n_gpus_per_node=4"]) == ["trainer.n_gpus_per_node=4", "trainer.nnodes=1"]
    with pytest.raises(ValueError, match="trainer.n_gpus_per_node=8 but torchrun started 4 processes"):
        driver_overrides(one_node, ["trainer.n_gpus_per_node=8"])
    with pytest.raises(ValueError, match="torchrun started 2 nodes x 4 processes.*trainer.nnodes=2"):
        driver_overrides(TorchrunLaunch(rank=0, world_size=8, local_world_size=4), [])


def test_the_driver_drops_torchrun_s_variables_before_ray_starts():
    environ = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "MASTER_PORT": "29500", "PATH": "/bin"}
    clear_torchrun_environment(environ)
    assert environ == {"PATH": "/bin"}


def _torchrun(nproc: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    command = [*TORCHRUN, f"--nproc_per_node={nproc}", "-m", "hybridflow.trainer.fsdp_sft_trainer", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_verl_sft_line_under_torchrun_plans_torchrun_s_ranks(sft_workspace, tmp_path):
    result = _torchrun(2, ["--dry-run", *sft_overrides(sft_workspace, tmp_path / "run")], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ranks (nnodes x n_gpus_per_node)                 2" in result.stdout
    assert result.stdout.count("[sft]") == 1  # one driver: rank 1 printed nothing but its exit line
    assert "torchrun rank 1 of 2: the driver on rank 0 runs all 2 workers on Ray" in result.stderr


def test_a_layout_that_disagrees_with_torchrun_is_refused_by_every_rank(sft_workspace, tmp_path):
    result = _torchrun(2, ["trainer.n_gpus_per_node=4", *sft_overrides(sft_workspace, tmp_path / "run")], timeout=300)
    assert result.returncode != 0
    # Every rank prints it: torchrun stops the other ranks when the first exits, so under load the one that printed
    # may be the only one left (when only rank 0 printed, a loaded machine's rank 1 exited first and nothing was said).
    errors = [line for line in result.stderr.splitlines() if "config error:" in line]
    assert 1 <= len(errors) <= 2, result.stderr[-2000:]
    assert all("config error: trainer.n_gpus_per_node=4 but torchrun started 2 processes" in line for line in errors)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sft_under_torchrun_trains_on_two_ray_workers_and_checkpoints(sft_workspace, tmp_path):
    run_dir = tmp_path / "run"
    args = sft_overrides(sft_workspace, run_dir, "trainer.total_training_steps=2", "trainer.logger=[console]",
                         "data.val_files=null")
    result = _torchrun(2, args, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "hybridflow_sft: 2 ranks on 1 Ray node" in result.stderr
    assert "step 2/2" in result.stderr
    assert (run_dir / "global_step_2" / "driver_state.json").is_file()
