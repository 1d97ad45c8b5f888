"""Daily spend caps: what the desks' models may use per UTC day, in tokens and in money.

Each desk may have its own caps (``[desks.<name>.controls]``) and the daemon caps every desk
together (``[daemon.spend]``). :class:`SpendGuard` counts every model request's usage as its
event goes by (a subagent's counts for its desk), starting from what the store already
counted today, so a restart forgets nothing:

- at 80% of a cap a :class:`SpendAlert` goes out, once per cap and day;
- at 100% another, and the desk (every desk, for the daemon's cap) is paused with the
  reason, until 00:00 UTC or until an operator resumes it. A desk an operator resumed is not
  paused again by a cap that day: the person has seen the figures.

The turn in flight when a cap is reached ends at its next safe point: a cap is checked per
request, so a desk overshoots by at most the requests of one tool round.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Literal, Protocol

import structlog

from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import UsageReported
from trading_agent.daemon.events import SpendAlert

__all__ = ["ALERT_SHARE", "SPEND_CAP", "SpendCaps", "SpendGuard"]


class SpendCaps(Protocol):
    """A daily cap as the guard reads it (the settings' ``[daemon.spend]`` and each desk's
    ``controls`` are ones): None for no cap."""

    @property
    def max_tokens_per_day(self) -> int | None: ...

    @property
    def max_cost_per_day(self) -> float | None: ...


_log = structlog.get_logger(__name__)

ALERT_SHARE = 0.8
"""The share of a cap at which the operators are warned."""

SPEND_CAP = "spend cap"
"""Who pauses a desk whose cap is used up (its hold's ``by``)."""

Pause = Callable[[str, str, float], Awaitable[None]]
"""Pauses a desk: ``(desk, reason, until)``, ``until`` in seconds since the epoch."""

UsageToday = Callable[[str], Awaitable[tuple[int, float | None]]]
"""A desk's tokens and cost counted today, from the store."""

RecordResume = Callable[[str, date], Awaitable[None]]
"""Keeps that an operator resumed a capped desk on a day (so a restart does not pause it
again)."""


@dataclass
class _Count:
    tokens: int = 0
    cost: float = 0.0


@dataclass
class _Day:
    day: date
    desks: dict[str, _Count] = field(default_factory=dict)
    total: _Count = field(default_factory=_Count)
    alerted: set[tuple[str, str, str]] = field(default_factory=set)
    """(scope, measure, level) already announced: scope is a desk or ``*``."""
    resumed: set[str] = field(default_factory=set)
    """Desks an operator resumed today."""


class SpendGuard:
    """Counts the desks' usage against their daily caps; warns, then pauses.

    Args:
        desks: Each desk's caps, by name (every desk of the daemon).
        daemon: The caps over every desk together.
        bus: Where alerts are published.
        pause: Pauses a desk until a time.
        record_resume: Keeps an operator's resume of a capped desk for the day; None keeps
            it in memory only.
        clock: Seconds since the epoch.
    """

    def __init__(self, desks: Mapping[str, SpendCaps], daemon: SpendCaps, bus: EventBus,
                 pause: Pause, *, record_resume: RecordResume | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._caps = dict(desks)
        self._daemon = daemon
        self._bus = bus
        self._pause = pause
        self._record_resume = record_resume
        self._clock = clock
        self._today = _Day(self._date())

    def configure(self, desks: Mapping[str, SpendCaps], daemon: SpendCaps) -> None:
        """New caps (a reload): today's counts stay, and are checked against them at the
        next request."""
        self._caps = dict(desks)
        self._daemon = daemon

    def caps(self, desk: str) -> SpendCaps | None:
        """The desk's own caps as configured now (its settings' ``controls``), or None."""
        return self._caps.get(desk)

    @property
    def active(self) -> bool:
        """Whether any cap is set (without one, nothing needs counting)."""
        return any(_set(caps) for caps in [self._daemon, *self._caps.values()])

    async def load(self, usage_today: UsageToday, resumed: Collection[str] = ()) -> None:
        """Starts from what the store counted today, and acts on it (a restart after a cap
        was reached pauses the desk again, unless an operator resumed it today).

        Args:
            usage_today: Each desk's tokens and cost today.
            resumed: The desks an operator resumed from a cap's pause today.
        """
        day = self._today = _Day(self._date(), resumed=set(resumed))
        for desk in self._caps:
            tokens, cost = await usage_today(desk)
            count = day.desks.setdefault(desk, _Count())
            count.tokens, count.cost = tokens, cost or 0.0
            day.total.tokens += tokens
            day.total.cost += cost or 0.0
        for desk in self._caps:
            await self._check(desk)

    async def run(self, subscription: Subscription) -> None:
        """Counts each usage event until the subscription closes."""
        async for event in subscription:
            if isinstance(event, UsageReported):
                await self.count(event.desk, event.input_tokens + event.output_tokens,
                                 event.cost)

    async def count(self, desk: str, tokens: int, cost: float | None) -> None:
        """Adds one request's usage, then checks the desk's caps and the daemon's."""
        day = self._day()
        if desk not in self._caps:
            return
        count = day.desks.setdefault(desk, _Count())
        count.tokens += tokens
        count.cost += cost or 0.0
        day.total.tokens += tokens
        day.total.cost += cost or 0.0
        await self._check(desk)

    async def resumed(self, desk: str) -> None:
        """An operator resumed the desk from a cap's pause: no cap pauses it again today."""
        day = self._day()
        day.resumed.add(desk)
        if self._record_resume is not None:
            await self._record_resume(desk, day.day)

    def figures(self, desk: str) -> list[dict[str, object]]:
        """Today's use of each cap on the desk: its own, then the daemon's."""
        day = self._day()
        count = day.desks.get(desk, _Count())
        rows: list[dict[str, object]] = []
        for scope, caps, used in (("desk", self._caps.get(desk), count),
                                  ("daemon", self._daemon, day.total)):
            if caps is None:
                continue
            for measure, cap, value in _measures(caps, used):
                rows.append({"scope": scope, "measure": measure, "used": value, "cap": cap,
                             "share": value / cap})
        return rows

    async def _check(self, desk: str) -> None:
        day = self._today
        caps = self._caps.get(desk)
        if caps is not None:
            for measure, cap, used in _measures(caps, day.desks.get(desk, _Count())):
                await self._judge(desk, "desk", measure, used, cap, [desk])
        for measure, cap, used in _measures(self._daemon, day.total):
            await self._judge("*", "daemon", measure, used, cap, list(self._caps))

    async def _judge(self, scope: str, kind: Literal["desk", "daemon"],
               measure: Literal["tokens", "cost"], used: float, cap: float,
               desks: Sequence[str]) -> None:
        share = used / cap
        level = "full" if share >= 1 else "alert" if share >= ALERT_SHARE else None
        day = self._today
        if level is None or (scope, measure, level) in day.alerted:
            return
        day.alerted.add((scope, measure, level))
        if level == "full":
            day.alerted.add((scope, measure, "alert"))
        whose = f"desk {scope}'s" if kind == "desk" else "the daemon's"
        figure = (f"{used:,.0f} of {cap:,.0f} tokens" if measure == "tokens"
                  else f"{used:,.4f} of {cap:,.4f} in model cost")
        if level == "alert":
            text = f"{whose} daily spend cap is {share:.0%} used: {figure} today (UTC)"
        else:
            text = f"{whose} daily spend cap is used up: {figure} today (UTC)"
        _log.warning("spend_cap", scope=scope, measure=measure, used=used, cap=cap,
                     level=level)
        self._bus.publish(SpendAlert(desk=scope, scope=kind, measure=measure, used=used,
                                     cap=cap, share=share, text=text))
        if level == "full":
            until = datetime.combine(day.day + timedelta(days=1), datetime.min.time(),
                                     UTC).timestamp()
            for desk in desks:
                if desk not in day.resumed:
                    await self._pause(desk, text, until)

    def _day(self) -> _Day:
        today = self._date()
        if today != self._today.day:
            self._today = _Day(today)
        return self._today

    def _date(self) -> date:
        return datetime.fromtimestamp(self._clock(), UTC).date()


def _set(caps: SpendCaps) -> bool:
    return caps.max_tokens_per_day is not None or caps.max_cost_per_day is not None


def _measures(caps: SpendCaps, count: _Count
              ) -> list[tuple[Literal["tokens", "cost"], float, float]]:
    found: list[tuple[Literal["tokens", "cost"], float, float]] = []
    if caps.max_tokens_per_day is not None:
        found.append(("tokens", float(caps.max_tokens_per_day), float(count.tokens)))
    if caps.max_cost_per_day is not None:
        found.append(("cost", caps.max_cost_per_day, count.cost))
    return found
