from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def local_tokenizer():
    from hybridflow.models import build_local_tokenizer

    return build_local_tokenizer()
