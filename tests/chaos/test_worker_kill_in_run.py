"""SIGKILL of a worker process during the actor update of a tiny GRPO run on local Ray: the run stops at once with
an error naming the worker, and the last checkpoint resumes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from hybridflow.single_controller import WorkerError
from hybridflow.single_controller.ray import RayWorkerGroup
from hybridflow.trainer import checkpointing
from hybridflow.trainer.checkpoint_dirs import list_steps
from hybridflow.trainer.config import load_config, validate_config
from hybridflow.trainer.config.schema import RunConfig
from hybridflow.trainer.run import run_ppo
from tests.tiny_runs import build_workspace

@pytest.fixture
def workspace(tmp_path, ray_cluster):
    return build_workspace(tmp_path, train_size=8, test_size=2, num_layers=1, hidden=32)


def grpo_run(root: Path) -> list[str]:
    """2 steps of GRPO on 2 CPU ranks, a checkpoint after each; 8 epochs make each update last a while."""
    return [
        f"data.train_files=[{root / 'data' / 'train.parquet'}]", "data.val_files=[]",
        "data.train_batch_size=2", "data.max_prompt_length=128", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={root / 'tiny'}", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_epochs=8",
        "trainer.n_gpus_per_node=2", "trainer.device=cpu", "trainer.logger=[file]",
        "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=False",
        f"trainer.default_local_dir={root / 'run'}", f"custom_reward_function.path={root / 'reward.py'}",
    ]


@pytest.mark.slow  # a long end-to-end run, outside the default suite's time budget: `make test-all`
def test_sigkill_during_the_actor_update_stops_the_run_and_the_last_checkpoint_resumes(workspace, monkeypatch):
    run_dir = workspace / "run"
    killed: dict[str, float] = {}
    execute = RayWorkerGroup._execute

    def execute_then_kill(group, method_name, ranks, args, kwargs):
        handles = execute(group, method_name, ranks, args, kwargs)
        if method_name.endswith("update_actor") and list_steps(run_dir) == [1] and not killed:
            pid = group.process_info[1][1]  # rank 1, in the middle of step 2's update

            def kill() -> None:
                finished, _ = ray.wait(handles, num_returns=len(handles), timeout=0)
                os.kill(pid, signal.SIGKILL)
                killed.update(pid=pid, at=time.monotonic(), update_had_finished=len(finished) == len(handles))

            threading.Timer(0.1, kill).start()
        return handles

    monkeypatch.setattr(RayWorkerGroup, "_execute", execute_then_kill)
    config = load_config(grpo_run(workspace))
    with pytest.raises(WorkerError) as info:
        run_ppo(config, validate_config(config))
    stopped_after_s = time.monotonic() - killed["at"]
    assert not killed["update_had_finished"], "the kill came after the update; make the update longer"
    assert stopped_after_s < 60, f"the run stopped {stopped_after_s:.1f} s after the kill"
    message = str(info.value)
    assert "worker rank 1 of worker group 'actor_rollout' failed in 'update_actor'" in message
    assert "its process died" in message and f"pid: {killed['pid']}" in message
    print(f"run stopped {stopped_after_s:.2f} s after the SIGKILL")

    monkeypatch.setattr(RayWorkerGroup, "_execute", execute)
    assert list_steps(run_dir) == [1], "step 2 was never saved"
    assert checkpointing.load_driver_state(
        checkpointing.find_resume_dir(RunConfig(resume_mode="auto"), run_dir)
    )["global_steps"] == 1
    config = load_config(grpo_run(workspace))
    run_ppo(config, validate_config(config))  # resumes from global_step_1 and trains step 2
    assert list_steps(run_dir) == [1, 2]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = {key: value for record in records if record["step"] == 2 for key, value in record.items()}
    assert resumed["actor/grad_norm"] > 0 and resumed["workers/alive"] == 2
