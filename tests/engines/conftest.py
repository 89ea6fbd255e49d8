from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A saved 2-layer, hidden-64 llama with SmolLM2's (or a local) tokenizer."""
    from hybridflow.models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", seed=0))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama_dir):
    from hybridflow.models import load_tokenizer

    return load_tokenizer(tiny_llama_dir)
