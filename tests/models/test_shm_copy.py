"""verl's model.use_shm: a checkpoint copied once into shared memory (per version of its files), raced safely by
the workers of a node, refused clearly when shared memory is too small; the worker loads the copy."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridflow.models import save_tiny_model
from hybridflow.models.shm_copy import shm_copy_of


def test_the_copy_is_made_once_and_again_when_the_checkpoint_changes(tmp_path):
    source = save_tiny_model(tmp_path / "model")
    (tmp_path / "shm").mkdir()
    root = tmp_path / "shm" / "hybridflow_models"  # a stand-in for /dev/shm/hybridflow_models
    with ThreadPoolExecutor(4) as pool:  # the workers of one node start together
        copies = set(pool.map(lambda _: shm_copy_of(source, root), range(4)))
    assert len(copies) == 1
    copy = copies.pop()
    assert sorted(os.listdir(copy)) == sorted(os.listdir(source))
    assert not [name for name in os.listdir(os.path.dirname(copy)) if name.endswith(".tmp")]
    assert shm_copy_of(source, root) == copy  # found, not copied again
    (source / "config.json").write_text((source / "config.json").read_text() + " ")
    assert shm_copy_of(source, root) != copy  # a changed checkpoint is a new copy


def test_too_little_shared_memory_is_refused(tmp_path, monkeypatch):
    source = save_tiny_model(tmp_path / "model")
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1, 1, 10))
    with pytest.raises(RuntimeError, match=r"model.use_shm=True: .* GiB free; free shared memory or set use_shm=False"):
        shm_copy_of(source, tmp_path / "shm" / "hybridflow_models")


def test_a_worker_loads_the_shared_memory_copy(tmp_path, monkeypatch):
    from hybridflow.models.config import ModelConfig
    from hybridflow.workers import process
    from hybridflow.workers.config import WorkerRuntimeConfig

    source = save_tiny_model(tmp_path / "model")
    (tmp_path / "shm").mkdir()
    root = tmp_path / "shm" / "hybridflow_models"
    monkeypatch.setattr(process, "shm_copy_of", lambda location: shm_copy_of(location, root))

    class OneRank:
        world_size = 1

    path, tokenizer = process.prepare_worker_process(OneRank(), WorkerRuntimeConfig(), ModelConfig(path=str(source), use_shm=True))
    assert path.startswith(str(root)) and tokenizer is not None
