"""The encodings a backend shared by many desks keeps: one per desk's prompt and tool list,
encoded once while it is in use, the least recently used dropped past the bound."""

from __future__ import annotations

from typing import Any

from trading_agent.backends.recent_encodings import RecentEncodings


def test_each_desks_encoding_is_made_once_while_desks_take_turns() -> None:
    memo = RecentEncodings(size=3)
    made: list[str] = []

    def encode(prompt: str) -> bytes:
        made.append(prompt)
        return prompt.encode()

    for _ in range(5):  # three desks, in turn: each prompt encoded once
        for prompt in ("alpha", "beta", "gamma"):
            assert memo.get(prompt, lambda p=prompt: encode(p)) == prompt.encode()
    assert made == ["alpha", "beta", "gamma"]

    memo.get("beta", lambda: encode("beta"))
    memo.get("delta", lambda: encode("delta"))  # past the bound: alpha, the least recent, goes
    assert len(memo) == 3
    memo.get("beta", lambda: encode("beta"))
    memo.get("alpha", lambda: encode("alpha"))
    assert made == ["alpha", "beta", "gamma", "delta", "alpha"]


def test_each_desks_tool_list_is_its_own_even_when_equal_to_anothers() -> None:
    memo = RecentEncodings()
    tools: list[dict[str, Any]] = [{"name": "get_ticker"}]
    same_text: list[dict[str, Any]] = [{"name": "get_ticker"}]  # another desk's registry
    assert memo.for_tools(tools, lambda: b"alpha's") == b"alpha's"
    assert memo.for_tools(same_text, lambda: b"beta's") == b"beta's"
    # The same definitions in another list (each request builds one): encoded once.
    assert memo.for_tools(list(tools), lambda: b"again") == b"alpha's"
    assert len(memo) == 2
