"""Approvals: a dangerous call waits for an operator; approve, deny and time out, over the API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from tests.daemon_config import write_daemon_config
from tests.operator.harness import (
    build_control,
    collect_events,
    in_process_daemon,
    running_api,
    uds_client,
)
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer, ToolCall
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_registry import Tool, ToolContext
from trading_agent.operator.approvals import ApprovalBook, order_notional
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.events import ApprovalRequested, ApprovalResolved

ORDER = {"symbol": "BTC/USDT", "side": "buy", "amount": 0.5, "price": 64000}


def _config(**overrides: object) -> OperatorConfig:
    return OperatorConfig.model_validate(overrides)


def _live(control_desks: set[str]) -> Any:
    return lambda desk: desk in control_desks


async def _wait_pending(client: Any, count: int = 1) -> list[dict[str, Any]]:
    with anyio.fail_after(5):
        while True:
            pending = (await client.get("/api/approvals")).json()["approvals"]
            if len(pending) >= count:
                return list(pending)
            await anyio.sleep(0.01)


def _tool_result_sent(server: ScriptedServer, request_index: int) -> str:
    message = server.requests[request_index].messages[-1]
    assert message["role"] == "tool"
    return str(message["content"])


async def test_a_live_order_waits_and_runs_once_approved(scripted_server: ScriptedServer,
                                                         state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]),
                        Reply("Bought."))
    book = ApprovalBook(timeout_seconds=10, is_live=_live({"alpha"}))
    control, gate = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy half a bitcoin."})
        [pending] = await _wait_pending(client)
        assert pending["desk"] == "alpha" and pending["tool"] == "place_order"
        assert pending["arguments"]["amount"] == 0.5
        assert pending["notional"] == pytest.approx(32_000)
        assert pending["reason"] == "the desk trades live"
        status = (await client.get("/api/desks/alpha")).json()
        assert status["pending_approvals"] == 1
        assert gate.orders == []  # nothing placed while it waits
        response = await client.post(f"/api/approvals/{pending['id']}/approve",
                                     json={})
        assert response.status_code == 200
        assert response.json()["approval"]["outcome"] == "approved"
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        again = await client.post(f"/api/approvals/{pending['id']}/deny", json={})
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "already_resolved"
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
    assert gate.orders == [{"symbol": "BTC/USDT", "side": "buy", "amount": 0.5,
                            "price": 64000.0}]
    assert _tool_result_sent(scripted_server, 1).startswith("order placed")
    kinds = [e.type for e in events]
    assert kinds.index("tool_call") < kinds.index("approval_requested") < kinds.index(
        "approval_resolved") < kinds.index("tool_result")
    resolved = next(e for e in events if e.type == "approval_resolved")
    assert resolved.data["outcome"] == "approved" and resolved.data["operator"] == OS_USER
    assert resolved.data["turn"] == next(e for e in events if e.type == "turn_start").data["turn"]
    scripted_server.assert_complete()


async def test_a_denied_order_is_not_placed_and_the_model_reads_why(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]),
                        Reply("Understood, no order."))
    book = ApprovalBook(timeout_seconds=10, is_live=_live({"alpha"}))
    control, gate = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy."})
        [pending] = await _wait_pending(client)
        response = await client.post(f"/api/approvals/{pending['id']}/deny",
                                     json={"reason": "too large for today"})
        assert response.status_code == 200
        assert response.json()["approval"]["outcome"] == "denied"
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        assert (await client.get("/api/approvals")).json()["approvals"] == []
    assert gate.orders == []
    result = _tool_result_sent(scripted_server, 1)
    assert result.startswith(f"Denied by operator {OS_USER}: too large for today.")
    assert "not placed" in result
    scripted_server.assert_complete()


async def test_no_answer_in_time_means_deny(scripted_server: ScriptedServer,
                                           state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]),
                        Reply("Nobody answered; I did not trade."))
    book = ApprovalBook(timeout_seconds=0.3, is_live=_live({"alpha"}))
    control, gate = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy."})
        [pending] = await _wait_pending(client)
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
        late = await client.post(f"/api/approvals/{pending['id']}/approve", json={})
        assert late.status_code == 409
        assert "timed_out" in late.json()["error"]["message"]
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
    assert gate.orders == []
    assert _tool_result_sent(scripted_server, 1).startswith(
        "Timed out waiting for approval after 0.3 s: not placed")
    resolved = next(e for e in events if e.type == "approval_resolved")
    assert resolved.data["outcome"] == "timed_out"
    scripted_server.assert_complete()


async def test_paper_orders_wait_only_above_the_notional_threshold(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    small = {**ORDER, "amount": 0.01}  # 640: below
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", small)]),
                        Reply(tool_calls=[ToolCall("place_order", ORDER)]),  # 32,000: above
                        Reply("Done."))
    book = ApprovalBook(timeout_seconds=10, notional_threshold=1_000)
    control, gate = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/beta/messages", json={"text": "Trade."})
        [pending] = await _wait_pending(client)
        assert len(gate.orders) == 1  # the small one ran without asking
        assert "above the approval threshold 1,000.00" in pending["reason"]
        await client.post(f"/api/approvals/{pending['id']}/approve", json={})
        with anyio.fail_after(5):
            await control.wait_turns("beta", 1)
    assert [o["amount"] for o in gate.orders] == [0.01, 0.5]
    scripted_server.assert_complete()


async def test_steering_still_flows_while_an_approval_waits(scripted_server: ScriptedServer,
                                                            state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", ORDER)]), Reply("OK."))
    book = ApprovalBook(timeout_seconds=10, is_live=_live({"alpha"}))
    control, _ = build_control(scripted_server.base_url, approvals=book)
    async with running_api(control, book, _config(), state_dir) as (endpoints, _), \
            uds_client(endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy."})
        [pending] = await _wait_pending(client)
        response = await client.post("/api/desks/alpha/messages",
                                     json={"text": "Actually, half the size."})
        assert response.json()["delivery"] == "steering"
        await client.post(f"/api/approvals/{pending['id']}/deny",
                          json={"reason": "see my message"})
        with anyio.fail_after(5):
            await control.wait_turns("alpha", 1)
    sent = scripted_server.requests[1].messages
    assert sent[-2]["role"] == "tool" and "see my message" in sent[-2]["content"]
    assert sent[-1]["content"].endswith("Actually, half the size.")


# --------------------------------------------------------------------------- the book itself


class _Args(BaseModel):
    symbol: str = "BTC/USDT"
    amount: float
    price: float | None = None


async def _handler(arguments: Any, context: ToolContext) -> str:
    return "ran"


def _tool(dangerous: bool = True) -> Tool:
    return Tool("place_order", "orders", _Args, _handler, dangerous=dangerous)


def _context(bus: EventBus) -> ToolContext:
    return ToolContext(desk="alpha", turn="t1", call_id="c1", events=bus)


async def test_safe_tools_and_small_paper_orders_pass_at_once() -> None:
    bus = EventBus()
    book = ApprovalBook(timeout_seconds=5, notional_threshold=100)
    with bus.subscribe("test") as seen:
        assert await book.review(_tool(dangerous=False), _Args(amount=10, price=1e6),
                                 _context(bus)) is None
        assert await book.review(_tool(), _Args(amount=1, price=50), _context(bus)) is None
        assert seen.get_nowait() is None  # nothing was held, nothing published


async def test_a_market_order_is_valued_at_the_last_price() -> None:
    bus = EventBus()
    asked: list[tuple[str, str]] = []

    async def last_price(desk: str, symbol: str) -> float | None:
        asked.append((desk, symbol))
        return 200.0

    book = ApprovalBook(timeout_seconds=0.05, notional_threshold=100, price_lookup=last_price)
    with bus.subscribe("test") as seen:
        refusal = await book.review(_tool(), _Args(amount=1), _context(bus))
        requested = seen.get_nowait()
        resolved = seen.get_nowait()
    assert asked == [("alpha", "BTC/USDT")]
    assert isinstance(requested, ApprovalRequested) and requested.notional == 200.0
    assert json.loads(requested.arguments) == {"symbol": "BTC/USDT", "amount": 1.0,
                                               "price": None}
    assert isinstance(resolved, ApprovalResolved) and resolved.outcome == "timed_out"
    assert refusal is not None and refusal.startswith("Timed out waiting for approval")


async def test_an_order_of_unknown_value_is_held() -> None:
    book = ApprovalBook(timeout_seconds=0.05, notional_threshold=100)
    refusal = await book.review(_tool(), _Args(amount=1), _context(EventBus()))
    assert refusal is not None and "not placed" in refusal


async def test_a_cancelled_wait_closes_the_approval() -> None:
    bus = EventBus()
    book = ApprovalBook(timeout_seconds=30, is_live=lambda desk: True)
    with bus.subscribe("test") as seen:
        async with anyio.create_task_group() as group:
            group.start_soon(book.review, _tool(), _Args(amount=1, price=1), _context(bus))
            with anyio.fail_after(5):
                while not book.pending():  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            group.cancel_scope.cancel()
        events = [seen.get_nowait(), seen.get_nowait()]
    assert book.pending() == []
    assert isinstance(events[1], ApprovalResolved) and events[1].outcome == "cancelled"
    with pytest.raises(Exception, match="already cancelled"):
        book.approve(events[1].approval_id, "alice")


@pytest.mark.parametrize(("arguments", "last", "expected"), [
    ({"amount": 2, "price": 10}, None, (True, 20.0)),
    ({"quantity": "0.5", "limit_price": "100"}, None, (True, 50.0)),
    ({"size": 3}, 7.0, (True, 21.0)),
    ({"qty": -2, "price": 5}, None, (True, 10.0)),
    ({"amount": 1}, None, (True, None)),
    ({"amount": "lots", "price": 1}, None, (True, None)),
    ({"order_id": "x"}, 5.0, (False, None)),
])
def test_order_notional_reads_the_common_field_names(
        arguments: dict[str, Any], last: float | None,
        expected: tuple[bool, float | None]) -> None:
    assert order_notional(arguments, last) == expected


class _SideArgs(BaseModel):
    symbol: str = "BTC/USDT"
    side: str = "buy"
    amount: float
    price: float | None = None


def _order_tool() -> Tool:
    return Tool("place_order", "orders", _SideArgs, _handler, dangerous=True)


async def test_a_sell_limit_below_the_market_is_valued_at_the_market() -> None:
    async def last_price(desk: str, symbol: str) -> float | None:
        return 16_000.0

    book = ApprovalBook(timeout_seconds=0.05, notional_threshold=1_000, price_lookup=last_price)
    # 10 BTC at a limit of 1 fills at the market: 160,000, not 10.
    refusal = await book.review(_order_tool(), _SideArgs(side="sell", amount=10, price=1),
                                _context(EventBus()))
    assert refusal is not None and refusal.startswith("Timed out")
    assert order_notional({"side": "sell", "amount": 10, "price": 1}, 16_000.0) == (
        True, 160_000.0)
    assert order_notional({"side": "sell", "amount": 1, "price": 20_000}, 16_000.0) == (
        True, 20_000.0)
    assert order_notional({"side": "sell", "amount": 1, "price": 20_000}) == (True, None)


async def test_the_lookup_gets_the_normalised_symbol_and_its_failure_holds_the_order() -> None:
    asked: list[str] = []

    async def last_price(desk: str, symbol: str) -> float | None:
        asked.append(symbol)
        raise RuntimeError("btc/usdt is not replayed")

    bus = EventBus()
    book = ApprovalBook(timeout_seconds=0.05, notional_threshold=1_000, price_lookup=last_price)
    with bus.subscribe("test") as seen:
        refusal = await book.review(_order_tool(), _SideArgs(symbol=" btc/usdt", amount=0.01),
                                    _context(bus))
        requested = seen.get_nowait()
    assert asked == ["BTC/USDT"]
    assert isinstance(requested, ApprovalRequested) and requested.notional is None
    assert "could not be computed" in requested.reason
    assert refusal is not None and "not placed" in refusal


async def test_an_order_split_under_the_threshold_is_held_within_the_hour() -> None:
    now = [1_000.0]
    book = ApprovalBook(timeout_seconds=0.05, notional_threshold=1_000, clock=lambda: now[0])
    bus = EventBus()
    half = _SideArgs(amount=1, price=600)
    assert await book.review(_order_tool(), half, _context(bus)) is None
    with bus.subscribe("test") as seen:
        refusal = await book.review(_order_tool(), half, _context(bus))
        requested = seen.get_nowait()
    assert refusal is not None and refusal.startswith("Timed out")
    assert isinstance(requested, ApprovalRequested)
    assert requested.reason == ("notional 600.00 plus 600.00 placed without approval in the "
                                "last hour is above the approval threshold 1,000.00")
    now[0] += 3_601  # an hour later the first no longer counts
    assert await book.review(_order_tool(), half, _context(bus)) is None


# --------------------------------------------------------------------------- risk comes first


def _threshold_daemon(folder: Path, base_url: str) -> Path:
    """A daemon with one paper desk on the replay whose orders above 1,000 USDT wait; its
    risk limits allow 10,000 USDT an order (BTC trades near 16,600)."""
    return write_daemon_config(
        folder, base_url,
        operator={"approval_timeout_seconds": 30, "approval_notional_threshold": 1000},
        desks={"alpha": {"system_prompt": "You are alpha.", "tools": ["place_order"],
                         "risk": {"max_order_notional": "10000"}}})


async def test_risk_refuses_before_any_approval_and_an_order_within_it_waits(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    too_large = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "1"}
    within = {**too_large, "amount": "0.1"}  # ~1,660: within the limits, above 1,000
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", too_large)]),
                        Reply(tool_calls=[ToolCall("place_order", within)]),
                        Reply("Bought 0.1 BTC."))
    async with in_process_daemon(_threshold_daemon(state_dir, scripted_server.base_url)) \
            as running, uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy bitcoin."})
        [pending] = await _wait_pending(client)
        # The first order never reached an operator: the model read risk's refusal at once.
        refusal = _tool_result_sent(scripted_server, 1)
        assert refusal.startswith("Error: Refused: order notional 16,")
        assert refusal.endswith("exceeds max_order_notional 10,000.00 USDT.")
        assert pending["arguments"]["amount"] == "0.1"
        assert "above the approval threshold 1,000.00" in pending["reason"]
        response = await client.post(f"/api/approvals/{pending['id']}/approve",
                                     json={})
        assert response.status_code == 200
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: es[-1].type == "turn_end")
    placed = _tool_result_sent(scripted_server, 2)
    assert placed.startswith("Order ") and "filled: bought 0.1 BTC on BTC/USDT" in placed
    requested = [e for e in events if e.type == "approval_requested"]
    assert len(requested) == 1 and requested[0].data["approval_id"] == pending["id"]
    scripted_server.assert_complete()


async def test_a_held_order_cut_off_at_once_is_told_it_never_ran_and_the_hold_is_stored(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    order = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.1"}
    scripted_server.add(Reply(tool_calls=[ToolCall("place_order", order, id="call_held")]))
    async with in_process_daemon(_threshold_daemon(state_dir, scripted_server.base_url)) \
            as running, uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/messages", json={"text": "Buy bitcoin."})
        await _wait_pending(client)
        response = await client.post("/api/desks/alpha/cancel",
                                     json={"now": True})
        assert response.status_code == 200
        store = running.daemon.store
        with anyio.fail_after(5):
            while (await store.transcripts.transcript("alpha"))[-1]["kind"] != "notice":  # noqa: ASYNC110
                await anyio.sleep(0.02)
        rows = await store.transcripts.transcript("alpha")
        turn = await store.transcripts.turn_of("alpha", rows[-3]["id"])
        assert turn is not None
        held = await store.held_calls.held_calls("alpha", turn)
        books = await running.daemon.venues["alpha"].exchange.fetch_open_orders()
    (result,) = rows[-2]["content"]
    assert result["tool_use_id"] == "call_held"
    assert result["content"][0]["text"].startswith(
        "Error: the turn was ended before the call to place_order ran (it was waiting for an "
        "operator's approval or another check), so it never ran and nothing was done.")
    # The hold and its end were stored as they happened: a restart would say the same.
    assert held == {"call_held": "cancelled"}
    assert books == []
    scripted_server.assert_complete()
