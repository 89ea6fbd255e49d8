from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer and chat template (through a saved tiny model directory)."""
    from hybridflow.models import load_tokenizer, save_tiny_model

    return load_tokenizer(save_tiny_model(tmp_path_factory.mktemp("agent_tiny"), arch="llama", seed=0))
