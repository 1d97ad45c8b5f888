"""A request's messages without a copy of the history: the first part of a list that only
grows at its end, shared, and the few messages after it.

A desk of 1,000 messages sent a fresh 1,000-item list with every request (the window as
prepared, then the backend's copy of it for its memo of what it joined). Copying costs
little; but each such list lives as long as the request is in flight or until the desk's next
request, and the cyclic collector walks every item of every young list at every collection of
its generation, which reads 1,000 objects scattered over the heap. With 500 desks waking at
once that was a fifth of the event loop's time between their triggers and their requests
(issue 31). :class:`SharedMessages` holds the list and a count instead: the collector visits
three references.

What makes sharing safe is one rule of the list's owner (:class:`~trading_agent.agent.
sent_window.SentWindow`): it only ever appends to the list; any other change makes a new list.
So the first ``count`` items a :class:`SharedMessages` was given never change, and two of them
on the same list, one no longer than the other, share that many messages without comparing
them (:func:`starts_with`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import overload

from trading_agent.agent.conversation import Message

__all__ = ["SharedMessages", "frozen", "starts_with"]


class SharedMessages(Sequence[Message]):
    """The first ``count`` messages of ``base`` (a list that only grows at its end), then
    ``tail``; an immutable sequence.

    Args:
        base: The shared list; its owner only appends to it.
        count: How many of its first messages belong to this sequence.
        tail: The messages after those.
    """

    __slots__ = ("_base", "_count", "_tail")

    def __init__(self, base: list[Message], count: int, tail: Sequence[Message] = ()) -> None:
        if not 0 <= count <= len(base):
            raise ValueError(f"count {count} is outside the shared list (0 to {len(base)})")
        self._base = base
        self._count = count
        self._tail = tuple(tail)

    def __len__(self) -> int:
        return self._count + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> Message: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Message]: ...

    def __getitem__(self, index: int | slice) -> Message | Sequence[Message]:
        count = self._count
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            stop = max(start, stop)
            if start == 0:  # a beginning: shared too, as long as it is the list's
                if stop <= count:
                    return SharedMessages(self._base, stop)
                return SharedMessages(self._base, count, self._tail[:stop - count])
            if start >= count:
                return list(self._tail[start - count:stop - count])
            return self._base[start:min(stop, count)] + list(self._tail[:max(0, stop - count)])
        if index < 0:
            index += len(self)
        if 0 <= index < count:
            return self._base[index]
        if count <= index < len(self):
            return self._tail[index - count]
        raise IndexError("message index out of range")

    def __iter__(self) -> Iterator[Message]:
        return itertools.chain(itertools.islice(self._base, self._count), self._tail)

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same messages, object for object (a message
        compares by identity)."""
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == len(self) and starts_with(other, self)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SharedMessages({len(self)} messages, {self._count} shared)"


def starts_with(messages: Sequence[Message], prefix: Sequence[Message]) -> bool:
    """Whether ``prefix``'s messages are the first of ``messages``, object for object.

    Two :class:`SharedMessages` on the same list share the shorter one's shared part without
    a comparison; the rest is compared in C (list equality tests identity first).
    """
    length = len(prefix)
    if length > len(messages):
        return False
    if (isinstance(messages, SharedMessages) and isinstance(prefix, SharedMessages)
            and messages._base is prefix._base):
        shared = min(messages._count, prefix._count)
        return list(messages[shared:length]) == list(prefix[shared:length])
    return _as_list(messages[:length]) == _as_list(prefix)


def frozen(messages: Sequence[Message]) -> Sequence[Message]:
    """``messages`` as kept past the request: as they are when they cannot change (shared
    or a tuple), else a copy (a caller's list may change after the request)."""
    if isinstance(messages, SharedMessages | tuple):
        return messages
    return list(messages)


def _as_list(messages: Sequence[Message]) -> list[Message]:
    return messages if isinstance(messages, list) else list(messages)
