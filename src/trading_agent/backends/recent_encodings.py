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

__all__ = ["RecentEncodings"]

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

    def get(self, key: Hashable, encode: Callable[[], bytes]) -> bytes:
        """The encoding kept under ``key`` (a system prompt's text), else ``encode()``'s,
        kept."""
        return self._get(key, encode, lambda: None)

    def for_tools(self, tools: Sequence[Mapping[str, Any]],
                  encode: Callable[[], bytes]) -> bytes:
        """A tool list's encoding, keyed by the identity of each definition (a registry
        builds them once): the memo holds the definitions, so an identity is not reused
        while it is a key."""
        return self._get(tuple(map(id, tools)), encode, lambda: tuple(tools))

    def _get(self, key: Hashable, encode: Callable[[], bytes],
             holds: Callable[[], object]) -> bytes:
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
            return found[1]
        encoded = encode()
        self._kept[key] = (holds(), encoded)
        if len(self._kept) > self._size:
            self._kept.popitem(last=False)
        return encoded

    def __len__(self) -> int:
        return len(self._kept)
