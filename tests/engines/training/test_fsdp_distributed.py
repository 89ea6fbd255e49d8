"""2-rank gloo runs of the FSDP2 engine against single-process references (one spawn for all checks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from hybridflow.engines.rollout import HFRollout, SamplingParams
from hybridflow.engines.training import FSDPConfig, FSDPEngine, FSDPEngineConfig, OptimConfig, build_fsdp_engine
from hybridflow.models import build_causal_lm, build_tiny_model, load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.utils.device import get_dist_backend
from tests.engines.helpers import encode_prompts, make_batch, run_distributed, seq_mean_nll

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="2 ranks need 2 GPUs on a CUDA host"
)

CONFIG = FSDPEngineConfig(micro_batch_size_per_gpu=2, optim=OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0))
NUM_STEPS = 2
PROMPTS = ["hello there", "what is 12 + 7?", "x", "def add(a, b):"]


def _train(engine: FSDPEngine, batch: DataProto, num_steps: int) -> list[dict[str, float]]:
    metrics = []
    for _ in range(num_steps):
        metrics.append(engine.train_batch(batch, seq_mean_nll))
        engine.lr_scheduler_step()
    return metrics


def _full_params(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone().cpu() for name, tensor in engine.named_full_params()}


def _mean_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def _scenario(rank: int, world_size: int, model_dir: str, out_file: str, ckpt_dir: str) -> None:
    torch.manual_seed(1234)
    batch = make_batch(len(load_tokenizer(model_dir)), batch_size=8)
    local = batch.chunk(world_size)[rank]
    results: dict = {}

    # 1) training equals the single-process run
    engine = build_fsdp_engine(model_dir, CONFIG)
    assert engine.is_sharded
    metrics = _train(engine, local, NUM_STEPS)
    results["losses"] = [_mean_over_ranks(m["loss"]) for m in metrics]
    results["grad_norms"] = [m["grad_norm"] for m in metrics]
    results["params"] = _full_params(engine)
    full_sd = engine.full_state_dict()
    if rank == 0:
        results["full_state_dict_keys"] = sorted(full_sd)

    # 2) checkpoint -> load -> one more step equals an uninterrupted step, bit for bit
    engine.save_checkpoint(ckpt_dir)
    engine.train_batch(local, seq_mean_nll)
    uninterrupted = _full_params(engine)
    resumed = build_fsdp_engine(model_dir, CONFIG)
    resumed.load_checkpoint(ckpt_dir)
    resumed.train_batch(local, seq_mean_nll)
    resumed_params = _full_params(resumed)
    results["resume_exact"] = all(torch.equal(uninterrupted[k], v) for k, v in resumed_params.items())
    resumed.save_hf_model(f"{ckpt_dir}/hf", tokenizer=load_tokenizer(model_dir))
    if rank == 0:
        exported = dict(build_causal_lm(f"{ckpt_dir}/hf").named_parameters())
        results["export_exact"] = all(torch.equal(exported[k], v) for k, v in resumed_params.items())

    # 3) weight hand-over into a rollout built from other weights; greedy = training model's argmax
    tokenizer = load_tokenizer(model_dir)
    other, _ = build_tiny_model(seed=99, tokenizer=tokenizer)
    rollout = HFRollout(other, tokenizer, SamplingParams(temperature=0.8, max_new_tokens=6))
    rollout.update_weights(resumed.named_full_params())
    prompts = encode_prompts(tokenizer, PROMPTS).chunk(world_size)[rank]
    greedy = rollout.generate_sequences(encode_prompts(tokenizer, PROMPTS, {"validate": True}).chunk(world_size)[rank])
    with torch.no_grad():
        logits = resumed.module(
            input_ids=greedy.batch["input_ids"],
            attention_mask=greedy.batch["attention_mask"],
            position_ids=greedy.batch["position_ids"],
            use_cache=False,
        ).logits
    argmax = logits[:, -7:-1].argmax(-1)
    mask = greedy.batch["response_mask"].bool()
    results["greedy_matches"] = bool((argmax == greedy.batch["responses"])[mask].all())

    # 4) sampled log-probs of the rollout equal the sharded engine's log-probs
    sampled = rollout.generate_sequences(prompts)
    log_probs, _ = resumed.compute_log_prob(sampled, temperature=0.8)
    mask = sampled.batch["response_mask"].bool()
    results["logprob_max_diff"] = (log_probs - sampled.batch["rollout_log_probs"])[mask].abs().max().item()

    # 5) parameter CPU offload gives the same first step
    offloaded = build_fsdp_engine(model_dir, dataclasses.replace(CONFIG, fsdp=FSDPConfig(param_offload=True)))
    plain = build_fsdp_engine(model_dir, CONFIG)
    loss_off = offloaded.train_batch(local, seq_mean_nll)["loss"]
    loss_plain = plain.train_batch(local, seq_mean_nll)["loss"]
    a, b = _full_params(offloaded), _full_params(plain)
    results["offload_loss_diff"] = abs(loss_off - loss_plain)
    results["offload_param_diff"] = max((a[k] - b[k]).abs().max().item() for k in a)

    # 6) token-budget micro-batches (use_dynamic_bsz): the ranks' rows differ in length, so they need different
    # numbers of micro-batches; both run the larger count (FSDP pairs their collectives) and the results equal the
    # row micro-batches'. Rank 1 keeps only one token of each response: far fewer tokens than rank 0.
    uneven = DataProto.from_dict({k: v.clone() for k, v in local.batch.items()})
    if rank == 1:
        uneven.batch["attention_mask"][:, -4:] = 0
        uneven.batch["response_mask"][:, -4:] = 0
    budget = int(local.batch["input_ids"].size(1))  # one full-length row per micro-batch at most
    counts = [None] * world_size
    dist.all_gather_object(counts, len(plain.split_micro_batches(uneven, max_token_len=budget)[0]))
    results["token_micro_batch_counts"] = counts
    by_rows, _ = plain.compute_log_prob(uneven)
    by_tokens, _ = plain.compute_log_prob(uneven, max_token_len=budget)
    mask = uneven.batch["response_mask"].bool()
    results["token_logprob_diff"] = (by_rows - by_tokens)[mask].abs().max().item()
    total = float(uneven.batch["response_mask"].sum())

    def token_sum_nll(outputs, micro_batch):  # normalised by the whole batch: the same however it is cut
        token_mask = micro_batch.batch["response_mask"].to(outputs["log_probs"].dtype)
        return -(outputs["log_probs"] * token_mask).sum() / total, {}

    rows_step = build_fsdp_engine(model_dir, CONFIG).train_batch(
        plain.split_micro_batches(uneven)[0], token_sum_nll, scale_by_rows=False)
    tokens_step = build_fsdp_engine(model_dir, CONFIG).train_batch(
        plain.split_micro_batches(uneven, max_token_len=budget)[0], token_sum_nll, scale_by_rows=False)
    results["token_grad_norm_diff"] = abs(rows_step["grad_norm"] - tokens_step["grad_norm"])

    gathered = [None] * world_size
    dist.all_gather_object(gathered, {k: v for k, v in results.items() if k != "params"})
    if rank == 0:
        torch.save({"rank0": results, "all": gathered}, out_file)


@pytest.fixture(scope="module")
def dist_results(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.pt"
    ckpt = tmp_path_factory.mktemp("ckpt")
    run_distributed(_scenario, 2, tiny_llama_dir, str(out), str(ckpt), backend=get_dist_backend())
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def single_process_run(tiny_llama_dir):
    batch = make_batch(len(load_tokenizer(tiny_llama_dir)), batch_size=8)
    engine = build_fsdp_engine(tiny_llama_dir, CONFIG)
    assert not engine.is_sharded
    metrics = _train(engine, batch, NUM_STEPS)
    return metrics, _full_params(engine)


def test_fsdp2_two_ranks_match_single_process(dist_results, single_process_run):
    metrics, params = single_process_run
    rank0 = dist_results["rank0"]
    for dist_loss, single in zip(rank0["losses"], metrics, strict=True):
        assert dist_loss == pytest.approx(single["loss"], abs=1e-5)
    for dist_norm, single in zip(rank0["grad_norms"], metrics, strict=True):
        assert dist_norm == pytest.approx(single["grad_norm"], abs=1e-5)
    assert rank0["params"].keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(rank0["params"][name], value, atol=1e-5, rtol=0)
    assert set(rank0["full_state_dict_keys"]) >= set(params)


def test_fsdp2_checkpoint_resume_is_bit_exact(dist_results):
    assert all(r["resume_exact"] for r in dist_results["all"])


def test_fsdp2_hf_export_holds_the_full_weights(dist_results):
    assert dist_results["rank0"]["export_exact"]


def test_fsdp2_weight_handover_greedy_matches_training_model(dist_results):
    assert all(r["greedy_matches"] for r in dist_results["all"])


def test_fsdp2_log_probs_match_rollout(dist_results):
    assert max(r["logprob_max_diff"] for r in dist_results["all"]) < 1e-4


def test_fsdp2_param_offload_matches(dist_results):
    for r in dist_results["all"]:
        assert r["offload_loss_diff"] < 1e-6
        assert r["offload_param_diff"] < 1e-6


def test_fsdp2_token_budget_micro_batches_agree_across_ranks(dist_results):
    for r in dist_results["all"]:
        counts = r["token_micro_batch_counts"]
        assert counts[0] == counts[1] >= 2, counts  # the shorter rank runs as many micro-batches as the longer
        assert r["token_logprob_diff"] < 1e-6
        assert r["token_grad_norm_diff"] < 1e-5
