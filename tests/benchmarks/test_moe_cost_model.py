"""The MoE cost model's pure functions (benchmarks/moe_cost_model.py): sizes, FLOPs, all-to-all, FSDP, memory."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.moe_cost_model import (
    DEEPSEEK_V3,
    QWEN3_30B_A3B,
    EpLayout,
    compute_all_to_all_bytes,
    compute_all_to_all_seconds,
    compute_moe_flops,
    compute_moe_fsdp_seconds,
    compute_moe_memory,
    compute_moe_params,
    ep_sizes,
)

TINY = dataclasses.replace(QWEN3_30B_A3B, hidden=8, layers=2, attention_params=4 * 64, heads=2, qk_head_dim=4,
                           v_head_dim=4, experts=4, top_k=2, moe_intermediate=4, vocab=10)


def test_published_sizes_of_the_two_models():
    qwen, deepseek = compute_moe_params(QWEN3_30B_A3B), compute_moe_params(DEEPSEEK_V3)
    assert qwen["total"] / 1e9 == pytest.approx(30.5, rel=0.01) and qwen["active"] / 1e9 == pytest.approx(3.3, rel=0.03)
    assert deepseek["total"] / 1e9 == pytest.approx(671, rel=0.01)
    assert deepseek["active"] / 1e9 == pytest.approx(37, rel=0.03)


def test_tiny_sizes_by_hand():
    # per layer: experts 4 x 3 x 8 x 4 = 384; attention 256, norms 16, router 4 x 8 = 32; root 2 x 10 x 8 + 8 = 168
    params = compute_moe_params(TINY)
    assert params["experts"] == 2 * 384
    assert params["total"] == 2 * (384 + 256 + 16 + 32) + 168
    assert params["active"] == params["total"] - 2 * 384 // 2  # top-2 of 4 experts


def test_imbalance_stretches_only_the_routed_experts():
    base = compute_moe_flops(TINY, 100, 10, 0, passes=1, causal_fraction=1.0)
    stretched = compute_moe_flops(TINY, 100, 10, 0, passes=1, causal_fraction=1.0, imbalance=2.0)
    routed = 2 * (2 * 384 * 2 // 4) * 100  # 2 FLOPs x active expert parameters x tokens
    assert stretched - base == pytest.approx(routed)


def test_all_to_all_volume_by_hand():
    # 10 tokens x top-2 x hidden 8 x 2 bytes = 320 bytes per call; half leaves at ep=2; 2 layers; 3 micro-batches;
    # forward (1 pass) + backward: 2 x 2 calls
    sent = compute_all_to_all_bytes(TINY, EpLayout(4, 2), 10, 3, forward_passes=1, backward=True, value_bytes=2)
    assert sent == 3 * 2 * 4 * 320 / 2
    assert compute_all_to_all_bytes(TINY, EpLayout(4, 1), 10, 3, forward_passes=1, backward=True, value_bytes=2) == 0
    assert compute_all_to_all_seconds(TINY, EpLayout(4, 1), 10, 3, forward_passes=1, backward=True, value_bytes=2,
                                      bandwidth=1.0, latency=1.0) == 0


def test_expert_fsdp_traffic_vanishes_when_every_rank_holds_its_own_experts():
    kwargs = dict(backward=True, value_bytes=2, grad_bytes=4, bandwidth=1e9, latency=0.0, expert_latency=0.0)
    plain = compute_moe_fsdp_seconds(TINY, EpLayout(4, 1), 1, expert_bandwidth=1e9, **kwargs)
    full_ep = compute_moe_fsdp_seconds(TINY, EpLayout(4, 4), 1, expert_bandwidth=1e9, **kwargs)
    no_experts = compute_moe_fsdp_seconds(TINY, EpLayout(4, 4), 1, expert_bandwidth=1e-9, **kwargs)
    assert full_ep == no_experts < plain  # efsdp = 1: the experts' bandwidth does not matter


def test_state_does_not_depend_on_ep_but_the_gathered_layer_does():
    one, many = compute_moe_memory(DEEPSEEK_V3, EpLayout(256, 1), 5120), compute_moe_memory(DEEPSEEK_V3, EpLayout(256, 64), 5120)
    assert one["state"] == many["state"] == pytest.approx(16 * 671.03e9 / 256, rel=1e-3)
    assert many["gathered"] < one["gathered"] / 10
    assert ep_sizes(TINY, 8) == [1, 2, 4]
