"""Counting the calls that would block the host on an accelerator (`SyncCounter`), for the hot-path tests of the
training engine and the native rollout (issue 25)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode


def _is_bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class SyncCounter:
    """Counts blocking calls made from the watched files, by call site.

    Tensor methods are patched on the class, except indexing: assigning `__getitem__`/`__setitem__` on
    `torch.Tensor` gives the type a sequence slot that survives the undo (a 0-d tensor then looks like a sequence to
    `torch.tensor([...])` in every later test), so boolean-mask indexing is seen through a TorchFunctionMode instead.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, watched: tuple[str, ...]) -> None:
        """watched: path prefixes of the files whose calls count."""
        self.calls: Counter[str] = Counter()
        self.watched = watched
        self._mode: _BoolIndexMode | None = None
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "nonzero",
                     "unique", "masked_select"):
            monkeypatch.setattr(torch.Tensor, name, self._wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
        for name in ("nonzero", "unique", "masked_select", "argwhere"):
            monkeypatch.setattr(torch, name, self._wrap(f"torch.{name}", getattr(torch, name)))

    @property
    def active(self) -> bool:
        return self._mode is not None

    @active.setter
    def active(self, on: bool) -> None:
        if on and self._mode is None:
            self._mode = _BoolIndexMode(self)
            self._mode.__enter__()
        elif not on and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def record(self, label: str, frame) -> None:
        # While the mode is on, a patched method is reached twice: from the caller, then from the mode's dispatch.
        if frame.f_code is _BoolIndexMode.__torch_function__.__code__:
            return
        if frame.f_code.co_filename.startswith(self.watched):
            self.calls[f"{label} at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}"] += 1

    def _wrap(self, label, original):
        def counted(*args, **kwargs):
            if self.active:
                self.record(label, sys._getframe(1))
            return original(*args, **kwargs)

        return counted

    def total(self) -> int:
        return sum(self.calls.values())


class _BoolIndexMode(TorchFunctionMode):
    """Sees `tensor[mask]` and `tensor[mask] = ...` with a boolean index (output size depends on the values)."""

    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _is_bool_index(args[1]):
            self.counter.record(f"Tensor.{func.__name__}[bool]", sys._getframe(1))
        return func(*args, **(kwargs or {}))
