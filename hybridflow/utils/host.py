"""What kind of host this is (CPU model, SIMD flags, cores, load): the doctor prints it, benchmarks record it with
their results, so a reader can tell which row of a table applies to their machine."""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The flags that decide which row of our CPU tables applies: AVX2/FMA (fp32 kernels), AVX-512, bf16 and AMX units.
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def _cpuinfo_field(text: str, field: str) -> str | None:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (Linux `/proc/cpuinfo`), else what `platform` knows."""
    text = _read_cpuinfo() if cpuinfo is None else cpuinfo
    return _cpuinfo_field(text, "model name") or platform.processor() or platform.machine() or "unknown"


def cpu_simd_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of `SIMD_FLAGS` the CPU has, in that order (empty where `/proc/cpuinfo` is missing)."""
    text = _read_cpuinfo() if cpuinfo is None else cpuinfo
    flags = set((_cpuinfo_field(text, "flags") or "").split())
    return [flag for flag in SIMD_FLAGS if flag in flags]


def describe_host(cpuinfo: str | None = None) -> str:
    """One line: 'AMD EPYC, 2 cores, avx2 fma (no AVX-512)'."""
    flags = cpu_simd_flags(cpuinfo)
    avx512 = "" if "avx512f" in flags else " (no AVX-512)"
    return f"{cpu_model(cpuinfo)}, {os.cpu_count()} cores, {' '.join(flags) or 'no AVX2'}{avx512}"


def host_facts() -> dict[str, object]:
    """CPU model and flags, core count, torch version and the load average: what a benchmark's results file records."""
    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_simd_flags(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }


def _read_cpuinfo() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


def write_results(name: str, config: dict, rows: list[dict], load_before: list[float],
                  directory: Path = Path("benchmarks/results")) -> Path:
    """Write a benchmark's raw results with the host's facts (`host_facts`, the load before and now) to
    `directory/{name}_{UTC time}.json`; returns the path, which a table in the docs can name."""
    import json
    import time

    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    facts = host_facts()
    record = {"benchmark": name, "utc": stamp, "host": facts, "load_before": list(load_before),
              "load_after": facts["load_average"], "config": config, "rows": rows}
    path = directory / f"{name}_{stamp}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path
