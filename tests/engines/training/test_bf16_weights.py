"""verl's `fsdp_config.model_dtype=bfloat16`: the weights, their gradients and AdamW's moments are bfloat16, in one
process and sharded over 2 gloo ranks (LoRA adapters too); the model learns, and a checkpoint round-trips."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import DTensor

from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models.config import ModelConfig
from hybridflow.utils.config import ConfigFieldError
from tests.engines.helpers import make_batch, run_distributed, seq_mean_nll

BF16 = FSDPEngineConfig(
    fsdp=FSDPConfig(model_dtype="bfloat16"), optim=OptimConfig(lr=3e-3, weight_decay=0.0), micro_batch_size_per_gpu=4,
)
LORA = dataclasses.replace(BF16, model=ModelConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _train_and_check(engine, batch, steps: int = 4) -> list[float]:
    """Train on one batch; every trained weight, gradient and AdamW moment is bfloat16; returns the losses."""
    losses = [float(engine.train_batch(batch, seq_mean_nll)["nll"]) for _ in range(steps)]
    trained = [p for p in engine.module.parameters() if p.requires_grad]
    assert trained and all(_local(p).dtype == torch.bfloat16 for p in engine.module.parameters())
    for param in trained:
        state = engine.optimizer.state[param]
        assert _local(state["exp_avg"]).dtype == _local(state["exp_avg_sq"]).dtype == torch.bfloat16
    return losses


def test_bf16_weights_train_in_one_process_and_log_probs_stay_near_float32(tiny_llama_dir, tmp_path):
    batch = make_batch(128, batch_size=8, seed=0)
    engine = build_fsdp_engine(tiny_llama_dir, BF16)
    assert engine.param_dtype == engine.weight_dtype == torch.bfloat16
    reference = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(BF16, fsdp=FSDPConfig()))
    mask = batch.batch["response_mask"].bool()
    got, _ = engine.compute_log_prob(batch)
    expected, _ = reference.compute_log_prob(batch)
    # bf16 weights and activations: log-probs of a few nats within a few hundredths; a wrong cast is far off
    assert (got[mask] - expected[mask]).abs().max() < 0.1
    losses = _train_and_check(engine, batch)
    assert losses[-1] < losses[0] - 0.05, losses
    engine.save_checkpoint(tmp_path / "ckpt")
    resumed = build_fsdp_engine(tiny_llama_dir, BF16)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for (name, saved), (_, loaded) in zip(engine.named_full_params(), resumed.named_full_params()):
        assert loaded.dtype == torch.bfloat16 and torch.equal(saved, loaded), name


def test_lora_adapters_on_bf16_weights_are_bf16(tiny_llama_dir):
    engine = build_fsdp_engine(tiny_llama_dir, LORA)
    losses = _train_and_check(engine, make_batch(128, batch_size=8, seed=1))
    assert losses[-1] < losses[0], losses


def _two_ranks(rank: int, world_size: int, model_dir: str) -> None:
    batch = make_batch(128, batch_size=8, seed=2).chunk(world_size)[rank]
    for config in (BF16, LORA):
        engine = build_fsdp_engine(model_dir, config)
        assert engine.is_sharded and all(isinstance(p, DTensor) for p in engine.module.parameters())
        losses = _train_and_check(engine, batch)
        assert losses[-1] < losses[0], (config.model.lora_rank, losses)


def test_bf16_weights_shard_and_train_on_two_ranks(tiny_llama_dir):
    run_distributed(_two_ranks, 2, tiny_llama_dir)


def test_a_compute_dtype_above_the_weights_is_refused():
    with pytest.raises(ConfigFieldError, match=r"dtype='float32' with model_dtype='bfloat16'.*set dtype=auto"):
        FSDPConfig(model_dtype="bfloat16", dtype="float32")
    assert FSDPConfig(model_dtype="bf16").compute_dtype == "bfloat16"
    assert FSDPConfig().compute_dtype == "auto" and FSDPConfig(dtype="bfloat16").weight_dtype == "float32"
    with pytest.raises(ConfigFieldError, match="model_dtype"):
        FSDPConfig(model_dtype="fp16")


def test_verl_s_mixed_precision_dict_sets_the_compute_and_reduce_dtypes():
    """verl's `+fsdp_config.mixed_precision.*` (NPU scripts): param_dtype and reduce_dtype become dtype and
    reduce_dtype (bf16 compute is verl's default once the dict is given); a contradiction is refused."""
    config = FSDPConfig(mixed_precision={"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "fp32"})
    assert (config.dtype, config.reduce_dtype, config.compute_dtype) == ("bfloat16", "bfloat16", "bfloat16")
    assert FSDPConfig(mixed_precision={"reduce_dtype": "fp32"}).dtype == "bfloat16"
    assert FSDPConfig(mixed_precision={"param_dtype": "fp32"}).compute_dtype == "float32"
    for mixed, message in (({"param_dtype": "fp16"}, "param_dtype='float16' with dtype='float32'"),
                           ({"reduce_dtype": "fp16"}, "gradients reduce in float32 or bfloat16"),
                           ({"buffer_dtype": "bf16"}, "FSDP2 keeps buffers in the weights' dtype"),
                           ({"param_dtype": "int8"}, "is not one of"), ({"cast": "bf16"}, "unknown keys")):
        with pytest.raises(ConfigFieldError, match=message):
            FSDPConfig(dtype="float32" if "fp16" in mixed.values() and "param_dtype" in mixed else "auto",
                       mixed_precision=mixed)
