"""The step cost model's pure functions (benchmarks/step_cost_model.py): sizes, FLOPs, collectives, memory, fits."""

from __future__ import annotations

import dataclasses
import math

import pytest

from benchmarks.step_cost_model import (
    H100,
    LLAMA_LIKE,
    Layout,
    ModelShape,
    RLStep,
    Workload,
    compute_activation_bytes,
    compute_bubble_fraction,
    compute_collective_seconds,
    compute_flops,
    compute_fsdp_seconds,
    compute_params,
    compute_state_bytes,
    compute_tp_seconds,
    compute_ulysses_seconds,
    fit_least_squares,
    fit_link,
    layout_refusal,
    rank_layouts,
)

SMALL = ModelShape(hidden=768, layers=4, heads=12, kv_heads=4, intermediate=2048, vocab=402, tied=True)
LINK = dict(bandwidth=1e9, latency=0.0)


def test_parameter_counts_match_the_published_models_and_a_built_one():
    published = {"7B": 7.24e9, "32B": 32.76e9, "70B": 70.55e9}  # Mistral-7B, Qwen2.5-32B (no qkv biases), Llama-3-70B
    for name, params in published.items():
        assert compute_params(LLAMA_LIKE[name]) == pytest.approx(params, rel=0.005)
    from hybridflow.models import build_local_tokenizer, build_tiny_model

    model, _ = build_tiny_model(num_layers=2, hidden=96, num_heads=6, num_kv_heads=2, intermediate=256,
                                tokenizer=build_local_tokenizer())
    shape = ModelShape(hidden=96, layers=2, heads=6, kv_heads=2, intermediate=256, vocab=model.config.vocab_size,
                       tied=True)
    assert compute_params(shape) == sum(p.numel() for p in model.parameters())


def test_training_is_three_forward_passes_and_attention_is_the_only_quadratic_term():
    short = Workload(sequences=8, seq_len=256, response_len=128, micro_batch_tokens=256)
    long = Workload(sequences=2, seq_len=1024, response_len=512, micro_batch_tokens=1024)  # the same tokens
    one = compute_flops(SMALL, short, passes=1, causal_fraction=1.0)
    assert compute_flops(SMALL, short, passes=3, causal_fraction=1.0) == pytest.approx(3 * one)
    attention_per_token = 4 * SMALL.hidden * SMALL.layers
    extra = compute_flops(SMALL, long, passes=1, causal_fraction=1.0) - one
    assert extra == pytest.approx(attention_per_token * (1024 - 256) * 2048)
    half = compute_flops(SMALL, long, passes=1, causal_fraction=0.5)
    assert half < compute_flops(SMALL, long, passes=1, causal_fraction=1.0)


def test_collectives_cost_nothing_on_one_rank_and_all_reduce_sends_twice_an_all_gather():
    assert compute_collective_seconds("all_reduce", 1e6, 1, **LINK) == 0.0
    gather = compute_collective_seconds("all_gather", 1e6, 8, **LINK)
    assert compute_collective_seconds("all_reduce", 1e6, 8, **LINK) == pytest.approx(2 * gather)
    assert gather == pytest.approx(7 / 8 * 1e6 / 1e9)
    assert compute_collective_seconds("all_to_all", 1e6, 2, bandwidth=1e9, latency=1e-3) == pytest.approx(1e-3 + 0.5e-3)


def test_sharded_state_halves_when_data_parallel_ranks_double():
    params = compute_params(LLAMA_LIKE["7B"])
    eight = compute_state_bytes(params, Layout(dp=8), 16)
    assert eight == pytest.approx(params * 16 / 8)
    assert compute_state_bytes(params, Layout(dp=16), 16) == pytest.approx(eight / 2)
    # FSDP shards over every rank that is not a tensor-parallel peer: 8 ranks hold 1/8 in every layout.
    assert compute_state_bytes(params, Layout(dp=4, tp=2), 16) == pytest.approx(eight)
    assert compute_state_bytes(params, Layout(dp=2, sp=4), 16) == pytest.approx(eight)


def test_tensor_parallel_all_reduce_time_scales_with_tokens_and_vanishes_without_tp():
    common = dict(forward_passes=1, backward=True, value_bytes=2, **LINK)
    one = compute_tp_seconds(SMALL, Layout(dp=1, tp=2), 1024, 4, **common)
    assert compute_tp_seconds(SMALL, Layout(dp=1, tp=2), 2048, 4, **common) == pytest.approx(2 * one)
    assert compute_tp_seconds(SMALL, Layout(dp=1, tp=2), 1024, 8, **common) == pytest.approx(2 * one)
    assert compute_tp_seconds(SMALL, Layout(dp=2), 1024, 4, **common) == 0.0
    # 4 micro-batches x (4 all-reduces per layer, 2 forward and 2 backward, plus the embedding's one); on 2 ranks a
    # ring all-reduce sends the tensor's size from each rank.
    assert one == pytest.approx(4 * (4 * SMALL.layers + 1) * 1024 * SMALL.hidden * 2 / 1e9)


def test_ulysses_moves_less_per_rank_as_sp_grows():
    common = dict(forward_passes=1, backward=True, value_bytes=2, **LINK)
    two = compute_ulysses_seconds(SMALL, Layout(dp=1, sp=2), 4096, 1, **common)
    four = compute_ulysses_seconds(SMALL, Layout(dp=1, sp=4), 4096, 1, **common)
    assert four == pytest.approx(two * (3 / 4) / (1 / 2) / 2)  # half the tokens per rank, 3/4 of them sent
    assert compute_ulysses_seconds(SMALL, Layout(dp=2), 4096, 1, **common) == 0.0


def test_fsdp_traffic_grows_with_micro_batches_and_is_free_on_one_rank():
    common = dict(backward=True, value_bytes=2, grad_bytes=4, **LINK)
    four = compute_fsdp_seconds(SMALL, Layout(dp=2), 4, **common)
    assert compute_fsdp_seconds(SMALL, Layout(dp=2), 8, **common) == pytest.approx(2 * four)
    assert compute_fsdp_seconds(SMALL, Layout(dp=1), 8, **common) == 0.0
    forward_only = compute_fsdp_seconds(SMALL, Layout(dp=2), 4, **{**common, "backward": False})
    assert forward_only < four / 2


def test_activations_split_wholly_by_sp_and_partly_by_tp():
    kwargs = dict(value_bytes=2, factor=1.0, checkpointing=False)
    base = compute_activation_bytes(SMALL, Layout(dp=1), 4096, **kwargs)
    assert compute_activation_bytes(SMALL, Layout(dp=1, sp=2), 4096, **kwargs) == pytest.approx(base / 2)
    tp2 = compute_activation_bytes(SMALL, Layout(dp=1, tp=2), 4096, **kwargs)
    assert base / 2 < tp2 < base  # the norms' inputs and outputs stay replicated
    assert compute_activation_bytes(SMALL, Layout(dp=1), 4096, **{**kwargs, "checkpointing": True}) < base


def test_least_squares_and_the_link_fit_recover_known_constants():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert fit_least_squares([[1.0] * 4, xs], [2 + 3 * x for x in xs]) == pytest.approx([2.0, 3.0])
    latency, bandwidth = 2e-4, 1.5e9
    rows = [{"kind": kind, "bytes": size, "seconds": compute_collective_seconds(kind, size, 2, bandwidth, latency)}
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") for size in (1e3, 1e4, 1e6, 1e8)]
    fitted = fit_link(rows)
    assert fitted[0] == pytest.approx(latency, rel=1e-3) and fitted[1] == pytest.approx(bandwidth, rel=1e-3)


def test_refused_layouts_and_a_70b_model_on_one_node():
    shape = LLAMA_LIKE["7B"]
    assert layout_refusal(shape, Layout(dp=2, tp=2, sp=2), 8) == "tp x sp is not implemented"
    assert "divide" in layout_refusal(dataclasses.replace(shape, heads=30), Layout(dp=2, tp=4), 8)
    assert layout_refusal(shape, Layout(dp=1, tp=16), 8) == "tp/sp group larger than a node"
    assert layout_refusal(shape, Layout(dp=4, sp=2), 8) is None
    # 70.6B x 16 bytes of fp32 weights, gradients and AdamW state is 1.1 TB: 8 GPUs of 80 GB cannot hold it.
    ranked = rank_layouts(LLAMA_LIKE["70B"], 8, RLStep(), H100, activation_factor=1.0)
    assert all(row["reason"] for row in ranked)
    best = rank_layouts(LLAMA_LIKE["7B"], 8, RLStep(), H100, activation_factor=1.0)[0]
    assert best["reason"] is None and best["memory"]["total"] <= 0.9 * H100.memory and math.isfinite(best["train_s"])


def test_pipeline_bubble_shrinks_with_micro_batches_and_interleaving():
    assert compute_bubble_fraction(1, 8) == 0.0
    assert compute_bubble_fraction(4, 1) == pytest.approx(3 / 4)  # one micro-batch: 3 of 4 stages idle
    assert compute_bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert compute_bubble_fraction(4, 12, virtual_stages=2) < compute_bubble_fraction(4, 12)
