"""Repair gives every tool call a result and drops stray results; it is safe to run twice."""

from __future__ import annotations

from trading_agent.agent.conversation import (
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
    repair,
)


def _call(call_id: str) -> ToolUseBlock:
    return ToolUseBlock(id=call_id, name="get_ticker", arguments='{"symbol": "BTC/USDT"}')


def _result(call_id: str) -> ToolResultBlock:
    return ToolResultBlock(tool_use_id=call_id, content=(TextBlock("BTC/USDT 21,000"),))


def test_a_valid_conversation_comes_back_as_the_same_objects() -> None:
    messages = [
        Message.user_text("tick"),
        Message(role="assistant", content=(_call("a"),)),
        Message(role="user", content=(_result("a"),), kind="tool_results"),
        Message(role="assistant", content=(TextBlock("done"),)),
    ]
    repaired = repair(messages)
    assert all(a is b for a, b in zip(repaired, messages, strict=True))


def test_a_call_without_result_gets_an_interrupted_error_result() -> None:
    messages = [Message.user_text("tick"), Message(role="assistant", content=(_call("a"),
                                                                               _call("b")))]
    repaired = repair(messages)
    assert len(repaired) == 3
    results = repaired[2].tool_results
    assert [r.tool_use_id for r in results] == ["a", "b"]
    assert all(r.is_error and "interrupted" in r.text for r in results)
    assert [m.id for m in repair(repaired)] == [m.id for m in repaired]


def test_a_partial_result_set_is_completed_in_call_order() -> None:
    messages = [
        Message(role="assistant", content=(_call("a"), _call("b"))),
        Message(role="user", content=(_result("b"),), kind="tool_results"),
    ]
    results = repair(messages)[1].tool_results
    assert [r.tool_use_id for r in results] == ["a", "b"]
    assert results[0].is_error and not results[1].is_error


def test_results_without_a_call_are_dropped() -> None:
    stray = Message(role="user", content=(_result("zzz"),), kind="tool_results")
    messages = [Message.user_text("tick"), stray, Message(role="assistant",
                                                           content=(TextBlock("ok"),))]
    repaired = repair(messages)
    assert [m.text for m in repaired] == ["tick", "ok"]


def test_token_estimate_counts_characters_and_images() -> None:
    short = Message.user_text("x" * 400)
    assert 100 <= estimate_tokens(short) <= 110
