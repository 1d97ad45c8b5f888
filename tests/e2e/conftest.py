"""Fixtures of the end-to-end tests with the real local model (the ``local`` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache the tests share: the GGUF file is assembled into it once (~1 s)."""
    return tmp_path_factory.mktemp("models")
