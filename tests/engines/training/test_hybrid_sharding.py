"""Hybrid sharding (`fsdp_size`, HSDP): groups of fsdp_size ranks shard the weights and replicate each other. One
step of it equals one step of FSDP2 over all ranks (gradients, norm and the parameters after the optimizer step),
its checkpoint resumes bit for bit, is refused by an engine of another fsdp_size, and the merge tool assembles it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from hybridflow.engines.training import FSDPConfig, build_fsdp_engine
from hybridflow.engines.training.merge import load_full_state_dict
from hybridflow.engines.training.config import ParallelLayout
from hybridflow.models import load_tokenizer
from hybridflow.utils.device import get_dist_backend
from tests.engines.helpers import make_batch, run_distributed
from tests.engines.training.test_parallel_training import BASE, PACKED, _run


def _hybrid(rank: int, world_size: int, model_dir: str, fsdp_size: int, out_file: str, sp: int = 1) -> None:
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=4, prompt_len=7, response_len=6, seed=3)
    data = batch.chunk(world_size // sp)[rank // sp]  # sequence-parallel peers take the same rows
    base = BASE if sp == 1 else dataclasses.replace(PACKED, ulysses_sequence_parallel_size=sp)
    hybrid_config = dataclasses.replace(base, fsdp=FSDPConfig(fsdp_size=fsdp_size))
    results = {}
    for name, config in (("fsdp", base), ("hsdp", hybrid_config)):
        torch.manual_seed(0)
        engine = build_fsdp_engine(model_dir, config)
        results[name] = _run(engine, data)
    mesh = engine.meshes.fsdp
    assert mesh.mesh_dim_names == ("replicate", "shard") and mesh.shape == (world_size // fsdp_size, fsdp_size)
    for name, param in engine.module.named_parameters():  # each rank holds 1 / fsdp_size of a sharded weight
        if param.dim() == 2:
            assert param.to_local().numel() * fsdp_size == param.numel(), name
    ckpt = f"{out_file}.ckpt"
    engine.save_checkpoint(ckpt)
    resumed = build_fsdp_engine(model_dir, hybrid_config)
    resumed.load_checkpoint(ckpt)
    again = {key: value.clone().cpu() for key, value in resumed.named_full_params()}
    results["resumed_exact"] = all(torch.equal(again[key], value) for key, value in results["hsdp"]["params"].items())
    try:
        build_fsdp_engine(model_dir, base).load_checkpoint(ckpt)
    except ValueError as err:
        results["other_layout_error"] = str(err)
    dist.barrier()
    if rank == 0:
        results["merged"] = load_full_state_dict(ckpt)
        torch.save(results, out_file)


@pytest.mark.parametrize(
    ("world_size", "fsdp_size", "sp"),
    [(2, 1, 1), pytest.param(4, 2, 1, marks=pytest.mark.slow), pytest.param(4, 2, 2, marks=pytest.mark.slow)],
    ids=["2x1", "2x2", "2x2_sp2"],
)
def test_hybrid_sharding_steps_like_fsdp_over_all_ranks(tiny_llama_dir, tmp_path, world_size, fsdp_size, sp):
    out = tmp_path / "results.pt"
    run_distributed(_hybrid, world_size, str(tiny_llama_dir), fsdp_size, str(out), sp, backend=get_dist_backend())
    results = torch.load(out, weights_only=False)
    fsdp, hsdp = results["fsdp"], results["hsdp"]
    assert hsdp["grad_norm"] == pytest.approx(fsdp["grad_norm"], rel=1e-5)
    for name, grad in fsdp["grads"].items():
        torch.testing.assert_close(hsdp["grads"][name], grad, atol=1e-6, rtol=0, msg=f"gradient of {name}")
    for name, param in fsdp["params"].items():
        torch.testing.assert_close(hsdp["params"][name], param, atol=1e-6, rtol=0, msg=f"parameter {name}")
        assert torch.equal(results["merged"][name], hsdp["params"][name]), f"merged {name}"
    assert results["resumed_exact"]
    assert f"fsdp_size={fsdp_size}, this run uses {world_size}" in results["other_layout_error"]


def test_sharding_groups_must_divide_the_ranks_and_stay_off_tp_and_ep():
    assert ParallelLayout(8, fsdp_size=4).hybrid_shards and not ParallelLayout(8, fsdp_size=8).hybrid_shards
    # verl reads fsdp_size >= the ranks as one group of all of them (a line written for more GPUs runs on fewer)
    assert not ParallelLayout(2, fsdp_size=8).hybrid_shards and not ParallelLayout(1, fsdp_size=3).hybrid_shards
    with pytest.raises(ValueError, match=r"fsdp_size=3 does not divide the 8 ranks"):
        ParallelLayout(8, fsdp_size=3)
    with pytest.raises(ValueError, match=r"fsdp_size=2 with tensor_parallel_size=2: hybrid sharding groups with"):
        FSDPConfig(fsdp_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"fsdp_size=0 must be > 0"):
        FSDPConfig(fsdp_size=0)
