"""GPU tests: every test here is marked `gpu` and needs CUDA devices (`make test` deselects them; a GPU node runs
`benchmarks/gpu_smoke.sh`, which runs them)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


def require_gpus(count: int) -> None:
    """Skip the calling test unless this host has `count` CUDA devices."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < count:
        pytest.skip(f"needs {count} CUDA device(s), this host has {available}")
