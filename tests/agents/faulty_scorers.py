"""Scorers that fail as model output can make them fail, at module level so that scorer processes can import them."""

from __future__ import annotations

import ctypes
import math
import time


def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("not a boxed expression")


def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3.0)
    return 1.0


def hangs_in_c(data_source, solution_str, ground_truth, extra_info=None):
    """Blocks in C with SIGALRM ignored, where no alarm reaches it: only killing the process ends it."""
    import signal

    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    ctypes.CDLL(None).sleep(30)
    return 1.0


def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan
