"""A backtest: one desk run over historical candles, exactly as the daemon runs it.

The desk is built as the daemon builds it (:func:`~trading_agent.desks.building.build_desk`):
the same :class:`~trading_agent.agent.agent_loop.AgentLoop`, tools, risk policy, compressor,
image preparer, market watcher and schedules, on the paper exchange with its fees and
slippage. What differs is only who moves time:

- **One simulated clock.** The replay feed's time is the only clock of the feed, the exchange,
  the tools, the charts, the schedules, the desk and its store. The feed is given no candle
  after the span's end, and shows none after its cursor.
- **Step by step.** The engine publishes one candle step, lets the paper exchange match
  waiting orders and the risk policy record the day, fires the desk's triggers (ticks, candle
  closes, schedules, scripted operator messages), and runs the desk's queued turns to the end
  before the next step: the clock stands still while the desk thinks, and the run goes as
  fast as the model answers.
- **No look-ahead in fills.** The paper exchange runs with ``market_fill = "next_open"``: a
  market order decided at a close fills at the next candle's open, slipped and charged; a
  limit order fills only on a later candle that trades through it.
- **Deterministic.** Turn ids are numbered, so client order ids (and every tool result that
  names them) are the same on a re-run; with the response cache the whole run is.
- **Nobody to approve.** Orders that pass the risk limits are not held for an operator.

The run produces a :class:`~trading_agent.backtest.record.BacktestRecord`; the figures and the
report are computed from it elsewhere. Its trades and fills are the desk's own books, which
the venue keeps on the way through its exchange as it does for a running desk: one round trip
per position opened and closed, one fill per paper fill (and an opening fill for what the
paper account held at the start, turn ``start``).
"""

from __future__ import annotations

import bisect
import itertools
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import structlog

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    Event,
    ModelRequest,
    SteeringDelivered,
    TextDelta,
    ToolCallStarted,
    ToolResultReady,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.agent.trigger import Trigger
from trading_agent.backtest.cache import CacheMode, ResponseCache, sampling_of
from trading_agent.backtest.candles import (
    cached_candles_path,
    candles_in_span,
    default_data_dir,
    load_history_csv,
)
from trading_agent.backtest.concurrency import BoundedModel, ModelSlots
from trading_agent.backtest.cutoff import seen_notice
from trading_agent.backtest.mask import Mask, MaskedModel
from trading_agent.backtest.mcp_replay import McpReplay, recordings_path
from trading_agent.backtest.record import (
    BacktestRecord,
    Decision,
    EquityPoint,
    FillRecord,
    ModelUsage,
    TranscriptEntry,
    TranscriptSpool,
)
from trading_agent.blocking import blocking_inline
from trading_agent.desks.building import DeskParts, ModelBackends, build_desk
from trading_agent.errors import ConfigError
from trading_agent.settings import DeskSettings, Settings
from trading_agent.settings.model import knowledge_cutoff
from trading_agent.store.store import Store
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.booked_exchange import STARTING_TURN
from trading_agent.trading.books import BookFill, BookPosition, RoundTrip, apply_fill
from trading_agent.trading.config import ExchangeConfig
from trading_agent.trading.exchange import Candle, client_order_id_for, timeframe_delta
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.valuation import value_account

__all__ = ["BacktestSpec", "Progress", "ScriptedMessage", "default_cache_dir",
           "load_scripted_messages", "paper_exchange", "run_backtest", "scratch_folder",
           "span_notice"]

_log = structlog.get_logger(__name__)

_EVENTS_BUFFER = 1_000_000
"""The recorder's subscription is drained after every step; this only bounds a runaway."""

_RECORDED = (TurnStarted, TurnEnded, TextDelta, ToolCallStarted, ToolResultReady,
             SteeringDelivered, ModelRequest, UsageReported)


@dataclass(frozen=True)
class ScriptedMessage:
    """An operator message a backtest sends at a simulated time.

    Attributes:
        at: When (the first step closing at or after it delivers it).
        text: What the operator says.
    """

    at: datetime
    text: str


@dataclass(frozen=True)
class Progress:
    """Where a running backtest is, for a progress bar.

    Attributes:
        now: The simulated time.
        start: The span's start.
        end: The span's end.
        step: Steps taken.
        steps: Steps in all.
        decisions: Turns run so far.
        equity: The account's value now.
        quote_currency: The currency of ``equity``.
        tokens: Prompt and completion tokens so far.
        model_calls: Requests that reached the model.
        cache_hits: Requests answered from the cache.
        elapsed: Wall-clock seconds since the run started.
    """

    now: datetime
    start: datetime
    end: datetime
    step: int
    steps: int
    decisions: int
    equity: Decimal
    quote_currency: str
    tokens: int
    model_calls: int
    cache_hits: int
    elapsed: float


@dataclass(frozen=True)
class BacktestSpec:
    """What to run.

    Attributes:
        settings: The validated settings of the config file.
        desk: The desk to run.
        start: The span's start (aware, UTC).
        end: The span's end.
        cache_mode: ``record``, ``strict`` or ``off``.
        cache_dir: Where the response cache lives.
        data: CSV files by symbol, instead of the desk's own candles.
        data_dir: Where ``trading-agent data fetch`` keeps candles (for desks on a ccxt feed).
        messages: Operator messages to send during the run.
        environ: Where secrets are read from (the model's API key).
        source: The config file, named in messages.
        mask: The view the desk reads its market through (:mod:`.mask`); None for the
            real market.
        concurrency: At most this many model calls in flight across every process of the
            run, 429s waited out (:mod:`.concurrency`); None for no bound.
    """

    settings: Settings
    desk: str
    start: datetime
    end: datetime
    cache_mode: CacheMode = "record"
    cache_dir: Path | None = None
    data: Mapping[str, Path] = field(default_factory=dict)
    data_dir: Path | None = None
    messages: Sequence[ScriptedMessage] = ()
    environ: Mapping[str, str] | None = None
    source: str = "the config"
    mask: Mask | None = None
    concurrency: int | None = None


BackendFactory = Callable[[DeskSettings, AsyncExitStack], Awaitable[ModelBackend]]
"""Builds a desk's model (the daemon's own by default; a benchmark passes one in process)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/trading-agent/responses``, else ``~/.cache/trading-agent/responses``."""
    return default_data_dir().parent / "responses"


def desk_settings(spec: BacktestSpec) -> DeskSettings:
    """The desk to run, refused when unknown or live.

    Raises:
        ConfigError: No such desk, or a desk in live mode.
    """
    desks = spec.settings.desks
    config = desks.get(spec.desk)
    if config is None:
        raise ConfigError(f"{spec.source}: no desk named {spec.desk!r}; the desks are "
                          f"{', '.join(desks) or 'none'}")
    if config.exchange.mode == "live":
        raise ConfigError(
            f"{spec.source}: desks.{spec.desk}.exchange.mode is \"live\": a backtest never "
            "reaches a live exchange; copy the config with mode = \"paper\" to backtest it")
    return config


def span_notice(spec: BacktestSpec, config: DeskSettings) -> str | None:
    """The notice for a span the desk's model may have seen in training
    (:mod:`.cutoff`), or None when it starts after the model's ``knowledge_cutoff`` or the
    model has none."""
    return seen_notice(spec.start, knowledge_cutoff(config.model),
                       getattr(config.model, "knowledge_cutoff", None),
                       masked=spec.mask is not None)


def load_history(spec: BacktestSpec, config: DeskSettings) -> tuple[dict[str, list[Candle]],
                                                                     str]:
    """Each symbol's candles up to the span's end, with the warm-up history before it.

    The warm-up is the desk's replay ``start_offset`` (one day by default), or what the
    data has before the start when that is less.

    Returns:
        The candles by symbol, and their timeframe.

    Raises:
        ConfigError: A file is missing or malformed, the span lies outside the data.
    """
    replay = config.exchange.replay
    timeframe = replay.timeframe
    try:
        timeframe_delta(timeframe)
    except ValueError as exc:
        raise ConfigError(f"{spec.source}: desks.{spec.desk}.exchange.replay.timeframe: "
                          f"{exc}") from None
    series: dict[str, list[Candle]] = {}
    for symbol in config.symbols:
        path = _source(spec, config, symbol, timeframe)
        candles = load_history_csv(path, symbol, timeframe)
        span, _ = candles_in_span(candles, spec.start, spec.end, source=str(path))
        begin = bisect.bisect_left([c.opened_at for c in candles], span[0].opened_at)
        series[symbol] = [*candles[max(0, begin - replay.start_offset):begin], *span]
    return series, timeframe


def _source(spec: BacktestSpec, config: DeskSettings, symbol: str, timeframe: str) -> Path:
    if symbol in spec.data:
        return spec.data[symbol]
    exchange = config.exchange
    if exchange.feed == "replay":
        path = exchange.replay.files.get(symbol)
        if path is None:
            raise ConfigError(
                f"{spec.source}: desks.{spec.desk} trades {symbol} but "
                f"exchange.replay.files has no file for it (it has "
                f"{', '.join(exchange.replay.files)}); add one, or pass --data "
                f"{symbol}=FILE")
        return Path(path)
    assert exchange.ccxt is not None  # ExchangeConfig validates this
    cached = cached_candles_path(spec.data_dir or default_data_dir(),
                                 exchange.ccxt.exchange_id, symbol, timeframe)
    if not cached.exists():
        day = timedelta(days=1)
        raise ConfigError(
            f"no candles of {symbol} {timeframe} from {exchange.ccxt.exchange_id} in "
            f"{cached.parent}; fetch them first: trading-agent data fetch "
            f"{exchange.ccxt.exchange_id} {symbol} {timeframe} --from "
            f"{(spec.start - day).date().isoformat()} --to {spec.end.date().isoformat()}")
    return cached


def load_scripted_messages(path: Path) -> list[ScriptedMessage]:
    """Reads operator messages to replay: one per line, ``TIME TEXT`` (ISO 8601 time, UTC
    when it has no offset, then the message), oldest first; blank lines and lines starting
    with ``#`` are skipped; ``\\n`` in the text is a line break.

    Raises:
        ConfigError: The file cannot be read, or a line has no valid time or no text.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the operator messages: {exc}") from exc
    messages: list[ScriptedMessage] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        moment, _, text = line.strip().partition(" ")
        try:
            at = parse_time(moment)
        except ValueError:
            raise ConfigError(f"{path}:{number}: a line is TIME TEXT with an ISO 8601 time "
                              f"(2023-01-05T14:00); found {moment!r}") from None
        if not text.strip():
            raise ConfigError(f"{path}:{number}: no message after the time")
        if messages and at < messages[-1].at:
            raise ConfigError(f"{path}:{number}: the messages must be in time order")
        messages.append(ScriptedMessage(at, text.strip().replace("\\n", "\n")))
    return messages


def parse_time(text: str) -> datetime:
    """An ISO 8601 date or time, UTC when it has no offset.

    Raises:
        ValueError: Not a date or time.
    """
    moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


async def run_backtest(spec: BacktestSpec, *,
                       backend_factory: BackendFactory | None = None,
                       on_progress: Callable[[Progress], None] | None = None) -> BacktestRecord:
    """Runs one desk over the span and returns what it did.

    Args:
        spec: What to run.
        backend_factory: Builds the desk's model; the daemon's backends by default.
        on_progress: Called after every step.

    Returns:
        The record: equity per step, trades, decisions, model usage.

    Raises:
        ConfigError: Bad input: unknown desk, live mode, data problems, a corrupt cache.
        BackendError: The model failed, or the strict cache had no answer.
    """
    config = desk_settings(spec)
    series, timeframe = load_history(spec, config)
    feed = ReplayFeed(series, timeframe=timeframe, speed=0, start=spec.start)
    # One desk on a loop of its own, its store in memory: SQLite writes run inline, not each
    # handed to a worker thread and back (blocking.py).
    with blocking_inline():
        return await _run(spec, config, feed, backend_factory, on_progress)


async def _run(spec: BacktestSpec, config: DeskSettings, feed: ReplayFeed,
               backend_factory: BackendFactory | None,
               on_progress: Callable[[Progress], None] | None) -> BacktestRecord:
    async with AsyncExitStack() as stack:
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="backtest-", dir=scratch_folder())))
        database = state / "backtest.sqlite3"
        store = await Store.open(database, clock=lambda: feed.now().timestamp())
        stack.push_async_callback(store.close)
        bus = EventBus()
        exchange_config = _paper_next_open(config.exchange)
        venue = await stack.enter_async_context(open_exchange(
            exchange_config, state=TradingStateFile(database), account=spec.desk,
            symbols=config.symbols, risk_limits=config.risk, feed=feed,
            protections=config.protections))  # on the simulated clock, in memory
        if backend_factory is None:
            backend = await ModelBackends(stack, spec.environ).get(config)
        else:
            backend = await backend_factory(config, stack)
        if spec.concurrency is not None:
            slots = ModelSlots((spec.cache_dir or default_cache_dir()) / "model-slots",
                               spec.concurrency)
            timed = _Timed(BoundedModel(backend, slots))
        else:
            timed = _Timed(backend)
        cache = ResponseCache(timed, _cache_path(spec), spec.cache_mode,
                              sampling=sampling_of(backend))
        await cache.open()
        stack.push_async_callback(cache.aclose)
        mask = spec.mask
        # MCP servers are never started: recorded answers are replayed, others refused.
        mcp = McpReplay(recordings_path(_cache_path(spec)))
        if mask is None:
            parts = await build_desk(spec.desk, config, venue, cache, stack=stack,
                                     database=database, store=store, bus=bus, approvals=None,
                                     settings=spec.settings, clock=feed.now, sleep=_no_wait,
                                     mcp_tools=mcp.register)
        else:
            # The same desk, built on the masked view of the same venue: what it reads is
            # masked, what it sends is made real before the risk policy sees it.
            parts = await build_desk(spec.desk, mask.desk_settings(config), mask.venue(venue),
                                     MaskedModel(cache, mask), stack=stack, database=database,
                                     store=store, bus=bus, approvals=None, settings=spec.settings,
                                     clock=lambda: mask.time(feed.now()), sleep=_no_wait,
                                     mcp_tools=mcp.register)
        numbers = itertools.count(1)
        parts.desk.loop.new_turn_id = lambda: f"t{next(numbers):06d}"
        run = _Run(spec, config, feed, venue, parts, cache, mcp.notices, bus.subscribe(
            "backtest", max_buffer=_EVENTS_BUFFER, accept=lambda e: isinstance(e, _RECORDED)))
        record = await run.go(on_progress)
        record.usage.model_seconds = timed.seconds
        return record


class _Run:
    """One run's moving parts and what it records."""

    def __init__(self, spec: BacktestSpec, config: DeskSettings, feed: ReplayFeed,
                 venue: TradingVenue, parts: DeskParts, cache: ResponseCache,
                 notices: Sequence[str], events: Subscription) -> None:
        self.spec = spec
        self.feed = feed
        self.venue = venue
        self.parts = parts
        self.cache = cache
        self.events = events
        self.quote = config.risk.quote_currency
        self.record = BacktestRecord(
            desk=spec.desk, model=cache.model, start=feed.now(), end=feed.now(),
            timeframe=feed.timeframe, quote_currency=self.quote, candles={},
            starting_equity=Decimal(0), masked=spec.mask is not None)
        notice = span_notice(spec, config)
        if notice is not None:
            self.record.notices.append(notice)
        self.record.notices.extend(notices)
        self.spool = TranscriptSpool()
        """Where decisions' transcripts wait for the report, out of memory."""
        self._turns: dict[str, _TurnNotes] = {}
        self._label: str | None = None
        """What woke the desk, for the turn it starts now (taken by the turn's first event)."""
        parts.desk.on_turn_start.append(self._turn_starts)
        self._messages = list(spec.messages)
        self._tokens = 0
        self._input = 0
        self._output = 0
        self._cost: float | None = None

    async def go(self, on_progress: Callable[[Progress], None] | None) -> BacktestRecord:
        desk, watcher, schedules = self.parts.desk, self.parts.watcher, self.parts.schedules
        feed = self.feed
        await desk.run_pending()  # restores the (new) conversation
        await watcher.prime()
        if schedules is not None:
            await schedules.start()
        self.record.starting_equity, _ = await self._equity()
        steps = feed.steps - 1 - feed.cursor
        started = time.perf_counter()
        span: dict[str, list[Candle]] = {symbol: [] for symbol in feed.symbols}
        for step in range(1, steps + 1):
            candles = feed.advance()
            for candle in candles:
                span[candle.symbol].append(candle)
            await watcher.take_step(candles if self.spec.mask is None
                                    else [self.spec.mask.candle(c) for c in candles])
            if schedules is not None:
                schedules.fire_due()
            await self._send_due_messages()
            await desk.run_pending()
            equity, exposure = await self._equity()
            self.record.equity.append(EquityPoint(feed.now(), equity, exposure))
            self._take_events()
            if on_progress is not None:
                on_progress(Progress(
                    now=feed.now(), start=self.record.start, end=self.spec.end, step=step,
                    steps=steps, decisions=len(self.record.decisions), equity=equity,
                    quote_currency=self.quote, tokens=self._tokens,
                    model_calls=self.cache.model_calls, cache_hits=self.cache.cache_hits,
                    elapsed=time.perf_counter() - started))
        # Orders still waiting at the end are matched against nothing more: they stay open.
        self.record.end = feed.now()
        self.record.candles = span
        self.record.trades, self.record.fills = await self._ledger()
        self.record.usage = ModelUsage(
            model_calls=self.cache.model_calls, cache_hits=self.cache.cache_hits,
            input_tokens=self._input, output_tokens=self._output, cost=self._cost)
        return self.record

    async def _send_due_messages(self) -> None:
        now = self.feed.now()
        while self._messages and self._messages[0].at <= now:
            message = self._messages.pop(0)
            text = message.text if self.spec.mask is None else self.spec.mask.text(message.text)
            await self.parts.desk.send_message(text, source="operator (scripted)")

    async def _equity(self) -> tuple[Decimal, Decimal]:
        valuation = await value_account(self.venue.exchange, self.quote)
        total = valuation.total
        if total <= 0:
            return total, Decimal(0)
        cash = valuation.by_currency.get(self.quote, Decimal(0))
        return total, (total - cash) / total

    # -- what happened ---------------------------------------------------------------------

    def _turn_starts(self, trigger: Trigger) -> None:
        self._take_events()  # what came before belongs to earlier turns
        source = f": {trigger.source}" if trigger.source else ""
        merged = f" ({trigger.merged} merged)" if trigger.merged > 1 else ""
        self._label = f"{trigger.kind}{source}{merged}"

    def _take_events(self) -> None:
        while (event := self.events.get_nowait()) is not None:
            self._note(event)

    def _note(self, event: Event) -> None:
        if isinstance(event, UsageReported):
            self._input += event.input_tokens
            self._output += event.output_tokens
            self._tokens += event.input_tokens + event.output_tokens
            if event.cost is not None:
                self._cost = (self._cost or 0.0) + event.cost
            return
        if event.turn is None or event.subagent is not None:
            return
        if isinstance(event, TurnStarted):
            if not event.silent:
                # A turn opened inside the same run_turn (a message that came as the last
                # one ended) started without the desk's hook: its kind says enough.
                label, self._label = self._label or event.trigger_kind, None
                self._turns[event.turn] = _TurnNotes(
                    self.feed.now(), label, [TranscriptEntry(
                        "operator" if event.trigger_kind == "operator" else "trigger",
                        event.trigger_text)])
            return
        notes = self._turns.get(event.turn)
        if notes is None:
            return  # the silent memory flush
        if isinstance(event, TextDelta):
            notes.text(event.text)
        elif isinstance(event, ModelRequest):
            notes.model_calls += 1
            notes.close_text()
        elif isinstance(event, ToolCallStarted):
            notes.close_text()
            notes.entries.append(TranscriptEntry("tool_call", f"{event.name}({event.arguments})"))
            if event.name == "place_order":
                cid = client_order_id_for(self.spec.desk, event.turn, event.call_id)
                notes.orders.append(cid)
        elif isinstance(event, ToolResultReady):
            notes.entries.append(TranscriptEntry("tool_result", event.text, event.is_error))
        elif isinstance(event, SteeringDelivered):
            notes.close_text()
            notes.entries.append(TranscriptEntry("operator", event.text))
        elif isinstance(event, TurnEnded):
            notes.close_text()
            self._decide(event.turn, notes, event.final_text)

    def _decide(self, turn: str, notes: _TurnNotes, final_text: str) -> None:
        self.record.decisions.append(Decision(
            index=len(self.record.decisions) + 1, at=notes.at, trigger=notes.kind,
            final_text=final_text, transcript=self.spool.add(notes.entries),
            orders=tuple(notes.orders), model_calls=notes.model_calls, turn=turn))
        notes.decision = len(self.record.decisions)
        notes.entries = []  # kept once, in the decision

    async def _ledger(self) -> tuple[list[RoundTrip], list[FillRecord]]:
        """The desk's round trips and fills from its books, at the times they filled.

        The books count a paper fill when the desk next looks at its order, at the close of
        the candle it filled on; the paper exchange knows the fill's own time (a market
        order's: the open of that candle). Both files give that time.
        """
        books = self.venue.books
        paper_fills = getattr(self.venue.exchange, "fills", None)
        assert paper_fills is not None  # the paper exchange's, through the booked one
        filled_at: dict[str, datetime] = {}
        for fill in await paper_fills():
            filled_at.setdefault(fill.order_id, fill.at)
        noted = {order.client_order_id: order.noted_at
                 for order in await books.orders(open_only=False)}
        reasons = {decision.turn: decision.final_text for decision in self.record.decisions
                   if decision.turn is not None}
        reasons[STARTING_TURN] = "what the paper account held at the start"
        counted = await books.fills()

        def moment(fill: BookFill) -> datetime:
            return filled_at.get(fill.order_id, fill.at)

        fills = [FillRecord(
            decided_at=noted.get(fill.client_order_id, fill.at), filled_at=moment(fill),
            symbol=fill.symbol, side=fill.side, amount=fill.amount, price=fill.price,
            fee=fill.fee, client_order_id=fill.client_order_id,
            reason=reasons.get(fill.turn, "") if fill.turn is not None else "",
            turn=fill.turn) for fill in counted]
        return _at_fill_times(await books.trades(), counted, moment), fills


def _at_fill_times(trips: Sequence[RoundTrip], fills: Sequence[BookFill],
                  moment: Callable[[BookFill], datetime]) -> list[RoundTrip]:
    """The round trips, each opened and closed at ``moment`` of the fill that did it.

    The books date a round trip by the fill that opened it and the one that closed it; which
    fills those were is found by applying the fills again, in order, with the books' own
    accounting (:func:`~trading_agent.trading.books.apply_fill`). Should that not give the
    books' round trips (it always does), they are kept as the books date them.

    Args:
        trips: The desk's round trips, as its books hold them.
        fills: The desk's fills, oldest first.
        moment: When a fill filled.

    Returns:
        The round trips, oldest first.
    """
    positions: dict[str, BookPosition] = {}
    holding: dict[str, tuple[int, RoundTrip]] = {}
    found: list[tuple[str, datetime, datetime | None]] = []
    for fill in fills:
        position = positions.get(fill.symbol) or BookPosition(fill.symbol)
        index, trip = holding.get(fill.symbol, (-1, None))
        effect = apply_fill(position, trip, fill)
        positions[fill.symbol] = effect.position
        if effect.closed is not None:
            symbol, opened, _ = found[index]
            found[index] = (symbol, opened, moment(fill))
            del holding[fill.symbol]
        if effect.opened is not None:
            holding[fill.symbol] = (len(found), effect.opened)
            found.append((fill.symbol, moment(fill), None))
        elif effect.updated is not None:
            holding[fill.symbol] = (index, effect.updated)
    ordered = sorted(trips, key=lambda trip: trip.id)
    if [(t.symbol, t.is_open) for t in ordered] != [(s, c is None) for s, _, c in found]:
        return ordered
    return [replace(trip, opened_at=opened, closed_at=closed)
            for trip, (_, opened, closed) in zip(ordered, found, strict=True)]


@dataclass
class _TurnNotes:
    at: datetime
    kind: str
    entries: list[TranscriptEntry]
    orders: list[str] = field(default_factory=list)
    model_calls: int = 0
    decision: int = 0
    _text: list[str] = field(default_factory=list)

    def text(self, piece: str) -> None:
        self._text.append(piece)

    def close_text(self) -> None:
        if self._text:
            text = "".join(self._text).strip()
            self._text.clear()
            if text:
                self.entries.append(TranscriptEntry("text", text))


def scratch_folder() -> str | None:
    """Where a run's store lives while it runs: in memory (``/dev/shm``) where the system has
    it, since the store is thrown away at the end and the daemon's durable commits would
    otherwise wait for the disk on every message; else the system's temporary folder."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def paper_exchange(config: ExchangeConfig) -> ExchangeConfig:
    """The exchange a backtest trades on (and its baselines): the desk's, paper on the
    replay, market orders filling at the next open."""
    return _paper_next_open(config)


def _paper_next_open(config: ExchangeConfig) -> ExchangeConfig:
    """The desk's exchange, paper on the replay, market orders filling at the next open."""
    paper = config.paper.model_copy(update={"market_fill": "next_open"})
    return config.model_copy(update={"paper": paper, "feed": "replay"})


def _cache_path(spec: BacktestSpec) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.desk)
    return (spec.cache_dir or default_cache_dir()) / f"{name}.jsonl"


class _Timed:
    """The model, with the seconds spent waiting for it counted."""

    def __init__(self, inner: ModelBackend) -> None:
        self.inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # count_tokens, config...

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        started = time.perf_counter()
        try:
            return await self.inner.complete(request, on_text, on_thinking)
        finally:
            self.seconds += time.perf_counter() - started


async def _no_wait(seconds: float) -> None:
    """A failed turn is retried at once: the simulated clock does not move while it waits."""
    await anyio.lowlevel.checkpoint()
