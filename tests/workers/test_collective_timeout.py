"""verl's actor_rollout_ref.nccl_timeout: the timeout of every worker pool's process group (a collective that
waits longer fails instead of hanging), carried by the workers' runtime config into `init_process_group`."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from hybridflow.single_controller import Worker
from hybridflow.trainer.config import load_config
from hybridflow.trainer.scaffold import worker_runtime
from hybridflow.workers import process


def test_nccl_timeout_reaches_the_process_group(monkeypatch):
    cfg = load_config(["actor_rollout_ref.nccl_timeout=1800"])
    runtime = worker_runtime(cfg.trainer, 10, 1, cfg.actor_rollout_ref.nccl_timeout)
    assert runtime.collective_timeout_s == 1800
    seen = {}

    class TwoRanks(Worker):
        world_size = 2

    worker = TwoRanks.__new__(TwoRanks)
    monkeypatch.setattr(TwoRanks, "init_distributed", lambda self, timeout_s=None: seen.update(timeout_s=timeout_s))
    monkeypatch.setattr(process, "resolve_model_path", lambda path: path)
    monkeypatch.setattr(process, "load_tokenizer", lambda path, trust_remote_code=False: None)
    process.prepare_worker_process(worker, runtime, cfg.actor_rollout_ref.model)
    assert seen == {"timeout_s": 1800}
    assert load_config([]).actor_rollout_ref.nccl_timeout is None  # torch's default unless set
    with pytest.raises(ValueError, match="nccl_timeout=0 must be > 0"):
        load_config(["actor_rollout_ref.nccl_timeout=0"])


def test_the_worker_passes_the_timeout_to_init_process_group(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: object())
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    worker = Worker.__new__(Worker)
    worker._local_mode, worker._rank, worker._world_size = False, 1, 2
    worker._master_addr, worker._master_port = "127.0.0.1", "1"
    worker.init_distributed(backend="gloo", timeout_s=42)
    worker.init_distributed(backend="gloo")
    assert calls[0]["timeout"] == datetime.timedelta(seconds=42) and "timeout" not in calls[1]
