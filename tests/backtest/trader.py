"""A scripted trader for backtests: a responder for the scripted OpenAI-compatible server.

It reads what the desk was sent, as a model would: on a trigger it asks for the ticker; given
the ticker it buys or sells 0.01 BTC at market, alternating (and says why); given the order's
result it answers in one sentence. Its answers depend only on the request, so a run and its
re-run ask it the same things and get the same answers.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tests.scripted_server import RecordedRequest, Reply, Step, ToolCall

__all__ = ["trading_responder"]

_LAST = re.compile(r"last ([\d,]+\.?\d*)")
_SYMBOLS = re.compile(r"Desk symbols: ([^,.]+)")


def _symbol(request: RecordedRequest) -> str:
    """The desk's first symbol, as its ticker tool describes it (ASSET/USD when masked)."""
    for tool in request.tools:
        found = _SYMBOLS.search(str(tool["function"].get("description", "")))
        if found:
            return found.group(1).strip()
    return "BTC/USDT"


def _tool_name(messages: list[dict[str, Any]], call_id: str) -> str:
    for message in reversed(messages):
        for call in message.get("tool_calls") or ():
            if call.get("id") == call_id:
                return str(call["function"]["name"])
    return ""


def trading_responder(request: RecordedRequest) -> Step:
    """Ticker, then an order, then a sentence; a summary request gets a summary."""
    messages = request.messages
    if not request.tools:
        return Reply("Summary: the desk alternates small buys and sells.")
    last = messages[-1]
    if last.get("role") != "tool":
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": _symbol(request)})])
    name = _tool_name(messages, str(last.get("tool_call_id")))
    content = last.get("content")
    text = content if isinstance(content, str) else json.dumps(content)
    if name == "get_ticker":
        orders = sum(1 for m in messages for c in m.get("tool_calls") or ()
                     if c["function"]["name"] == "place_order")
        side = "buy" if orders % 2 == 0 else "sell"
        return Reply(tool_calls=[ToolCall("place_order", {
            "symbol": _symbol(request), "side": side, "type": "market", "amount": "0.01"})])
    price = _LAST.search(text)
    seen = price.group(1) if price else "the market"
    return Reply(f"Traded 0.01 at market after reading the ticker ({seen}): {text[:60]}")
