"""One daemon's part in a fleet: which desks it holds, kept even across the daemons alive.

:class:`FleetMember` runs two loops beside the desks:

- **renewing**, every third of ``lease_seconds``: the daemon says it is alive (also while a
  look waits for a desk's turn to end) and each lease held is extended; one that
  cannot be (it ran out while the daemon was paused, and another took it) is dropped from
  :attr:`FleetMember.held` at once, which the fence reads, and its desk stopped;
- **balancing**, every second (every third of the lease if that is shorter; at once when
  another daemon says it let desks go): the daemon says it is alive, reads who else is, and
  works out its fair share, ``ceil(desks / daemons alive)``. Below it, it takes free desks,
  those that prefer it first; above it (a daemon joined), it hands the extra ones over at
  the end of their turns.

Preference is rendezvous hashing: each desk ranks the live daemons by a hash of the pair,
so a daemon that restarts tends to get its own desks back, and the desks of one that died
spread over the others instead of all landing on one.

:attr:`FleetMember.held` is also the **fence** of the store's writes
(:meth:`FleetMember.check`): a desk's write runs only while this daemon holds its lease
at the epoch it took it at.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import anyio
import structlog

from trading_agent.store.desk_leases import DeskLeases
from trading_agent.store.fencing import FencedError

__all__ = ["FleetMember", "preference"]

_log = structlog.get_logger(__name__)

_BALANCE_SECONDS = 1.0
"""How often the daemon looks for desks to take or hand over (a take-over waits for the
lease to run out, then for the next look: at most ``lease_seconds`` plus this)."""

DeskChange = Callable[[str], Awaitable[None]]
"""Starts or stops a desk, given its name."""


def preference(desk: str, daemon_id: str) -> int:
    """How much ``desk`` prefers ``daemon_id`` (rendezvous hashing: higher wins)."""
    digest = hashlib.blake2b(f"{desk}\0{daemon_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class FleetMember:
    """Holds this daemon's share of the desks.

    Args:
        leases: The fleet's leases.
        daemon_id: This daemon.
        desks: Every desk of the config, in config order.
        lease_seconds: How long a lease lasts unless renewed.
        start_desk: Starts a desk this daemon just took (builds it; it restores its
            transcript and resumes a cut-off turn).
        stop_desk: Stops a desk: at once when its lease was lost, at its turn's end when it
            is handed over.
    """

    def __init__(self, leases: DeskLeases, daemon_id: str, desks: Sequence[str], *,
                 lease_seconds: float, start_desk: DeskChange,
                 stop_desk: Callable[[str, bool], Coroutine[Any, Any, None]]) -> None:
        self._leases = leases
        self.daemon_id = daemon_id
        self.desks = list(desks)
        self.lease_seconds = lease_seconds
        self._start_desk = start_desk
        self._stop_desk = stop_desk
        self.held: dict[str, int] = {}
        """The desks this daemon holds, with the epoch it took each at."""
        self._last_epoch: dict[str, int] = {}
        self.live: list[str] = [daemon_id]
        """The daemons alive at the last look."""
        self._wake = anyio.Event()
        self._changing = anyio.Lock()
        self._leaving = False
        self._left = False

    # ------------------------------------------------------------------ the fence

    def check(self, connection: Any, desk: str) -> None:
        """Refuses a write for ``desk`` unless this daemon still holds its lease.

        Runs inside the write's transaction (see :meth:`DeskLeases.check`).

        Raises:
            FencedError: This daemon does not hold the desk, or no longer at its epoch.
        """
        epoch = self.held.get(desk)
        if epoch is None or not DeskLeases.check(connection, desk, self.daemon_id, epoch):
            raise FencedError(desk, epoch if epoch is not None else self._last_epoch.get(desk, 0))

    # ------------------------------------------------------------------ the loops

    async def run(self) -> None:
        """Renews and balances until cancelled."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._renewing)
            await self._balancing()

    def wake(self) -> None:
        """Looks again now (another daemon let desks go)."""
        self._wake.set()

    async def _renewing(self) -> None:
        while True:
            await anyio.sleep(self.lease_seconds / 3)
            held = dict(self.held)
            try:
                # Alive, also while a look waits for a desk's turn to end before handing it
                # over (the others must not count this daemon gone meanwhile).
                if not self._left:
                    await self._leases.heartbeat(self.daemon_id, within=self.lease_seconds)
                kept = await self._leases.renew(held, self.daemon_id, self.lease_seconds)
            except Exception as exc:  # the database is away: the leases may run out
                _log.error("fleet_renew_failed", daemon=self.daemon_id, error=str(exc))
                continue
            for desk in held.keys() - kept:
                if self.held.get(desk) == held[desk]:
                    del self.held[desk]  # the fence refuses its writes from this instant
                    _log.error("fleet_lease_lost", daemon=self.daemon_id, desk=desk,
                               epoch=held[desk])
                    await self._stop_desk(desk, True)

    async def _balancing(self) -> None:
        while not self._leaving:
            try:
                await self.balance()
            except Exception as exc:
                _log.error("fleet_balance_failed", daemon=self.daemon_id, error=str(exc))
            # Well within the lease: a daemon's heartbeat must never look a lease old.
            with anyio.move_on_after(min(_BALANCE_SECONDS, self.lease_seconds / 3)):
                await self._wake.wait()
            self._wake = anyio.Event()

    async def balance(self) -> None:
        """One look: says this daemon is alive, then takes or hands over desks toward its
        fair share."""
        async with self._changing:
            if self._leaving:
                return
            self.live = await self._leases.heartbeat(self.daemon_id,
                                                     within=self.lease_seconds)
            share = math.ceil(len(self.desks) / max(1, len(self.live)))
            if len(self.held) < share:
                await self._take(share - len(self.held))
            elif len(self.held) > share:
                await self._hand_over(self._least_preferred(len(self.held) - share))

    def _rank(self, desk: str) -> list[str]:
        """The live daemons, the one ``desk`` prefers first."""
        return sorted(self.live, key=lambda daemon: preference(desk, daemon), reverse=True)

    async def _take(self, wanted: int) -> None:
        leases = await self._leases.leases()
        free = [desk for desk in self.desks
                if desk not in self.held and not (desk in leases and leases[desk].live)]
        # Its own desks first; another's favourite only when that daemon is not taking it.
        free.sort(key=lambda desk: self._rank(desk).index(self.daemon_id))
        for desk in free[:wanted]:
            epoch = await self._leases.acquire(desk, self.daemon_id, self.lease_seconds)
            if epoch is None:
                continue  # another daemon was quicker
            self.held[desk] = self._last_epoch[desk] = epoch
            _log.info("fleet_desk_taken", daemon=self.daemon_id, desk=desk, epoch=epoch)
            try:
                await self._start_desk(desk)
            except Exception as exc:
                _log.error("fleet_desk_start_failed", daemon=self.daemon_id, desk=desk,
                           error=str(exc))
                await self._release([desk])

    def _least_preferred(self, count: int) -> list[str]:
        """The ``count`` held desks that rank this daemon lowest."""
        ranked = sorted(sorted(self.held),
                        key=lambda desk: self._rank(desk).index(self.daemon_id), reverse=True)
        return ranked[:count]

    async def _hand_over(self, desks: Sequence[str]) -> None:
        """Stops the desks at the end of their turns, all at once, and gives their leases
        up (daemons starting together: the first takes every desk, then hands the others
        theirs in one look)."""
        async with anyio.create_task_group() as group:
            for desk in desks:
                _log.info("fleet_desk_handed_over", daemon=self.daemon_id, desk=desk,
                          daemons=len(self.live))
                group.start_soon(self._stop_desk, desk, False)
        await self._release(desks)

    async def _release(self, desks: Sequence[str]) -> None:
        given = [(desk, self.held.pop(desk)) for desk in desks if desk in self.held]
        await self._leases.release(given, self.daemon_id)

    def stop_taking(self) -> None:
        """Takes no more desks (the daemon is stopping); the leases held are still renewed
        until :meth:`leave`."""
        self._leaving = True
        self.wake()

    async def leave(self) -> list[str]:
        """A graceful stop, once the desks have stopped: every lease given up at once and
        this daemon off the roll, so the others take the desks now instead of waiting for
        the leases to run out.

        Returns:
            The desks given up.
        """
        self._leaving = self._left = True
        async with self._changing:
            desks = list(self.held)
            await self._release(desks)
            await self._leases.leave(self.daemon_id)
            return desks
