"""A daemon as one node of a fleet: what it opens, runs beside its desks, and gives up.

:func:`open_node` connects to the fleet (the leases on the shared PostgreSQL store, NATS)
and yields a :class:`FleetNode`. The application layer then builds no desk up front: the
node's :class:`~trading_agent.fleet.member.FleetMember` takes this daemon's share of the
desks and, for each desk it takes, the node builds it (it restores its transcript and
resumes a cut-off turn, as after a restart), starts it under the supervisor and serves its
inbox and requests; for each desk it loses or hands over, it stops it and closes what the
desk had opened.

Every event of this daemon's desks is also published to the fleet's event stream
(:meth:`FleetNode.share_events`), which every daemon's operator API shows.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event
from trading_agent.errors import ConfigError
from trading_agent.fleet.bus import FleetBus
from trading_agent.fleet.control import DeskService, FleetControl
from trading_agent.fleet.member import FleetMember
from trading_agent.store.desk_leases import DeskLeases

if TYPE_CHECKING:
    from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
    from trading_agent.operator.approvals import ApprovalBook
    from trading_agent.settings import Settings
    from trading_agent.store.store import Store

__all__ = ["FleetNode", "open_node"]

_log = structlog.get_logger(__name__)

DeskBuilder = Callable[[str, AsyncExitStack], Awaitable["DeskRuntime"]]
"""Builds a desk this daemon took, opening what it needs on the given stack."""


@dataclass
class _Running:
    """A desk this daemon runs: what it opened, and the task serving its inbox."""

    stack: AsyncExitStack
    serving: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class FleetNode:
    """This daemon's part of the fleet. Use :func:`open_node`.

    Args:
        settings: The daemon's settings.
        leases: The fleet's leases.
        bus: The fleet's NATS.
        daemon_id: This daemon.
    """

    def __init__(self, settings: Settings, leases: DeskLeases, bus: FleetBus,
                 daemon_id: str) -> None:
        self.settings = settings
        self.leases = leases
        self.bus = bus
        self.daemon_id = daemon_id
        self.member = FleetMember(leases, daemon_id, list(settings.desks),
                                  lease_seconds=settings.fleet.lease_seconds,
                                  start_desk=self._start_desk, stop_desk=self._stop_desk)
        self._supervisor: Supervisor | None = None
        self._build: DeskBuilder | None = None
        self._service: DeskService | None = None
        self._running: dict[str, _Running] = {}

    def attach(self, supervisor: Supervisor, store: Store, build: DeskBuilder,
               approvals: ApprovalBook | None = None) -> FleetControl:
        """Gives the node the supervisor to run desks under and how to build one, and the
        approval book whose held calls operators on other daemons answer.

        Returns:
            The operator API's view of every desk of the fleet.
        """
        self._supervisor, self._build = supervisor, build
        self._service = DeskService(supervisor, self.bus, store.inbox, approvals)
        supervisor.on_shutdown.append(self.member.stop_taking)
        supervisor.on_shutdown.append(self._service.stopping)
        return FleetControl(supervisor, self.member, self.bus, self.leases, store.transcripts,
                            list(self.settings.desks))

    async def first_event_id(self) -> int:
        """Where this daemon's bus starts numbering: a block of ids of its own."""
        return await self.leases.reserve_event_ids()

    async def run(self) -> None:
        """Takes, keeps and hands over desks until cancelled (a supervisor service); hears
        when another daemon lets desks go."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._hear_releases)
            await self.member.run()

    async def _hear_releases(self) -> None:
        async for _ in self.bus.released():
            self.member.wake()

    async def share_events(self, subscription: Subscription) -> None:
        """Publishes every event of this daemon's desks to the fleet's stream, until the
        subscription closes."""
        while True:
            event: Event | None
            try:
                event = await subscription.get()
            except anyio.EndOfStream:
                return
            while event is not None:
                if event.id > 0:  # not a drop report
                    self.bus.publish_event(event.desk, event.to_dict())
                event = subscription.get_nowait()

    async def _start_desk(self, desk: str) -> None:
        assert self._supervisor is not None and self._build is not None
        assert self._service is not None
        stack = AsyncExitStack()
        try:
            runtime = await self._build(desk, stack)
        except BaseException:
            await stack.aclose()
            raise
        running = self._running[desk] = _Running(stack)
        await self._supervisor.add_desk(runtime)
        service = self._service

        async def serve() -> None:
            with running.serving:
                await service.run(desk)

        self._supervisor.start_task(f"fleet inbox {desk}", serve, desk)

    async def _stop_desk(self, desk: str, lost: bool) -> None:
        """Stops a desk: at once when its lease was lost (its writes are refused anyway),
        at the end of its turn when handed over; then closes what it opened."""
        assert self._supervisor is not None
        running = self._running.pop(desk, None)
        if running is not None:
            if lost:
                running.serving.cancel()
            else:  # no message taken from now on; the requests answered until the turn ends
                assert self._service is not None  # attached before any desk started
                await self._service.stop_taking(desk)
        if desk in self._supervisor.desk_names():
            if lost:
                self._supervisor.cancel_turn(desk, "fleet: lease lost", now=True)
            await self._supervisor.remove_desk(desk, finish_turn=not lost)
        if running is not None:
            running.serving.cancel()
            with anyio.CancelScope(shield=True):
                await running.stack.aclose()
        _log.info("fleet_desk_stopped", daemon=self.daemon_id, desk=desk,
                  why="lease lost" if lost else "handed over")

    async def leave(self) -> None:
        """A graceful stop, once the supervisor has stopped the desks: their leases given up
        at once and the others told, so they take the desks now."""
        for running in self._running.values():
            running.serving.cancel()
            with anyio.CancelScope(shield=True):
                await running.stack.aclose()
        self._running.clear()
        given = await self.member.leave()
        if given:
            await self.bus.announce_released(given)
        _log.info("fleet_left", daemon=self.daemon_id, desks=given)


@asynccontextmanager
async def open_node(settings: Settings, store_target: object,
                    environ: Mapping[str, str] | None = None) -> AsyncIterator[FleetNode]:
    """Joins the fleet: the leases' schema brought up to date, NATS connected.

    Args:
        settings: The daemon's settings (``store`` and ``fleet``).
        store_target: The shared store.
        environ: Where NATS' password or token and the fleet's key are read
            (``os.environ`` by default).

    Raises:
        StoreError: The store cannot be opened.
        ConfigError: NATS cannot be reached (naming its URL), the fleet's key is missing or
            too short, or a certificate file of ``[fleet]`` cannot be used.
    """
    daemon_id = settings.fleet.resolved_daemon_id()
    assert settings.fleet.nats_url is not None
    environ = os.environ if environ is None else environ
    try:
        key = settings.fleet.fleet_key(environ)
        sign_in = settings.fleet.nats_sign_in(environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    async with AsyncExitStack() as stack:
        leases = await DeskLeases.open(store_target)
        stack.push_async_callback(leases.close)
        bus = await stack.enter_async_context(FleetBus.connect(
            sign_in.url, daemon_id, prefix=settings.fleet.nats_prefix, user=sign_in.user,
            password=sign_in.password, token=sign_in.token,
            credentials_file=sign_in.credentials_file, tls=sign_in.tls, key=key))
        node = FleetNode(settings, leases, bus, daemon_id)
        yield node
