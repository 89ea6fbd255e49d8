"""The engines on one CUDA device: an nccl group of one rank, bf16 mixed precision, offload, rollout on GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPConfig, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.engines.training.sharding import join_single_rank_group
from hybridflow.models import load_tokenizer
from hybridflow.utils.device import get_dist_backend
from tests.engines.helpers import encode_prompts, make_batch, run_distributed, seq_mean_nll

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIG = FSDPEngineConfig(micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2))


def _params(engine):
    return {name: tensor.float().cpu() for name, tensor in engine.named_full_params()}


def _scenario(rank: int, world_size: int, model_dir: str, out_file: str, ckpt_dir: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    batch = make_batch(len(tokenizer), batch_size=4)
    results = {}

    bf16 = build_fsdp_engine(model_dir, CONFIG)  # fsdp.dtype 'auto' -> bfloat16 on GPU
    assert bf16.is_sharded and bf16.device.type == "cuda" and bf16.param_dtype == torch.bfloat16
    results["bf16_losses"] = [bf16.train_batch(batch, seq_mean_nll)["loss"] for _ in range(4)]

    fp32_config = dataclasses.replace(CONFIG, fsdp=FSDPConfig(dtype="float32"))
    fp32 = build_fsdp_engine(model_dir, fp32_config)
    rollout = HFRollout(model_dir, tokenizer, SamplingParams(temperature=0.8, max_new_tokens=8))
    rollout.sleep()
    results["rollout_slept_on"] = str(next(rollout.model.parameters()).device)
    rollout.wake_up()
    rollout.update_weights(fp32.named_full_params())
    sampled = rollout.generate_sequences(encode_prompts(tokenizer, ["hello there", "what is 12 + 7?", "x"]))
    log_probs, _ = fp32.compute_log_prob(sampled, temperature=0.8)
    mask = sampled.batch["response_mask"].bool()
    results["logprob_max_diff"] = (log_probs - sampled.batch["rollout_log_probs"])[mask].abs().max().item()

    offload_config = dataclasses.replace(fp32_config, fsdp=FSDPConfig(dtype="float32", param_offload=True))
    offloaded = build_fsdp_engine(model_dir, offload_config)
    loss_plain = fp32.train_batch(batch, seq_mean_nll)["loss"]
    loss_off = offloaded.train_batch(batch, seq_mean_nll)["loss"]
    a, b = _params(fp32), _params(offloaded)
    results["offload_loss_diff"] = abs(loss_plain - loss_off)
    results["offload_param_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)

    fp32.offload_to_cpu()
    results["offloaded_optimizer_on"] = str(next(iter(fp32.optimizer.state.values()))["exp_avg"].device)
    fp32.load_to_device()
    fp32.save_checkpoint(ckpt_dir)
    fp32.train_batch(batch, seq_mean_nll)
    expected = _params(fp32)
    resumed = build_fsdp_engine(model_dir, fp32_config)
    resumed.load_checkpoint(ckpt_dir)
    resumed.train_batch(batch, seq_mean_nll)
    got = _params(resumed)
    results["resume_max_diff"] = max((expected[k] - got[k]).abs().max().item() for k in expected)
    torch.save(results, out_file)


def test_engines_on_one_gpu(tiny_llama_dir, tmp_path):
    out, ckpt = str(tmp_path / "r.pt"), str(tmp_path / "ckpt")
    run_distributed(_scenario, 1, tiny_llama_dir, out, ckpt, backend=get_dist_backend())
    results = torch.load(tmp_path / "r.pt", weights_only=False)
    print(results)
    losses = results["bf16_losses"]
    assert losses[-1] < losses[0]
    assert results["rollout_slept_on"] == "cpu"
    assert results["logprob_max_diff"] < 1e-3
    assert results["offload_loss_diff"] < 1e-5 and results["offload_param_diff"] < 1e-5
    assert results["offloaded_optimizer_on"] == "cpu"
    assert results["resume_max_diff"] < 1e-5


@pytest.mark.parametrize("own_group", [False, True], ids=["autocast", "one-rank-group"])
def test_one_gpu_computes_in_bf16_alone_or_over_a_group_of_its_own(tiny_llama_dir, own_group):
    """No process group (one GPU outside a worker group): autocast over float32 weights by default; after
    `join_single_rank_group`, FSDP2's mixed precision over float32 master weights."""
    assert not torch.distributed.is_initialized()  # tests/conftest.py destroys the group a test made
    if own_group:
        assert join_single_rank_group(CONFIG, torch.device("cuda"))
    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    assert engine.is_sharded == own_group and engine.world_size == 1 and engine.param_dtype == torch.bfloat16
    batch = make_batch(len(load_tokenizer(tiny_llama_dir)), batch_size=4)
    losses = [engine.train_batch(batch, seq_mean_nll)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    log_probs, entropy = engine.compute_log_prob(batch, calculate_entropy=True)
    assert log_probs.device.type == "cpu" and log_probs.dtype == torch.float32 and entropy.shape == log_probs.shape


def test_one_gpu_with_param_offload_keeps_its_parameters_on_the_host(tiny_llama_dir):
    """A lone GPU rank with param_offload joins a one-rank group, so FSDP2's CPU offload holds the parameters
    (and the optimizer state beside them) on the host between steps; without it the setting did nothing."""
    assert not torch.distributed.is_initialized()  # tests/conftest.py destroys the group a test made
    engine = build_fsdp_engine(tiny_llama_dir, dataclasses.replace(CONFIG, fsdp=FSDPConfig(param_offload=True)))
    assert engine.is_sharded and engine.world_size == 1 and engine.shards_on_host
    batch = make_batch(len(load_tokenizer(tiny_llama_dir)), batch_size=4)
    losses = [engine.train_batch(batch, seq_mean_nll)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(p.to_local().device.type == "cpu" for p in engine.module.parameters())
    engine.load_to_device()  # the worker's call before an update: the state stays with the host shards
    assert all(v.device.type == "cpu" for s in engine.optimizer.state.values() for v in s.values() if v.dim())
