"""The operator's controls over the real daemon's API: kill switch, pause and resume, cancel.

Each test opens the daemon the way ``trading-agent run`` does (:func:`in_process_daemon`), with
paper desks on the replayed candles and the scripted server as their model, and drives it
through the operator API on its Unix socket. The desks' model is :class:`OrderModel`: it
places the orders an operator's message spells out, one tool round each, and then says what
the tool results told it, so the tests read the refusals exactly as the model read them.

The helpers here (:class:`OrderModel`, :func:`paper_orders`...) are
shared with ``test_control_cli.py`` and ``tests/daemon/test_spend.py``.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.harness import collect_events, in_process_daemon, uds_client
from tests.os_user import OS_USER
from tests.scripted_server import (
    HttpError,
    RecordedRequest,
    Reply,
    ScriptedServer,
    Step,
    ToolCall,
    rate_limited,
)
from tests.waiting import wait_until
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.desk import RESUME_TEXT

__all__ = [
    "HALTED",
    "OrderModel",
    "message_text",
    "paper_fills",
    "paper_orders",
    "positions",
    "tool_results_read",
]

HALTED = re.compile(r"Refused \(kill_switch\): halted by (?P<by>[\w .@+-]+) at "
                    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: (?P<reason>.+?)\. No new order is sent "
                    r"until an operator switches the kill switch off\.")
"""What the model reads when the kill switch refuses its order."""


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text, whether its content is a string or parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "\n".join(str(part.get("text", "")) for part in content or [])


_ORDER = re.compile(r"\b(market|limit) (buy|sell) ([\d.]+)(?: @ ([\d.]+))?")


class OrderModel:
    """The desks' model, computed from each request.

    The last operator (or trigger) message lists orders as ``market buy 0.01`` or
    ``limit buy 0.01 @ 10000``; the model places them one tool round each, in order, then
    answers ``Done. `` followed by every tool result it read, joined with `` | ``. A message
    with no order gets ``Noted.``.
    """

    def __init__(self) -> None:
        self.held = threading.Event()
        self.held.set()

    def __call__(self, request: RecordedRequest) -> Step:
        messages = request.messages
        opening = max(i for i, m in enumerate(messages) if m["role"] == "user")
        orders = _ORDER.findall(message_text(messages[opening]))
        results = [message_text(m) for m in messages[opening + 1:] if m["role"] == "tool"]
        if len(results) < len(orders):
            kind, side, amount, price = orders[len(results)]
            arguments = {"symbol": "BTC/USDT", "side": side, "type": kind, "amount": amount}
            if price:
                arguments["price"] = price
            return Reply(tool_calls=[ToolCall("place_order", arguments)])
        return Reply("Done. " + " | ".join(results) if results else "Noted.")


def tool_results_read(server: ScriptedServer) -> list[str]:
    """Every place_order result the model was sent, each once, in order."""
    seen: dict[str, str] = {}
    for request in server.requests:
        calls = {c["id"]: c["function"]["name"] for m in request.messages
                 for c in m.get("tool_calls") or []}
        for message in request.messages:
            if message["role"] == "tool" and calls.get(message["tool_call_id"]) == "place_order":
                seen.setdefault(message["tool_call_id"], message_text(message))
    return list(seen.values())


def _database(folder: Path) -> Path:
    return folder / "state" / "trading-agent.sqlite3"


def _read(folder: Path, sql: str, *values: str) -> list[tuple[Any, ...]]:
    connection = sqlite3.connect(f"file:{_database(folder)}?mode=ro", uri=True)
    try:
        return list(connection.execute(sql, values))
    finally:
        connection.close()


async def paper_orders(folder: Path, account: str) -> list[dict[str, str]]:
    """Every order the desk's paper exchange ever took (from its SQLite books)."""
    rows = await anyio.to_thread.run_sync(
        _read, folder, "SELECT id, side, type, amount, price, status FROM paper_orders "
                       "WHERE account = ? ORDER BY seq", account)
    return [dict(zip(("id", "side", "type", "amount", "price", "status"), row, strict=True))
            for row in rows]


async def paper_fills(folder: Path, account: str) -> int:
    """How many fills the desk's paper exchange made."""
    rows = await anyio.to_thread.run_sync(
        _read, folder, "SELECT COUNT(*) FROM paper_fills WHERE account = ?", account)
    return int(rows[0][0])


async def positions(folder: Path, account: str) -> dict[str, float]:
    """The desk's paper positions that are not flat."""
    rows = await anyio.to_thread.run_sync(
        _read, folder, "SELECT symbol, amount FROM paper_positions WHERE account = ?", account)
    return {symbol: float(amount) for symbol, amount in rows if float(amount) != 0}


async def _turns_done(client: httpx.AsyncClient, desk: str, count: int) -> list[str]:
    """Waits until ``count`` turns of the desk ended (its own, not its subagents'); returns
    their final texts."""
    def ends(events: list[Any]) -> list[str]:
        return [e.data["final_text"] for e in events
                if e.type == "turn_end" and e.data["desk"] == desk
                and e.data["subagent"] is None and not e.data["silent"]]

    events = await collect_events(client, params={"after": 0, "desk": desk},
                                  until=lambda es: len(ends(es)) >= count)
    return ends(events)


async def _send(client: httpx.AsyncClient, desk: str, text: str, **extra: Any) -> dict[str, Any]:
    response = await client.post(f"/api/desks/{desk}/messages",
                                 json={"text": text, **extra})
    assert response.status_code in (200, 202), response.text
    return dict(response.json())


async def _status(client: httpx.AsyncClient, desk: str) -> dict[str, Any]:
    return dict((await client.get(f"/api/desks/{desk}")).json())


async def _kill(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/api/kill-switch", json=body)


# --------------------------------------------------------------------------- kill switch


async def test_the_kill_switch_refuses_every_order_of_its_desks_before_the_exchange(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks=("alpha", "beta"))
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await _kill(client, on=True, desk="alpha", reason="the model misbehaves")
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["on"] is True and answer["scope"] == "alpha"
        assert answer["halt"]["by"] == OS_USER
        assert answer["halt"]["reason"] == "the model misbehaves"
        assert answer["halt"]["text"].startswith(f"halted by {OS_USER} at ")

        # alpha keeps trying: three orders in one turn, every one refused.
        await _send(client, "alpha", "market buy 0.01; market buy 0.02; limit buy 0.01 @ 10000")
        # beta, outside the switch's scope, still trades.
        await _send(client, "beta", "market buy 0.01")
        await _turns_done(client, "alpha", 1)
        await _turns_done(client, "beta", 1)
        read = tool_results_read(scripted_server)
        alpha_results = [r for r in read if "kill_switch" in r]
        assert len(alpha_results) == 3, read
        for result in alpha_results:
            match = HALTED.search(result)
            assert match is not None, result
            assert match["by"] == OS_USER and match["reason"] == "the model misbehaves"
        assert await paper_orders(state_dir, "alpha") == []
        assert await paper_fills(state_dir, "alpha") == 0
        assert [o["status"] for o in await paper_orders(state_dir, "beta")] == ["closed"]

        status = await _status(client, "alpha")
        assert status["kill_switch"].startswith(f"halted by {OS_USER} at ")
        assert status["kill_switch"].endswith(": the model misbehaves")
        assert (await _status(client, "beta"))["kill_switch"] == ""
        halts = (await client.get("/api/kill-switch")).json()["halts"]
        assert [(h["scope"], h["by"]) for h in halts] == [("alpha", OS_USER)]

        # Every desk: beta is refused too; alpha's own switch off leaves it halted by the other.
        response = await _kill(client, on=True, reason="exchange outage")
        assert response.json()["scope"] == "*"
        response = await _kill(client, on=False, desk="alpha")
        assert response.json()["was"]["reason"] == "the model misbehaves"
        await _send(client, "alpha", "market buy 0.01")
        await _send(client, "beta", "market buy 0.01")
        await _turns_done(client, "alpha", 2)
        await _turns_done(client, "beta", 2)
        refused = [HALTED.search(r) for r in tool_results_read(scripted_server)[-2:]]
        assert [m["reason"] if m else None for m in refused] == ["exchange outage"] * 2
        assert await paper_orders(state_dir, "alpha") == []
        assert len(await paper_orders(state_dir, "beta")) == 1

        # Off for every desk: orders go through again.
        response = await _kill(client, on=False)
        assert response.json()["was"]["reason"] == "exchange outage"
        assert (await client.get("/api/kill-switch")).json()["halts"] == []
        await _send(client, "alpha", "market buy 0.01")
        [*_, answer_text] = await _turns_done(client, "alpha", 3)
        assert "filled: bought 0.01 BTC" in answer_text
        assert [o["status"] for o in await paper_orders(state_dir, "alpha")] == ["closed"]

        events = await collect_events(client, params={"after": 0}, until=lambda es: sum(
            e.type == "kill_switch" for e in es) >= 4)
    switches = [(e.data["desk"], e.data["on"], e.data["by"]) for e in events
                if e.type == "kill_switch"]
    assert switches == [("alpha", True, OS_USER), ("*", True, OS_USER), ("alpha", False, OS_USER),
                        ("*", False, OS_USER)]


async def test_the_kill_switch_is_still_on_after_a_restart(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await _kill(client, on=True, desk="alpha", reason="until I look at it")
        halted = response.json()["halt"]
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await client.get("/api/kill-switch")).json()["halts"] == [halted]
        assert (await _status(client, "alpha"))["kill_switch"] == halted["text"]
        await _send(client, "alpha", "market buy 0.01")
        await _turns_done(client, "alpha", 1)
        [result] = tool_results_read(scripted_server)
        assert halted["text"] in result
        assert await paper_orders(state_dir, "alpha") == []
        await _kill(client, on=False, desk="alpha")
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await client.get("/api/kill-switch")).json()["halts"] == []
        await _send(client, "alpha", "market buy 0.01")
        await _turns_done(client, "alpha", 2)
    assert [o["status"] for o in await paper_orders(state_dir, "alpha")] == ["closed"]


async def test_the_kill_switch_api_refuses_what_it_cannot_do(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await _kill(client, on=True, desk="alpha", reason="  ")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "reason_required"
        response = await _kill(client, on=True, desk="gamma", reason="x")
        assert response.status_code == 404 and "gamma" in response.json()["error"]["message"]
        response = await _kill(client, on=False, flatten=True)
        assert response.status_code == 400
        assert (await client.get("/api/kill-switch")).json()["halts"] == []
        response = await _kill(client, on=False, desk="alpha")
        assert response.status_code == 200 and response.json()["was"] is None
    scripted_server.assert_complete()


async def test_failed_turns_in_a_row_switch_the_kill_switch_on(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    model = OrderModel()
    failing = [True]

    def respond(request: RecordedRequest) -> Step:
        if failing[0]:  # a 400 is not retried: each try is one failed turn
            return HttpError(400, "the model server cannot parse this request",
                             "invalid_request_error", "bad_request")
        return model(request)

    scripted_server.responder = respond
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": {"controls": {"halt_after_failed_turns": 2}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _send(client, "alpha", "market buy 0.01")

        async def halted() -> list[dict[str, Any]]:
            return list((await client.get("/api/kill-switch")).json()["halts"])

        [halt] = await wait_until(halted, "the kill switch to go on by itself")
        failing[0] = False
        assert halt["scope"] == "alpha" and halt["by"] == "daemon"
        assert halt["reason"].startswith("2 turns in a row failed; the last: ")
        assert "cannot parse this request" in halt["reason"]
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: any(e.type == "kill_switch" for e in es))
        kill = next(e for e in events if e.type == "kill_switch")
        assert kill.data["desk"] == "alpha" and kill.data["on"] is True
        assert kill.data["text"].startswith("kill switch ON (alpha): halted by daemon at ")
        # The model answers again: every order the desk places is refused.
        await _send(client, "alpha", "market buy 0.01")
        await wait_until(lambda: tool_results_read(scripted_server), "the next turn's order")
        [refused] = tool_results_read(scripted_server)
        match = HALTED.search(refused)
        assert match is not None and match["by"] == "daemon", refused
        # An operator who has looked switches it off; the record says who did.
        response = await _kill(client, on=False, desk="alpha")
        assert response.json()["was"]["by"] == "daemon"
        events = await collect_events(client, params={"after": 0}, until=lambda es: sum(
            e.type == "kill_switch" for e in es) >= 2)
    off = [e for e in events if e.type == "kill_switch"][1]
    assert off.data["on"] is False
    assert off.data["by"] == OS_USER, off.data  # who switched it off, not who switched it on
    assert await paper_orders(state_dir, "alpha") == []


async def test_failed_turns_after_an_outage_still_switch_the_kill_switch_on(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    outages = [8]  # two outages: each is 4 rate-limited tries (the loop's 3 retries)

    def respond(request: RecordedRequest) -> Step:
        if outages[0] > 0:
            outages[0] -= 1
            return rate_limited(retry_after=0)
        return HttpError(400, "the model server cannot parse this request",
                         "invalid_request_error", "bad_request")

    scripted_server.responder = respond
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": {"controls": {"halt_after_failed_turns": 2}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        desk = running.daemon.supervisor.desk("alpha")
        await _send(client, "alpha", "First.")
        await wait_until(lambda: len(scripted_server.requests) >= 4, "the first outage")
        await wait_until(lambda: desk.state == "paused", "the desk to wait out the first outage")
        await _send(client, "alpha", "Second.")  # a person is there: the desk tries again now
        await wait_until(lambda: len(scripted_server.requests) >= 8, "the second outage")
        await wait_until(lambda: desk.state == "paused", "the desk to wait out the second one")
        await _send(client, "alpha", "Third.")
        # From here every turn fails: after two in a row the switch must be on.
        await wait_until(lambda: len(scripted_server.requests) >= 12, "failed turns")

        async def halted() -> list[dict[str, Any]]:
            return list((await client.get("/api/kill-switch")).json()["halts"])

        [halt] = await wait_until(halted, "the kill switch after failed turns", within=3)
    assert halt["by"] == "daemon"


async def test_the_daily_loss_limit_switches_the_kill_switch_on_and_says_so(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    # A market buy pays the fee and the slippage at once: about 0.25 USDT on 0.01 BTC.
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": {"risk": {"max_daily_loss": "0.05"}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _send(client, "alpha", "market buy 0.01; market buy 0.01; market buy 0.01")
        await _turns_done(client, "alpha", 1)
        first, second, third = tool_results_read(scripted_server)
        assert "filled: bought 0.01 BTC" in first
        assert "Refused: daily loss 0.2" in second and "max_daily_loss 0.05 USDT" in second
        assert "Refused (kill_switch): halted by risk limit max_daily_loss at " in third
        [halt] = (await client.get("/api/kill-switch")).json()["halts"]
        assert halt["scope"] == "alpha" and halt["by"] == "risk limit max_daily_loss"
        assert (await _status(client, "alpha"))["kill_switch"].startswith(
            "halted by risk limit max_daily_loss")
        # The operators hear of it as of any other switch.
        events = await collect_events(client, params={"after": 0}, until=lambda es: any(
            e.type == "kill_switch" for e in es))
    kill = next(e for e in events if e.type == "kill_switch")
    assert kill.data["on"] is True and kill.data["by"] == "risk limit max_daily_loss"
    assert len(await paper_orders(state_dir, "alpha")) == 1


# --------------------------------------------------------------------------- pause and resume


def _tick(text: str = "BTC/USDT moved 1.2%") -> Trigger:
    return Trigger(kind="tick", text=text, source="BTC/USDT")


@pytest.mark.timeout(20)
async def test_a_paused_desk_runs_no_turn_until_resumed(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        response = await client.post("/api/desks/alpha/pause",
                                     json={"reason": "lunch break"})
        assert response.status_code == 200
        answer = response.json()
        assert answer["changed"] is True and answer["status"]["state"] == "paused"
        assert re.fullmatch(rf"paused by {OS_USER} at \d{{4}}-\d\d-\d\d \d\d:\d\d UTC: lunch break "
                            r"\(until an operator resumes it\)",
                            answer["status"]["paused_reason"])
        again = await client.post("/api/desks/alpha/pause", json={})
        assert again.json()["changed"] is False
        assert f"paused by {OS_USER}" in again.json()["status"]["paused_reason"]

        await _send(client, "alpha", "Are you there?")
        desk = running.daemon.supervisor.desk("alpha")
        for _ in range(3):
            desk.fire(_tick())  # coalesced into one
        await anyio.sleep(0.3)  # kept: that no turn runs in this time is what is checked
        status = await _status(client, "alpha")
        assert status["state"] == "paused" and status["queued_triggers"] == 2
        assert scripted_server.requests == []  # no turn ran

        response = await client.post("/api/desks/alpha/resume", json={})
        assert response.json()["changed"] is True
        await wait_until(lambda: len(scripted_server.requests) >= 2, "the turns that waited")
        await _turns_done(client, "alpha", 2)
        assert (await _status(client, "alpha"))["paused_reason"] == ""
        again = await client.post("/api/desks/alpha/resume", json={})
        assert again.json()["changed"] is False
        events = await collect_events(client, params={"after": 0}, until=lambda es: any(
            e.type == "desk_resumed" for e in es))
    openings = [message_text(r.messages[-1]) for r in scripted_server.requests]
    assert openings[0].endswith("Are you there?")  # the person first
    assert openings[1].startswith("[tick, 3 merged: BTC/USDT]")
    paused = next(e for e in events if e.type == "desk_paused")
    assert paused.data["by"] == OS_USER and paused.data["reason"] == "lunch break"
    resumed = next(e for e in events if e.type == "desk_resumed")
    assert resumed.data["by"] == OS_USER and resumed.data["waiting"] == 2


@pytest.mark.timeout(20)
async def test_with_when_paused_drop_a_trigger_is_dropped_but_a_message_waits(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks={"alpha": {"controls": {"when_paused": "drop"}}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/pause", json={"reason": "noisy"})
        desk = running.daemon.supervisor.desk("alpha")
        desk.fire(_tick())
        desk.fire(_tick("BTC/USDT moved 2%"))
        status = await _status(client, "alpha")
        assert status["dropped_triggers"] == 2 and status["queued_triggers"] == 0
        await _send(client, "alpha", "Still there?")
        await anyio.sleep(0.3)  # kept: that no turn runs in this time is what is checked
        status = await _status(client, "alpha")
        assert status["queued_triggers"] == 1 and scripted_server.requests == []
        await client.post("/api/desks/alpha/resume", json={})
        await _turns_done(client, "alpha", 1)
        await anyio.sleep(0.2)  # kept: room for a dropped trigger's turn, which must not come
    assert len(scripted_server.requests) == 1
    assert message_text(scripted_server.requests[0].messages[-1]).endswith("Still there?")


async def test_pausing_a_working_desk_ends_its_turn_at_a_safe_point(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    scripted_server.add(Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                              hold_until=release))
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _send(client, "alpha", "Look at BTC.")
        await scripted_server.wait_for_requests(1)
        response = await client.post("/api/desks/alpha/pause",
                                     json={"reason": "stop thinking"})
        assert response.json()["changed"] is True
        release.set()
        await wait_until(lambda: running.daemon.supervisor.desk("alpha").state == "paused",
                         "the turn to end")

        async def transcript_with_the_notice() -> list[dict[str, Any]]:
            # The desk is paused before its notice is stored: wait for the row, not the state.
            rows = (await client.get("/api/desks/alpha/transcript")).json()["messages"]
            return list(rows) if rows and rows[-1]["kind"] == "notice" else []

        rows = await wait_until(transcript_with_the_notice, "the notice in the transcript")
        status = await _status(client, "alpha")
    assert [r["kind"] for r in rows] == ["operator", "assistant", "tool_results", "notice"]
    assert status["last_turn_text"] == f"Stopped at a safe point: the desk was paused by {OS_USER}."
    # The desk reads why its turn ended, so it does not take the silence for a finished task.
    assert message_text(rows[3]).startswith("[notice] Your previous turn was ended early. "
                                            "Stopped at a safe point: the desk was paused "
                                            f"by {OS_USER}.")
    assert len(scripted_server.requests) == 1
    scripted_server.assert_complete()


# --------------------------------------------------------------------------- cancel


async def test_cancel_ends_the_turn_at_its_safe_point_with_every_call_answered(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"}),
                          ToolCall("get_balance", {})], hold_until=release),
        Reply("Next one."))
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _send(client, "alpha", "Look at BTC.")
        await scripted_server.wait_for_requests(1)
        response = await client.post("/api/desks/alpha/cancel", json={})
        assert response.json() == {"desk": "alpha", "cancelled": True, "now": False}
        release.set()
        [ended] = await _turns_done(client, "alpha", 1)
        assert ended == f"Stopped at a safe point: an operator ({OS_USER}) cancelled the turn."
        assert (await _status(client, "alpha"))["state"] == "idle"
        idle = await client.post("/api/desks/alpha/cancel", json={})
        assert idle.json()["cancelled"] is False
        await _send(client, "alpha", "Anything else?")
        await _turns_done(client, "alpha", 2)
        rows = (await client.get("/api/desks/alpha/transcript")).json()["messages"]
        events = await collect_events(client, params={"after": 0}, until=lambda es: any(
            e.type == "turn_cancelled" for e in es))
    assert [r["kind"] for r in rows] == ["operator", "assistant", "tool_results", "notice",
                                         "operator", "assistant"]
    calls = [b["id"] for b in rows[1]["content"] if b["type"] == "tool_use"]
    answered = [b["tool_use_id"] for b in rows[2]["content"] if b["type"] == "tool_result"]
    assert len(calls) == 2 and answered == calls
    assert not any(b["is_error"] for b in rows[2]["content"] if b["type"] == "tool_result")
    # The next turn opens with the next message: nothing resumes the cancelled one.
    assert message_text(scripted_server.requests[1].messages[-1]).endswith("Anything else?")
    assert RESUME_TEXT not in str(scripted_server.requests[1].messages)
    cancelled = next(e for e in events if e.type == "turn_cancelled")
    assert cancelled.data["by"] == OS_USER and cancelled.data["now"] is False
    scripted_server.assert_complete()


async def test_cancel_now_cuts_the_turn_and_the_desk_takes_its_next_trigger(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    asked = threading.Event()

    def respond(request: RecordedRequest) -> Step:
        system = message_text(request.messages[0])
        if "research assistant" in system:
            asked.set()
            return Reply("Research done.", hold_until=release)
        return Reply("Noted.")

    scripted_server.add(Reply(tool_calls=[ToolCall("delegate", {"task": "Study BTC/USDT."})]))
    scripted_server.responder = respond
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    try:
        async with in_process_daemon(config) as running, \
                uds_client(running.endpoints.socket_path) as client:
            await _send(client, "alpha", "Research BTC.")
            await wait_until(asked.is_set, "the subagent's request")
            response = await client.post("/api/desks/alpha/cancel",
                                         json={"now": True})
            assert response.json()["cancelled"] is True
            await wait_until(lambda: running.daemon.supervisor.desk("alpha").state == "idle",
                             "the desk to be free")
            await _send(client, "alpha", "Next question.")
            await _turns_done(client, "alpha", 1)

            async def transcript_with_the_answer() -> list[dict[str, Any]]:
                rows = (await client.get("/api/desks/alpha/transcript")).json()["messages"]
                return list(rows) if rows and rows[-1].get("text") == "Noted." else []

            rows = await wait_until(transcript_with_the_answer, "the answer in the transcript")
    finally:
        release.set()
    desk_requests = [r for r in scripted_server.requests
                     if "research assistant" not in message_text(r.messages[0])]
    assert len(desk_requests) == 2  # the cut turn's first call, then the next message's turn
    sent = desk_requests[1].messages
    assert message_text(sent[-1]).endswith("Next question.")
    assert RESUME_TEXT not in str(sent)
    rows = [r for r in rows if r["subagent"] is None]
    assert [r["kind"] for r in rows] == ["operator", "assistant", "tool_results", "notice",
                                         "operator", "assistant"]
    assert rows[3]["text"].endswith(f"Why it stopped: an operator ({OS_USER}) cancelled it at once")
    interrupted = rows[2]["content"][0]
    assert interrupted["type"] == "tool_result" and interrupted["is_error"]
    assert "interrupted" in str(interrupted["content"])
    assert rows[-1]["text"] == "Noted."
