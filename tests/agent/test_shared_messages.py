"""A request's messages shared with the window's list: read like a list, never changed by
what the window does next, and compared with the last request's without a walk."""

from __future__ import annotations

import pytest

from trading_agent.agent.conversation import Message
from trading_agent.agent.shared_messages import SharedMessages, frozen, starts_with


def _messages(count: int) -> list[Message]:
    return [Message.user_text(f"tick {number}") for number in range(count)]


def test_it_reads_as_the_shared_start_then_its_tail() -> None:
    base, tail = _messages(5), _messages(2)
    shared = SharedMessages(base, 3, tail)
    expected = [*base[:3], *tail]

    assert len(shared) == 5
    assert list(shared) == expected
    assert [shared[i] for i in range(-5, 5)] == [*expected, *expected]
    for start in range(-6, 7):
        for stop in (*range(-6, 7), None):
            assert list(shared[start:stop]) == expected[start:stop], (start, stop)
    assert list(shared[::2]) == expected[::2]
    assert shared == expected and expected == shared
    assert shared != expected[:4]
    with pytest.raises(IndexError):
        shared[5]
    with pytest.raises(ValueError, match="outside the shared list"):
        SharedMessages(base, 6)


def test_what_it_shares_does_not_change_when_the_list_grows() -> None:
    base = _messages(3)
    earlier = SharedMessages(base, 3)
    before = list(earlier)
    base.extend(_messages(2))
    later = SharedMessages(base, 5)

    assert list(earlier) == before
    assert starts_with(later, earlier)
    assert not starts_with(earlier, later)
    assert isinstance(later[:3], SharedMessages)  # a beginning is shared, not copied


def test_a_start_is_compared_message_for_message_across_lists() -> None:
    base = _messages(4)
    replaced = [*base[:2], Message.user_text("tick 2, cut"), base[3]]
    earlier = SharedMessages(base, 4)

    assert starts_with(SharedMessages(replaced, 2), SharedMessages(base, 2))
    assert not starts_with(SharedMessages(replaced, 4), earlier)
    assert starts_with(base + _messages(1), earlier)  # a plain list against a shared one
    tail = _messages(1)
    assert starts_with(SharedMessages(base, 2, [base[2], *tail]), SharedMessages(base, 3))
    assert not starts_with(SharedMessages(base, 2, tail), SharedMessages(base, 3))


def test_a_callers_list_is_copied_before_it_is_kept() -> None:
    mine = _messages(2)
    kept = frozen(mine)
    mine.append(Message.user_text("later"))

    assert len(kept) == 2
    shared = SharedMessages(mine, 3)
    assert frozen(shared) is shared


def shared_as_a_window_sends(window: list[Message], base: list[Message],
                             tail: int = 0) -> tuple[SharedMessages, list[Message]]:
    """``window`` as the loop's window would send it: on ``base`` grown in place while the
    window only grows at its end, on a new list otherwise; its last ``tail`` messages after
    the shared part. Returns the messages and the list they share, for the next call."""
    tail = min(tail, len(window))
    count = len(window) - tail
    if any(a is not b for a, b in zip(window, base, strict=False)):
        base = []  # changed other than at its end: a new list; the old one stays as it was
    if len(base) < count:
        base.extend(window[len(base):count])
    return SharedMessages(base, count, window[count:]), base
