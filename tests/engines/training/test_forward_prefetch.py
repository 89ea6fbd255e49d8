"""`fsdp_config.forward_prefetch`: each sharded decoder layer prefetches the next one's all-gather, and a step with
it equals a step without it bit for bit (log-probs, gradients, parameters after the optimizer step)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hybridflow.engines.training import FSDPConfig, build_fsdp_engine
from hybridflow.models import load_tokenizer
from hybridflow.utils.device import get_dist_backend
from tests.engines.helpers import make_batch, run_distributed
from tests.engines.training.test_parallel_training import BASE, _run


def _prefetched_layers(engine) -> list[int]:
    """Per decoder layer, how many modules its forward prefetches (FSDP2 keeps them on the layer's state)."""
    from torch.distributed.fsdp import FSDPModule

    layers = [sub for sub in engine.module.modules() if isinstance(sub, FSDPModule) and sub is not engine.module]
    return [len(layer._get_fsdp_state()._states_to_forward_prefetch) for layer in layers]


def _compare(rank: int, world_size: int, model_dir: str, out_file: str) -> None:
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, prompt_len=7, response_len=6, seed=3)
    data = batch.chunk(world_size)[rank]
    results = {}
    for name, prefetch in (("plain", False), ("prefetch", True)):
        torch.manual_seed(0)
        engine = build_fsdp_engine(model_dir, dataclasses.replace(BASE, fsdp=FSDPConfig(forward_prefetch=prefetch)))
        results[name] = _run(engine, data)
        results[f"{name}_prefetches"] = _prefetched_layers(engine)
    dist.barrier()
    if rank == 0:
        torch.save(results, out_file)


def test_forward_prefetch_wires_each_layer_to_the_next_and_changes_no_number(tiny_llama_dir, tmp_path):
    out = tmp_path / "results.pt"
    run_distributed(_compare, 2, str(tiny_llama_dir), str(out), backend=get_dist_backend())
    results = torch.load(out, weights_only=False)
    layers = len(results["plain_prefetches"])
    assert layers >= 2
    assert results["plain_prefetches"] == [0] * layers
    assert results["prefetch_prefetches"] == [1] * (layers - 1) + [0]  # the last layer has no next one
    plain, prefetch = results["plain"], results["prefetch"]
    assert torch.equal(prefetch["log_probs"], plain["log_probs"])
    assert prefetch["grad_norm"] == plain["grad_norm"]
    for name, grad in plain["grads"].items():
        assert torch.equal(prefetch["grads"][name], grad), f"gradient of {name}"
    for name, param in plain["params"].items():
        assert torch.equal(prefetch["params"][name], param), f"parameter {name}"
