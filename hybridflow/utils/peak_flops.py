"""The device's peak FLOP/s, the denominator of MFU: a table for GPUs, a measured and cached matmul rate for CPUs.

- CUDA: the dense bf16 tensor-core peak of the device model, from `CUDA_BF16_PEAK_FLOPS` by device name (no
  sparsity). An unknown device has no peak: MFU is not reported, and the worker logs that once.
- CPU: there is no datasheet figure worth using (it depends on the vector units, the clock under load and the
  threads), so hybridflow measures it: the best rate of a few seconds of 2048 x 2048 fp32 matmuls with the
  worker's torch thread count. The result is cached as a small JSON file under
  `hybridflow.env.cache_dir() / "peak_flops"`, keyed by the CPU model and the thread count. `hybridflow doctor`
  measures and caches it; a worker reads the cache, and measures once when it is missing.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import time
from pathlib import Path

import torch

from hybridflow import env

logger = logging.getLogger(__name__)

__all__ = [
    "CUDA_BF16_PEAK_FLOPS",
    "cpu_model_name",
    "cpu_peak_flops",
    "cuda_peak_flops",
    "device_peak_flops",
    "measure_cpu_matmul_flops",
]

CUDA_BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    # (substring of torch.cuda.get_device_name(), dense bf16 FLOP/s); the first match wins, so the more specific
    # names come first. Figures from NVIDIA's and AMD's datasheets, without sparsity.
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("A40", 150e12),
    ("RTX 4090", 165e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def cuda_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a CUDA device by its name (`torch.cuda.get_device_name()`), or None if unknown."""
    for key, flops in CUDA_BF16_PEAK_FLOPS:
        if key in device_name:
            return flops
    return None


def cpu_model_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's `model name`), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def measure_cpu_matmul_flops(num_threads: int, seconds: float = 3.0, size: int = 2048) -> float:
    """The best fp32 FLOP/s of `size`^2 matmuls run for about `seconds` on `num_threads` torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # warm-up: thread pool and caches
        best, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / best


def _cache_file(num_threads: int) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model_name()).strip("-").lower() or "cpu"
    return env.cache_dir() / "peak_flops" / f"{slug}-{num_threads}threads.json"


def cpu_peak_flops(num_threads: int, *, measure_if_missing: bool = True, remeasure: bool = False) -> float | None:
    """The cached fp32 matmul rate of this CPU with `num_threads` threads (FLOP/s).

    Measures and caches it when there is no cache entry (`measure_if_missing`) or when asked (`remeasure`);
    returns None when it is missing and may not be measured.
    """
    path = _cache_file(num_threads)
    if path.is_file() and not remeasure:
        try:
            record = json.loads(path.read_text())
            if not is_oversubscribed(float(record.get("load_avg_1min", 0.0))):
                return float(record["flops_per_s"])
            logger.warning(
                "the cached fp32 matmul rate %s (%.1f GFLOP/s) was measured at load %.1f on %d cores, a share of "
                "the CPU rather than its peak: measuring again", path, record["flops_per_s"] / 1e9,
                record["load_avg_1min"], os.cpu_count() or 1,
            )
        except (ValueError, KeyError) as err:
            logger.warning("unreadable peak-FLOPs cache %s (%s): measuring again", path, err)
    if not (measure_if_missing or remeasure):
        return None
    flops = measure_cpu_matmul_flops(num_threads)
    record = {"cpu": cpu_model_name(), "num_threads": num_threads, "flops_per_s": flops,
              "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_1min": os.getloadavg()[0]}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")  # ranks measuring at once each rename a whole file
    staging.write_text(json.dumps(record, indent=1))
    os.replace(staging, path)
    logger.info("measured this CPU's fp32 matmul rate on %d threads: %.1f GFLOP/s (cached in %s)",
                num_threads, flops / 1e9, path)
    return flops


def is_oversubscribed(load_avg_1min: float) -> bool:
    """Whether a CPU rate measured at this 1-minute load average is a share of the CPU rather than its peak: more
    than two runnable tasks per core (a cache entry measured at load 9.1 on 2 cores read 11.5 GFLOP/s for one
    thread, about a seventh of the figure a quiet run gives, and made MFU read 180%)."""
    return load_avg_1min > 2 * (os.cpu_count() or 1)


def device_peak_flops(device: torch.device, num_threads: int | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s or None, what it is) for MFU on `device`: the CUDA table, or this CPU's measured rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops = cuda_peak_flops(name)
        if flops is None:
            return None, f"{name}: not in hybridflow's table of peak FLOP/s (hybridflow/utils/peak_flops.py)"
        return flops, f"{name}: dense bf16 peak {flops / 1e12:.0f} TFLOP/s"
    threads = num_threads or torch.get_num_threads()
    flops = cpu_peak_flops(threads)
    plural = "s" if threads > 1 else ""
    return flops, f"{cpu_model_name()}, {threads} thread{plural}: measured fp32 matmul {flops / 1e9:.1f} GFLOP/s"
