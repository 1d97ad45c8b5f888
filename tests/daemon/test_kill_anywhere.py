"""``kill -9`` anywhere in a trading turn: the transcript and the paper books stay equal.

One desk, one state directory, one scripted model that trades carefully. Each operator
message opens a turn of five model rounds, one tool call each: a market buy (it fills at once
on the paper exchange), a limit buy far below the market (it rests), its cancel, a market
sell, then the answer. Every model reply is held ``_HOLD`` seconds by the server, so a
turn's rounds take a known time.

- 20 moments spread evenly over a turn: a first turn runs uninterrupted and is timed
  (message sent to answer); turn ``i`` is then cut by ``kill -9`` at ``i/20`` of that time,
  timed from the model request that precedes the moment in the timed turn (the rounds' small
  delays do not add up), and the daemon is started again on the same directory to finish it.
- The narrow moment the whole suite is about, made wide: each order call of a turn runs
  beside a research call (``delegate``) whose subagent the server holds, so the kill lands
  after the order took effect in the books and before its result was stored.

After each restart, the state directory is audited (:func:`_audit`) once the desk has
answered and is idle:

- no message id twice; each operator message in the transcript exactly once, in order;
- every tool call answered by the message right after it; every turn answered;
- the ledger equal to what the transcript says: every order in the books was placed by a
  ``place_order`` call of the transcript (matched by its client order id); each call's result
  agrees with the books (an order said filled is filled, by that amount, at that price; one
  said never sent does not exist); the transcript's last word on each order is its status in
  the books, so every fill is reported; the balances are what the fills make them;
- no client order id twice (paper orders, and the order journal when the file has one), and
  no step of a turn traded twice.

A finding is attributed to the kill after which it first appears; each test fails at the
end listing every kill with its findings and where it landed.

The scripted model does what the daemon's notice asks of a careful model: a result that says
a call "may or may not have taken effect" is checked with ``get_order`` (by the client order
id the result gives, or the resting order's id) before anything is repeated; an order the
exchange says was never sent is placed again; one it cannot look up is not repeated.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from tests.daemon.careful_trading import (
    HOLD,
    STEPS,
    CarefulTrader,
    audit,
    changes,
    read_books,
    result_of,
    stored_last,
    text_of,
)
from tests.daemon.harness import is_valid_transcript
from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import RecordedRequest, ScriptedServer
from trading_agent.store.store import Store

pytestmark = pytest.mark.slow

MOMENTS = 20
"""How many kills, spread evenly over one turn."""


_DESK = "alpha"

_ROOMY = {"alpha": {"risk": {"max_open_orders": 1000, "max_orders_per_hour": 100000},
                   "model": {"context_window": 200000}}}
"""Room for every turn's orders: no risk limit or compaction may change what a turn does."""

# --------------------------------------------------------------------------- the daemon


class _Desk:
    """The daemon on one state directory: started, told, killed, started again, audited."""

    def __init__(self, server: ScriptedServer, folder: Path) -> None:
        self.config = write_config(folder, server.base_url, desks=_ROOMY)
        self.database = folder / "state" / "trading-agent.sqlite3"
        self.sent: list[str] = []
        self.known: set[str] = set()
        self.daemon: DaemonProcess | None = None

    async def start(self) -> None:
        self.daemon = DaemonProcess(self.config)
        await self.daemon.wait_ready()

    @property
    def running(self) -> DaemonProcess:
        assert self.daemon is not None
        return self.daemon

    async def send(self, text: str, *, wait: bool = False) -> None:
        async with self.running.client() as client:
            if wait:
                reply = await client.send_and_wait(_DESK, text, "ann", wait_seconds=30)
                assert reply["reply"]["ok"], reply
            else:
                reply = await client.send_message(_DESK, text, "ann")
        self.sent.append(reply["id"])

    def kill(self) -> None:
        self.running.kill()
        self.running.close()

    async def restart_and_audit(self, turn: int, kill: _Kill) -> list[str]:
        """Starts the daemon again, waits for the desk to answer ``turn``; the findings
        that were not there before ``kill``."""
        await self.start()
        try:
            await self.idle_after(turn)
        except AssertionError as exc:
            raise AssertionError(f"after {kill.describe()}:\n{exc}") from None
        found = audit(read_books(self.database), self.sent)
        new, self.known = sorted(found - self.known), self.known | found
        return new

    async def idle_after(self, turn: int, within: float = 30) -> None:
        answer = f"Turn {turn} done."
        try:
            with anyio.fail_after(within):
                while True:
                    books = read_books(self.database)
                    if books.messages and books.messages[-1][1] == "assistant" \
                            and text_of(books.messages[-1][3]) == answer:
                        async with self.running.client() as client:
                            status = await client.desk(_DESK)
                        if status["state"] == "idle" and not status["queued_triggers"]:
                            return
                    await anyio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"the desk did not answer turn {turn} within {within} s:\n"
                                 f"{self.running.log()[-3000:]}") from None

    async def stop(self, last_turn: int) -> None:
        """SIGTERM; then the store, read back as a restart would, holds nothing cut off."""
        self.running.signal(signal.SIGTERM)
        assert await self.running.wait_exit(10) == 0, self.running.log()[-3000:]
        async with await Store.open(self.database) as store:
            assert await store.inbox.undelivered_operator_messages(_DESK) == []
            restored = await store.transcripts.restore_conversation(_DESK, "x")
        assert is_valid_transcript(restored.messages)
        assert restored.messages[-1].text == f"Turn {last_turn} done.", "left cut off"

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()


@dataclass
class _Kill:
    """One kill: where it landed, and what the audit found after the restart."""

    name: str
    landed: str = ""
    findings: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return "\n    ".join([f"{self.name}: {self.landed}", *self.findings])


def _report(kills: Sequence[_Kill], preface: str) -> str:
    failing = [kill for kill in kills if kill.findings]
    return (f"{len(failing)} of {len(kills)} kills break the invariants ({preface}):\n  "
            + "\n  ".join(kill.describe() for kill in failing))


def _where(requests: Sequence[RecordedRequest], killed_at: float) -> str:
    """Where in the turn a kill landed, by the model requests the server had seen."""
    requests = [request for request in requests if request.received_at <= killed_at]
    if not requests:
        return "before the turn's first model request"
    since = killed_at - requests[-1].received_at
    if since < HOLD:
        return f"{since * 1000:.0f} ms into the model's hold of reply {len(requests)}"
    return f"{(since - HOLD) * 1000:.0f} ms after model reply {len(requests)} was sent"


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def _kill_at_moments(server: ScriptedServer, folder: Path,
                           moments: Sequence[int]) -> tuple[list[_Kill], float]:
    """One state directory: a turn timed, then a turn cut by ``kill -9`` at each of
    ``moments`` (of :data:`MOMENTS` spread over the timed turn) and finished after a
    restart; the kills with their findings, and the timed turn's length."""
    server.responder = CarefulTrader()
    desk = _Desk(server, folder)
    kills: list[_Kill] = []
    try:
        await desk.start()
        first, opened = len(server.requests), time.monotonic()
        await desk.send("Turn 0: buy, rest, cancel, sell.", wait=True)
        duration = time.monotonic() - opened
        arrivals = [0.0] + [r.received_at - opened for r in server.requests[first:]]
        assert len(arrivals) == 6, f"the plan takes 5 model rounds, not {len(arrivals) - 1}"
        desk.known = audit(read_books(desk.database), desk.sent)
        assert not desk.known, f"the uninterrupted turn breaks the invariants: {desk.known}"

        for turn, index in enumerate(moments, start=1):
            at = index / MOMENTS * duration
            anchor = max(k for k, arrival in enumerate(arrivals) if arrival <= at)
            before, base, opened = read_books(desk.database), len(server.requests), \
                time.monotonic()
            await desk.send(f"Turn {turn}: buy, rest, cancel, sell.")
            with anyio.fail_after(20):
                while len(server.requests) < base + anchor:  # noqa: ASYNC110
                    await anyio.sleep(0.001)
            start = opened if anchor == 0 else server.requests[base + anchor - 1].received_at
            await anyio.sleep(max(0.0, start + at - arrivals[anchor] - time.monotonic()))
            killed_at = time.monotonic()
            desk.kill()
            books = read_books(desk.database)
            kill = _Kill(f"moment {index} ({index}/{MOMENTS} of the turn, {at * 1000:.0f} ms)",
                         f"{_where(server.requests[base:], killed_at)}; stored last: "
                         f"{stored_last(books)}; books: {changes(before, books) or 'as before'}")
            kills.append(kill)
            kill.findings = await desk.restart_and_audit(turn, kill)
        await desk.stop(len(moments))
    finally:
        desk.close()
    return kills, duration


@pytest.mark.timeout(300)
async def test_kill_9_at_20_moments_of_an_order_turn_keeps_transcript_and_books_equal(
        scripted_server: ScriptedServer) -> None:
    # Two state directories, each with its own server, take every other moment side by
    # side: a restart is mostly the daemon's start, and two of them share the two cores.
    kills: dict[int, tuple[list[_Kill], float]] = {}
    with ScriptedServer() as other_server, short_dir() as first, short_dir() as second:

        async def lane(number: int, server: ScriptedServer, folder: Path) -> None:
            kills[number] = await _kill_at_moments(server, folder, range(number, MOMENTS, 2))

        async with anyio.create_task_group() as group:
            group.start_soon(lane, 0, scripted_server, first)
            group.start_soon(lane, 1, other_server, second)
    every = sorted([*kills[0][0], *kills[1][0]], key=lambda kill: int(kill.name.split()[1]))
    assert len(every) == MOMENTS
    timed = ", ".join(f"{duration * 1000:.0f} ms" for _, duration in kills.values())
    assert not any(kill.findings for kill in every), _report(
        every, f"the timed turns took {timed}")


@pytest.mark.timeout(120)
async def test_kill_9_after_each_order_took_effect_and_before_its_result_was_stored(
        scripted_server: ScriptedServer, folder: Path) -> None:
    hold = threading.Event()
    script = CarefulTrader(research_hold=hold)
    scripted_server.responder = script
    desk = _Desk(scripted_server, folder)
    wanted = {"buy": "market buy closed", "rest": "limit buy open",
              "cancel": "limit buy canceled", "sell": "market sell closed"}
    kills: list[_Kill] = []
    try:
        await desk.start()
        for turn, step in enumerate(STEPS, start=1):
            hold.clear()
            script.research_asked.clear()
            before = read_books(desk.database)
            await desk.send(f"Turn {turn}: buy, rest, cancel, sell; research beside the {step}.")
            with anyio.fail_after(20):
                while not (script.research_asked.is_set() and any(  # noqa: ASYNC110
                        change.endswith(wanted[step])
                        for change in changes(before, read_books(desk.database)))):
                    await anyio.sleep(0.005)
            desk.kill()
            hold.set()  # the killed daemon's subagent request ends; nothing else is held
            books = read_books(desk.database)
            kill = _Kill(f"the {step}", f"stored last: {stored_last(books)}; books: "
                                        f"{changes(before, books)}")
            kills.append(kill)
            call = "cancel_order" if step == "cancel" else "place_order"
            assert stored_last(books) == f"assistant ({call}, delegate)", \
                f"the kill missed the moment it aims at: {kill.landed}"
            (call_id,) = [b["id"] for b in books.messages[-1][3]
                          if b["type"] == "tool_use" and b["name"] == call]
            kill.findings = await desk.restart_and_audit(turn, kill)
            # The restore looked the cut-off order call up: a definite answer, not a guess.
            answer = result_of(read_books(desk.database), call_id)
            if "may or may not" in answer or "looked up after the restart" not in answer.lower():
                kill.findings.append(f"the restore did not look {call} up: {answer!r}")
        await desk.stop(len(STEPS))
    finally:
        hold.set()
        desk.close()
    assert not any(kill.findings for kill in kills), _report(
        kills, "each order took effect in the books, its result was not stored yet")
