"""`fsdp_config.param_offload` on a lone accelerator rank is real: the rank joins a one-rank process group, so
FSDP2's CPUOffloadPolicy keeps the parameters on the host (without a group the engine would not shard, and the
setting would do nothing). The device is faked where a check runs before anything moves to it; the offload
itself runs on CPU over a one-rank gloo group, the path a GPU takes but for the copies."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hybridflow.engines.training.sharding as sharding
from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models.config import ModelConfig
from tests.engines.helpers import make_batch, seq_mean_nll

OFFLOAD = FSDPEngineConfig(
    fsdp=FSDPConfig(dtype="float32", param_offload=True), optim=OptimConfig(lr=1e-3, weight_decay=0.0),
    micro_batch_size_per_gpu=4,
)
CUDA = torch.device("cuda", 0)


@pytest.fixture()
def no_process_group():
    """The test starts without a process group (tests/conftest.py destroys the one an engine makes)."""
    assert not dist.is_initialized()


@pytest.fixture()
def joins_on_cpu(monkeypatch):
    """Joining for a faked CUDA device makes a gloo group with no device id (this host has no CUDA); records the
    devices it was asked for."""
    asked = []
    real_join = sharding._join_one_rank_group

    def join(device):
        asked.append(device)
        real_join(torch.device("cpu"))

    monkeypatch.setattr(sharding, "_join_one_rank_group", join)
    return asked


def test_a_lone_accelerator_rank_with_param_offload_joins_a_group(no_process_group, joins_on_cpu, monkeypatch):
    plain = FSDPEngineConfig(fsdp=FSDPConfig(dtype="float32"))
    assert sharding.join_group_for_param_offload(OFFLOAD, torch.device("cpu")) is False  # the host is the device
    assert sharding.join_group_for_param_offload(plain, CUDA) is False  # nothing to offload
    with monkeypatch.context() as patch:  # a rank of a 2-rank worker group joins its own group instead
        patch.setenv("WORLD_SIZE", "2")
        assert sharding.join_group_for_param_offload(OFFLOAD, CUDA) is False
    assert not dist.is_initialized() and joins_on_cpu == []
    assert sharding.join_group_for_param_offload(OFFLOAD, CUDA) is True
    assert dist.is_initialized() and dist.get_world_size() == 1 and joins_on_cpu == [CUDA]
    assert sharding.join_group_for_param_offload(OFFLOAD, CUDA) is False  # one exists


def test_the_engine_joins_before_it_checks_lora(tiny_llama_dir, no_process_group, joins_on_cpu, monkeypatch):
    """Built on a (faked) GPU with param_offload, the engine is sharded: LoRA in bf16 over that one-rank group is
    then refused, naming param_offload, before anything moves to the device."""
    import hybridflow.engines.training.fsdp as fsdp_module

    monkeypatch.setattr(fsdp_module, "get_torch_device", lambda rank: CUDA)
    config = FSDPEngineConfig(
        fsdp=FSDPConfig(dtype="bfloat16", param_offload=True), model=ModelConfig(lora_rank=4, lora_alpha=8)
    )
    with pytest.raises(RuntimeError, match="param_offload=True joins one"):
        build_fsdp_engine(tiny_llama_dir, config)
    assert joins_on_cpu == [CUDA] and dist.get_world_size() == 1


def test_offload_over_a_one_rank_group_keeps_parameters_on_the_host_and_trains_alike(tiny_llama_dir, no_process_group):
    """FSDP2's CPU offload over a one-rank group: host shards, and the same update as the unsharded engine."""
    batch = make_batch(256, batch_size=8, seed=2)
    unsharded = build_fsdp_engine(tiny_llama_dir, FSDPEngineConfig(
        fsdp=FSDPConfig(dtype="float32"), optim=OFFLOAD.optim, micro_batch_size_per_gpu=4,
    ))
    expected = [unsharded.train_batch(batch, seq_mean_nll)["loss"] for _ in range(2)]
    expected_params = {name: p.detach().clone() for name, p in unsharded.named_full_params()}
    sharding._join_one_rank_group(torch.device("cpu"))
    offloaded = build_fsdp_engine(tiny_llama_dir, OFFLOAD)
    assert offloaded.is_sharded and offloaded.shards_on_host
    params = list(offloaded.module.parameters())
    assert params and all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params)
    got = [offloaded.train_batch(batch, seq_mean_nll)["loss"] for _ in range(2)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for name, tensor in offloaded.named_full_params():
        torch.testing.assert_close(tensor, expected_params[name], rtol=1e-5, atol=1e-6)
