"""Write fencing: a daemon that lost a desk's lease can no longer write for that desk.

In a fleet each desk is held by one daemon through a lease (holder, epoch, expiry). A daemon
that was paused past its lease may wake up still believing it holds the desk; every write
that matters therefore names its desk (``Database.write(call, desk=...)``), and the
:class:`Fence` the database was opened with checks, inside the write's own savepoint and so
in the same transaction as the write, that this daemon still holds it. A refused write
changes nothing and raises :class:`FencedError` to its own caller only.

Exceptions::

    StoreError
    └── FencedError      this daemon no longer holds the desk; the write was refused
"""

from __future__ import annotations

from typing import Protocol

from trading_agent.errors import StoreError
from trading_agent.store.connection import Connection

__all__ = ["Fence", "FencedError"]


class FencedError(StoreError):
    """A write for a desk this daemon no longer holds was refused (it changed nothing).

    Args:
        desk: The desk.
        epoch: The lease epoch this daemon held, now stale.

    Attributes:
        desk: The desk.
        epoch: The stale epoch.
    """

    def __init__(self, desk: str, epoch: int) -> None:
        super().__init__(f"desk {desk}: this daemon no longer holds it (lease epoch {epoch} "
                         "is stale); the write was refused")
        self.desk = desk
        self.epoch = epoch


class Fence(Protocol):
    """Says whether this daemon still holds a desk (the fleet's lease side implements it)."""

    def check(self, connection: Connection, desk: str) -> None:
        """Checks the lease of ``desk`` on the write's own connection, in its transaction
        (it may lock the lease row, so a take-over waits for the write to commit).

        Args:
            connection: The connection the write runs on, inside its savepoint.
            desk: The desk the write is for.

        Raises:
            FencedError: This daemon no longer holds the desk.
        """
        ...
