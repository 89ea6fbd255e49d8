"""One rank computing in bfloat16 over a one-rank process group of its own (`join_single_rank_group`, opt-in) runs
FSDP2's mixed precision: bf16 activations and residual stream, float32 master weights, and an update that follows
the float32 engine's. Without the group (the default) the same engine runs autocast over unsharded weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.sharding import join_single_rank_group
from tests.engines.helpers import make_batch, seq_mean_nll


@pytest.fixture()
def no_process_group():
    """The test starts without a process group (tests/conftest.py destroys the one an engine makes)."""
    assert not dist.is_initialized()


def _engine(model_dir: str, dtype: str, *, own_group: bool = True):
    config = FSDPEngineConfig(
        fsdp=FSDPConfig(dtype=dtype), optim=OptimConfig(lr=1e-3, weight_decay=0.0), micro_batch_size_per_gpu=4
    )
    if own_group:
        join_single_rank_group(config, torch.device("cpu"))
    return build_fsdp_engine(model_dir, config)


def test_a_bf16_rank_alone_runs_autocast_unless_it_joins_a_group(tiny_llama_dir, no_process_group):
    engine = _engine(tiny_llama_dir, "bfloat16", own_group=False)
    assert not dist.is_initialized() and not engine.is_sharded and engine.param_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in engine.module.parameters())
    metrics = engine.train_batch(make_batch(engine.module.config.vocab_size, batch_size=8, seed=0), seq_mean_nll)
    assert metrics["grad_norm"] > 0


def test_a_bf16_rank_over_its_own_group_shards_and_computes_in_bf16(tiny_llama_dir, no_process_group):
    engine = _engine(tiny_llama_dir, "bfloat16")
    assert dist.is_initialized() and dist.get_world_size() == 1 and engine.is_sharded
    params = dict(engine.module.named_parameters())
    assert all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in params.values())  # fp32 master weights
    seen = {}
    layers = engine.module.model.layers
    hooks = [
        layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: seen.update(q_weight=m.weight.dtype)),
        layers[-1].register_forward_hook(
            lambda m, args, out: seen.update(residual=(out[0] if isinstance(out, tuple) else out).dtype)
        ),
    ]
    batch = make_batch(engine.module.config.vocab_size, batch_size=8, seed=0)
    before = {name: p.full_tensor().clone() for name, p in params.items()}
    metrics = engine.train_batch(batch, seq_mean_nll)
    for hook in hooks:
        hook.remove()
    assert seen == {"q_weight": torch.bfloat16, "residual": torch.bfloat16}  # no float32 residual stream
    assert metrics["grad_norm"] > 0
    after = {name: p.full_tensor() for name, p in engine.module.named_parameters()}
    assert all(after[name].dtype == torch.float32 for name in after)
    assert any(not torch.equal(after[name], before[name]) for name in after)


def test_the_bf16_engine_update_follows_the_float32_one(tiny_llama_dir, no_process_group):
    """Same batch, same start: bf16 log-probs within bf16 rounding of the float32 engine's (the float32 engine
    runs first, without a group: float32 needs none)."""
    batch = make_batch(256, batch_size=8, seed=1)
    reference = _engine(tiny_llama_dir, "float32")
    assert not dist.is_initialized() and not reference.is_sharded
    expected, _ = reference.compute_log_prob(batch)
    engine = _engine(tiny_llama_dir, "bfloat16")
    assert engine.is_sharded
    got, _ = engine.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=0.05, rtol=0.02)


def test_float32_and_a_rank_of_a_larger_group_are_left_alone(no_process_group, monkeypatch):
    cpu = torch.device("cpu")
    with monkeypatch.context() as patch:  # a rank of a 2-rank worker group, before it joins its group
        patch.setenv("WORLD_SIZE", "2")
        assert join_single_rank_group(FSDPEngineConfig(fsdp=FSDPConfig(dtype="bfloat16")), cpu) is False
    assert join_single_rank_group(FSDPEngineConfig(fsdp=FSDPConfig(dtype="float32")), cpu) is False
    assert join_single_rank_group(FSDPEngineConfig(), cpu) is False  # auto is float32 on a CPU
    assert not dist.is_initialized()
    assert join_single_rank_group(FSDPEngineConfig(fsdp=FSDPConfig(dtype="bfloat16")), cpu) is True
    assert join_single_rank_group(FSDPEngineConfig(fsdp=FSDPConfig(dtype="bfloat16")), cpu) is False  # one exists


def test_lora_over_a_one_rank_group_on_cuda_is_refused_before_any_step(tiny_llama_dir, no_process_group, monkeypatch):
    """FSDP2 on a one-rank CUDA group assigned a bf16 gradient to a float32 LoRA shard (H200, torch 2.11): the
    engine says so when it is built (the device is faked: the check runs before anything moves to it)."""
    import hybridflow.engines.training.fsdp as fsdp_module
    from hybridflow.models.config import ModelConfig

    config = FSDPEngineConfig(fsdp=FSDPConfig(dtype="bfloat16"), model=ModelConfig(lora_rank=4, lora_alpha=8))
    assert join_single_rank_group(config, torch.device("cpu"))
    monkeypatch.setattr(fsdp_module, "get_torch_device", lambda rank: torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="LoRA with FSDP2's bf16 mixed precision over a one-rank"):
        build_fsdp_engine(tiny_llama_dir, config)
