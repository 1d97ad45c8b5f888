"""The embedded model's tokenizer, read in-process, for ``check-config``.

``check-config`` starts no model server, yet the embedded model's own tokenizer is at hand:
its vocabulary, read from the GGUF file already in the cache (about 0.7 s, no weights, no
context). The daemon itself never imports llama.cpp (its model runs in a child, see
:mod:`.local_server`); this short-lived check does. When the file is not in the cache yet
(``run`` writes it there on first start) or llama-cpp-python is missing, there is no counter
and the caller estimates on the large side.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import anyio

from trading_agent.agent.fixed_part import TokenCounter
from trading_agent.backends.config import LocalModelConfig

__all__ = ["cached_model_file", "vocabulary_counter"]


def cached_model_file(config: LocalModelConfig) -> Path | None:
    """The model's GGUF file when it is already whole in ``config.cache_dir``, else None
    (nothing is written)."""
    if importlib.util.find_spec(config.model_package) is None:
        return None
    try:
        package = importlib.import_module(config.model_package)
        target = config.cache_dir / str(package.MODEL_NAME)
        size = sum(Path(chunk).stat().st_size for chunk in package.chunk_paths())
        found = target.is_file() and target.stat().st_size == size
    except (AttributeError, ImportError, OSError):
        return None
    return target if found else None


async def vocabulary_counter(config: LocalModelConfig) -> TokenCounter | None:
    """A token counter over the cached model's vocabulary, or None when there is none.

    Args:
        config: Which model package and where its cache is.

    Returns:
        Counts tokens as the model's server will (no start-of-text token).
    """
    path = cached_model_file(config)
    if path is None or importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        vocabulary = await anyio.to_thread.run_sync(_load_vocabulary, path)
    except (OSError, ValueError, RuntimeError, ImportError, AttributeError):
        return None

    async def count(text: str) -> int | None:
        tokens = vocabulary.tokenize(text.encode(), add_bos=False, special=False)
        return len(tokens)

    return count


def _load_vocabulary(path: Path) -> Any:
    # The model object of llama-cpp-python's internals: unlike ``Llama``, it loads the
    # vocabulary alone without a context, and says nothing on stderr. Imported by name, as
    # llama_chat_handler does: llama_cpp comes with the optional ``local`` extra only.
    llama_cpp: Any = importlib.import_module("llama_cpp")
    _internals: Any = importlib.import_module("llama_cpp._internals")

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    return _internals.LlamaModel(path_model=str(path), params=params, verbose=False)
