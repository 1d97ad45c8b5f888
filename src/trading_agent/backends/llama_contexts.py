"""Contexts the local model set aside, so desks taking turns on it need not each be read again.

Runs inside the local model server's child process (see :mod:`.llama_chat_handler`). llama.cpp
keeps one context: the tokens it has read and their attention cache. A desk's next request
repeats its last prompt and adds a little, so the server reads only what was added, unless
another desk asked in between: then the whole prompt is read again (46 s for 5,600 tokens on
one core here). Before a request, :meth:`ContextShelf.prepare` copies the live context aside
when the request would throw most of it away, and brings back a copy that shares more of the
request's prompt. A copy is llama.cpp's own state (about 18 KB a token for Gemma 3 270M; 57 ms
to save and 36 ms to restore 5,600 tokens, measured); the oldest go first beyond the budget.

Why not llama-cpp-python's ``LlamaRAMCache``: its saved state holds a copy of the logits
buffer (512 rows of the 262,144-word vocabulary, 512 MB) with every entry, and it saves after
every completion, where this saves only when another prompt takes the context over.
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ContextShelf"]

MIN_GAIN = 64
"""Fewer tokens than this are cheaper to read again than a context is to copy."""


@dataclass
class _Shelved:
    tokens: list[int]
    state: Any  # a ctypes byte array holding llama.cpp's state
    size: int


def _common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    count = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        count += 1
    return count


class ContextShelf:
    """Copies of the model's context, most recently set aside last, within a byte budget.

    Args:
        capacity_bytes: The most the copies may take together; 0 keeps none.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._shelved: list[_Shelved] = []
        self._llama_cpp: Any = None

    @property
    def size(self) -> int:
        """The bytes the copies take."""
        return sum(entry.size for entry in self._shelved)

    def prepare(self, llama: Any, prompt: Sequence[int]) -> int:
        """Readies ``llama`` for ``prompt`` (its tokens) and returns how many of them it need
        not read again."""
        live = [int(token) for token in llama.input_ids[:llama.n_tokens]]
        reused = _common_prefix(live, prompt)
        if self.capacity_bytes <= 0:
            return reused
        best_reused, best = max(((_common_prefix(entry.tokens, prompt), entry)
                                 for entry in self._shelved),
                                key=lambda found: found[0], default=(0, None))
        if len(live) - reused >= MIN_GAIN:  # the request would overwrite most of the live one
            self._set_aside(llama, live)
        if best is not None and best_reused >= reused + MIN_GAIN:
            return best_reused if self._bring_back(llama, best) else 0
        return reused

    def _library(self) -> Any:
        if self._llama_cpp is None:
            self._llama_cpp = importlib.import_module("llama_cpp")
        return self._llama_cpp

    def _set_aside(self, llama: Any, tokens: list[int]) -> None:
        library = self._library()
        context = llama._ctx.ctx
        size = int(library.llama_state_get_size(context))
        if size > self.capacity_bytes:
            return
        state = (ctypes.c_uint8 * size)()
        written = int(library.llama_state_get_data(context, state, size))
        if written <= 0 or written > size:
            return
        # A copy that the live context only extends is the same conversation, older.
        self._shelved = [entry for entry in self._shelved
                         if _common_prefix(entry.tokens, tokens) < len(entry.tokens)]
        self._shelved.append(_Shelved(tokens, state, written))
        while self.size > self.capacity_bytes:
            self._shelved.pop(0)

    def _bring_back(self, llama: Any, entry: _Shelved) -> bool:
        library = self._library()
        self._shelved.remove(entry)  # live again; set aside anew when another prompt comes
        if int(library.llama_state_set_data(llama._ctx.ctx, entry.state, entry.size)) != (
                entry.size):
            llama.reset()  # a state it could not take: read the prompt from the start
            return False
        count = len(entry.tokens)
        llama.input_ids[:count] = entry.tokens
        llama.n_tokens = count
        llama._requires_eval = True  # the next token's scores come from a decode, not a copy
        return True
