"""How long a restarting daemon takes to restore its desks: 100 desks of 1,000 messages each.

The store is filled first, out of the timing, through its own write API, as the daemon fills
it: messages appended to a ``Conversation`` whose observer is
``store.transcripts.observer`` (so each is stored with its turn, and a compaction through
``Conversation.compact``), operator messages
with ``add_operator_message`` before they are delivered, events with ``append_events``; the
desks are written side by side, so the group commit batches them. What is written is what
desks that ran for weeks leave behind. Each desk's turns open with ticks, candle closes,
schedules and operators' messages (some arrive mid-turn, as steering); the model calls tools
(ticker, order book, candles as a table, balances and positions, orders, its memory) and
reads their results; now and then it looks at a chart (a real PNG from ``render_chart_png``,
distinct for each desk); two compactions took the oldest ``--compacted`` messages out of its
window, and ``--messages`` are still in it, so a restore reads that many. The events the bus
published for every turn are stored too, as the daemon stores them (a restore does not read
them, but they make the file the size it is). A ``kill -9`` also leaves its marks: one desk
in twenty was cut off in the middle of a tool round, one in twenty had a trigger nobody
answered, and one in ten has operator messages that never reached it (one with a picture).

Timed: what the daemon does at start for those desks (``app.services.open_daemon``, then
``Supervisor.run`` until every desk is ready): open the store, read the highest event id,
build the desks (AgentLoop, mailbox, Desk, as ``bench/desks_scale.py`` builds them) and run
them until each has read its hold, restored its conversation (the latest summary and the
messages after it, pictures included; a cut-off turn repaired, answered and a notice stored)
and queued its undelivered operator messages. The exchanges, feeds and model servers the
application layer also opens are left out. A desk owed a turn (a resume, an operator's
message) starts it once every desk has restored, as in the daemon, against the scripted
OpenAI-compatible server (its own process, answering after 50 ms).

Each run restores a fresh copy of the same file (a restore stores what it repairs). The first
is cold-ish: the copy's pages are written out and dropped from the page cache
(``posix_fadvise(DONTNEED)``; the Python modules stay warm); then ``--repeats`` runs with the
page cache warm, whose median and max are the figures. The reference, in the same process and
on the same copy, after each restore: a plain ``sqlite3`` read of every row of the messages
table and every picture (``SELECT ... fetchall()``, nothing decoded), so the ratio says what
a restore costs over reading its bytes.

Bar (the issue): 100 desks with 1,000 messages each restored in at most 2 s on two cores.
``--profile`` adds one warm restore under cProfile (SQLite calls run inline for it, so the
worker thread's work is in the profile) and prints where the time goes.

Run: ``.venv/bin/python bench/restart.py [--desks 100] [--messages 1000] [--repeats 5]
[--profile]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import platform
import pstats
import random
import shutil
import sqlite3
import statistics
import struct
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import anyio
import structlog

from desks_scale import build_desk, scripted_model  # the same desks and model server
from trading_agent.agent.conversation import (
    ContentBlock,
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    Event,
    ModelRequest,
    SteeringDelivered,
    ToolCallStarted,
    ToolResultReady,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.blocking import blocking_inline
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.store.store import Store, database_path
from trading_agent.tools.charts import render_chart_png
from trading_agent.tools.text import candles_table, format_time
from trading_agent.trading.exchange import Candle
from trading_agent.trading.formatting import format_amount, format_percent, format_price
from trading_agent.trading.replay import load_candles_csv

ROOT = Path(__file__).resolve().parents[1]
CANDLES_CSV = ROOT / "src" / "trading_agent" / "data" / "BTC_USDT-5m.csv"
SYMBOL = "BTC/USDT"
BAR_SECONDS = 2.0
CONTEXT_WINDOW = 1_000_000
"""Large enough that a resumed turn never compacts first: what is timed is the restore, not
a summary the model would write."""
CHARTS = 8
"""Charts rendered for real; each desk's pictures are these with a text chunk of their own,
so every desk stores pictures of its own at the size a real chart has."""
TOOL_COUNT = 14
"""The tools a desk has, as its model_request events tell."""
_FIRST_CANDLE = 300
"""The replay's first candle for a desk: a day of candles before it (the 24h change)."""
_EVENT_BATCH = 500
"""Events written at a time, as the store's subscription writes them."""

# --------------------------------------------------------------------------- the data


@dataclass
class _Turn:
    """One turn as the store keeps it: its id, the operator messages stored before it
    (delivered by its messages), its messages, and the events the bus published for it."""

    turn_id: str
    messages: list[Message]
    events: list[Event]
    operator: list[SteeringMessage] = field(default_factory=list)


def _with_text_chunk(png: bytes, text: str) -> bytes:
    """The PNG with a ``tEXt`` chunk before its ``IEND``: still a valid picture, other bytes."""
    data = b"Comment\x00" + text.encode()
    chunk = (struct.pack(">I", len(data)) + b"tEXt" + data
             + struct.pack(">I", zlib.crc32(b"tEXt" + data)))
    return png[:-12] + chunk + png[-12:]


_Call = tuple[str, dict[str, object], list[TextBlock | ImageBlock]]
"""A tool call: its tool, its arguments, and its result's blocks."""


class _DeskHistory:
    """Makes one desk's turns, one after the other, on the replayed candles."""

    def __init__(self, desk: str, index: int, candles: list[Candle], rows: list[str],
                 charts: list[bytes], start: float) -> None:
        self.desk = desk
        self.index = index
        self.rng = random.Random(index)
        self.candles = candles
        self.rows = rows
        self.charts = charts
        self.position = self.rng.randrange(_FIRST_CANDLE, len(candles))
        self.start = start
        self.at = start + self.rng.uniform(0, 300)
        self.pictures = 0
        self.window_messages = 0
        """Messages since the turn started, as a model request would count them."""

    # ---------------------------------------------------------------- helpers

    def hex_id(self, bits: int = 96) -> str:
        return f"{self.rng.getrandbits(bits):0{bits // 4}x}"

    def _candle(self, back: int = 0) -> Candle:
        return self.candles[self.position - back]

    def event_id(self, at: float) -> int:
        """An id increasing with time across desks, as the bus's are (with gaps, as the
        skipped text deltas leave), without numbering every desk's events in one pass."""
        return round((at - self.start) * 1000) * 1024 + self.index

    def picture(self, title: str) -> ImageBlock:
        self.pictures += 1
        png = _with_text_chunk(self.rng.choice(self.charts), f"{self.desk} #{self.pictures}")
        return ImageBlock(png, "image/png", title)

    def _ticker(self) -> str:
        candle, day_ago = self._candle(), self._candle(288)
        change = candle.close / day_ago.close - 1
        return (f"{SYMBOL} last {format_price(candle.close)}; bid "
                f"{format_price(candle.close - Decimal('0.1'))} / ask "
                f"{format_price(candle.close + Decimal('0.1'))}; 24h {format_percent(change)}, "
                f"volume {format_amount(candle.volume * 288)} BTC; at "
                f"{format_time(candle.opened_at)}")

    def _order_book(self) -> str:
        middle = self._candle().close
        lines = [f"{SYMBOL} order book at {format_time(self._candle().opened_at)}",
                 "asks, best last:"]
        lines += [f"  {format_price(middle + Decimal(step) / 2)}  "
                  f"{format_amount(Decimal(self.rng.randrange(1, 4000)) / 1000)}"
                  for step in range(10, 0, -1)]
        lines.append("bids, best first:")
        lines += [f"  {format_price(middle - Decimal(step) / 2)}  "
                  f"{format_amount(Decimal(self.rng.randrange(1, 4000)) / 1000)}"
                  for step in range(1, 11)]
        lines.append(f"spread {format_price(Decimal(1))} (0.6 bps), mid {format_price(middle)}")
        return "\n".join(lines)

    def _candles(self, limit: int) -> str:
        first_index = self.position - limit + 1
        window = self.candles[first_index:self.position + 1]
        table = (self.rows[0], *self.rows[first_index + 1:self.position + 2])  # header first
        first, last = window[0], window[-1]
        return (f"{SYMBOL} 5m: {limit} candles from {format_time(first.opened_at)} to "
                f"{format_time(last.opened_at)} (open times, UTC). Close "
                f"{format_price(last.close)}, change {format_percent(last.close / first.open - 1)}"
                f", high {format_price(max(c.high for c in window))}, low "
                f"{format_price(min(c.low for c in window))}.\n"
                + "\n".join(table))

    def _account(self) -> list[str]:
        price = self._candle().close
        entry = format_price(price * Decimal("0.99"))
        held = Decimal(self.rng.randrange(0, 50)) / 100
        return [f"USDT: free {format_amount(Decimal(10_000) - held * price)}, used "
                f"{format_amount(Decimal(0))}, total {format_amount(Decimal(10_000))}\n"
                f"BTC: free {format_amount(held)}, used 0, total {format_amount(held)}",
                f"{SYMBOL}: long {format_amount(held)} BTC, entry {entry}"
                f", mark {format_price(price)}, unrealized "
                f"{format_amount(held * price / 100, 'USDT')}" if held else "No open positions.",
                "No open orders."]

    def _answer(self) -> str:
        candle = self._candle()
        move = candle.close / self._candle(12).close - 1
        parts = [f"{SYMBOL} is at {format_price(candle.close)}, {format_percent(move)} over the "
                 "last hour.",
                 "The book is balanced within 10 levels and volume is near its daily average, "
                 "so the move has no follow-through yet." if self.rng.random() < 0.5 else
                 "Bids thinned out under the last low; a break below it would open the way to "
                 "the previous session's range.",
                 f"EMA 20 is {'above' if move > 0 else 'below'} EMA 50 on the 5m chart."]
        if self.rng.random() < 0.6:
            parts.append("No trade: the setup does not meet the entry rules (a close beyond "
                         "the range with volume at least 1.5x its average). I keep watching "
                         f"{format_price(candle.high)} and {format_price(candle.low)}.")
        return " ".join(parts)

    # ---------------------------------------------------------------- one turn

    def _trigger(self, kind: str, at: float) -> tuple[Trigger, list[SteeringMessage]]:
        """What opens the turn, and the operator's message it comes from (if one)."""
        if kind == "operator":
            question = self.rng.choice([
                "What is your view on BTC for the next few hours?",
                "Cut the position size in half for today, volatility is too high.",
                "Why did you not buy the dip at the last low?"])
            message = SteeringMessage(question, source="alice", queued_at=at - 1,
                                      id=self.hex_id(128))
            return message.to_trigger(), [message]
        close = self._candle().close
        if kind == "candle":
            return Trigger(kind="candle", text=f"The 5m candle closed at {format_price(close)}.",
                           source=SYMBOL, at=at, id=self.hex_id(128)), []
        if kind == "schedule":
            return Trigger(kind="schedule", source="hourly-review", at=at, id=self.hex_id(128),
                           text="Hourly review: positions, open orders and the day's result."), []
        move = format_percent(close / self._candle(6).close - 1)
        return Trigger(kind="tick", source=SYMBOL, at=at, id=self.hex_id(128),
                       text=f"{SYMBOL} moved {move} to {format_price(close)} since the desk "
                            "last looked."), []

    def _rounds(self, kind: str) -> list[list[_Call]]:
        """The tool calls of each round of a turn of ``kind``, with their results."""
        if kind == "operator":
            return [[("get_positions", {}, [TextBlock(self._account()[1])])]] \
                if self.rng.random() < 0.5 else []
        if kind in ("tick", "steering"):
            limit = self.rng.choice((24, 48, 96))
            return [[("get_order_book", {"symbol": SYMBOL, "depth": 10},
                      [TextBlock(self._order_book())])],
                    [("get_candles", {"symbol": SYMBOL, "timeframe": "5m", "limit": limit},
                      [TextBlock(self._candles(limit))])]]
        if kind == "candle":
            return [[("get_ticker", {"symbol": SYMBOL}, [TextBlock(self._ticker())])]]
        if kind == "schedule":
            balance, positions, orders = self._account()
            return [[("get_balance", {}, [TextBlock(balance)]),
                     ("get_positions", {}, [TextBlock(positions)]),
                     ("list_open_orders", {"symbol": SYMBOL}, [TextBlock(orders)])]]
        if kind == "chart":
            last = format_time(self._candle().opened_at)
            return [[("render_chart", {"symbol": SYMBOL, "timeframe": "5m", "limit": 120},
                      [TextBlock(f"Chart of {SYMBOL} 5m, 120 candles to {last}: last "
                                 f"{format_price(self._candle().close)}."),
                       self.picture(f"{SYMBOL} 5m candlestick chart to {last}")])]]
        price = self._candle().close  # an order
        filled = (f"paper-{self.hex_id(32)}: buy limit 0.05 BTC on {SYMBOL} @ "
                  f"{format_price(price)}, closed, filled 0.05 at {format_price(price)}, fee "
                  "0.00005 BTC")
        return [[("get_candles", {"symbol": SYMBOL, "timeframe": "15m", "limit": 32},
                  [TextBlock(self._candles(32))])],
                [("place_order", {"symbol": SYMBOL, "side": "buy", "type": "limit",
                                  "amount": "0.05", "price": f"{price:f}"}, [TextBlock(filled)])],
                [("remember", {"note": f"Bought 0.05 BTC at {price:f} on the range break; stop "
                                       "under the range low."}, [TextBlock("Saved to memory.")])]]

    def turn(self, kind: str) -> _Turn:
        """One turn of ``kind``: tick, candle, schedule, chart, order, operator, steering."""
        self.position += self.rng.randint(1, 3)
        if self.position >= len(self.candles):  # the replay starts over
            self.position = _FIRST_CANDLE
        self.at += self.rng.uniform(120, 900)
        turn_id = self.hex_id(64)
        at = self.at
        trigger, operator = self._trigger(kind, at)
        rounds = self._rounds(kind)
        messages = [trigger.to_message()]
        events: list[Event] = [TurnStarted(desk=self.desk, turn=turn_id, at=at,
                                           id=self.event_id(at), trigger_kind=trigger.kind,
                                           trigger_text=trigger.text)]
        step = 0.0

        def later() -> float:
            nonlocal step
            step += self.rng.uniform(0.5, 4.0)
            return at + step

        for number, calls in enumerate(rounds, start=1):
            events.append(self._request(turn_id, later(), number, len(messages)))
            uses = [ToolUseBlock(f"call_{self.hex_id()}", name, json.dumps(arguments))
                    for name, arguments, _ in calls]
            thought = self.rng.choice(["Checking the market first.", "Let me look closer.", ""])
            head: tuple[ContentBlock, ...] = (TextBlock(thought),) if thought else ()
            messages.append(Message(role="assistant", content=(*head, *uses),
                                    created_at=later()))
            events.append(self._usage(turn_id, later(), len(messages)))
            results = []
            for use, (_, _, output) in zip(uses, calls, strict=True):
                when = later()
                events.append(ToolCallStarted(desk=self.desk, turn=turn_id, at=when,
                                              id=self.event_id(when), call_id=use.id,
                                              name=use.name, arguments=use.arguments))
                text = "\n".join(b.text for b in output if isinstance(b, TextBlock))
                when = later()
                events.append(ToolResultReady(
                    desk=self.desk, turn=turn_id, at=when, id=self.event_id(when),
                    call_id=use.id, name=use.name,
                    text=text, is_error=False, duration=self.rng.uniform(0.01, 0.4),
                    image_count=sum(isinstance(b, ImageBlock) for b in output)))
                results.append(ToolResultBlock(use.id, tuple(output)))
            messages.append(Message(role="user", kind="tool_results", content=tuple(results),
                                    created_at=later()))
            if kind == "steering" and number == 1:
                steering = SteeringMessage("Keep an eye on the 16,800 level, a large seller "
                                           "sits there.", source="bob", queued_at=later(),
                                           id=self.hex_id(128))
                operator.append(steering)
                messages.append(steering.to_message())
                when = later()
                events.append(SteeringDelivered(desk=self.desk, turn=turn_id, at=when,
                                                id=self.event_id(when), text=steering.text,
                                                queued_at=steering.queued_at,
                                                after_round=number, message_id=steering.id))
        final = self._answer()
        events.append(self._request(turn_id, later(), len(rounds) + 1, len(messages)))
        messages.append(Message(role="assistant", content=(TextBlock(final),),
                                created_at=later()))
        events.append(self._usage(turn_id, later(), len(messages)))
        when = later()
        events.append(TurnEnded(desk=self.desk, turn=turn_id, at=when, id=self.event_id(when),
                                rounds=len(rounds) + 1, hit_round_limit=False, final_text=final,
                                input_tokens=40_000 * (len(rounds) + 1),
                                output_tokens=120 * (len(rounds) + 1), cost=None))
        self.at = at + step
        return _Turn(turn_id, messages, events, operator)

    def _request(self, turn: str, at: float, number: int, count: int) -> ModelRequest:
        return ModelRequest(desk=self.desk, turn=turn, at=at, id=self.event_id(at), round=number,
                            message_count=self.window_messages + count, tool_count=TOOL_COUNT,
                            estimated_tokens=40_000, image_count=min(self.pictures, 4))

    def _usage(self, turn: str, at: float, count: int) -> UsageReported:
        return UsageReported(desk=self.desk, turn=turn, at=at, id=self.event_id(at),
                             input_tokens=40_000,
                             output_tokens=self.rng.randrange(20, 300), estimated=False,
                             cost=None, context_tokens=40_300, context_window=CONTEXT_WINDOW,
                             cached_input_tokens=36_000)

    def next_kind(self) -> str:
        return self.rng.choices(
            ["tick", "candle", "schedule", "chart", "order", "operator", "steering"],
            weights=[36, 22, 10, 2, 8, 14, 8])[0]

    def summary(self, number: int) -> Message:
        """A compaction's summary, as long as the compressor's (about 1,200 tokens)."""
        lines = [f"[Summary of the conversation so far, compaction {number}]",
                 "Goals: trade BTC/USDT range breaks on the 5m chart; risk 1% per trade.",
                 f"Position: long 0.05 BTC from {format_price(self._candle(40).close)}; stop "
                 f"under {format_price(self._candle(40).low)}.",
                 "Operator instructions: alice asked to halve size on volatile days; bob "
                 "flagged a large seller near 16,800."]
        lines += [f"- {format_time(self._candle(back).opened_at)}: close "
                  f"{format_price(self._candle(back).close)}, no trade, watching the range."
                  for back in range(120, 0, -6)]
        return Message(role="user", kind="summary", content=(TextBlock("\n".join(lines)),),
                       created_at=self.at)


def _cut(turn: _Turn, where: str) -> _Turn:
    """The turn as a kill -9 left it: after the first tool call (its result never stored),
    or right after its trigger; the events as far as they were stored."""
    keep = 2 if where == "tool round" else 1
    last = turn.messages[keep - 1].created_at
    events = [e for e in turn.events if e.at <= last + 1 and e.type != "turn_end"]
    return _Turn(turn.turn_id, turn.messages[:keep], events, turn.operator)


@dataclass
class Shape:
    """What the bench writes: ``desks`` desks, each ``messages`` in its window after
    ``compacted`` summarized ones."""

    desks: int
    messages: int
    compacted: int


@dataclass
class Built:
    """What the file holds."""

    messages: int = 0
    window: int = 0
    pictures: int = 0
    events: int = 0
    compactions: int = 0
    cut_off: int = 0
    pending: int = 0
    seconds: float = 0.0


def desk_name(index: int) -> str:
    return f"desk{index:03d}"


async def build_store(path: Path, shape: Shape, candles: list[Candle],
                      charts: list[bytes]) -> Built:
    """Fills the store through its own API: desks side by side, each turn after turn."""
    started = time.perf_counter()
    built = Built()
    start = datetime(2023, 1, 2, tzinfo=UTC).timestamp()
    rows = candles_table(candles).split("\n")  # formatted once: a table is its header and a slice
    store = await Store.open(path)

    async def fill(index: int) -> None:
        name = desk_name(index)
        history = _DeskHistory(name, index, candles, rows, charts, start)
        # Written as the loop writes it: appended to a conversation the store observes.
        conversation = Conversation(f"You are the desk {name}.",
                                    observer=store.transcripts.observer(name))
        written: deque[_Turn] = deque(maxlen=2)  # a compaction keeps the last two turns
        events: list[Event] = []

        async def next_turn(turn: _Turn | None = None) -> _Turn:
            turn = turn or history.turn(history.next_kind())
            for kept in turn.operator:
                await store.inbox.add_operator_message(name, kept)  # as the API does, first
            conversation.turn_id = turn.turn_id  # as the loop sets it: stored with each message
            for message in turn.messages:
                await conversation.append(message)
            built.messages += len(turn.messages)
            events.extend(turn.events)
            if len(events) >= _EVENT_BATCH:  # as the store's subscription writes them
                await store.events.append_events(events)
                built.events += len(events)
                events.clear()
            written.append(turn)
            history.window_messages += len(turn.messages)
            return turn

        async def compact(number: int) -> None:
            """Summarizes all but the last two turns."""
            kept = sum(len(turn.messages) for turn in written)
            await conversation.compact(history.summary(number),
                                       len(conversation.messages) - kept)
            history.window_messages = kept
            built.compactions += 1

        # The past: summarized by a first compaction halfway, by the second after it.
        past = 0
        while past < shape.compacted:
            past += len((await next_turn()).messages)
            if conversation.summary is None and past >= shape.compacted / 2:
                await compact(1)
        # The window: every message a restore reads.
        in_window = window_turns = 0
        cut = {0: "tool round", 10: "trigger"}.get(index % 20)
        while in_window < shape.messages - (3 if cut else 0):
            in_window += len((await next_turn()).messages)
            window_turns += 1
            if shape.compacted and window_turns == 2:
                await compact(2)  # before the window's third turn: all before it summarized
        if cut is not None:
            in_window += len((await next_turn(_cut(history.turn("tick"), cut))).messages)
            built.cut_off += 1
        await store.events.append_events(events)
        built.events += len(events)
        built.window += in_window
        built.pictures += history.pictures
        if index % 10 == 3:
            # Came in after the last turn; the daemon was killed before the desk took them.
            for number in range(1 + index % 2):
                images = ((history.picture("operator's screenshot"),)
                          if index == 3 and number == 0 else ())
                await store.inbox.add_operator_message(name, SteeringMessage(
                    "Flatten the position before the US open, please." if number == 0 else
                    "And report the day's result when done.", source="alice",
                    images=images, queued_at=history.at + 60 * (number + 1),
                    id=history.hex_id(128)))
                built.pending += 1

    async with anyio.create_task_group() as group:
        for index in range(shape.desks):
            group.start_soon(fill, index)
    await store.close()
    built.seconds = time.perf_counter() - started
    return built


def render_charts(candles: list[Candle]) -> list[bytes]:
    """A few real charts (120 candles each, their averages seeded), from spread-out spans."""
    charts = []
    for number in range(CHARTS):
        end = 200 + number * (len(candles) - 400) // CHARTS
        charts.append(render_chart_png(candles[end - 120:end], history=candles[end - 170:end - 120],
                                       title=f"{SYMBOL} · 5m · paper"))
    return charts


# --------------------------------------------------------------------------- the restore


@dataclass
class Restore:
    """One restart's figures."""

    seconds: float
    cpu_seconds: float
    """CPU time of this process (every thread) over the same span: what a loaded machine
    inflates less than the wall time."""
    open_seconds: float
    messages: int
    turns_owed: int


async def restore(path: Path, desks: int, base_url: str) -> Restore:
    """Starts the desks on the file as a restarting daemon does, until every one is ready."""
    started, cpu_started = time.perf_counter(), time.process_time()
    store = await Store.open(path)
    bus = EventBus(first_id=await store.events.last_event_id() + 1)
    opened = time.perf_counter()
    recorded = bus.subscribe("store", max_buffer=50_000)
    backend = OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=base_url, model="scripted-model", context_window=CONTEXT_WINDOW))
    started_desks = [build_desk(desk_name(i), store, bus, backend,
                                 context_window=CONTEXT_WINDOW) for i in range(desks)]
    supervisor = Supervisor([DeskRuntime(desk) for desk in started_desks], bus, store)
    async with anyio.create_task_group() as group:
        group.start_soon(store.events.persist_events, recorded)
        await group.start(supervisor.run)  # returns once every desk has restored
        ready, cpu_ready = time.perf_counter(), time.process_time()
        messages = sum(len(desk.conversation.messages) for desk in started_desks
                       if desk.conversation is not None)
        owed = sum(desk.turns > 0 or desk.state == "working" or len(desk.queue) > 0
                   for desk in started_desks)
        supervisor.shutdown()
        await supervisor.stopped.wait()
        recorded.close()
    await store.close()
    await backend.aclose()
    return Restore(ready - started, cpu_ready - cpu_started, opened - started, messages, owed)


def read_raw(path: Path) -> tuple[float, int, int]:
    """The reference: every message row and every picture read with plain sqlite3.

    Returns:
        Seconds, rows, and bytes of content and pictures.
    """
    started = time.perf_counter()
    connection = sqlite3.connect(path)
    rows = connection.execute(
        "SELECT seq, desk, message_id, role, kind, content, created_at, subagent_id, "
        "parent_call_id FROM messages").fetchall()
    pictures = connection.execute("SELECT sha256, media_type, data FROM images").fetchall()
    seconds = time.perf_counter() - started
    connection.close()
    size = sum(len(row[5]) for row in rows) + sum(len(row[2]) for row in pictures)
    return seconds, len(rows), size


def evict(path: Path) -> None:
    """Writes the file out and drops its pages from the page cache (not the modules')."""
    for file in (path, path.with_name(path.name + "-wal")):
        if file.exists():
            descriptor = os.open(file, os.O_RDONLY)
            try:
                os.fsync(descriptor)
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(descriptor)


def fresh_copy(built: Path, folder: Path, number: int) -> Path:
    """A copy of the built file in a state directory of its own (a restore writes to it)."""
    state = folder / f"run{number}"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(mode=0o700)
    path = database_path(state)
    shutil.copyfile(built, path)
    os.chmod(path, 0o600)
    return path


def _default_build_dir() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def profile_restore(path: Path, desks: int, base_url: str, top: int) -> float:
    """One restore under cProfile, SQLite calls inline (a profile sees one thread only)."""

    async def inline() -> Restore:
        with blocking_inline():
            return await restore(path, desks, base_url)

    profiler = cProfile.Profile()
    profiler.enable()
    figures = anyio.run(inline)
    profiler.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
        text = out.getvalue()
        print(f"--- profile, by {order} ---")
        print(text[text.find("   ncalls"):].rstrip())
    return figures.seconds


@dataclass
class Run:
    """One restart and its reference read, on one copy of the file."""

    restore: Restore
    raw_seconds: float
    raw_rows: int
    raw_bytes: int

    @property
    def ratio(self) -> float:
        return self.restore.seconds / self.raw_seconds


def measure_run(built_path: Path, folder: Path, number: int, desks: int, base_url: str, *,
                cold: bool) -> Run:
    """Restores a fresh copy, then reads it raw; when ``cold``, the reference first, each
    after the copy's pages are dropped from the page cache."""
    path = fresh_copy(built_path, folder, number)
    try:
        if cold:
            evict(path)
            gc.collect()
            raw = read_raw(path)
            evict(path)
        gc.collect()  # neither pays for the other's garbage
        figures = anyio.run(restore, path, desks, base_url)
        if not cold:
            gc.collect()
            raw = read_raw(path)
    finally:
        shutil.rmtree(path.parent)
    return Run(figures, *raw)


def report(runs: list[Run], desks: int, messages: int, profiled: float | None) -> None:
    """Prints each run, the warm median and max, and the verdict against the bar."""
    cold, warm = runs[0], runs[1:]
    print(f"each run: {cold.restore.messages:,} messages restored into {desks} desks; when all "
          f"were ready, {cold.restore.turns_owed} desks had a turn queued, running or done (a "
          "resume, an operator's message)")
    print(f"{'run':<20} {'restore':>9} {'CPU':>9} {'of it: open':>12} {'raw read':>9} "
          f"{'ratio':>7}")
    for label, run in [("cold-ish (evicted)", cold),
                       *((f"warm {number}", run) for number, run in enumerate(warm, start=1))]:
        print(f"{label:<20} {run.restore.seconds:>7.3f} s {run.restore.cpu_seconds:>7.3f} s "
              f"{run.restore.open_seconds:>10.3f} s {run.raw_seconds:>7.3f} s {run.ratio:>6.1f}x")
    seconds = [run.restore.seconds for run in warm]
    median, worst = statistics.median(seconds), max(seconds)
    cpu = statistics.median(run.restore.cpu_seconds for run in warm)
    print(f"warm, {len(warm)} runs: restore median {median:.3f} s (CPU {cpu:.3f} s), max "
          f"{worst:.3f} s; raw read "
          f"of {warm[0].raw_rows:,} rows ({warm[0].raw_bytes / 2**20:.0f} MiB of content and "
          f"pictures) median {statistics.median(run.raw_seconds for run in warm):.3f} s; "
          f"restore / raw read {statistics.median(run.ratio for run in warm):.1f}x")
    if profiled is not None:
        print(f"profiled restore (SQLite inline, under cProfile): {profiled:.3f} s")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"load average at the end {load} (above 2 the restores shared the cores)")
    print(f"{desks} desks x {messages:,} messages restored: warm median {median:.2f} s, max "
          f"{worst:.2f} s (bar: at most {BAR_SECONDS:g} s on two cores) -> "
          f"{'PASS' if worst <= BAR_SECONDS else 'FAIL'}; cold-ish {cold.restore.seconds:.2f} s"
          f" -> {'PASS' if cold.restore.seconds <= BAR_SECONDS else 'FAIL'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--desks", type=int, default=100)
    parser.add_argument("--messages", type=int, default=1000,
                        help="messages per desk in the window a restore reads")
    parser.add_argument("--compacted", type=int, default=100,
                        help="messages per desk summarized by two compactions before them")
    parser.add_argument("--repeats", type=int, default=5, help="warm runs")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one warm restore and print where the time goes")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the restored copies go (a temporary folder by default)")
    parser.add_argument("--build-dir", type=Path, default=_default_build_dir(),
                        help="where the file is built, then copied from (/dev/shm by default: "
                             "the build's fsyncs cost nothing there; the copies are on disk)")
    args = parser.parse_args()
    # The figures only: each cut-off desk logs a turn_interrupted warning, the data's intent.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}; "
          f"load average {load}", flush=True)
    profiled = None
    with scripted_model() as base_url, \
            tempfile.TemporaryDirectory(prefix="restart-", dir=args.state_dir) as copies, \
            tempfile.TemporaryDirectory(prefix="restart-", dir=args.build_dir) as building:
        folder, built_path = Path(copies), Path(building) / "built.sqlite3"
        candles = load_candles_csv(CANDLES_CSV, SYMBOL)
        shape = Shape(args.desks, args.messages, args.compacted)
        built = anyio.run(build_store, built_path, shape, candles, render_charts(candles))
        print(f"store: {built_path.stat().st_size / 2**20:.0f} MiB, built in "
              f"{built.seconds:.1f} s (not timed), restored from copies in {folder}: "
              f"{args.desks} desks, {built.messages:,} messages, {built.window:,} of them "
              f"after the latest compaction ({built.window / args.desks:.0f} a desk), "
              f"{built.compactions} compactions, {built.pictures} pictures, "
              f"{built.events:,} events; {built.cut_off} desks cut off mid-turn, "
              f"{built.pending} operator messages undelivered", flush=True)
        runs = [measure_run(built_path, folder, number, args.desks, base_url,
                            cold=number == 0) for number in range(args.repeats + 1)]
        if args.profile:
            path = fresh_copy(built_path, folder, args.repeats + 1)
            profiled = profile_restore(path, args.desks, base_url, top=30)
    report(runs, args.desks, args.messages, profiled)


if __name__ == "__main__":
    main()
