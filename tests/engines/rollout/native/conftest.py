"""Tiny Llama and Qwen2 checkpoints with peaked output distributions (initializer_range 0.3), so that greedy
decoding produces varied tokens and a wrong position, mask or cache entry changes the output."""

from __future__ import annotations

import pytest

from hybridflow.models import build_causal_lm, build_tiny_model
from hybridflow.models.loader import save_model_and_tokenizer


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def sharp_model_dir(request, tmp_path_factory, tiny_tokenizer):
    model, tokenizer = build_tiny_model(request.param, initializer_range=0.3, seed=1, tokenizer=tiny_tokenizer)
    return str(save_model_and_tokenizer(model, tokenizer, tmp_path_factory.mktemp(f"sharp_{request.param}")))


@pytest.fixture()
def sharp_model(sharp_model_dir):
    """A fresh module per test (tests change weights)."""
    return build_causal_lm(sharp_model_dir)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled decode kernels (built once per machine, ~30 s; cached under TORCH_EXTENSIONS_DIR)."""
    from hybridflow.engines.rollout.native.kernels import load_cpu_kernels

    return load_cpu_kernels("cpu")
