"""MoE models (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3) through the FSDP2 engine: 2 gloo ranks equal one process,
in the padded and the packed layout (with the fused head), and the hf rollout generates from them."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import load_tokenizer
from hybridflow.models.config import ModelConfig
from hybridflow.models.loader import save_model_and_tokenizer
from hybridflow.models.moe import (
    MOE_ARCHS,
    ROUTED_EXPERTS_KEY,
    build_tiny_moe_model,
    find_routers,
    record_routing,
    save_tiny_moe_model,
)
from tests.engines.helpers import encode_prompts, make_batch, run_distributed, seq_mean_nll

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs on a CUDA host"
)

LAYOUTS = {"padded": (False, False), "packed": (True, True)}  # (use_remove_padding, use_fused_kernels)


def _config(layout: str) -> FSDPEngineConfig:
    packed, fused = LAYOUTS[layout]
    return FSDPEngineConfig(
        micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2),
        model=ModelConfig(use_remove_padding=packed, use_fused_kernels=fused),
    )


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: str(save_tiny_moe_model(root / arch, arch, tokenizer=tiny_tokenizer)) for arch in MOE_ARCHS}


def _run(rank: int, world_size: int, dirs: dict[str, str], out_file: str) -> None:
    batch = make_batch(len(load_tokenizer(next(iter(dirs.values())))), batch_size=4)
    local = batch.chunk(world_size)[rank] if world_size > 1 else batch
    results = {}
    for arch, path in dirs.items():
        engine = build_fsdp_engine(path, _config("packed"))
        metrics = [engine.train_batch(local, seq_mean_nll) for _ in range(2)]
        losses = torch.tensor([m["loss"] for m in metrics], dtype=torch.float64)
        if world_size > 1:
            torch.distributed.all_reduce(losses)
        params = {name: t.clone() for name, t in engine.named_full_params()}
        results[arch] = ((losses / world_size).tolist(), [m["grad_norm"] for m in metrics], params, metrics[0])
    if rank == 0:
        torch.save(results, out_file)


@pytest.mark.slow
def test_moe_engine_two_ranks_equal_one_process(moe_dirs, tmp_path):
    """Each architecture trains two steps in the packed layout with the fused head; FSDP2 over 2 gloo ranks equals
    one process (losses, grad norms, parameters), and the routing metrics are reported."""
    single, sharded = str(tmp_path / "single.pt"), str(tmp_path / "sharded.pt")
    _run(0, 1, moe_dirs, single)
    run_distributed(_run, 2, moe_dirs, sharded)
    one, two = torch.load(single), torch.load(sharded)
    for arch, (losses, norms, params, metrics) in one.items():
        losses2, norms2, params2, _ = two[arch]
        worst = max((params[name] - params2[name]).abs().max().item() for name in params)
        assert losses[1] < losses[0], arch  # it trains
        print(f"{arch}: losses {losses} / {losses2}, grad norms {norms} / {norms2}, max param diff {worst:.1e}")
        assert losses2 == pytest.approx(losses, rel=1e-5), arch
        assert norms2[0] == pytest.approx(norms[0], rel=1e-5), arch  # the first step's gradients
        # AdamW's first step moves every weight by about lr (1e-2) whatever its gradient's size, so the float-order
        # noise of an expert's near-zero gradient shows in the weights (measured up to 3.6e-4, deepseek_v3) and in
        # the second step's grad norm (2.2e-5 relative); a wrong gradient would move a weight by ~lr the other way.
        assert norms2[1] == pytest.approx(norms[1], rel=1e-4), arch
        assert worst < 1e-3, (arch, worst)
        assert metrics["moe/router_entropy"] > 0 and metrics["moe/layer_0/tokens_per_expert_max"] >= 1


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_hf_rollout_generates_from_moe_and_matches_engine_log_probs(arch, moe_dirs, tiny_tokenizer):
    model, _ = build_tiny_moe_model(arch, tokenizer=tiny_tokenizer)
    rollout = HFRollout(model, tiny_tokenizer, SamplingParams(temperature=1.0, max_new_tokens=5))
    out = rollout.generate_sequences(encode_prompts(tiny_tokenizer, ["hello there", "what is 12 + 7?"]))
    assert out.batch["responses"].shape == (2, 5)
    engine = build_fsdp_engine(moe_dirs[arch], _config("packed"))
    log_probs, _ = engine.compute_log_prob(out)
    mask = out.batch["response_mask"].bool()
    assert (log_probs - out.batch["rollout_log_probs"])[mask].abs().max().item() < 1e-4


def _routing_of(engine, batch):
    """The experts the engine's forward picks (or replays) for every real token: (tokens, layers, k)."""
    with record_routing(engine.module) as recorder:
        log_probs, _ = engine.compute_log_prob(batch)
    return recorder.per_token(1)[0], log_probs


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_router_replay_routes_as_the_rollout(arch, moe_dirs, tiny_tokenizer):
    # Seeded: the sampled responses and the routers' perturbation are drawn from torch's global generator, and an
    # unlucky draw (about 1 in 6 unseeded) left the replayed gap above the free one.
    torch.manual_seed(0)
    model, _ = build_tiny_moe_model(arch, tokenizer=tiny_tokenizer)
    rollout = HFRollout(model, tiny_tokenizer, SamplingParams(temperature=1.0, max_new_tokens=6))
    rollout.record_routed_experts = True
    out = rollout.generate_sequences(encode_prompts(tiny_tokenizer, ["hello there", "what is 12 + 7?", "x"]))
    routed = out.batch[ROUTED_EXPERTS_KEY]
    assert routed.dtype == torch.uint8 and routed.shape[:2] == out.batch["input_ids"].shape
    mask = out.batch["attention_mask"].bool().clone()
    mask[:, -1] = False  # the last token is never fed back to the rollout
    real = out.batch["attention_mask"].reshape(-1).bool()
    engine = build_fsdp_engine(moe_dirs[arch], _config("packed"))
    response_mask = out.batch["response_mask"].bool()

    # same weights, no replay: the engine routes as the rollout recorded (positions line up)
    free, _ = _routing_of(engine, out.select(batch_keys=[k for k in out.batch.keys() if k != ROUTED_EXPERTS_KEY]))
    expected = routed.reshape(-1, *routed.shape[2:])[real].long()
    compare = mask.reshape(-1)[real]
    assert torch.equal(free.sort(-1).values[compare], expected.sort(-1).values[compare])

    # perturbed routers: without replay routing and log-probs drift; with replay routing equals the rollout's
    with torch.no_grad():
        for router in find_routers(engine.module):
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    drift, lp_free = _routing_of(engine, out.select(batch_keys=[k for k in out.batch.keys() if k != ROUTED_EXPERTS_KEY]))
    replayed, lp_replay = _routing_of(engine, out)
    assert torch.equal(replayed, expected)
    assert not torch.equal(drift.sort(-1).values[compare], expected.sort(-1).values[compare])
    gap_free = (lp_free - out.batch["rollout_log_probs"])[response_mask].abs().mean().item()
    gap_replay = (lp_replay - out.batch["rollout_log_probs"])[response_mask].abs().mean().item()
    print(f"{arch}: rollout/training log-prob gap without replay {gap_free:.2e}, with replay {gap_replay:.2e}")
    assert gap_replay < gap_free


def test_router_aux_loss_is_added_with_the_model_config_coefficient(tmp_path, tiny_tokenizer):
    model, _ = build_tiny_moe_model("mixtral", tokenizer=tiny_tokenizer)
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.5
    path = save_model_and_tokenizer(model, tiny_tokenizer, tmp_path / "mixtral_aux")
    engine = build_fsdp_engine(path, dataclasses.replace(_config("padded"), micro_batch_size_per_gpu=4))
    metrics = engine.train_batch(make_batch(len(tiny_tokenizer), batch_size=4), seq_mean_nll)
    assert metrics["moe/aux_loss"] > 0
    assert metrics["loss"] == pytest.approx(metrics["nll"] + 0.5 * metrics["moe/aux_loss"], abs=1e-5)
    assert 0 < metrics["moe/router_entropy"] <= math.log(4) + 1e-6
