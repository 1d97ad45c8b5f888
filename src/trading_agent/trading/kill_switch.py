"""The kill switch: an operator (or the daemon itself) stops every new order of a desk, or of
every desk, in one step.

While it is on, the desk's :class:`~trading_agent.trading.risk.RiskPolicy` refuses each new
order before anything else, with "halted by NAME at TIME: REASON", and no exchange sees it.
It stays on across restarts (a row in the state directory's SQLite file, written with full
durability before the switch reports itself on) until an operator switches it off.

A switch has a scope: a desk's name, or :data:`ALL_DESKS` for every desk of the daemon. A desk
is halted while either is on; switching one off leaves the other as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

__all__ = ["ALL_DESKS", "Halt", "HaltRecords", "KillSwitch"]

ALL_DESKS = "*"
"""The scope of a switch that halts every desk (no desk can be named so)."""

@dataclass(frozen=True)
class Halt:
    """A kill switch that is on.

    Attributes:
        scope: The desk it halts, or :data:`ALL_DESKS`.
        by: Who switched it on (an operator's name, ``risk`` for the daily loss limit,
            ``daemon`` after failed turns).
        at: When.
        reason: Why, as they gave it.
    """

    scope: str
    by: str
    at: datetime
    reason: str

    def describe(self) -> str:
        """``halted by NAME at TIME: REASON``."""
        return f"halted by {self.by} at {self.at:%Y-%m-%d %H:%M:%S} UTC: {self.reason}"

    def to_dict(self) -> dict[str, str]:
        """JSON-ready, for the operator API."""
        return {"scope": self.scope, "by": self.by, "at": self.at.isoformat(),
                "reason": self.reason, "text": self.describe()}


class HaltRecords(Protocol):
    """Where the switches that are on are kept across restarts (the store's
    ``store.halts.SqliteHalts``)."""

    async def load(self) -> dict[str, Halt]:
        """The switches that are on, by scope."""
        ...

    async def put(self, halt: Halt) -> None:
        """Keeps a switch that went on; stored before this returns."""
        ...

    async def delete(self, scope: str) -> None:
        """Forgets a switch that went off."""
        ...

    async def close(self) -> None:
        """Lets go of the file."""
        ...


class KillSwitch:
    """Every switch of a daemon. Use :meth:`restore` (kept by the store) or :meth:`in_memory`.

    Args:
        records: Where the switches are kept, or None for memory only.
        halts: The switches that are on, by scope.
    """

    def __init__(self, records: HaltRecords | None = None,
                 halts: dict[str, Halt] | None = None) -> None:
        self._records = records
        self._halts: dict[str, Halt] = dict(halts or {})
        self.on_change: Callable[[Halt, bool, str], None] | None = None
        """Told of every switch that goes on (True) or off (False), and by whom, once it is
        stored: the daemon publishes it to the operators, whoever switched it."""

    @classmethod
    def in_memory(cls) -> KillSwitch:
        """A kill switch forgotten when the process ends (tests, backtests)."""
        return cls()

    @classmethod
    async def restore(cls, records: HaltRecords) -> KillSwitch:
        """The switches kept in ``records``, which it keeps from then on (and closes).

        Raises:
            StoreError: They cannot be read.
        """
        try:
            halts = await records.load()
        except BaseException:
            await records.close()
            raise
        return cls(records, halts)

    async def refresh(self) -> None:
        """Reads the kept switches again: in a fleet another daemon may have switched one on
        or off (a desk taken over from it must obey the switch it set). Memory only: no-op.

        Raises:
            StoreError: They cannot be read.
        """
        if self._records is not None:
            self._halts = dict(await self._records.load())

    def halt_for(self, desk: str) -> Halt | None:
        """What halts a desk: its own switch first, else the daemon-wide one; None when it may
        trade."""
        return self._halts.get(desk) or self._halts.get(ALL_DESKS)

    def halts(self) -> list[Halt]:
        """Every switch that is on, the daemon-wide one first."""
        return sorted(self._halts.values(), key=lambda h: (h.scope != ALL_DESKS, h.scope))

    async def switch_on(self, scope: str, by: str, reason: str,
                        at: datetime | None = None) -> Halt:
        """Switches a scope's kill switch on; stored before this returns. A switch already on
        keeps who switched it on first, and why.

        Args:
            scope: A desk's name, or :data:`ALL_DESKS`.
            by: Who.
            reason: Why (required: the refusal quotes it).
            at: When; now by default.

        Returns:
            The switch as it now is.
        """
        known = self._halts.get(scope)
        if known is not None:
            return known
        halt = Halt(scope, by, at or datetime.now(UTC), reason.strip() or "no reason given")
        if self._records is not None:
            await self._records.put(halt)
        self._halts[scope] = halt
        if self.on_change is not None:
            self.on_change(halt, True, halt.by)
        return halt

    async def switch_off(self, scope: str, by: str = "operator") -> Halt | None:
        """Switches a scope's kill switch off.

        Args:
            scope: A desk's name, or :data:`ALL_DESKS`.
            by: Who.

        Returns:
            The switch that was on, or None when it was off already.
        """
        halt = self._halts.get(scope)
        if halt is None:
            return None
        if self._records is not None:
            await self._records.delete(scope)
        del self._halts[scope]
        if self.on_change is not None:
            self.on_change(halt, False, by)
        return halt

    async def close(self) -> None:
        """Lets go of where the switches are kept, if anywhere."""
        if self._records is not None:
            await self._records.close()
