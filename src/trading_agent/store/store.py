"""The daemon's store: opens the one shared database and hands out its table families.

Each family is a module of its own, with its tables, its migrations and its queries; each
consumer depends on the narrow protocol it owns, not on this class:

- :attr:`Store.transcripts` (:mod:`~trading_agent.store.transcripts`): conversations,
  compactions, subagents, retractions, how turns ended; restored after a restart;
- :attr:`Store.images` (:mod:`~trading_agent.store.images`): pictures, once each;
- :attr:`Store.held_calls` (:mod:`~trading_agent.store.held_calls`): calls held for an
  operator's approval;
- :attr:`Store.inbox` (:mod:`~trading_agent.store.operator_inbox`): operator messages kept
  until they reach the desk;
- :attr:`Store.events` (:mod:`~trading_agent.store.event_log`): the event log;
- :attr:`Store.usage` (:mod:`~trading_agent.store.daily_usage`): tokens and cost per day;
- :attr:`Store.schedules` (:mod:`~trading_agent.store.schedule_state`): schedules' last slots;
- :attr:`Store.holds` (:mod:`~trading_agent.store.desk_holds`): paused desks;
- :attr:`Store.spend` (:mod:`~trading_agent.store.spend_resumes`): spend caps' resumes;
- :attr:`Store.equity` (:mod:`~trading_agent.store.equity_samples`): equity over time.

They share one :class:`~trading_agent.store.database.Database` (one writer, one group
commit), as do the trading layer's parts opened on the same file.

How the daemon uses it::

    store = await Store.open(database_path(settings.state_directory()))
    bus = EventBus(first_id=await store.events.last_event_id() + 1)
    group.start_soon(store.events.persist_events, bus.subscribe("store", max_buffer=50_000))
    conversation = await store.transcripts.restore_conversation("alpha", system_prompt)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from trading_agent.store.daily_usage import SqliteDailyUsage
from trading_agent.store.database import Database
from trading_agent.store.desk_holds import SqliteDeskHolds
from trading_agent.store.equity_samples import SqliteEquitySamples
from trading_agent.store.event_log import SqliteEventLog
from trading_agent.store.fencing import Fence
from trading_agent.store.held_calls import SqliteHeldCalls
from trading_agent.store.images import SqliteImages
from trading_agent.store.operator_inbox import SqliteOperatorInbox
from trading_agent.store.schedule_state import SqliteScheduleState
from trading_agent.store.schema import COMPONENT, MIGRATIONS
from trading_agent.store.spend_resumes import SqliteSpendResumes
from trading_agent.store.targets import PostgresTarget, StoreTarget
from trading_agent.store.transcripts import SqliteTranscripts

__all__ = ["DATABASE_NAME", "Store", "database_path"]

DATABASE_NAME = "trading-agent.sqlite3"
"""The file's name in the state directory; the trading layer opens the same file."""


def database_path(state_dir: Path | str) -> Path:
    """The SQLite file in a state directory.

    Args:
        state_dir: The daemon's state directory.

    Returns:
        ``state_dir / "trading-agent.sqlite3"``.
    """
    return Path(state_dir) / DATABASE_NAME


class Store:
    """The store of one daemon: its table families over one database. Use :meth:`open`
    (or ``async with await Store.open(...)``).

    Args:
        database: The open database, the store's schema applied.
        clock: Seconds since the epoch (injectable for tests).
        keeps_high_water: The event log keeps the highest event id stored, which a restarted
            daemon numbers on from (not in a fleet).
    """

    def __init__(self, database: Database, *, clock: Callable[[], float] = time.time,
                 keeps_high_water: bool = True) -> None:
        self._db = database
        self.images = SqliteImages(database)
        self.held_calls = SqliteHeldCalls(database, clock=clock)
        self.transcripts = SqliteTranscripts(database, self.held_calls, clock=clock)
        self.inbox = SqliteOperatorInbox(database)
        self.events = SqliteEventLog(database, keeps_high_water=keeps_high_water)
        self.usage = SqliteDailyUsage(database, clock=clock)
        self.schedules = SqliteScheduleState(database)
        self.holds = SqliteDeskHolds(database)
        self.spend = SqliteSpendResumes(database)
        self.equity = SqliteEquitySamples(database, clock=clock)

    @classmethod
    async def open(cls, target: StoreTarget, *, clock: Callable[[], float] = time.time,
                   fence: Fence | None = None) -> Store:
        """Opens (or creates) the store and brings its schema up to date.

        Args:
            target: The SQLite file (see :func:`database_path`; its folder is created), or
                the PostgreSQL database.
            clock: Seconds since the epoch.
            fence: Checks before each write for a desk that this daemon still holds it;
                None: nothing is fenced (one daemon).

        Raises:
            StoreError: The store cannot be opened or migrated.
        """
        # In a fleet each daemon numbers its events from a block of ids of its own: no high
        # water to keep, and one row every daemon wrote would make their event writes wait
        # on one another (and on a daemon stopped in the middle of a transaction).
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence),
                   clock=clock, keeps_high_water=fence is None)

    @property
    def database(self) -> Database:
        """The shared database the families use."""
        return self._db

    @property
    def target(self) -> Path | PostgresTarget:
        """The SQLite file, or the PostgreSQL database."""
        return self._db.target

    @property
    def path(self) -> Path:
        """The SQLite file.

        Raises:
            StoreError: The store is on PostgreSQL (see :attr:`target`).
        """
        return self._db.path

    async def close(self) -> None:
        """Closes the database once pending calls have finished (idempotent)."""
        await self._db.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
