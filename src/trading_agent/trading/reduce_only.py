"""Reduce-only: a desk may shrink its positions but take no new exposure.

An operator switches it on for a desk (``trading-agent reduce-only on DESK``), or a
protection trips (:mod:`.protections`), or a spend cap is reached with ``on_cap =
"reduce_only"``. While it is on, the desk's :class:`~trading_agent.trading.risk.RiskPolicy`
refuses every order that would open or grow a position (or cross zero), naming who set it,
why and when it lifts; an order that only makes a position smaller passes.

One that an operator set stays until an operator switches it off; one a protection (or a
spend cap) set lifts by itself at its ``until``, on the desk's clock (the replayed time on a
paper replay or a backtest). Each is kept in the store before it is reported on, so it
outlives a restart. A protection never replaces an operator's; an operator's replaces a
protection's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

__all__ = ["ReduceOnly", "ReduceOnlyRecords", "ReduceOnlyStates"]


@dataclass(frozen=True)
class ReduceOnly:
    """A desk in reduce-only.

    Attributes:
        desk: The desk.
        by: Who set it: an operator's name, ``protection NAME``, or ``spend cap``.
        reason: Why, with the numbers when a protection set it.
        at: When, on the desk's clock.
        until: When it lifts by itself; None for when an operator lifts it.
        protection: The protection that set it, when one did.
    """

    desk: str
    by: str
    reason: str
    at: datetime
    until: datetime | None = None
    protection: str | None = None

    def active(self, now: datetime) -> bool:
        """Whether it still holds at ``now``."""
        return self.until is None or now < self.until

    def lifts(self) -> str:
        """When it lifts, in words."""
        if self.until is None:
            return "until an operator switches it off"
        return f"until {self.until:%Y-%m-%d %H:%M:%S} UTC"

    def describe(self) -> str:
        """``reduce-only by NAME at TIME: REASON (until ...)``."""
        return (f"reduce-only by {self.by} at {self.at:%Y-%m-%d %H:%M:%S} UTC: {self.reason} "
                f"({self.lifts()})")

    def to_dict(self) -> dict[str, str | None]:
        """JSON-ready, for the operator API."""
        return {"desk": self.desk, "by": self.by, "reason": self.reason,
                "at": self.at.isoformat(),
                "until": None if self.until is None else self.until.isoformat(),
                "protection": self.protection, "text": self.describe()}


class ReduceOnlyRecords(Protocol):
    """Where the desks in reduce-only are kept across restarts (the store's
    ``store.reduce_only.SqliteReduceOnly``)."""

    async def load(self) -> dict[str, ReduceOnly]:
        """The desks in reduce-only, by desk."""
        ...

    async def put(self, state: ReduceOnly) -> None:
        """Keeps a desk's reduce-only; stored before this returns."""
        ...

    async def delete(self, desk: str) -> None:
        """Forgets a desk's reduce-only."""
        ...

    async def close(self) -> None:
        """Lets go of the store."""
        ...


Announce = Callable[[ReduceOnly, bool, str], None]
"""Told of each reduce-only that goes on (True) or off (False), and by whom."""


class ReduceOnlyStates:
    """Every desk's reduce-only state. Use :meth:`restore` (kept by the store) or
    :meth:`in_memory`.

    Args:
        records: Where the states are kept, or None for memory only.
        states: The desks in reduce-only, by desk.
    """

    def __init__(self, records: ReduceOnlyRecords | None = None,
                 states: dict[str, ReduceOnly] | None = None) -> None:
        self._records = records
        self._states: dict[str, ReduceOnly] = dict(states or {})
        self.on_change: Announce | None = None
        """Told of every change once it is stored (the daemon publishes it)."""

    @classmethod
    def in_memory(cls) -> ReduceOnlyStates:
        """States forgotten when the process ends (tests, backtests)."""
        return cls()

    @classmethod
    async def restore(cls, records: ReduceOnlyRecords) -> ReduceOnlyStates:
        """The states kept in ``records``, which it keeps from then on (and closes).

        Raises:
            StoreError: They cannot be read.
        """
        try:
            states = await records.load()
        except BaseException:
            await records.close()
            raise
        return cls(records, states)

    async def refresh(self) -> None:
        """Reads the kept states again: in a fleet another daemon may have set or lifted one
        (a desk taken over from it must obey it). Memory only: no-op.

        Raises:
            StoreError: They cannot be read.
        """
        if self._records is not None:
            self._states = dict(await self._records.load())

    def state_for(self, desk: str, now: datetime) -> ReduceOnly | None:
        """The desk's reduce-only if it holds at ``now``, else None."""
        state = self._states.get(desk)
        return state if state is not None and state.active(now) else None

    def states(self) -> list[ReduceOnly]:
        """Every state kept (one past its ``until`` included until it is lifted)."""
        return sorted(self._states.values(), key=lambda s: s.desk)

    async def switch_on(self, state: ReduceOnly) -> ReduceOnly:
        """Puts a desk in reduce-only; stored before this returns.

        An operator's (``until`` None) replaces whatever holds; a timed one (a protection's,
        a spend cap's) never replaces an operator's, and replaces another timed one only
        when it lasts longer.

        Returns:
            The state that now holds.
        """
        known = self._states.get(state.desk)
        if known is not None and known.active(state.at) and state.until is not None and (
                known.until is None or known.until >= state.until):
            return known
        if self._records is not None:
            await self._records.put(state)
        self._states[state.desk] = state
        if self.on_change is not None:
            self.on_change(state, True, state.by)
        return state

    async def switch_off(self, desk: str, by: str) -> ReduceOnly | None:
        """Lifts a desk's reduce-only.

        Returns:
            The state that held, or None when there was none.
        """
        state = self._states.get(desk)
        if state is None:
            return None
        if self._records is not None:
            await self._records.delete(desk)
        del self._states[desk]
        if self.on_change is not None:
            self.on_change(state, False, by)
        return state

    async def lift_expired(self, desk: str, now: datetime) -> ReduceOnly | None:
        """Lifts the desk's reduce-only if its time is up (by ``daemon``).

        Returns:
            The state lifted, or None.
        """
        state = self._states.get(desk)
        if state is None or state.active(now):
            return None
        return await self.switch_off(desk, "daemon")

    async def close(self) -> None:
        """Lets go of where the states are kept, if anywhere."""
        if self._records is not None:
            await self._records.close()
