"""What an operator does on any daemon of a fleet, for a desk another daemon runs.

An order held for approval on one daemon of a fleet is listed and answered on another.

Two real daemons share two paper desks (one each) on one PostgreSQL and one NATS; every order
waits for an operator (``approval_notional_threshold = 1``). Each desk is asked to buy through
the daemon that does not run it; each daemon's API lists both held orders; one is approved and
the other denied, each through the daemon that does not hold it, and the desks' transcripts
show the order placed and the order refused.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.daemon.careful_trading import text_of
from tests.daemon.process import short_dir
from tests.fleet.books import read_fleet_books
from tests.fleet.daemons import Fleet, fleet_config
from tests.os_user import OS_USER
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from trading_agent.operator.client import OperatorRequestError

pytestmark = pytest.mark.slow

DESKS = ("alpha", "bravo")
BUY = {"symbol": "BTC/USDT", "side": "buy", "type": "market", "amount": "0.01"}


def _trader(request: RecordedRequest) -> Step:
    """Buys when asked to; says what became of the order once its result is in."""
    last = request.messages[-1]
    if last["role"] == "tool":
        return Reply(f"Order outcome: {last['content'][:200]}")
    if "Buy now." in str(last.get("content")):
        return Reply(tool_calls=[ToolCall("place_order", BUY)])
    return Reply("Noted.")


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def _held(fleet: Fleet, via: str, within: float = 30) -> list[dict[str, Any]]:
    """The approvals daemon ``via`` lists, once both desks' orders wait."""
    approvals: list[dict[str, Any]] = []
    try:
        with anyio.fail_after(within):
            while len(approvals) < len(DESKS):
                async with fleet.daemons[via].client() as client:
                    approvals = await client.approvals()
                await anyio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{via} listed {approvals} after {within} s, not an order held "
                             f"for each of {DESKS}") from None
    return approvals


@asynccontextmanager
async def _two_daemons(folder: Path, config: Path, store_url: str,
                       desks: Sequence[str]) -> AsyncIterator[tuple[Fleet, dict[str, str]]]:
    """Daemons d1 and d2 on ``config``, the desks spread over both; yields the fleet and,
    for each desk, the daemon that does not run it. Prints their logs when the test fails."""
    fleet = Fleet(folder, config, store_url, desks)
    try:
        for daemon_id in ("d1", "d2"):
            fleet.start(daemon_id)
        for daemon in fleet.daemons.values():
            await daemon.wait_ready(within=30)
        holders = await fleet.wait_held("d1", ["d1", "d2"], within=30)
        yield fleet, {desk: {"d1": "d2", "d2": "d1"}[holder] for desk, holder in holders.items()}
    except BaseException:
        print(fleet.logs())
        raise
    finally:
        fleet.close()


def _answer(fleet: Fleet, desk: str) -> str:
    messages = read_fleet_books(fleet.store_url, desk).messages
    last = messages[-1] if messages else None
    return text_of(last[3]) if last is not None and last[1] == "assistant" else ""


@pytest.mark.timeout(120)
async def test_an_order_held_on_one_daemon_is_listed_and_answered_on_the_other(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    scripted_server.responder = _trader
    config = fleet_config(folder, scripted_server.base_url, fleet_database, nats_prefix,
                          DESKS, operator={"approval_notional_threshold": 1},
                          lease_seconds=30)
    async with _two_daemons(folder, config, fleet_database, DESKS) as (fleet, elsewhere):
        for desk, via in elsewhere.items():  # each asked through the daemon not running it
            async with fleet.daemons[via].client() as client:
                await client.send_message(desk, "Buy now.", "ann")

        # Both daemons list both held orders, whichever runs the desk.
        for via in ("d1", "d2"):
            listed = await _held(fleet, via)
            assert sorted(a["desk"] for a in listed) == sorted(DESKS), (via, listed)
            assert all(a["tool"] == "place_order" and a["outcome"] == "pending"
                       and a["arguments"]["amount"] == "0.01" for a in listed)
            async with fleet.daemons[via].client() as client:
                assert [a["desk"] for a in await client.approvals("alpha")] == ["alpha"]
        ids = {a["desk"]: a["id"] for a in listed}

        approved_desk, denied_desk = DESKS
        async with fleet.daemons[elsewhere[approved_desk]].client() as client:
            approved = await client.approve(ids[approved_desk], "ann", "sized right")
            assert (approved["outcome"], approved["operator"], approved["desk"]) == (
                "approved", OS_USER, approved_desk)
            # Answered once: a second click hears who answered, as on one daemon.
            with pytest.raises(OperatorRequestError) as again:
                await client.deny(ids[approved_desk], "bob", "too late")
            assert again.value.status == 409 and f"approved by {OS_USER}" in str(again.value)
            with pytest.raises(OperatorRequestError) as unknown:
                await client.approve("0000beef", "ann")
            assert unknown.value.status == 404
        async with fleet.daemons[elsewhere[denied_desk]].client() as client:
            denied = await client.deny(ids[denied_desk], "bob", "not today")
            assert (denied["outcome"], denied["operator"]) == ("denied", OS_USER)

        with anyio.fail_after(30):
            waiting = list(DESKS)
            while waiting:  # the books are another process's: polled
                waiting = [desk for desk in waiting if not _answer(fleet, desk)]
                await anyio.sleep(0.1)
        assert "NEVER SENT" not in _answer(fleet, approved_desk)
        assert read_fleet_books(fleet.store_url, approved_desk).orders, fleet.logs()
        assert f"Denied by operator {OS_USER}: not today" in _answer(fleet, denied_desk)
        assert not read_fleet_books(fleet.store_url, denied_desk).orders
        for via in ("d1", "d2"):
            async with fleet.daemons[via].client() as client:
                assert await client.approvals() == []


@pytest.mark.timeout(120)
async def test_a_message_too_long_for_a_desk_elsewhere_is_said_to_be_shortened(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    """The desk's message limit comes from the daemon that runs it (its window, 2,048
    tokens here, with room for one tool's definition), so the answer says the message was
    shortened, as on one daemon."""
    scripted_server.responder = _trader
    config = fleet_config(folder, scripted_server.base_url, fleet_database, nats_prefix,
                          ["alpha"], context_window=2048, tools=["get_ticker"],
                          lease_seconds=30)
    async with _two_daemons(folder, config, fleet_database, ["alpha"]) as (fleet, elsewhere):
        text = "Closes: " + " ".join(["16751.3"] * 875)
        async with fleet.daemons[elsewhere["alpha"]].client() as client:
            sent = await client.send_message("alpha", text, "carol")
            short = await client.send_message("alpha", "Closes: 16751.3", "carol")
        assert sent["delivery"] == "turn"  # the idle desk's daemon said so when asked
        shortened = sent["shortened"]
        assert shortened["message_chars"] == len(text)
        assert shortened["limit_chars"] < len(text)
        assert "the middle was cut" in shortened["note"]
        assert "shortened" not in short


@pytest.mark.timeout(120)
async def test_a_message_to_a_working_desk_elsewhere_steers_as_its_daemon_says(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    """Whether a message steers is the desk's mailbox's word, from the daemon that runs it:
    while its turn waits for the model, a second message steers it."""
    release = threading.Event()
    scripted_server.add(Reply("Thinking it over.", hold_until=release), Reply("Noted."))
    config = fleet_config(folder, scripted_server.base_url, fleet_database, nats_prefix,
                          ["alpha"], lease_seconds=30)
    async with _two_daemons(folder, config, fleet_database, ["alpha"]) as (fleet, elsewhere):
        try:
            async with fleet.daemons[elsewhere["alpha"]].client() as client:
                first = await client.send_message("alpha", "Look at BTC.", "carol")
                with anyio.fail_after(30):
                    await scripted_server.wait_for_requests(1)  # the turn waits for the model
                second = await client.send_message("alpha", "And ETH too.", "carol")
        finally:
            release.set()
    assert (first["delivery"], second["delivery"]) == ("turn", "steering")


@pytest.mark.timeout(120)
async def test_a_pin_made_through_the_daemon_not_running_the_desk_is_in_its_next_request(
        scripted_server: ScriptedServer, folder: Path, fleet_database: str,
        nats_prefix: str) -> None:
    """Standing instructions in a fleet: pinned and listed through either daemon; the
    daemon running the desk keeps the pin in the shared store and sends it from the desk's
    next request; the daemon taking the desk over sends it too; a refusal reads as on one
    daemon; taken off, it is sent no more."""
    scripted_server.responder = lambda request: Reply("Noted.")
    rule = "Never hold more than 0.1 BTC."
    # 30 s leases: the desk stays where it started however loaded the machine (it is the
    # daemon not running it that is asked, throughout).
    config = fleet_config(folder, scripted_server.base_url, fleet_database, nats_prefix,
                          ["alpha"], lease_seconds=30)
    async with _two_daemons(folder, config, fleet_database, ["alpha"]) as (fleet, elsewhere), \
            fleet.daemons[elsewhere["alpha"]].client() as client:
        pinned = await client.pin("alpha", rule, "ignored")
        assert (pinned["pin"]["text"], pinned["pin"]["by"]) == (rule, OS_USER)
        for via in ("d1", "d2"):
            async with fleet.daemons[via].client() as either:
                listed = await either.pins("alpha")
            assert [p["text"] for p in listed["pins"]] == [rule], (via, listed)

        await client.send_and_wait("alpha", "How is BTC?", wait_seconds=30)
        assert rule in _system_prompt(scripted_server.requests[-1])

        # The daemon that ran the desk stops; the other takes it over and reads its pins
        # from the store (it was not the one that made the pin).
        asked = elsewhere["alpha"]
        holder = {"d1": "d2", "d2": "d1"}[asked]
        fleet.daemons[holder].signal(signal.SIGTERM)
        assert await fleet.daemons[holder].wait_exit(15) == 0, fleet.logs()
        await fleet.wait_held(asked, [asked], within=90)
        await client.send_and_wait("alpha", "Still there?", wait_seconds=30)
        assert rule in _system_prompt(scripted_server.requests[-1]), fleet.logs()

        with pytest.raises(OperatorRequestError) as unknown:
            await client.unpin("alpha", pinned["pin"]["id"] + 100, "ignored")
        assert (unknown.value.status, unknown.value.code) == (404, "unknown_pin")
        assert f"its pins: {pinned['pin']['id']}" in unknown.value.message

        unpinned = await client.unpin("alpha", pinned["pin"]["id"], "ignored")
        assert unpinned["unpinned"]["text"] == rule and unpinned["pins"] == []
        await client.send_and_wait("alpha", "And now?", wait_seconds=30)
        assert rule not in _system_prompt(scripted_server.requests[-1])


def _system_prompt(request: RecordedRequest) -> str:
    return str(next(m["content"] for m in request.messages if m["role"] == "system"))
