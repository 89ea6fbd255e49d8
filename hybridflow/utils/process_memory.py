"""This process's memory as the kernel counts it: resident set now and its peak since the last report (Linux
/proc), plus the accelerator's peak where there is one. Worker processes report it every step to the driver's
memory watch (`trainer.guards.memory`)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_peak_reset_works = True


class MemoryReport(NamedTuple):
    """One process's memory at the end of a step (bytes)."""

    pid: int
    node_ip: str
    rss_bytes: int
    peak_rss_bytes: int
    """Peak resident set since the previous report (since the process started, where the kernel cannot reset it)."""
    node_total_bytes: int
    """The node's physical memory."""
    device_peak_bytes: int
    """Peak accelerator memory allocated by torch since the previous report; 0 without an accelerator."""


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field} line")


def read_memory_report(node_ip: str) -> MemoryReport:
    """This process's report, then restart its peak counters (VmHWM via clear_refs, torch's device peak)."""
    global _peak_reset_works
    rss, peak = _status_kib("VmRSS") * 1024, _status_kib("VmHWM") * 1024
    if _peak_reset_works:
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        except OSError as err:
            _peak_reset_works = False
            logger.warning("cannot reset the peak RSS (%s): memory/peak_rss_gb is the peak since the process started", err)
    device_peak = 0
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return MemoryReport(os.getpid(), node_ip, rss, max(peak, rss), total, device_peak)
