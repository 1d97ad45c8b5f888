"""JSON text that can always be written, even when a string holds a lone surrogate.

A broken model stream can cut an emoji in half and leave a lone UTF-16 surrogate
(``"\\ud83d"``) in Python text. ``json.dumps(..., ensure_ascii=False)`` keeps it as is, and
the text then fails to encode as UTF-8 wherever it goes next (an HTTP body, an SSE frame,
SQLite). These helpers write readable UTF-8 JSON as usual and fall back to ASCII JSON, where
the surrogate is the escape ``\\ud83d``, which every JSON parser reads back to the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["json_bytes", "json_loads", "json_text"]


def json_text(value: Any, *, default: Callable[[Any], Any] | None = None) -> str:
    """Compact JSON text that encodes to UTF-8 without error.

    Args:
        value: JSON-ready data.
        default: Called for objects ``json`` cannot serialise (as in :func:`json.dumps`).

    Returns:
        The JSON: non-ASCII characters as themselves, unless the data holds a lone surrogate,
        when the whole text is ASCII with ``\\uXXXX`` escapes.
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=default)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), default=default)
    return text


def json_bytes(value: Any, *, default: Callable[[Any], Any] | None = None) -> bytes:
    """:func:`json_text` as UTF-8 bytes (encoded once).

    Args:
        value: JSON-ready data.
        default: Called for objects ``json`` cannot serialise.

    Returns:
        The JSON's UTF-8 bytes.
    """
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                          default=default).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), default=default).encode("ascii")


def json_loads(text: str | bytes) -> Any:
    """Parses JSON text, fast: orjson (five times ``json.loads`` on the store's messages, and
    it makes its objects without waking the garbage collector), and ``json.loads`` for what
    orjson refuses and ``json`` reads: a lone surrogate's escape (see the module's doc).

    Raises:
        ValueError: Not JSON.
    """
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
