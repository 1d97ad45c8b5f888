"""The wire bytes of the parts of a request that stay the same from one request of a desk to
the next (its system prompt, its tool definitions), kept for every desk that shares a backend.

Desks on the same model share its backend. A memo of one slot was overwritten by each desk in
turn, so with two desks or more every request encoded its tool definitions (8 KB of JSON
for a demo desk's 14 tools) and its system prompt again.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

__all__ = ["RecentEncodings", "tools_key"]

DESKS_KEPT = 1024
"""How many encodings a memo keeps (one a desk), the least recently used dropped first."""


class RecentEncodings:
    """A bounded memo of encoded request parts, the least recently used dropped first.

    Args:
        size: How many encodings are kept.
    """

    def __init__(self, size: int = DESKS_KEPT) -> None:
        self._size = size
        self._kept: collections.OrderedDict[Hashable, tuple[object, bytes]] = (
            collections.OrderedDict())

    def get(self, key: Hashable, encode: Callable[[], bytes], holds: object = None) -> bytes:
        """The encoding kept under ``key``, else ``encode()``'s, kept.

        Args:
            key: What the encoding is of.
            encode: Makes the encoding.
            holds: Kept alive with the encoding: the objects whose identities make ``key``
                (an id is never reused while its object lives).
        """
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
            return found[1]
        encoded = encode()
        self._kept[key] = (holds, encoded)
        if len(self._kept) > self._size:
            self._kept.popitem(last=False)
        return encoded

    def __len__(self) -> int:
        return len(self._kept)


def tools_key(tools: Sequence[Mapping[str, Any]]) -> tuple[int, ...]:
    """A tool list's key: the identity of each definition (a registry builds them once, and
    the memo holds them, so an identity is not reused while it is a key)."""
    return tuple(map(id, tools))
