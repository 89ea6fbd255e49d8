"""The native rollout's CPU decode kernels (`csrc/decode_kernels.cpp`): built on first use, torch ops otherwise.

A decode step on a CPU spends most of its time in two places that torch handles poorly at decode shapes
(docs/performance.md): weight products with a few rows (MKL streams uncached weights at a fraction of the
read bandwidth) and attention of one query per slot over the cache (many tiny batched matmuls). The C++
kernels do both in one pass each, fp32, with AVX2/FMA and torch's intra-op threads.

They are compiled with `torch.utils.cpp_extension.load` (g++ and ninja, about 30 s once; the build is
cached under `TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`, and shared by processes). Modes:
- `auto`: use them when this is an x86-64 CPU with AVX2 and the build works; otherwise log why once and use
  the torch ops (same results up to float summation order).
- `cpu`: require them (raise with the build error).
- `torch`: never use them.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "cpu", "torch")
_SOURCE = Path(__file__).with_name("csrc") / "decode_kernels.cpp"
_lock = threading.Lock()
_module: ModuleType | None = None  # the built kernels, once loaded
_unavailable: str | None = None  # why they cannot be used here, once known


def check_kernel_mode(mode: str) -> None:
    """Raise ValueError naming the choices if `mode` is not a kernel mode."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"native rollout kernels must be one of {KERNEL_MODES}, got {mode!r}")


def unsupported_reason() -> str | None:
    """Why the CPU kernels cannot run on this machine, or None if they can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU (this is {platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"they need AVX2 (torch reports CPU capability {capability})"
    return None


def load_cpu_kernels(mode: str = "auto") -> ModuleType | None:
    """The compiled kernel module, or None when `mode` is `torch` or (`auto`) they cannot be built here.

    Raises RuntimeError in mode `cpu` if they cannot be built or run here.
    """
    check_kernel_mode(mode)
    if mode == "torch":
        return None
    global _module, _unavailable
    with _lock:
        if _module is None and _unavailable is None:
            reason = unsupported_reason()
            if reason is None:
                try:
                    _module = _build()
                except Exception as error:  # noqa: BLE001 - any build failure falls back (or raises in `cpu` mode)
                    reason = f"building {_SOURCE.name} failed: {type(error).__name__}: {error}"
            if reason is not None:
                _unavailable = reason
                logger.warning("native rollout: CPU decode kernels unavailable, using torch ops (%s)", reason)
    if _unavailable is not None:
        if mode == "cpu":
            raise RuntimeError(f"native rollout kernels='cpu' but the CPU decode kernels are unavailable: {_unavailable}")
        return None
    return _module


def _build() -> ModuleType:
    import os

    import ninja
    from torch.utils.cpp_extension import load

    # torch looks for the ninja executable on PATH; the pip package's may not be there (venv not activated).
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")

    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # -fopenmp: at::parallel_for's OpenMP region
    with build_lock():
        return load(
            name="hybridflow_decode_kernels",
            sources=[str(_SOURCE)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


KILLED_BUILD_STATE = (".ninja_deps", ".ninja_log", "build.ninja")
"""ninja's state files in the build directory, which a killed build may leave half-written."""


@contextlib.contextmanager
def build_lock(name: str = "hybridflow_decode_kernels") -> Iterator[None]:
    """Hold the kernels' build directory for one process's build (or load) at a time.

    torch's extension builder marks a build with a `lock` file and waits, without end, while one exists; a build
    killed midway (Ctrl-C, a killed job, the OOM killer) leaves it behind. This lock is an advisory `flock` on a
    file beside it, which the kernel releases when its holder exits however it exits. A process holding it knows
    that no live process is building, so a `lock` file it finds was left by a killed build and is removed at once;
    the ranks of one run, and runs side by side, build one after another instead of racing over torch's file.

    A killed build may also leave ninja's dependency log half-written: ninja then finds the object out of date on
    every load and rebuilds it each time (about 20 s per process, seen after a killed build), so the build state
    goes with the stale lock and the next build starts clean."""
    import fcntl

    from torch.utils import cpp_extension

    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "hybridflow_build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("native rollout: removing the kernel build lock %s and the build state left by a "
                               "killed build", stale)
                for leftover in (stale, *(directory / name for name in KILLED_BUILD_STATE)):
                    leftover.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


if __name__ == "__main__":  # `make` builds them at install, so a first rollout does not wait ~30 s for g++
    logging.basicConfig(level=logging.INFO)
    reason = unsupported_reason()
    built = reason is None and load_cpu_kernels("auto") is not None
    print("native rollout CPU decode kernels:", "built" if built else f"not available ({reason or _unavailable})")
