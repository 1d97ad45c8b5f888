"""The daemon's figures for Prometheus: ``GET /metrics`` on the operator API.

:class:`DaemonMetrics` is an event-bus subscriber like the store and the logs. Counters and
histograms are fed from the events as they pass (turns, model calls, tokens, cost, retries,
compactions, memory flushes, orders, risk refusals, approvals, errors); gauges are read from
the daemon when a scrape comes (:meth:`DaemonMetrics.render`): each desk's status (state,
queue, equity, open orders), the pending approvals, the kill switches. Each instance has a
registry of its own, so several daemons in one process never share a figure.

Every name starts ``trading_agent_``; the labels are of low cardinality (``desk``, and a
small fixed set such as ``outcome`` or ``limit``), never a turn's or an order's id.

======================================================  =========  ==========================
name                                                    type       labels
======================================================  =========  ==========================
trading_agent_turns_total                               counter    desk, outcome
trading_agent_turn_seconds                              histogram  desk
trading_agent_model_call_seconds                        histogram  desk
trading_agent_input_tokens_total                        counter    desk
trading_agent_output_tokens_total                       counter    desk
trading_agent_cached_input_tokens_total                 counter    desk
trading_agent_model_cost_total                          counter    desk
trading_agent_model_retries_total                       counter    desk
trading_agent_compactions_total                         counter    desk, reason
trading_agent_memory_flushes_total                      counter    desk, outcome
trading_agent_orders_total                              counter    desk, state
trading_agent_risk_refusals_total                       counter    desk, limit
trading_agent_approvals_total                           counter    desk, outcome
trading_agent_errors_total                              counter    desk, error_type
trading_agent_approvals_pending                         gauge      desk
trading_agent_trigger_queue_depth                       gauge      desk
trading_agent_equity                                    gauge      desk
trading_agent_open_orders                               gauge      desk
trading_agent_position_amount                           gauge      desk, symbol
trading_agent_unrealized_profit                         gauge      desk, symbol
trading_agent_realized_profit                           gauge      desk, symbol
trading_agent_kill_switch                               gauge      desk (``*``: every desk's)
trading_agent_desk_paused                               gauge      desk
trading_agent_desk_reduce_only                          gauge      desk
trading_agent_desk_state                                gauge      desk, state
trading_agent_start_time_seconds                        gauge
trading_agent_uptime_seconds                            gauge
trading_agent_event_bus_dropped_events_total            counter    subscriber
======================================================  =========  ==========================

What counts:

- A turn is a desk's own turn, as the operator sees it (not the silent memory-flush turn, not
  a subagent's). ``outcome``: ``completed``, ``round_limit`` (``maximum_rounds`` reached),
  ``stopped`` (ended at a safe point: an operator's cancel, a spend cap, shutdown),
  ``cancelled`` (cut at once by an operator), ``failed`` (the model failed; or the turn
  ended without an end, which is known when the desk's next turn starts).
- A model call lasts from its request (or, after a retry, from the end of the retry's wait)
  to its usage report; every model call counts, subagents' and compactions' included, as do
  their tokens and cost (in the currency of the model's prices).
- Orders are ``place_order`` calls by how they ended: ``filled``, ``open`` (resting, or a
  market order waiting for the next candle), another exchange status (``canceled``...),
  ``refused`` (a risk limit, counted by ``limit`` in ``trading_agent_risk_refusals_total``),
  ``denied`` or ``approval_timed_out`` (an operator), ``failed`` (the exchange, invalid
  arguments, a timeout).
- Positions and profit are each desk's own books' (never the account's), in the symbol's
  base currency (amount, negative for a short) and quote currency (profit, fees
  subtracted): the amount and the unrealized profit at the mark of every open position,
  the realized profit of every market the desk ever traded, all time. A desk without
  books has none of these; a position without a mark has no unrealized figure.
- Event-bus drops, by subscriber (the store, the log, the spend caps, the operator API's
  stream, the metrics themselves): the events the bus dropped because it fell behind.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import (
    CompactionEnded,
    ErrorEvent,
    Event,
    MemoryFlush,
    ModelRequest,
    OverflowRecovery,
    RetryScheduled,
    ToolResultReady,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.daemon.control import DeskControl, DeskState, DeskStatus, UnknownDeskError
from trading_agent.daemon.events import StorageChanged, TurnCancelled
from trading_agent.operator.approvals import Approvals
from trading_agent.operator.event_stream import EventHub
from trading_agent.operator.events import ApprovalResolved

__all__ = ["METRICS_CONTENT_TYPE", "DaemonMetrics", "order_state", "refused_limit"]

_log = structlog.get_logger(__name__)

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format, as :func:`prometheus_client.generate_latest` writes."""

_SUBSCRIBER = "metrics"
"""The metrics' name on the event bus (in drop reports)."""

_EVERY_DESK = "*"
"""The scope of the daemon-wide kill switch (desk ``*`` in the daemon's events)."""

_DESK_STATES: tuple[DeskState, ...] = ("idle", "working", "paused", "stopped")

_TURN_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_MODEL_CALL_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

_MAX_OPEN = 10_000
"""The most turns and model calls followed at once: a bound if their ends are never seen."""

_WANTED = (TurnStarted, TurnEnded, ModelRequest, RetryScheduled, UsageReported,
           OverflowRecovery, ErrorEvent, CompactionEnded, MemoryFlush, ToolResultReady,
           TurnCancelled, ApprovalResolved, StorageChanged)
"""The events the metrics read; the subscription holds no others (text deltas above all)."""

_REFUSAL = re.compile(r"^(?:Error: )?Refused\b")
_NAMED_REFUSAL = re.compile(r"^(?:Error: )?Refused \((\w+)[,)]")

_LIMIT_NAMES = ("allowed_symbols", "max_daily_loss", "max_order_notional",
                "max_position_notional", "max_open_orders", "max_orders_per_hour")
"""The risk limits a refusal names in its text (``trading.risk``), in the order checked."""

_LIMIT_PHRASES = (("daily loss", "max_daily_loss"), ("an earlier", "unresolved_orders"),
                  ("to check the limits", "quote_currency"))
"""Refusals whose text names no limit, by a phrase of theirs."""

_PLACED = re.compile(r"^Order \S+ (filled|accepted|placed and resting|is (\w+))")


class DaemonMetrics:
    """The daemon's Prometheus metrics, fed by its event bus and read from it at scrape time.

    It subscribes at construction (every event published afterwards is counted); run
    :meth:`run` in a task group to read them, and serve :meth:`render`.

    Args:
        control: The running daemon (desk status and kill switches at scrape time).
        approvals: The approval book (pending approvals at scrape time).
        stream: The operator API's event hub, whose drops are reported with the metrics'.
        max_buffer: The most events the subscription holds before the bus drops (and counts).
        clock: Seconds since the epoch.
    """

    def __init__(self, control: DeskControl, approvals: Approvals, *,
                 stream: EventHub | None = None, max_buffer: int = 50_000,
                 clock: Callable[[], float] = time.time) -> None:
        self._control = control
        self._approvals = approvals
        self._clock = clock
        self._subscription = control.event_bus.subscribe(
            _SUBSCRIBER, max_buffer=max_buffer, accept=_wanted)
        drops: dict[str, Subscription | EventHub] = {_SUBSCRIBER: self._subscription}
        if stream is not None:
            drops["operator-api"] = stream
        self.registry = CollectorRegistry()
        """The metrics' own registry (never the process-wide one)."""
        self._turn_starts: dict[tuple[str, str], float] = {}
        self._call_starts: dict[tuple[str, str | None, str | None], float] = {}
        self._define(self.registry)
        self.registry.register(_DropsCollector(control.event_bus, drops))
        started = clock()
        self._start_time.set(started)
        self._uptime.set_function(lambda: self._clock() - started)

    def _define(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, ("desk", *labels), registry=registry)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self._turns = counter("trading_agent_turns_total", "Desk turns that ended, by outcome.",
                              "outcome")
        self._turn_seconds = Histogram(
            "trading_agent_turn_seconds", "How long a desk's turns took.", ("desk",),
            buckets=_TURN_BUCKETS, registry=registry)
        self._model_call_seconds = Histogram(
            "trading_agent_model_call_seconds",
            "How long model calls took, from request (or the end of a retry's wait) to usage.",
            ("desk",), buckets=_MODEL_CALL_BUCKETS, registry=registry)
        self._input_tokens = counter("trading_agent_input_tokens_total",
                                     "Prompt tokens sent to the model, the cached included.")
        self._output_tokens = counter("trading_agent_output_tokens_total",
                                      "Completion tokens the model wrote.")
        self._cached_tokens = counter("trading_agent_cached_input_tokens_total",
                                      "Prompt tokens the model's server read from its cache.")
        self._cost = counter("trading_agent_model_cost_total",
                             "Cost of the model calls, in the currency of the model's prices.")
        self._retries = counter("trading_agent_model_retries_total",
                                "Model requests that failed and were retried.")
        self._compactions = counter("trading_agent_compactions_total",
                                    "Conversation compactions, by reason.", "reason")
        self._flushes = counter("trading_agent_memory_flushes_total",
                                "Memory flushes before a compaction, by outcome.", "outcome")
        self._orders = counter("trading_agent_orders_total",
                               "place_order calls by how they ended.", "state")
        self._refusals = counter("trading_agent_risk_refusals_total",
                                 "Orders refused by a risk limit (or the kill switch), by limit.",
                                 "limit")
        self._approvals_resolved = counter("trading_agent_approvals_total",
                                           "Approvals answered, timed out or cancelled.",
                                           "outcome")
        self._errors = counter("trading_agent_errors_total", "Failures, by error type.",
                               "error_type")
        self._pending = gauge("trading_agent_approvals_pending",
                              "Tool calls waiting for an operator's decision.", "desk")
        self._queue = gauge("trading_agent_trigger_queue_depth",
                            "Triggers waiting for the desk to be free.", "desk")
        self._equity = gauge("trading_agent_equity", "The desk's own equity in its quote "
                             "currency (a live desk's by its books).", "desk")
        self._open_orders = gauge("trading_agent_open_orders", "Orders open on the exchange.",
                                  "desk")
        self._position_amount = gauge(
            "trading_agent_position_amount",
            "The desk's own position in a market, in its base currency (negative: short).",
            "desk", "symbol")
        self._unrealized = gauge(
            "trading_agent_unrealized_profit",
            "Profit of the desk's own open position at the mark, in the quote currency.",
            "desk", "symbol")
        self._realized = gauge(
            "trading_agent_realized_profit",
            "Profit the desk's own books realized in a market, all time, fees subtracted.",
            "desk", "symbol")
        self._kill_switch = gauge(
            "trading_agent_kill_switch",
            "1 while a kill switch refuses the desk's new orders (desk *: every desk's).", "desk")
        self._paused = gauge("trading_agent_desk_paused",
                             "1 while the desk takes no turns (held, or its model unavailable).",
                             "desk")
        self._reduce_only = gauge(
            "trading_agent_desk_reduce_only",
            "1 while the desk may only shrink its positions (an operator, a protection or a "
            "spend cap put it in reduce-only).", "desk")
        self._state = gauge("trading_agent_desk_state", "1 for the desk's current state.",
                            "desk", "state")
        self._storage_full = gauge(
            "trading_agent_storage_full",
            "1 while the disk holding the store is full: nothing more is stored, what "
            "cannot be is refused.")
        self._start_time = gauge("trading_agent_start_time_seconds",
                                 "When the daemon's operator API started, since the epoch.")
        self._uptime = gauge("trading_agent_uptime_seconds",
                             "Seconds since the daemon's operator API started.")

    # ------------------------------------------------------------------ events

    async def run(self) -> None:
        """Reads the bus until cancelled or closed."""
        try:
            async for event in self._subscription:
                try:
                    self.observe(event)
                except Exception as exc:  # a figure must never end the metrics
                    _log.warning("metrics_event_failed", event=event.type, error=repr(exc))
        finally:
            self._subscription.close()

    def close(self) -> None:
        """Stops reading the bus."""
        self._subscription.close()

    def observe(self, event: Event) -> None:
        """Counts one event (what :meth:`run` does with each).

        Args:
            event: An event of the daemon's bus.
        """
        desk = event.desk
        match event:
            case TurnStarted():
                self._turn_started(event)
            case TurnEnded():
                self._turn_ended(event)
            case ModelRequest():
                self._follow_call(event, event.at)
            case RetryScheduled():
                self._retries.labels(desk=desk).inc()
                self._follow_call(event, event.at + event.delay)
            case UsageReported():
                self._usage(event)
            case OverflowRecovery():
                self._call_starts.pop(_call_key(event), None)
            case ErrorEvent():
                self._errors.labels(desk=desk, error_type=event.error_type).inc()
                self._call_starts.pop(_call_key(event), None)
                if event.subagent is None and event.turn is not None:
                    self._end_turn(desk, event.turn, "failed", event.at)
            case TurnCancelled() if event.now:
                for key in [k for k in self._turn_starts if k[0] == desk]:
                    self._end_turn(desk, key[1], "cancelled", event.at)
            case CompactionEnded():
                self._compactions.labels(desk=desk, reason=event.reason).inc()
            case MemoryFlush():
                outcome = "nothing_saved" if event.no_op else "saved"
                self._flushes.labels(desk=desk, outcome=outcome).inc()
            case ToolResultReady() if event.name == "place_order":
                self._order_result(event)
            case ApprovalResolved():
                self._approvals_resolved.labels(desk=desk, outcome=event.outcome).inc()
            case StorageChanged():
                self._storage_full.set(1 if event.full else 0)

    def _turn_started(self, event: TurnStarted) -> None:
        if event.subagent is not None or event.silent or event.turn is None:
            return
        # A desk runs one turn at a time: one still open ended without an end (a crash).
        for key in [k for k in self._turn_starts if k[0] == event.desk]:
            self._end_turn(event.desk, key[1], "failed", None)
        _bounded(self._turn_starts)[(event.desk, event.turn)] = event.at

    def _turn_ended(self, event: TurnEnded) -> None:
        if event.subagent is not None or event.silent or event.turn is None:
            return
        outcome = ("stopped" if event.stopped else "round_limit" if event.hit_round_limit
                   else "completed")
        self._end_turn(event.desk, event.turn, outcome, event.at)

    def _end_turn(self, desk: str, turn: str, outcome: str, at: float | None) -> None:
        started = self._turn_starts.pop((desk, turn), None)
        if started is None:
            return
        self._turns.labels(desk=desk, outcome=outcome).inc()
        if at is not None:
            self._turn_seconds.labels(desk=desk).observe(max(0.0, at - started))

    def _follow_call(self, event: Event, starts_at: float) -> None:
        _bounded(self._call_starts)[_call_key(event)] = starts_at

    def _usage(self, event: UsageReported) -> None:
        desk = event.desk
        self._input_tokens.labels(desk=desk).inc(max(0, event.input_tokens))
        self._output_tokens.labels(desk=desk).inc(max(0, event.output_tokens))
        self._cached_tokens.labels(desk=desk).inc(max(0, event.cached_input_tokens))
        if event.cost is not None and event.cost >= 0:
            self._cost.labels(desk=desk).inc(event.cost)
        started = self._call_starts.pop(_call_key(event), None)
        if started is not None:
            self._model_call_seconds.labels(desk=desk).observe(max(0.0, event.at - started))

    def _order_result(self, event: ToolResultReady) -> None:
        limit = event.refused_limit or refused_limit(event.text)
        if limit is not None:
            self._refusals.labels(desk=event.desk, limit=limit).inc()
        self._orders.labels(desk=event.desk, state=order_state(event.text, event.is_error)).inc()

    # ------------------------------------------------------------------ scrape time

    async def refresh(self) -> None:
        """Reads the gauges of the moment from the daemon: each desk's status, the pending
        approvals and the kill switches. A desk whose status fails is left out (and
        logged); the other figures are still served."""
        names = list(self._control.desk_names())
        statuses: dict[str, DeskStatus] = {}
        books: dict[str, dict[str, Any]] = {}

        async def read(desk: str) -> None:
            try:
                statuses[desk] = await self._control.desk_status(desk)
            except UnknownDeskError:
                pass  # removed by a reload meanwhile
            except Exception as exc:  # a broken status must not fail the scrape
                _log.warning("metrics_desk_status_failed", desk=desk, error=repr(exc))

        async def read_books(desk: str) -> None:
            try:
                books[desk] = await self._control.books(desk, "positions")
            except UnknownDeskError:
                pass
            except Exception as exc:  # nor do broken books
                _log.warning("metrics_desk_books_failed", desk=desk, error=repr(exc))

        async with anyio.create_task_group() as group:
            for desk in names:
                group.start_soon(read, desk)
                group.start_soon(read_books, desk)
        halted = {halt.get("scope", "") for halt in self._control.kill_switch_halts()}
        # Set with no await in between: a concurrent scrape never sees half of them.
        for gauge in (self._pending, self._queue, self._equity, self._open_orders,
                      self._kill_switch, self._paused, self._reduce_only, self._state,
                      self._position_amount,
                      self._unrealized, self._realized):
            gauge.clear()
        for desk, answer in books.items():
            for market in answer.get("markets", []):
                self._realized.labels(desk=desk, symbol=market["symbol"]).set(
                    float(market["realized"] or 0))
            for position in answer.get("positions", []):
                labels = {"desk": desk, "symbol": position["symbol"]}
                self._position_amount.labels(**labels).set(float(position["amount"] or 0))
                if position.get("unrealized") is not None:
                    self._unrealized.labels(**labels).set(float(position["unrealized"]))
        self._kill_switch.labels(desk=_EVERY_DESK).set(1 if _EVERY_DESK in halted else 0)
        for desk in names:
            status = statuses.get(desk)
            if status is None:
                continue
            self._pending.labels(desk=desk).set(self._approvals.pending_count(desk))
            self._queue.labels(desk=desk).set(status.queued_triggers)
            if status.equity is not None:
                self._equity.labels(desk=desk).set(status.equity)
            self._open_orders.labels(desk=desk).set(status.open_orders)
            on = desk in halted or _EVERY_DESK in halted
            self._kill_switch.labels(desk=desk).set(1 if on else 0)
            self._paused.labels(desk=desk).set(1 if status.state == "paused" else 0)
            self._reduce_only.labels(desk=desk).set(1 if status.reduce_only else 0)
            for state in _DESK_STATES:
                self._state.labels(desk=desk, state=state).set(1 if status.state == state else 0)
            # Seen from the first scrape, as 0, rather than appearing with the first event.
            for counter in (self._input_tokens, self._output_tokens, self._cached_tokens,
                            self._retries):
                counter.labels(desk=desk)

    async def render(self) -> bytes:
        """Reads the gauges of the moment and writes every metric.

        Returns:
            The metrics in Prometheus' text format (:data:`METRICS_CONTENT_TYPE`).
        """
        await self.refresh()
        return generate_latest(self.registry)


class _DropsCollector(Collector):
    """Events the bus dropped for each subscriber (the store, the log, the spend caps, the
    API's own), read when scraped."""

    def __init__(self, bus: EventBus, sources: dict[str, Subscription | EventHub]) -> None:
        self._bus = bus
        self._sources = sources

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "trading_agent_event_bus_dropped_events",
            "Events the event bus dropped for a subscriber that fell behind.",
            labels=("subscriber",))
        totals = self._bus.dropped_totals()
        for name, source in self._sources.items():
            totals[name] = max(totals.get(name, 0), source.dropped_total)
        for name, total in sorted(totals.items()):
            family.add_metric((name,), total)
        yield family


def refused_limit(text: str) -> str | None:
    """The risk limit a tool result says refused an order, or None when it is no refusal.

    Args:
        text: The tool result (``Error: Refused: ... exceeds max_order_notional ...``).

    Returns:
        The limit's name as in the config (``kill_switch`` for the kill switch), or
        ``other`` for a refusal that names none known.
    """
    if not _REFUSAL.match(text):
        return None
    named = _NAMED_REFUSAL.match(text)
    if named is not None:
        return named.group(1)
    for limit in _LIMIT_NAMES:
        if limit in text:
            return limit
    for phrase, limit in _LIMIT_PHRASES:
        if phrase in text:
            return limit
    return "other"


def order_state(text: str, is_error: bool) -> str:
    """How a ``place_order`` call ended, from what the model read.

    Args:
        text: The tool result.
        is_error: Whether it was an error result.

    Returns:
        ``filled``, ``open``, an exchange status, ``refused``, ``denied``,
        ``approval_timed_out`` or ``failed``.
    """
    if not is_error:
        placed = _PLACED.match(text)
        if placed is None:
            return "placed"
        how, status = placed.groups()
        if status is not None:
            return status
        return "filled" if how == "filled" else "open"
    if _REFUSAL.match(text):
        return "refused"
    if text.startswith("Denied by operator"):
        return "denied"
    if text.startswith("Timed out waiting for approval"):
        return "approval_timed_out"
    return "failed"


def _wanted(event: Event) -> bool:
    return isinstance(event, _WANTED)


def _call_key(event: Event) -> tuple[str, str | None, str | None]:
    return (event.desk, event.turn, event.subagent)


def _bounded(starts: dict[Any, float]) -> dict[Any, float]:
    """``starts``, with its oldest entry dropped when full."""
    if len(starts) >= _MAX_OPEN:
        del starts[next(iter(starts))]
    return starts
