"""The compiled CPU decode kernels against float64 references, their input checks and the kernel modes."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.native import kernels as kernel_modes


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (2, 13), (3, 64), (50, 72), (7, 5)])
def test_linear_rows_matches_float64(cpu_kernels, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(cpu_kernels.linear_rows(x, weight, None).double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        cpu_kernels.linear_rows(x, weight, bias).double(), expected + bias.double(), rtol=1e-5, atol=1e-5
    )


def test_linear_rows_refuses_non_contiguous_and_non_float32(cpu_kernels):
    weight = torch.randn(6, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.linear_rows(torch.randn(8, 3).t(), weight, None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear_rows(torch.randn(3, 8, dtype=torch.float64), weight, None)
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.linear_rows(torch.randn(3, 7), weight, None)


def reference_attention(q, keys, values, visible):
    out = torch.empty(q.shape, dtype=torch.float64)
    for slot, n in enumerate(visible.tolist()):
        k, v = keys[slot, :, :n].double(), values[slot, :, :n].double()  # (kv_heads, n, head_dim)
        scores = torch.einsum("hgd,htd->hgt", q[slot].double(), k)
        out[slot] = torch.einsum("hgt,htd->hgd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(("kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 1, 16), (1, 4, 8), (2, 2, 40)])
def test_decode_attention_matches_float64(cpu_kernels, kv_heads, group, head_dim):
    generator = torch.Generator().manual_seed(kv_heads * 100 + group * 10 + head_dim)
    slots, cache_slots, max_len = 5, 8, 37  # the cache has more slots than are active
    q = torch.randn(slots, kv_heads, group, head_dim, generator=generator) * head_dim**-0.5
    keys = torch.randn(cache_slots, kv_heads, max_len, head_dim, generator=generator) * 3
    values = torch.randn(cache_slots, kv_heads, max_len, head_dim, generator=generator)
    visible = torch.tensor([1, 9, 37, 16, 8])  # 1 and the full length are the edges
    out = cpu_kernels.decode_attention(q, keys, values, visible)
    torch.testing.assert_close(out.double(), reference_attention(q, keys, values, visible), rtol=1e-5, atol=1e-5)


def test_decode_attention_ignores_positions_past_visible(cpu_kernels):
    q = torch.randn(2, 1, 2, 16)
    keys, values = torch.randn(2, 1, 10, 16), torch.randn(2, 1, 10, 16)
    visible = torch.tensor([4, 7])
    before = cpu_kernels.decode_attention(q, keys, values, visible)
    keys[0, :, 4:], values[0, :, 4:], keys[1, :, 7:] = float("nan"), 1e6, float("inf")
    assert torch.equal(cpu_kernels.decode_attention(q, keys, values, visible), before)


def test_decode_attention_checks_lengths_and_head_dim(cpu_kernels):
    q, cache = torch.randn(2, 1, 1, 16), torch.randn(2, 1, 10, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(q, cache, cache, torch.tensor([3, 11]))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.decode_attention(q, cache, cache, torch.tensor([0, 2]))
    odd = torch.randn(2, 1, 1, 12)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_kernels.decode_attention(odd, torch.randn(2, 1, 10, 12), torch.randn(2, 1, 10, 12), torch.tensor([1, 1]))


def test_kernel_modes():
    with pytest.raises(ValueError, match="auto"):
        kernel_modes.check_kernel_mode("avx")
    assert kernel_modes.load_cpu_kernels("torch") is None


def test_auto_falls_back_and_cpu_raises_when_unsupported(monkeypatch):
    monkeypatch.setattr(kernel_modes, "_loaded", {})
    monkeypatch.setattr(kernel_modes, "_failure", {})
    monkeypatch.setattr(kernel_modes, "unsupported_reason", lambda: "they need AVX2 (test)")
    assert kernel_modes.load_cpu_kernels("auto") is None
    with pytest.raises(RuntimeError, match="need AVX2"):
        kernel_modes.load_cpu_kernels("cpu")
