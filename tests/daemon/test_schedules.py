"""Schedules: intervals and cron in the desk's time zone; missed slots fire once at start."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import anyio
import pytest

from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.schedules import Schedule, ScheduleRunner, catch_up_slot, next_slot
from trading_agent.errors import ConfigError

PARIS = ZoneInfo("Europe/Paris")


class FakeTime:
    """A wall clock that moves only when the runner sleeps."""

    def __init__(self, start: datetime) -> None:
        self.now = start
        self.sleeps: list[float] = []

    def clock(self) -> datetime:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += timedelta(seconds=seconds)
        await anyio.lowlevel.checkpoint()


def _stored(slots: dict[str, datetime]) -> Callable[[], Awaitable[dict[str, datetime]]]:
    async def read() -> dict[str, datetime]:
        return slots

    return read


async def _run_until(runner: ScheduleRunner, time: FakeTime, end: datetime) -> None:
    async with anyio.create_task_group() as group:
        group.start_soon(runner.run)
        while time.now < end:
            await anyio.lowlevel.checkpoint()
        group.cancel_scope.cancel()


def test_a_schedule_needs_exactly_one_kind_and_a_valid_cron() -> None:
    with pytest.raises(ConfigError, match="either every or cron"):
        Schedule("bad", "x")
    with pytest.raises(ConfigError, match="not a valid cron"):
        Schedule("bad", "x", cron="61 * * * *")
    with pytest.raises(ConfigError, match="positive"):
        Schedule("bad", "x", every=timedelta(0))


def test_cron_slots_follow_the_desk_wall_clock_across_daylight_saving() -> None:
    morning = Schedule("morning", "Review.", cron="0 9 * * *", timezone=PARIS)
    before_change = datetime(2024, 3, 30, 12, 0, tzinfo=UTC)

    first = next_slot(morning, before_change, before_change)
    second = next_slot(morning, first, first)

    assert first == datetime(2024, 3, 31, 7, 0, tzinfo=UTC)  # 9:00 CEST (UTC+2)
    assert second == datetime(2024, 4, 1, 7, 0, tzinfo=UTC)
    assert next_slot(morning, before_change, datetime(2024, 3, 29, 12, tzinfo=UTC)) == (
        datetime(2024, 3, 30, 8, 0, tzinfo=UTC))  # 9:00 CET (UTC+1)


def test_an_interval_counts_from_its_last_slot() -> None:
    every = Schedule("quarter", "Check.", every=timedelta(minutes=15))
    anchor = datetime(2024, 1, 1, 10, 0, tzinfo=UTC)

    assert next_slot(every, anchor, anchor) == anchor + timedelta(minutes=15)
    assert next_slot(every, anchor, anchor + timedelta(minutes=44)) == (
        anchor + timedelta(minutes=45))


def test_missed_slots_give_one_catch_up_slot_the_newest() -> None:
    hourly = Schedule("hourly", "Check.", cron="0 * * * *")
    last = datetime(2024, 1, 1, 10, 0, tzinfo=UTC)

    assert catch_up_slot(hourly, last, last + timedelta(minutes=59)) is None
    assert catch_up_slot(hourly, last, datetime(2024, 1, 1, 15, 30, tzinfo=UTC)) == (
        datetime(2024, 1, 1, 15, 0, tzinfo=UTC))
    assert catch_up_slot(hourly, None, datetime(2024, 1, 2, tzinfo=UTC)) is None


async def test_the_runner_fires_each_slot_on_time() -> None:
    start = datetime(2024, 1, 1, 10, 7, tzinfo=UTC)
    time = FakeTime(start)
    fired: list[Trigger] = []
    runner = ScheduleRunner(
        [Schedule("quarter", "Check the book.", cron="*/15 * * * *"),
         Schedule("every 40m", "Look around.", every=timedelta(minutes=40))],
        fired.append, clock=time.clock, sleep=time.sleep)

    await _run_until(runner, time, start + timedelta(minutes=61))

    slots = [(t.source, datetime.fromtimestamp(t.at, UTC).strftime("%H:%M")) for t in fired]
    assert slots == [("quarter", "10:15"), ("quarter", "10:30"), ("quarter", "10:45"),
                     ("every 40m", "10:47"), ("quarter", "11:00")]
    assert all(t.kind == "schedule" and t.text.startswith(("Check the book.", "Look around."))
               for t in fired)
    assert max(time.sleeps) <= 60.0  # the clock is read again at least every minute


async def test_slots_missed_while_down_fire_once_at_start() -> None:
    start = datetime(2024, 1, 1, 15, 30, tzinfo=UTC)
    time = FakeTime(start)
    fired: list[Trigger] = []
    runner = ScheduleRunner(
        [Schedule("hourly", "Check.", cron="0 * * * *"),
         Schedule("new", "Fresh.", cron="0 * * * *")],
        fired.append, last_fired=_stored({"hourly": datetime(2024, 1, 1, 10, 0, tzinfo=UTC)}),
        clock=time.clock, sleep=time.sleep)

    await _run_until(runner, time, start + timedelta(minutes=31))

    assert [(t.source, datetime.fromtimestamp(t.at, UTC).strftime("%H:%M")) for t in fired] == [
        ("hourly", "15:00"), ("hourly", "16:00"), ("new", "16:00")]
    assert "not running" in fired[0].text
    assert "not running" not in fired[1].text


NEW_YORK = ZoneInfo("America/New_York")


def _slots(schedule: Schedule, start: datetime, count: int) -> list[str]:
    slots, now = [], start
    for _ in range(count):
        now = next_slot(schedule, now, now)
        slots.append(now.astimezone(NEW_YORK).strftime("%m-%d %H:%M %Z"))
    return slots


def test_a_daily_cron_runs_once_when_its_hour_comes_twice_in_autumn() -> None:
    daily = Schedule("night", "Night review.", cron="30 1 * * *", timezone=NEW_YORK)
    # 2024-11-03: 01:00-02:00 comes twice in New York (EDT, then EST).
    assert _slots(daily, datetime(2024, 11, 2, 12, tzinfo=UTC), 3) == [
        "11-03 01:30 EDT", "11-04 01:30 EST", "11-05 01:30 EST"]
    # A restart in the repeated hour does not fire it again as a missed slot.
    fired = datetime(2024, 11, 3, 1, 30, tzinfo=NEW_YORK)  # fold 0: the EDT one
    assert catch_up_slot(daily, fired, datetime(2024, 11, 3, 6, 45, tzinfo=UTC)) is None
    # A job every hour still runs in both of them.
    hourly = Schedule("hourly", "Look.", cron="30 * * * *", timezone=NEW_YORK)
    assert _slots(hourly, datetime(2024, 11, 3, 5, 0, tzinfo=UTC), 3) == [
        "11-03 01:30 EDT", "11-03 01:30 EST", "11-03 02:30 EST"]


def test_a_daily_cron_in_the_skipped_spring_hour_runs_once_at_the_shifted_time() -> None:
    daily = Schedule("night", "Night review.", cron="30 2 * * *", timezone=NEW_YORK)
    # 2024-03-10: 02:00-03:00 does not exist in New York.
    assert _slots(daily, datetime(2024, 3, 9, 12, tzinfo=UTC), 3) == [
        "03-10 03:00 EDT", "03-11 02:30 EDT", "03-12 02:30 EDT"]
