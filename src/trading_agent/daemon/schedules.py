"""Schedule triggers: fixed intervals and cron expressions, in a desk's time zone.

A schedule's *slots* are the moments it is due: ``anchor + k * every`` for an interval,
the cron expression's matches (read on the desk's wall clock, so ``0 9 * * mon-fri`` is
9:00 local time through daylight-saving changes) for a cron schedule. As in cron, a job at a
fixed hour runs once when the clocks go back and its wall time comes twice (the first time),
and at the shifted time when they go forward over it; a job every hour runs every hour.

Slots missed while the daemon was down fire **once** at start, not once per missed slot:
the store keeps the slot each schedule last fired for, and :func:`catch_up_slot` compares it
with the latest slot due. A schedule that never fired waits for its first slot.

The runner reads the clock and sleeps through injected functions, so tests move time by
hand and run in milliseconds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo

import anyio
from croniter import croniter

from trading_agent.agent.trigger import Trigger
from trading_agent.errors import ConfigError

__all__ = ["Schedule", "ScheduleRunner", "catch_up_slot", "next_slot"]

Clock = Callable[[], datetime]
Sleep = Callable[[float], Awaitable[None]]

_LONGEST_NAP = 60.0
"""The longest single sleep: the clock is read again after it, so a wall-clock jump (a
suspended machine, an NTP step) delays a schedule by at most this much."""


@dataclass(frozen=True)
class Schedule:
    """One schedule of a desk.

    Attributes:
        name: The schedule's name, unique per desk (its key in the store).
        text: What the desk is told when it fires.
        every: The interval, for an interval schedule.
        cron: The cron expression (five fields), for a cron schedule.
        timezone: The desk's time zone; cron fields are read on its wall clock.

    Raises:
        ConfigError: Neither or both of ``every`` and ``cron``, a non-positive interval, or
            an invalid cron expression.
    """

    name: str
    text: str
    every: timedelta | None = None
    cron: str | None = None
    timezone: tzinfo = UTC

    def __post_init__(self) -> None:
        if (self.every is None) == (self.cron is None):
            raise ConfigError(f"schedule {self.name!r}: give either every or cron, not both "
                              "or neither")
        if self.every is not None and self.every <= timedelta(0):
            raise ConfigError(f"schedule {self.name!r}: every must be positive")
        if self.cron is not None and not croniter.is_valid(self.cron):
            raise ConfigError(f"schedule {self.name!r}: {self.cron!r} is not a valid cron "
                              "expression (five fields: minute hour day month weekday)")

    def describe(self) -> str:
        """How the schedule repeats, for the desk and for logs."""
        if self.every is not None:
            return f"every {_format_interval(self.every)}"
        return f"cron {self.cron} ({self.timezone})"


def next_slot(schedule: Schedule, anchor: datetime, now: datetime) -> datetime:
    """The first slot strictly after ``now``.

    Args:
        schedule: The schedule.
        anchor: A past slot (an interval counts from it; a cron schedule ignores it).
        now: The current time, aware.

    Returns:
        The slot, in UTC.
    """
    if schedule.every is not None:
        steps = (now - anchor) // schedule.every + 1
        return (anchor + max(steps, 1) * schedule.every).astimezone(UTC)
    slots = _cron(schedule, now)
    found: datetime = slots.get_next(datetime)
    if _repeats_wall_time(schedule, found):
        found = slots.get_next(datetime)
    return found.astimezone(UTC)


def _latest_slot(schedule: Schedule, anchor: datetime, now: datetime) -> datetime:
    """The newest slot at or before ``now``."""
    if schedule.every is not None:
        return (anchor + ((now - anchor) // schedule.every) * schedule.every).astimezone(UTC)
    # get_prev is strictly before, so a moment exactly on a slot is that slot: look from
    # just after it.
    slots = _cron(schedule, now + timedelta(microseconds=1))
    found: datetime = slots.get_prev(datetime)
    if _repeats_wall_time(schedule, found):
        found = slots.get_prev(datetime)
    return found.astimezone(UTC)


def _repeats_wall_time(schedule: Schedule, slot: datetime) -> bool:
    """Whether ``slot`` is the second time a fixed-hour cron job's wall time comes round, in
    the hour the clocks go back (croniter gives both; cron runs such a job once)."""
    assert schedule.cron is not None
    if croniter(schedule.cron).expanded[1] == ["*"]:
        return False  # a job every hour keeps running every hour
    previous: datetime = _cron(schedule, slot).get_prev(datetime)
    wall = slot.astimezone(schedule.timezone).replace(tzinfo=None)
    return previous.astimezone(schedule.timezone).replace(tzinfo=None) == wall


def _cron(schedule: Schedule, start: datetime) -> croniter:
    """Cron slots around ``start``, read on the schedule's wall clock."""
    assert schedule.cron is not None
    return croniter(schedule.cron, start.astimezone(schedule.timezone))


def catch_up_slot(schedule: Schedule, last_fired: datetime | None,
                  now: datetime) -> datetime | None:
    """The slot to fire at start for slots missed while the daemon was down.

    Args:
        schedule: The schedule.
        last_fired: The slot it last fired for (from the store), or None if it never fired.
        now: The current time.

    Returns:
        The newest missed slot (fired once, standing for every missed one), or None when
        nothing was missed or the schedule never fired.
    """
    if last_fired is None:
        return None
    latest = _latest_slot(schedule, last_fired, now)
    return latest if latest > last_fired else None


class ScheduleRunner:
    """Fires a desk's schedules on time, as schedule triggers.

    Args:
        schedules: The desk's schedules.
        fire: Queues a trigger for the desk (never blocks). The desk records the slot in the
            store once the trigger reaches its conversation, so a trigger lost to a crash
            before that fires again at the next start.
        last_fired: Reads the slot each schedule last fired for, by name (from the store);
            read at each (re)start of :meth:`run`.
        clock: The wall clock (aware).
        sleep: The sleep.
        tolerance: How long after its slot a trigger still counts as on time (a backtest
            moves in candle steps: a slot inside the last step is on time).
    """

    def __init__(self, schedules: Sequence[Schedule], fire: Callable[[Trigger], None], *,
                 last_fired: Callable[[], Awaitable[Mapping[str, datetime]]] | None = None,
                 clock: Clock = lambda: datetime.now(UTC), sleep: Sleep = anyio.sleep,
                 tolerance: timedelta = timedelta(minutes=1)) -> None:
        self.schedules = list(schedules)
        self._fire = fire
        self._last_fired = last_fired
        self._clock = clock
        self._sleep = sleep
        self._tolerance = tolerance
        self.due: dict[str, datetime] = {}
        """When each schedule fires next, by name (for status and tests)."""

    async def run(self) -> None:
        """Fires schedules until cancelled: first any missed slot, then each slot as due."""
        if not self.schedules:
            return
        await self.start()
        while True:
            self.fire_due()
            wait = (min(self.due.values()) - self._clock()).total_seconds()
            await self._sleep(min(max(wait, 0.0), _LONGEST_NAP))

    async def start(self) -> None:
        """Fires any slot missed while the daemon was down, and sets when each schedule
        fires next (a backtest calls this, then :meth:`fire_due` at every step)."""
        fired = await self._last_fired() if self._last_fired is not None else {}
        now = self._clock()
        for schedule in self.schedules:
            last = fired.get(schedule.name)
            missed = catch_up_slot(schedule, last, now)
            if missed is not None:
                self._fire(_trigger(schedule, missed, late=True))
            self.due[schedule.name] = next_slot(schedule, missed or last or now, now)

    def fire_due(self) -> None:
        """Fires every schedule whose slot has come by the clock (once, however many slots
        passed)."""
        now = self._clock()
        for schedule in self.schedules:
            slot = self.due[schedule.name]
            if slot <= now:
                self._fire(_trigger(schedule, slot, late=now - slot > self._tolerance))
                self.due[schedule.name] = next_slot(schedule, slot, now)


def _trigger(schedule: Schedule, slot: datetime, *, late: bool) -> Trigger:
    when = slot.astimezone(schedule.timezone).strftime("%Y-%m-%d %H:%M %Z")
    note = (f"Scheduled for {when} ({schedule.describe()}); it comes late (the daemon was not "
            "running, or the machine was asleep) and fires once for every slot missed."
            if late else f"{when} ({schedule.describe()}).")
    return Trigger(kind="schedule", text=f"{schedule.text}\n{note}", source=schedule.name,
                   at=slot.timestamp())


def _format_interval(every: timedelta) -> str:
    seconds = int(every.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
