"""Who runs each desk in a fleet: a lease per desk (holder, epoch, expiry), and the daemons
that are alive.

A lease is taken when it is free or expired, and taking it raises its **epoch**; a holder
renews it well before it runs out. Every time comes from the database's clock, so the
daemons' own clocks never have to agree. The epoch fences the holder's writes: a write that
matters runs :meth:`DeskLeases.check` in its own transaction first, which takes a share
lock on the lease row and refuses the write unless this holder's epoch is still the lease's
and the lease has not run out. A take-over updates that row, so it waits for a write in
flight to commit, and every write after it sees the new epoch: a daemon that was paused and
lost its lease can never append a message or place an order afterwards.

PostgreSQL only: leases exist in a fleet, whose state is on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trading_agent.store.database import Database, Migration

__all__ = ["COMPONENT", "EVENT_BLOCK", "MIGRATIONS", "DeskLeases", "Lease"]

COMPONENT = "leases"
"""Its schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    """CREATE TABLE desk_leases (
    desk TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    expires_at REAL NOT NULL
)""",
    """CREATE TABLE fleet_daemons (
    daemon_id TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    seen_at REAL NOT NULL
)""",
    "CREATE SEQUENCE fleet_event_blocks",
)),)
"""Numbered migrations: a released one is never edited."""

EVENT_BLOCK = 2**36
"""Event ids per daemon start: at a thousand events a second, two years; and 2**17 starts
before the ids reach JavaScript's 2**53 (a browser's EventSource)."""

_NOW = "extract(epoch from clock_timestamp())::double precision"
"""The database's clock, in seconds since the epoch: the one clock every daemon shares."""


@dataclass(frozen=True)
class Lease:
    """A desk's lease as stored.

    Attributes:
        desk: The desk.
        holder: The daemon holding it (empty once released).
        epoch: How many times it was taken.
        expires_at: When it runs out unless renewed (the database's clock).
        live: Whether it had not run out when read.
    """

    desk: str
    holder: str
    epoch: int
    expires_at: float
    live: bool


class DeskLeases:
    """The leases and the roll of daemons, on the fleet's PostgreSQL store. Use :meth:`open`.

    Args:
        database: The open store, this component's schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._database = database

    @classmethod
    async def open(cls, target: Any) -> DeskLeases:
        """Opens the store and brings the leases' schema up to date.

        Args:
            target: The store (a ``PostgresTarget``).

        Raises:
            StoreError: The store cannot be opened.
        """
        return cls(await Database.open(target, MIGRATIONS, COMPONENT))

    async def close(self) -> None:
        """Lets go of the store."""
        await self._database.close()

    async def heartbeat(self, daemon_id: str, within: float) -> list[str]:
        """Says this daemon is alive, and reads who else is.

        Args:
            daemon_id: This daemon.
            within: Seconds: a daemon not seen for longer counts as gone.

        Returns:
            The live daemons' ids, sorted, this one included.
        """

        def beat(connection: Any) -> list[str]:
            connection.execute(
                f"INSERT INTO fleet_daemons (daemon_id, started_at, seen_at) "
                f"VALUES (?, {_NOW}, {_NOW}) ON CONFLICT (daemon_id) DO UPDATE SET "
                f"seen_at = excluded.seen_at", (daemon_id,))
            return sorted(row[0] for row in connection.execute(
                f"SELECT daemon_id FROM fleet_daemons WHERE seen_at > {_NOW} - ?",
                (within,)).fetchall())

        return await self._database.write(beat)

    async def leave(self, daemon_id: str) -> None:
        """Takes this daemon off the roll (a graceful stop): the others share its desks
        among themselves at once."""
        await self._database.write(lambda connection: connection.execute(
            "DELETE FROM fleet_daemons WHERE daemon_id = ?", (daemon_id,)))

    async def reserve_event_ids(self) -> int:
        """The first of :data:`EVENT_BLOCK` event ids no other daemon's bus uses (each daemon
        numbers its own events, and they share the store's events table).

        Returns:
            The first id of a block reserved for this start of this daemon.
        """
        block = await self._database.write(lambda connection: connection.execute(
            "SELECT nextval('fleet_event_blocks')").fetchone()[0])
        return int(block) * EVENT_BLOCK

    async def leases(self) -> dict[str, Lease]:
        """Every desk's lease, by desk."""
        return {lease.desk: lease for lease in await self._read("")}

    async def lease(self, desk: str) -> Lease | None:
        """One desk's lease; None when it was never taken."""
        found = await self._read(" WHERE desk = ?", desk)
        return found[0] if found else None

    async def _read(self, where: str, *parameters: str) -> list[Lease]:
        def read(connection: Any) -> list[Lease]:
            rows = connection.execute(
                f"SELECT desk, holder, epoch, expires_at, expires_at > {_NOW} "
                f"FROM desk_leases{where}", parameters).fetchall()
            return [Lease(desk, holder, int(epoch), float(expires), bool(live))
                    for desk, holder, epoch, expires, live in rows]

        return await self._database.read(read)

    async def acquire(self, desk: str, daemon_id: str, seconds: float) -> int | None:
        """Takes a desk's lease if nobody holds it (never taken, released, or run out).

        Args:
            desk: The desk.
            daemon_id: This daemon.
            seconds: How long the lease lasts unless renewed.

        Returns:
            The new epoch, or None when another daemon holds it.
        """

        def take(connection: Any) -> int | None:
            row = connection.execute(
                f"INSERT INTO desk_leases (desk, holder, epoch, expires_at) "
                f"VALUES (?, ?, 1, {_NOW} + ?) ON CONFLICT (desk) DO UPDATE SET "
                f"holder = excluded.holder, epoch = desk_leases.epoch + 1, "
                f"expires_at = excluded.expires_at "
                f"WHERE desk_leases.expires_at <= {_NOW} RETURNING epoch",
                (desk, daemon_id, seconds)).fetchone()
            return None if row is None else int(row[0])

        return await self._database.write(take)

    async def renew(self, held: Mapping[str, int], daemon_id: str,
                    seconds: float) -> set[str]:
        """Extends the leases this daemon holds.

        Args:
            held: The desks held, with their epochs.
            daemon_id: This daemon.
            seconds: How long from now each lasts.

        Returns:
            The desks still held; a desk missing was lost (it ran out and was taken, or its
            epoch moved on).
        """

        def extend(connection: Any) -> set[str]:
            kept: set[str] = set()
            for desk, epoch in held.items():
                row = connection.execute(
                    f"UPDATE desk_leases SET expires_at = {_NOW} + ? WHERE desk = ? AND "
                    f"holder = ? AND epoch = ? AND expires_at > {_NOW} RETURNING desk",
                    (seconds, desk, daemon_id, epoch)).fetchone()
                if row is not None:
                    kept.add(desk)
            return kept

        return await self._database.write(extend) if held else set()

    async def release(self, desks: Iterable[tuple[str, int]], daemon_id: str) -> None:
        """Gives leases up at once (a graceful stop, or a desk handed to another daemon):
        the next daemon may take each now instead of waiting for it to run out.

        Args:
            desks: The desks, with the epochs this daemon holds them at.
            daemon_id: This daemon.
        """
        rows = [(desk, daemon_id, epoch) for desk, epoch in desks]

        def give_up(connection: Any) -> None:
            for row in rows:
                connection.execute(
                    "UPDATE desk_leases SET holder = '', expires_at = 0 WHERE desk = ? AND "
                    "holder = ? AND epoch = ?", row)

        if rows:
            await self._database.write(give_up)

    @staticmethod
    def check(connection: Any, desk: str, daemon_id: str, epoch: int) -> bool:
        """Whether ``daemon_id`` still holds ``desk`` at ``epoch``, its lease not run out;
        run inside a write's transaction, it keeps a take-over out until that commits.

        Args:
            connection: The write's connection.
            desk: The desk.
            daemon_id: This daemon.
            epoch: The epoch this daemon took the desk at.
        """
        row = connection.execute(
            f"SELECT 1 FROM desk_leases WHERE desk = ? AND holder = ? AND epoch = ? AND "
            f"expires_at > {_NOW} FOR SHARE", (desk, daemon_id, epoch)).fetchone()
        return row is not None
