"""Loading once per process group (`engines/training/rank0_init.py`): on 2 gloo ranks only rank 0 reads the
checkpoint, and every rank's shards (parameters, LoRA adapters, a fresh value head, rotary buffers) equal what a
single process loads itself."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from hybridflow.engines.training import FSDPConfig, FSDPEngine, FSDPEngineConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm
from hybridflow.models.config import ModelConfig
from hybridflow.models.lora import apply_lora
from hybridflow.models.value_head import build_value_model
from tests.engines.helpers import run_distributed

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs on a CUDA host"
)

CONFIG = FSDPEngineConfig(micro_batch_size_per_gpu=2)


def _refuse_reading(*args, **kwargs):
    raise AssertionError("a rank other than 0 read the checkpoint")


def _engine_tensors(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """Full parameters and every buffer (persistent or not) of an engine's module."""
    tensors = {
        name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone().cpu()
        for name, param in engine.module.named_parameters()
    }
    tensors.update({f"buffer:{name}": buf.clone().cpu() for name, buf in engine.module.named_buffers()})
    return tensors


def _scenario(rank: int, world_size: int, model_dir: str, adapter_dir: str, out_file: str) -> None:
    layouts = {
        "causal_lm": (CONFIG, "causal_lm"),
        "tp2": (dataclasses.replace(CONFIG, fsdp=FSDPConfig(tensor_parallel_size=2)), "causal_lm"),
        "offload": (dataclasses.replace(CONFIG, fsdp=FSDPConfig(param_offload=True)), "causal_lm"),
        "lora_adapter": (dataclasses.replace(CONFIG, model=ModelConfig(lora_rank=4, lora_adapter_path=adapter_dir)),
                         "causal_lm"),
        "value": (CONFIG, "value"),
    }
    results = {}
    for name, (config, kind) in layouts.items():
        refuse = mock.patch.object(PreTrainedModel, "from_pretrained", _refuse_reading) if rank else mock.MagicMock()
        with refuse:
            engine = build_fsdp_engine(model_dir, config, model_kind=kind)
        assert not any(p.is_meta for p in engine.module.parameters()) and not any(
            b.is_meta for b in engine.module.buffers()
        )
        results[name] = _engine_tensors(engine)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_file)


def _single_process(model_dir: str, adapter_dir: str, kind: str) -> dict[str, torch.Tensor]:
    if kind == "value":
        module = build_value_model(model_dir)
    else:
        module = build_causal_lm(model_dir)
        if kind == "lora_adapter":
            module = apply_lora(module, lora_rank=4, lora_alpha=8, adapter_path=adapter_dir)
    tensors = {name: p.detach().clone() for name, p in module.named_parameters()}
    tensors.update({f"buffer:{name}": buf.clone() for name, buf in module.named_buffers()})
    return tensors


def test_rank0_reads_the_checkpoint_and_every_rank_gets_the_same_weights(tiny_llama_dir, tmp_path):
    # an adapter whose B matrices are non-zero, so that its weights differ from a fresh one
    peft_model = apply_lora(build_causal_lm(tiny_llama_dir), lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    peft_model.save_pretrained(tmp_path / "adapter")
    out_file = str(tmp_path / "out.pt")
    run_distributed(_scenario, 2, tiny_llama_dir, str(tmp_path / "adapter"), out_file)
    per_rank = torch.load(out_file, weights_only=False)
    for name in ("causal_lm", "tp2", "offload", "lora_adapter", "value"):
        kind = {"lora_adapter": "lora_adapter", "value": "value"}.get(name, "causal_lm")
        expected = _single_process(tiny_llama_dir, str(tmp_path / "adapter"), kind)
        for rank, results in enumerate(per_rank):
            got = results[name]
            assert set(got) == set(expected), (name, rank, set(got) ^ set(expected))
            for key, tensor in expected.items():
                assert torch.equal(got[key], tensor), (name, rank, key)
    rotary = [key for key in expected if key.endswith("inv_freq")]
    assert rotary, "the tiny llama has rotary buffers (not in state dicts): the check above covers them"
