"""The rollouts' weight moves around sleep/wake_up (written once in `engines/rollout/base.py`), the empty-cache
policy (no `empty_cache` when the rollout shares the trainer's module) and the rollout-copy dtype rule."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, NativeRollout, SamplingParams
from hybridflow.engines.rollout.base import (
    compute_empty_cache_on_sleep,
    compute_rollout_copy_dtype,
    sleep_rollout_model,
    wake_up_rollout_model,
)
from hybridflow.models import build_causal_lm

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


class _Moves(torch.nn.Module):
    """A module that records where it is asked to move (a CPU host has no accelerator to move to)."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return self


@pytest.fixture()
def empty_cache_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: calls.append(1))
    return calls


def test_empty_cache_policy():
    assert compute_empty_cache_on_sleep("cuda", shares_training_weights=False)
    assert not compute_empty_cache_on_sleep("cuda", shares_training_weights=True)
    assert not compute_empty_cache_on_sleep("cpu", shares_training_weights=False)


def test_sleep_moves_and_empties_only_own_weights_on_an_accelerator(empty_cache_calls):
    shared = _Moves()
    sleep_rollout_model(shared, CUDA, shares_training_weights=True)
    wake_up_rollout_model(shared, CUDA, shares_training_weights=True)
    assert shared.moves == [] and empty_cache_calls == []  # the trainer's module stays, its cache is reused
    own = _Moves()
    sleep_rollout_model(own, CUDA, shares_training_weights=False)
    assert own.moves == ["cpu"] and len(empty_cache_calls) == 1
    wake_up_rollout_model(own, CUDA, shares_training_weights=False)
    assert own.moves == ["cpu", "cuda"] and len(empty_cache_calls) == 1
    host = _Moves()
    sleep_rollout_model(host, CPU, shares_training_weights=False)
    wake_up_rollout_model(host, CPU, shares_training_weights=False)
    assert host.moves == [] and len(empty_cache_calls) == 1


@pytest.mark.parametrize("rollout_cls", [HFRollout, NativeRollout])
def test_rollouts_do_not_empty_the_cache_when_sharing_the_trainer_module(
    rollout_cls, tiny_llama_dir, tiny_tokenizer, empty_cache_calls, monkeypatch
):
    rollout = rollout_cls(build_causal_lm(tiny_llama_dir), tiny_tokenizer, SamplingParams(max_new_tokens=2))
    rollout.device = CUDA  # what the policy reads; nothing here touches a device
    monkeypatch.setattr(rollout, "model", _Moves())
    rollout.shares_training_weights = True
    rollout.sleep()
    assert empty_cache_calls == [] and rollout.model.moves == []
    rollout.shares_training_weights = False
    rollout.sleep()
    assert len(empty_cache_calls) == 1 and rollout.model.moves == ["cpu"]


def test_rollout_copy_dtype():
    # CPU: always the trainer's module, whatever the setting
    assert compute_rollout_copy_dtype("auto", CPU, torch.float32) is None
    assert compute_rollout_copy_dtype("bfloat16", CPU, torch.float32) is torch.bfloat16  # set explicitly: honoured
    assert compute_rollout_copy_dtype("float32", CPU, torch.float32) is None
    assert compute_rollout_copy_dtype("auto", CPU, torch.bfloat16) is None
    # accelerator: fp32 master weights generate from a bf16 copy ('auto' is bf16 there)
    assert compute_rollout_copy_dtype("auto", CUDA, torch.float32) is torch.bfloat16
    assert compute_rollout_copy_dtype("auto", CUDA, torch.bfloat16) is None
    assert compute_rollout_copy_dtype("float32", CUDA, torch.float32) is None
    assert compute_rollout_copy_dtype("float16", CUDA, torch.bfloat16) is torch.float16


def test_a_cpu_rollout_gives_the_freed_heap_back_on_sleep(monkeypatch):
    """On a CPU host sleep hands the C heap's free pages back to the OS (glibc's malloc_trim), the host's
    counterpart of emptying a GPU's cache; an accelerator rollout does not."""
    from hybridflow.engines.rollout import base

    trims = []
    monkeypatch.setattr(base, "release_freed_host_memory", lambda: trims.append(1) or True)
    sleep_rollout_model(_Moves(), CPU, shares_training_weights=False)
    sleep_rollout_model(_Moves(), CPU, shares_training_weights=True)
    assert len(trims) == 2
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    sleep_rollout_model(_Moves(), CUDA, shares_training_weights=False)
    assert len(trims) == 2


def test_releasing_the_freed_heap_is_a_no_op_without_malloc_trim(monkeypatch):
    """A C library without malloc_trim (musl, macOS) or none found: nothing to call, False, no error."""
    import ctypes

    from hybridflow.utils import device
    from hybridflow.utils.device import release_freed_host_memory

    class NoTrim:
        def __init__(self, name) -> None:
            self.name = name

    device._malloc_trim.cache_clear()  # the lookup is cached per process
    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    assert release_freed_host_memory() is False
    device._malloc_trim.cache_clear()

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert release_freed_host_memory() is False
    device._malloc_trim.cache_clear()  # later tests look this host's malloc_trim up again
