"""MFU's denominator (`hybridflow.utils.peak_flops`): the GPU table, and the CPU's measured rate and its cache."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.utils import peak_flops
from hybridflow.utils.peak_flops import cpu_peak_flops, cuda_peak_flops, device_peak_flops, measure_cpu_matmul_flops


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", 70e12),
        ("Tesla T4", None),
    ],
)
def test_cuda_peak_by_device_name(name, flops):
    assert cuda_peak_flops(name) == flops


def test_cpu_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    # A quiet host: a measurement taken under load is not trusted from the cache (its own test), and this one must
    # not depend on what else runs beside the suite.
    monkeypatch.setattr(peak_flops.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    calls = []

    def fake_measure(num_threads, seconds=3.0, size=2048):
        calls.append(num_threads)
        return 1e11 * num_threads

    monkeypatch.setattr(peak_flops, "measure_cpu_matmul_flops", fake_measure)
    assert cpu_peak_flops(3, measure_if_missing=False) is None and calls == []
    assert cpu_peak_flops(3) == 3e11 and calls == [3]
    assert cpu_peak_flops(3) == 3e11 and calls == [3]  # cached
    assert cpu_peak_flops(1) == 1e11 and calls == [3, 1]  # keyed by the thread count
    assert cpu_peak_flops(3, remeasure=True) == 3e11 and calls == [3, 1, 3]
    (cached,) = (tmp_path / "peak_flops").glob("*-3threads.json")
    record = json.loads(cached.read_text())
    assert record["num_threads"] == 3 and record["cpu"] == peak_flops.cpu_model_name()
    flops, what = device_peak_flops(torch.device("cpu"), 1)
    assert flops == 1e11 and "1 thread: measured fp32 matmul 100.0 GFLOP/s" in what


def test_a_short_real_measurement_is_a_plausible_rate():
    flops = measure_cpu_matmul_flops(1, seconds=0.05, size=256)
    assert 1e8 < flops < 1e13
    assert torch.get_num_threads() >= 1


def test_a_cached_rate_measured_on_an_oversubscribed_cpu_is_measured_again(tmp_path, monkeypatch):
    """A figure measured at more than two runnable tasks per core is a share of the CPU, not its peak (seen: 11.5
    GFLOP/s cached at load 9.1 on 2 cores, MFU 180%): it is measured again and replaced."""
    monkeypatch.setenv("HYBRIDFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(peak_flops.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(peak_flops, "measure_cpu_matmul_flops", lambda num_threads, seconds=3.0, size=2048: 8e10)
    path = peak_flops._cache_file(1)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"flops_per_s": 1.15e10, "load_avg_1min": 9.1}))
    assert cpu_peak_flops(1) == 8e10
    assert json.loads(path.read_text())["flops_per_s"] == 8e10
    path.write_text(json.dumps({"flops_per_s": 7e10, "load_avg_1min": 3.3}))  # busy but not oversubscribed: kept
    assert cpu_peak_flops(1) == 7e10
