"""The compiled CPU decode kernels against float64 references, their input checks and the kernel modes."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engines.rollout.native import kernels as kernel_modes


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 8), (2, 13), (16, 64), (50, 72), (7, 5), (33, 1)])
def test_linear_rows_matches_float64(cpu_kernels, rows, out_features, in_features):
    generator = torch.Generator().manual_seed(rows * 1000 + out_features * 10 + in_features)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    expected = x.double() @ weight.double().T
    packed = cpu_kernels.pack_weight(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    out = cpu_kernels.linear_rows(x, packed, out_features, None)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    out = cpu_kernels.linear_rows(x, packed, out_features, bias)
    torch.testing.assert_close(out.double(), expected + bias.double(), rtol=1e-5, atol=1e-5)


def test_linear_rows_refuses_bad_inputs(cpu_kernels):
    packed = cpu_kernels.pack_weight(torch.randn(6, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.linear_rows(torch.randn(8, 3).t(), packed, 6, None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.linear_rows(torch.randn(3, 8, dtype=torch.float64), packed, 6, None)
    with pytest.raises(RuntimeError, match="features"):
        cpu_kernels.linear_rows(torch.randn(3, 7), packed, 6, None)
    with pytest.raises(RuntimeError, match="pack_weight"):
        cpu_kernels.linear_rows(torch.randn(3, 8), torch.randn(6, 8), 6, None)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.linear_rows(torch.randn(3, 8), packed, 17, None)


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
    monkeypatch.setattr(kernel_modes, "_module", None)
    monkeypatch.setattr(kernel_modes, "_unavailable", None)
    monkeypatch.setattr(kernel_modes, "unsupported_reason", lambda: "they need AVX2 (test)")
    assert kernel_modes.load_cpu_kernels("auto") is None
    with pytest.raises(RuntimeError, match="need AVX2"):
        kernel_modes.load_cpu_kernels("cpu")


def test_linear_rows_add_accumulates_into_the_residual(cpu_kernels):
    generator = torch.Generator().manual_seed(3)
    x, weight = torch.randn(6, 40, generator=generator), torch.randn(11, 40, generator=generator)
    residual, bias = torch.randn(6, 11, generator=generator), torch.randn(11, generator=generator)
    expected = residual.double() + x.double() @ weight.double().T + bias.double()
    packed = cpu_kernels.pack_weight(weight)
    cpu_kernels.linear_rows_add_(residual, x, packed, bias)
    torch.testing.assert_close(residual.double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_kernels.linear_rows_add_(torch.zeros(6, 17), x, packed, None)


def test_append_kv_writes_each_slot_at_its_length(cpu_kernels):
    keys, values = torch.zeros(4, 2, 6, 8), torch.zeros(4, 2, 6, 8)
    k_new, v_new = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    lengths = torch.tensor([0, 5, 2])
    cpu_kernels.append_kv(k_new, v_new, keys, values, lengths)
    written = torch.zeros(keys.shape, dtype=torch.bool)
    for slot, position in enumerate(lengths.tolist()):
        assert torch.equal(keys[slot, :, position], k_new[slot]) and torch.equal(values[slot, :, position], v_new[slot])
        written[slot, :, position] = True
    # nothing else written (compared element by element: sums of the two layouts may round differently)
    assert (keys[~written] == 0).all() and (values[~written] == 0).all()
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.append_kv(k_new, v_new, keys, values, torch.tensor([0, 6, 1]))


def test_rms_norm_rotary_and_silu_match_torch(cpu_kernels):
    generator = torch.Generator().manual_seed(4)
    x, weight = torch.randn(5, 36, generator=generator) * 4, torch.randn(36, generator=generator)
    x64 = x.double()
    expected = weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-5).double(), expected, rtol=1e-5, atol=1e-5)

    heads = torch.randn(5, 3, 16, generator=generator)
    angles = torch.rand(5, 8, generator=generator) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-heads[..., 8:], heads[..., :8]], -1)
    expected = (heads * cos[:, None] + rotated * sin[:, None]) * 0.25
    cpu_kernels.rotate_(heads, cos, sin, 0.25)
    torch.testing.assert_close(heads, expected, rtol=1e-5, atol=1e-6)

    gate = torch.cat([torch.randn(4, 37, generator=generator) * 10, torch.tensor([[-200.0, 200.0, 0.0] * 12 + [1.0]])])
    up = torch.randn(5, 37, generator=generator)
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    cpu_kernels.silu_mul_(gate, up)
    torch.testing.assert_close(gate.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sample_rows_is_inverse_cdf_with_the_given_draws(cpu_kernels, temperature):
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 1000, generator=generator) * 3
    logits[:, 7] = -torch.inf  # zero weight: never drawn
    uniforms = torch.rand(40, generator=generator)
    tokens, log_probs = cpu_kernels.sample_rows(logits, temperature, uniforms)
    scaled = logits.double() / temperature
    weights = (scaled - scaled.max(-1, keepdim=True).values).exp()
    cdf = weights.cumsum(-1)
    expected = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert torch.equal(tokens, expected)
    reference = scaled.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(log_probs.double(), reference, rtol=0, atol=1e-5)
    assert not (tokens == 7).any()


def test_sample_rows_follows_the_distribution(cpu_kernels):
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.log().expand(20000, 4).contiguous()
    tokens, _ = cpu_kernels.sample_rows(logits, 1.0, torch.rand(20000, generator=torch.Generator().manual_seed(6)))
    frequencies = torch.bincount(tokens, minlength=4).double() / 20000
    torch.testing.assert_close(frequencies, probs.double(), rtol=0, atol=0.015)
    assert frequencies[3] == 0


def test_builds_take_turns_and_a_killed_builds_lock_is_removed_at_once(tmp_path, monkeypatch):
    """torch waits forever on a leftover `lock`: a live peer's build is waited for (its flock), and the `lock` of a
    build whose process died (its flock released by the kernel) is removed at once, without a timeout."""
    import subprocess
    import sys
    import threading
    import time

    from torch.utils import cpp_extension

    from hybridflow.engines.rollout.native import kernels

    lock = tmp_path / "lock"
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    inside = threading.Event()

    def peer_build():  # holds the build for 0.3 s, creating and removing torch's lock as torch does
        with kernels.build_lock():
            lock.touch()
            inside.set()
            time.sleep(0.3)
            lock.unlink()

    peer = threading.Thread(target=peer_build)
    peer.start()
    inside.wait(5)
    start = time.monotonic()
    with kernels.build_lock():
        waited = time.monotonic() - start
        assert not lock.exists(), "the peer's own lock was not touched: the peer removed it"
    peer.join()
    assert 0.2 < waited < 5
    killed = (  # a build killed midway: the flock held, torch's lock created, the process gone without cleanup
        "import fcntl, os, sys; d = sys.argv[1]; f = open(os.path.join(d, 'hybridflow_build.flock'), 'a'); "
        "fcntl.flock(f, fcntl.LOCK_EX); open(os.path.join(d, 'lock'), 'w').close(); os._exit(9)"
    )
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path)], timeout=60).returncode == 9
    assert lock.exists()
    (tmp_path / ".ninja_deps").write_bytes(b"# ninjadeps\n\x04")  # half-written by the killed build
    (tmp_path / "decode_kernels.o").write_bytes(b"")
    start = time.monotonic()
    with kernels.build_lock():
        assert not lock.exists() and time.monotonic() - start < 2
        assert not (tmp_path / ".ninja_deps").exists(), "a killed build's ninja state makes every later load rebuild"
    assert (tmp_path / "decode_kernels.o").exists()  # outputs stay: ninja rebuilds them if they are out of date
