"""``kill-switch``, ``pause``, ``resume``, ``cancel``, ``send`` and chat's ``/pause``,
``/resume`` and ``/kill`` as a user runs them: the real CLI in a process of its own, against
the real daemon (:func:`in_process_daemon`) whose paper desks talk to the scripted server.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.command_line import CLI, cli_environment, run_cli
from tests.operator.harness import in_process_daemon, uds_client
from tests.operator.test_controls import (
    HALTED,
    OrderModel,
    paper_fills,
    paper_orders,
    positions,
    tool_results_read,
)
from tests.os_user import OS_USER
from tests.scripted_server import HttpError, Reply, ScriptedServer, ToolCall
from tests.waiting import wait_until


async def _order_turn(client: Any, server: ScriptedServer, desk: str, text: str) -> list[str]:
    """Sends an operator message and waits for the end of the turn it opens (``send --wait``
    over the API); returns the place_order results the model read in it."""
    before = len(tool_results_read(server))
    response = await client.post(f"/api/desks/{desk}/messages",
                                 json={"text": text, "wait": True,
                                       "timeout": 10})
    assert response.status_code == 200, response.text
    assert response.json()["reply"]["ok"], response.json()
    return tool_results_read(server)[before:]


# --------------------------------------------------------------------------- kill switch


async def test_kill_switch_from_the_command_line_stops_a_desk_that_keeps_ordering(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks=("alpha", "beta"))
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        placed = await _order_turn(client, scripted_server, "alpha",
                                   "limit buy 0.01 @ 10000; market buy 0.02")
        assert "placed and resting" in placed[0] and "filled: bought 0.02 BTC" in placed[1]
        assert await positions(state_dir, "alpha") == {"BTC/USDT": 0.02}

        code, out, err = await run_cli(socket, "kill-switch", "on", "--desk", "alpha",
                                    "--cancel-orders", "--flatten", "--reason",
                                    "runaway model")
        assert code == 0, err
        lines = out.splitlines()
        assert re.fullmatch(rf"Kill switch ON for desk alpha: halted by {OS_USER} at "
                            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC: runaway model", lines[0])
        assert lines[1] == ("Every new order is refused before any exchange sees it, until "
                            "'trading-agent kill-switch off --desk alpha'.")
        assert re.fullmatch(r"  alpha: cancelled order \S+ \(buy limit 0.01 BTC/USDT\)",
                            lines[2]), out
        assert re.fullmatch(r"  alpha: order \S+ sell 0.02 BTC/USDT at market \(closed\)",
                            lines[3]), out
        assert len(lines) == 4
        assert await positions(state_dir, "alpha") == {}  # flat
        books = await paper_orders(state_dir, "alpha")
        assert [(o["side"], o["type"], o["status"]) for o in books] == [
            ("buy", "limit", "canceled"), ("buy", "market", "closed"),
            ("sell", "market", "closed")]
        fills = await paper_fills(state_dir, "alpha")

        # The model keeps calling place_order: each order is refused, none reaches the books.
        refused = await _order_turn(client, scripted_server, "alpha",
                                    "market buy 0.01; limit buy 0.01 @ 10000; market buy 0.03")
        assert len(refused) == 3
        for result in refused:
            match = HALTED.search(result)
            assert match is not None and match["reason"] == "runaway model", result
        assert await paper_orders(state_dir, "alpha") == books
        assert await paper_fills(state_dir, "alpha") == fills
        # beta was not named: it trades.
        assert "filled" in (await _order_turn(client, scripted_server, "beta",
                                              "market buy 0.01"))[0]

    # A restart: the switch is still on, orders are still refused.
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        code, out, err = await run_cli(socket, "desks", "--json")
        statuses = {d["name"]: d for d in json.loads(out)}
        assert statuses["alpha"]["kill_switch"].endswith(": runaway model")
        assert statuses["beta"]["kill_switch"] == ""
        [result] = await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
        assert HALTED.search(result) is not None
        assert await paper_orders(state_dir, "alpha") == books

        code, out, err = await run_cli(socket, "kill-switch", "off", "--desk", "alpha")
        assert code == 0, err
        assert re.fullmatch(rf"Kill switch off for desk alpha \(it was halted by {OS_USER} at "
                            r"\S+ \S+ UTC: runaway model\)\.\n", out)
        [result] = await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
        assert "filled: bought 0.01 BTC" in result
        assert len(await paper_orders(state_dir, "alpha")) == 4
        code, out, _ = await run_cli(socket, "kill-switch", "off", "--desk", "alpha")
        assert code == 0 and out == "Kill switch off for desk alpha: it was not on.\n"


async def test_kill_switch_for_every_desk_and_what_the_command_refuses(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS,
                                 desks=("alpha", "beta"))
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        code, out, err = await run_cli(socket, "kill-switch", "on")
        assert code == 2 and out == ""
        assert "say why the kill switch goes on (reason)" in err
        code, out, err = await run_cli(socket, "kill-switch", "on", "--desk", "gamma",
                                    "--reason", "x")
        assert code == 2 and "no desk named 'gamma'" in err
        code, out, err = await run_cli(socket, "kill-switch", "off", "--flatten")
        assert code == 2 and "--cancel-orders and --flatten go with 'kill-switch on'" in err
        assert (await client.get("/api/kill-switch")).json()["halts"] == []

        code, out, err = await run_cli(socket, "kill-switch", "on", "--reason", "exchange outage")
        assert code == 0, err
        assert out.startswith(f"Kill switch ON for every desk: halted by {OS_USER} at ")
        assert "until 'trading-agent kill-switch off'." in out
        for desk in ("alpha", "beta"):
            [result] = await _order_turn(client, scripted_server, desk, "market buy 0.01")
            assert HALTED.search(result) is not None, result
            assert await paper_orders(state_dir, desk) == []
        code, out, err = await run_cli(socket, "kill-switch", "off")
        assert code == 0 and out.startswith("Kill switch off for every desk (it was halted ")
        [result] = await _order_turn(client, scripted_server, "beta", "market buy 0.01")
        assert "filled" in result


# --------------------------------------------------------------------------- pause, resume


@pytest.mark.timeout(30)
async def test_the_socket_records_its_peers_os_user_whatever_name_a_request_gives(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    """On the Unix socket the name recorded is the OS user at the other end (its peer
    credentials), never one a request gives: ``--operator`` still runs, says it is ignored
    and who the records name; a body's ``operator`` changes nothing."""
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running:
        socket = running.endpoints.socket_path
        code, out, err = await run_cli(socket, "pause", "alpha", "--reason", "lunch",
                                       "--operator", "ann")
        assert code == 0, err
        assert out.startswith(f"alpha is paused: paused by {OS_USER} at "), out
        assert err == (f"trading-agent: --operator 'ann' is ignored; the records name "
                       f"{OS_USER!r}, who your credential says you are\n")
        async with uds_client(socket) as client:
            me = (await client.get("/api/me")).json()
            resumed = await client.post("/api/desks/alpha/resume", json={"operator": "ann"})
            assert resumed.status_code == 200, resumed.text
            audit = (await client.get("/api/audit")).json()["actions"]
    assert (me["name"], me["role"]) == (OS_USER, "owner")
    assert [(a["action"], a["who"]) for a in audit if a["desk"] == "alpha"] == [
        ("pause", OS_USER), ("resume", OS_USER)]


@pytest.mark.timeout(30)
async def test_pause_and_resume_from_the_command_line(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running:
        socket = running.endpoints.socket_path
        code, out, err = await run_cli(socket, "pause", "alpha", "--reason", "lunch")
        assert code == 0, err
        assert re.fullmatch(rf"alpha is paused: paused by {OS_USER} at \S+ \S+ UTC: lunch "
                            r"\(until an operator resumes it\)\n", out)
        code, out, _ = await run_cli(socket, "pause", "alpha")
        assert code == 0 and out.startswith(f"alpha was already paused: paused by {OS_USER}")
        code, out, err = await run_cli(socket, "send", "alpha", "Are you there?")
        assert code == 0 and re.fullmatch(r"sent \(\S+; turn\)\n", out), err
        code, out, _ = await run_cli(socket, "desks")
        assert re.search(r"^alpha +paused +paper", out, re.MULTILINE)
        assert f"alpha is paused: paused by {OS_USER} at " in out

        async def held() -> bool:  # the message waits in the paused desk's queue
            _, listed, _ = await run_cli(socket, "desks", "--json")
            return any(d["name"] == "alpha" and d["queued_triggers"] == 1
                       for d in json.loads(listed))

        await wait_until(held, "the message held by the paused desk", within=30, step=0.1)
        assert scripted_server.requests == []

        code, out, err = await run_cli(socket, "resume", "alpha")
        assert code == 0, err
        assert out == "alpha resumed; 1 trigger(s) waiting run now.\n"
        await scripted_server.wait_for_requests(1)
        code, out, _ = await run_cli(socket, "resume", "alpha")
        assert code == 0 and out == "alpha was not paused.\n"
        code, _, err = await run_cli(socket, "pause", "gamma")
        assert code == 2 and "no desk named 'gamma'" in err


# --------------------------------------------------------------------------- cancel


async def test_cancel_from_the_command_line(scripted_server: ScriptedServer,
                                            state_dir: Path) -> None:
    first, second = threading.Event(), threading.Event()
    scripted_server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})], hold_until=first),
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})], hold_until=second))
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    try:
        async with in_process_daemon(config) as running, \
                uds_client(running.endpoints.socket_path) as client:
            socket = running.endpoints.socket_path
            code, out, _ = await run_cli(socket, "cancel", "alpha")
            assert code == 0 and out == "alpha was not running a turn; nothing to cancel.\n"

            await client.post("/api/desks/alpha/messages", json={"text": "Look."})
            await scripted_server.wait_for_requests(1)
            code, out, err = await run_cli(socket, "cancel", "alpha")
            assert code == 0, err
            assert out == ("alpha's turn ends at its next safe point (after the tool round in "
                           "flight).\n")
            first.set()
            desk = running.daemon.supervisor.desk("alpha")
            await wait_until(lambda: desk.state == "idle", "the turn to end")
            assert len(scripted_server.requests) == 1  # no model call after the safe point

            await client.post("/api/desks/alpha/messages", json={"text": "Look again."})
            await scripted_server.wait_for_requests(2)
            code, out, err = await run_cli(socket, "cancel", "alpha", "--now")
            assert code == 0, err
            assert out == ("alpha's turn was cut; calls in flight are stored as "
                           "interrupted.\n")
            await wait_until(lambda: desk.state == "idle", "the cut")
            code, _, err = await run_cli(socket, "cancel", "gamma")
            assert code == 2 and "no desk named 'gamma'" in err
    finally:
        first.set()
        second.set()


# --------------------------------------------------------------------------- send --wait


async def test_send_wait_prints_the_desks_answer(scripted_server: ScriptedServer,
                                                 state_dir: Path) -> None:
    scripted_server.add(Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})]),
                        Reply("BTC is range-bound today.", text_chunks=3))
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running:
        code, out, err = await run_cli(running.endpoints.socket_path, "send", "alpha",
                                    "How is BTC?", "--wait")
    assert (code, out, err) == (0, "BTC is range-bound today.\n", "")
    sent = scripted_server.requests[0].messages[-1]["content"]
    assert sent == f"[Message from {OS_USER}, a human operator]\nHow is BTC?"
    scripted_server.assert_complete()


async def test_send_wait_exits_3_when_the_turn_fails(scripted_server: ScriptedServer,
                                                     state_dir: Path) -> None:
    scripted_server.responder = lambda request: HttpError(
        400, "this model does not accept tools", "invalid_request_error", "bad_request")
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running:
        code, out, err = await run_cli(running.endpoints.socket_path, "send", "alpha",
                                    "How is BTC?", "--wait")
    assert code == 3, (out, err)
    assert err.startswith("trading-agent: the turn failed: BackendError: ")
    assert "this model does not accept tools (HTTP 400)" in err


async def test_send_wait_exits_3_when_no_answer_comes_in_time(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    scripted_server.add(Reply("Late answer.", hold_until=release))
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    try:
        async with in_process_daemon(config) as running:
            socket = running.endpoints.socket_path
            code, out, err = await run_cli(socket, "send", "alpha", "Quick?", "--wait",
                                        "--timeout", "0.5")
            assert code == 3, (out, err)
            assert out == ""
            assert re.fullmatch(r"trading-agent: no answer within 0.5 s; the message \(\S+\) "
                                r"was delivered and the desk will still answer it\n", err)
            code, _, err = await run_cli(socket, "send", "gamma", "Hello?", "--wait")
            assert code == 2 and "no desk named 'gamma'" in err
    finally:
        release.set()


# --------------------------------------------------------------------------- desks


async def test_desks_shows_the_kill_switch_a_pause_and_the_spend_caps(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Hello.", usage=(700, 150)))
    config = write_daemon_config(
        state_dir, scripted_server.base_url,
        daemon={**FAST_RESTARTS, "spend": {"max_tokens_per_day": 10000}},
        desks={"alpha": {"controls": {"max_tokens_per_day": 1000}}, "beta": {}})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        socket = running.endpoints.socket_path
        await client.post("/api/desks/alpha/messages",
                          json={"text": "Hi.", "wait": True, "timeout": 10})
        await wait_until(lambda: _tokens(client, "alpha"), "the usage to be stored")
        await run_cli(socket, "kill-switch", "on", "--desk", "alpha", "--reason", "audit")
        await run_cli(socket, "pause", "beta", "--reason", "quiet day")
        code, out, err = await run_cli(socket, "desks")
        assert code == 0, err
        code, raw, _ = await run_cli(socket, "desks", "--json")
    lines = out.splitlines()
    # Realized today and unrealized: "-" for a desk without books, else nothing traded yet.
    assert re.search(r"^alpha +idle +paper +scripted-model +10,000.00 +(-|0\.00) +(-|0\.00) "
                     r"+0 +850 ", out,
                     re.MULTILINE), out
    assert re.fullmatch(rf"alpha: KILL SWITCH ON, new orders refused: halted by {OS_USER} at "
                        r"\S+ \S+ UTC: audit",
                        next(x for x in lines if x.startswith("alpha: KILL")))
    assert f"beta is paused: paused by {OS_USER} at " in out
    assert ": quiet day (until an operator resumes it)" in out
    assert "alpha spend caps today: desk tokens 85% of 1,000; daemon tokens 8% of 10,000" in lines
    assert "beta spend caps today: daemon tokens 8% of 10,000" in lines
    alpha = next(d for d in json.loads(raw) if d["name"] == "alpha")
    assert alpha["spend"] == [
        {"scope": "desk", "measure": "tokens", "used": 850.0, "cap": 1000.0, "share": 0.85},
        {"scope": "daemon", "measure": "tokens", "used": 850.0, "cap": 10000.0,
         "share": 0.085}]


async def _tokens(client: Any, desk: str) -> int:
    return int((await client.get(f"/api/desks/{desk}")).json()["tokens_today"])


# --------------------------------------------------------------------------- chat


class _Chat:
    """``trading-agent chat DESK`` in a process, its input a pipe: types lines, reads what it
    prints."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.seen = ""

    async def type(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(line.encode() + b"\n")

    async def expect(self, text: str | re.Pattern[str]) -> str:
        """Reads until ``text`` shows (10 s at most); returns everything read so far."""
        assert self.process.stdout is not None
        found = (lambda: text.search(self.seen)) if isinstance(text, re.Pattern) else (
            lambda: text in self.seen)
        try:
            with anyio.fail_after(10):
                while not found():
                    self.seen += (await self.process.stdout.receive()).decode()
        except TimeoutError:
            raise AssertionError(f"chat never printed {text!r}; it printed:\n{self.seen}"
                                 ) from None
        return self.seen


@asynccontextmanager
async def _chat(socket: Path, desk: str) -> AsyncIterator[_Chat]:
    process = await anyio.open_process(
        [*CLI, "chat", desk, "--socket", str(socket)],
        env=cli_environment())
    try:
        yield _Chat(process)
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()
        await process.aclose()


async def test_chat_pauses_resumes_and_asks_before_flattening(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.responder = OrderModel()
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await _order_turn(client, scripted_server, "alpha", "market buy 0.01")
        async with _chat(running.endpoints.socket_path, "alpha") as chat:
            await chat.expect("Connected to alpha · idle · paper")
            await chat.type("/pause lunch")
            await chat.expect(re.compile(rf"Paused: paused by {OS_USER} at \S+ \S+ UTC: lunch"))
            await chat.expect(f"⏸ paused by {OS_USER} until resumed: lunch")  # the stream's event
            assert (await client.get("/api/desks/alpha")).json()["state"] == "paused"
            await chat.type("/pause again")
            await chat.expect("Already paused.")
            await chat.type("/resume")
            await chat.expect("Resumed.")
            await chat.expect(f"▶ resumed by {OS_USER}")
            assert (await client.get("/api/desks/alpha")).json()["state"] == "idle"

            await chat.type("/kill on --flatten the model went wild")
            await chat.expect("This closes every position of alpha at market. Type yes to go "
                              "on; anything else cancels.")
            await chat.type("no")
            await chat.expect("Not done: the kill switch is as it was.")
            assert (await client.get("/api/kill-switch")).json()["halts"] == []
            assert await positions(state_dir, "alpha") == {"BTC/USDT": 0.01}

            await chat.type("/kill on --flatten the model went wild")
            await chat.expect("Type yes to go on")
            await chat.type("yes")
            await chat.expect(re.compile(rf"Kill switch ON for desk alpha: halted by {OS_USER} at "
                                         r"\S+ \S+ UTC: the model went wild"))
            await chat.expect(re.compile(r"alpha: order \S+ sell 0.01 BTC/USDT at market"))
            await chat.expect(f"⛔ kill switch ON (alpha): halted by {OS_USER}")
            assert await positions(state_dir, "alpha") == {}

            await chat.type("/kill on")
            await chat.expect("Usage: /kill on [--all] [--cancel-orders] [--flatten] REASON")
            await chat.type("/kill off")
            await chat.expect(f"Kill switch off for desk alpha (it was halted by {OS_USER} at ")
            await chat.type("/quit")
            await chat.expect("Bye; the desk keeps running.")
        assert (await client.get("/api/kill-switch")).json()["halts"] == []
