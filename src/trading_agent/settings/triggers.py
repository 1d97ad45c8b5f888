"""What wakes a desk besides operators (``[desks.<name>.triggers]``)."""

from __future__ import annotations

import re
from datetime import timedelta

from croniter import croniter
from pydantic import Field, field_validator, model_validator

from trading_agent.settings.table import Table
from trading_agent.trading.exchange import timeframe_delta

__all__ = ["ScheduleSettings", "TickTriggerSettings", "TriggerSettings"]

_INTERVAL = re.compile(r"(\d+)([smhd])")
_INTERVAL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class TickTriggerSettings(Table):
    """Market triggers (``[desks.<name>.triggers] ticks = {...}``).

    Attributes:
        move_percent: Wake the desk when a symbol moved this many percent since it last
            looked; None for no move triggers.
        on_candle_close: Timeframes whose candle closes wake the desk (``["5m", "1h"]``).
    """

    move_percent: float | None = Field(default=None, gt=0, le=100)
    on_candle_close: list[str] = Field(default_factory=list)

    @field_validator("on_candle_close")
    @classmethod
    def _timeframes(cls, value: list[str]) -> list[str]:
        for timeframe in value:
            timeframe_delta(timeframe)
        return value


def _parse_interval(text: str) -> timedelta:
    """``"15m"``, ``"1h30m"``, ``"90s"``, ``"1d"`` as a duration."""
    compact = text.replace(" ", "")
    parts = _INTERVAL.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"{text!r} is not an interval; use a number and a unit s, m, h or d, "
                         "such as 30s, 15m, 4h, 1d or 1h30m")
    seconds = sum(int(number) * _INTERVAL_UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the interval must be longer than zero")
    return timedelta(seconds=seconds)


class ScheduleSettings(Table):
    """One schedule of a desk: ``{ every = "15m" }`` or ``{ cron = "*/30 * * * *" }``.

    Attributes:
        every: A fixed interval (``30s``, ``15m``, ``4h``, ``1d``, ``1h30m``).
        cron: A cron expression of five fields (minute hour day month weekday), read on the
            desk's wall clock (its ``timezone``).
        message: What the desk is told when the schedule fires.
        name: The schedule's name, unique per desk: its key for the last time it fired. By
            default ``every 15m`` or ``cron */30 * * * *``.
    """

    every: str | None = None
    cron: str | None = None
    message: str = Field(default="Scheduled check: review the market, your positions and "
                                 "your open orders, and act if needed.", min_length=1)
    name: str | None = Field(default=None, min_length=1)

    @field_validator("every")
    @classmethod
    def _check_every(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_interval(value)
        return value

    @field_validator("cron")
    @classmethod
    def _check_cron(cls, value: str | None) -> str | None:
        if value is None:
            return value
        allowed = ("five fields: minute hour day-of-month month day-of-week, such as "
                   "'*/30 * * * *' or '0 9 * * mon-fri'")
        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression ({allowed})")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleSettings:
        if (self.every is None) == (self.cron is None):
            raise ValueError("a schedule needs exactly one of every (such as \"15m\") or cron "
                             "(such as \"*/30 * * * *\")")
        return self

    @property
    def key(self) -> str:
        """The schedule's name: as configured, else derived from how it repeats."""
        if self.name is not None:
            return self.name
        return f"every {self.every}" if self.every is not None else f"cron {self.cron}"

    @property
    def interval(self) -> timedelta | None:
        """``every`` as a duration, or None for a cron schedule."""
        return _parse_interval(self.every) if self.every is not None else None


class TriggerSettings(Table):
    """What wakes a desk besides operators (``[desks.<name>.triggers]``).

    Attributes:
        ticks: Market moves and candle closes.
        schedules: Intervals and cron schedules.
    """

    ticks: TickTriggerSettings = Field(default_factory=TickTriggerSettings)
    schedules: list[ScheduleSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> TriggerSettings:
        seen: set[str] = set()
        for schedule in self.schedules:
            if schedule.key in seen:
                raise ValueError(f"two schedules are named {schedule.key!r}; give each a "
                                 "distinct name")
            seen.add(schedule.key)
        return self
