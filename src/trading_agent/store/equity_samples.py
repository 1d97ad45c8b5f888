"""Each desk's equity over time (the ``equity_samples`` table), for the web page's chart:
sampled on a timer and on every fill (:mod:`trading_agent.operator.equity`), and thinned as
it grows so that a desk's whole life fits in a bounded number of rows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "SqliteEquitySamples"]

TABLES = ("equity_samples",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((4, (
    # Each desk's equity over time, for the web page's chart: sampled on a timer and on
    # every fill, and thinned as it grows (record_equity_sample keeps it bounded).
    """CREATE TABLE equity_samples (
            desk TEXT NOT NULL,
            at REAL NOT NULL,
            equity REAL NOT NULL)""",
    "CREATE INDEX equity_samples_by_desk ON equity_samples (desk, at)",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


class SqliteEquitySamples:
    """The equity samples in the store.

    Args:
        database: The open store, its schema applied.
        clock: Seconds since the epoch (a sample's default time).
    """

    def __init__(self, database: Database, *, clock: Callable[[], float] = time.time) -> None:
        self._db = database
        self._clock = clock

    async def record_equity_sample(self, desk: str, equity: float, at: float | None = None, *,
                                   keep: int = 3000) -> None:
        """Adds one sample of a desk's equity, keeping the desk's history bounded.

        Past ``keep`` samples, the newest half stays as it is and the older ones are thinned
        to one (the last) per equal stretch of time, at most ``keep // 4`` stretches over
        their span, the desk's first sample kept too. So at most ``keep`` rows hold the whole
        life of a desk: the recent curve in full, the older one evenly coarser as it grows.

        Args:
            desk: The desk.
            equity: Its account value in the quote currency.
            at: When, seconds since the epoch (now by default).
            keep: The most samples kept for the desk (at least 4); 3,000 by default, so the
                last day at one a minute stays whole.

        Raises:
            ValueError: ``equity`` is not a finite number, or ``keep`` is below 4.
        """
        if not math.isfinite(equity):
            raise ValueError(f"desk {desk}: an equity sample must be a finite number, not "
                             f"{equity!r}")
        if keep < 4:
            raise ValueError(f"keep must be at least 4, not {keep}")
        when = self._clock() if at is None else at

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO equity_samples (desk, at, equity) VALUES (?, ?, ?)",
                               (desk, when, float(equity)))
            (count,) = connection.execute(
                "SELECT COUNT(*) FROM equity_samples WHERE desk = ?", (desk,)).fetchone()
            if count <= keep:
                return
            older: list[tuple[int, float]] = connection.execute(
                "SELECT rowid, at FROM equity_samples WHERE desk = ? ORDER BY at, rowid "
                "LIMIT ?", (desk, count - keep // 2)).fetchall()
            # Stretches on a fixed grid (a power of two seconds wide): a kept sample stays
            # the last of its stretch as later passes widen them, so none is lost by chance.
            stretches, first, last = keep // 4, older[0][1], older[-1][1]
            width = 1.0
            while last // width - first // width + 1 > stretches:
                width *= 2
            last_of_stretch = {at // width: rowid for rowid, at in older}
            kept = {older[0][0], *last_of_stretch.values()}
            connection.executemany("DELETE FROM equity_samples WHERE rowid = ?",
                                   [(rowid,) for rowid, _ in older if rowid not in kept])

        await self._db.write(write, desk=desk)

    async def equity_samples(self, desk: str) -> list[tuple[float, float]]:
        """A desk's equity samples as ``(at, equity)``, oldest first."""

        def read(connection: Connection) -> list[tuple[float, float]]:
            return [(float(at), float(equity)) for at, equity in connection.execute(
                "SELECT at, equity FROM equity_samples WHERE desk = ? ORDER BY at, rowid",
                (desk,))]

        return await self._db.read(read)
