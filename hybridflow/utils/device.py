"""Device selection in one place: CUDA when present, else CPU. Nothing else in hybridflow names a device."""

from __future__ import annotations

import functools

import numpy as np
import torch


def get_device_name() -> str:
    """'cuda' when a CUDA device is visible, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_torch_device(local_rank: int = 0) -> torch.device:
    """The device this rank computes on: `cuda:{local_rank}` on GPU hosts, `cpu` elsewhere."""
    if get_device_name() == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def get_dist_backend() -> str:
    """The torch.distributed backend for this host: gloo on CPU; with CUDA, nccl for GPU tensors and gloo for
    CPU ones (counts, CPU-offloaded parameters), so a collective on a CPU tensor never meets an nccl-only group."""
    return "cpu:gloo,cuda:nccl" if get_device_name() == "cuda" else "gloo"


def device_count() -> int:
    """Number of accelerators visible (0 on a CPU host)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def new_standalone_process_group(store, rank: int, world_size: int, timeout):
    """A process group outside torch.distributed's global state (not `new_group`, which needs one world): nccl on
    CUDA hosts, gloo elsewhere. It lives beside the process's own default group; call its collectives directly
    (`group.broadcast([tensor], options).wait()`), not through `torch.distributed.*`.

    Args:
        store: a `torch.distributed.Store` that every member reaches (e.g. a `TCPStore` behind a `PrefixStore`).
        rank, world_size: this process's rank in the new group and the group's size.
        timeout: a `datetime.timedelta` for each collective.
    """
    import torch.distributed as dist

    if get_device_name() == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # Connect now, on this process's device, rather than at the first broadcast.
        group.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return group
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of `device`: a CUDA device's own, else the host's physical RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory in GiB: CUDA's max_memory_allocated on a GPU; on CPU the peak resident set size
    (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def release_freed_host_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim(0)`), the host's counterpart of emptying
    an accelerator's cache: memory torch has freed otherwise stays in the process's resident set. True if glibc
    released some; False if it released none or this C library has no `malloc_trim` (musl, macOS)."""
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim():
    """The C library's `malloc_trim`, looked up once (a library search per rollout sleep would repeat it), or None."""
    import ctypes
    import ctypes.util

    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def to_device_async(array, device: torch.device) -> torch.Tensor:
    """A host array (numpy or CPU tensor) on `device` without blocking the host: staged through pinned memory on an
    accelerator, so the copy is queued behind the device's work instead of waiting for it (CPU: the array itself)."""
    tensor = array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
