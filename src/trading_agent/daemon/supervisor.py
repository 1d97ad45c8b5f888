"""The supervisor: every desk of a daemon in one task group.

:class:`Supervisor` runs each desk (and what runs beside it: its schedules, its market
watcher) in a task of its own, and the services the desks share (the price feeds they
trade on) once every desk is ready; it is the :class:`DeskControl` the operator
API talks to. A desk's failures stay inside the desk (see :mod:`.desk`); a failing service
beside it is logged and restarted with backoff. The process around it (signals, systemd,
the operator API) is :mod:`trading_agent.app.running`'s.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.abc
import structlog
from anyio.abc import TaskStatus

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.books_view import cancel_desk_order, decimal_text, read_books
from trading_agent.daemon.control import DeskReply, DeskStatus, UnknownDeskError
from trading_agent.daemon.desk import Backoff, Desk
from trading_agent.daemon.heap import HeapKeeper, is_compaction
from trading_agent.daemon.mailbox import Delivery
from trading_agent.daemon.pins import DeskPins
from trading_agent.daemon.spend import SPEND_CAP, SpendGuard
from trading_agent.errors import ConfigError
from trading_agent.trading.kill_switch import ALL_DESKS, KillSwitch
from trading_agent.trading.reduce_only import ReduceOnly, ReduceOnlyStates

if TYPE_CHECKING:
    from trading_agent.store.daily_usage import DailyUsage
    from trading_agent.trading.desk_books import DeskBooks
    from trading_agent.trading.risk import RiskPolicy

__all__ = ["DeskRuntime", "Service", "Supervisor"]

_log = structlog.get_logger(__name__)

Service = Callable[[], Awaitable[None]]
"""Something that runs beside a desk until cancelled (a schedule runner, a market watcher)."""

AccountProbe = Callable[[], Awaitable[tuple[float | None, int]]]
"""Gives a desk's equity (None when unknown) and its number of open orders."""

Reloader = Callable[[str], Awaitable[list[str]]]
"""Reads the config again and applies it, given who asked; returns what changed, or raises
ConfigError (nothing changed)."""


_STATUS_PROBE_SECONDS = 2.0
"""How long a status request waits for the exchange before leaving its figures out."""


class _Transcripts(Protocol):
    async def transcript(self, desk: str, before_seq: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]: ...


class _EventLog(Protocol):
    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]: ...


class _Usage(Protocol):
    async def usage_on(self, desk: str) -> DailyUsage: ...


class _History(Protocol):
    """What the supervisor reads back from the store for operators."""

    @property
    def transcripts(self) -> _Transcripts: ...
    @property
    def events(self) -> _EventLog: ...
    @property
    def usage(self) -> _Usage: ...


class _Approvals(Protocol):
    def pending_count(self, desk: str) -> int: ...


@dataclass
class DeskRuntime:
    """One desk and what runs beside it.

    Attributes:
        desk: The desk.
        services: Named tasks run while the desk runs (restarted with backoff if they fail,
            left alone if they return).
        account: Gives the desk's equity and open orders for its status, when it trades.
        risk: The desk's risk policy, which cancels its orders and closes its positions for
            the kill switch.
        books: The desk's own books (its orders, fills, positions and profit), read for
            operators; None when it keeps none (its status and views then show none).
    """

    desk: Desk
    services: list[tuple[str, Service]] = field(default_factory=list)
    account: AccountProbe | None = None
    risk: RiskPolicy | None = None
    books: DeskBooks | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class Supervisor:
    """Runs the desks and answers for them (a :class:`DeskControl`).

    Args:
        runtimes: The desks, in config order.
        event_bus: The daemon's bus.
        history: The store, for transcripts, stored events and usage.
        approvals: The approval book, for each desk's pending approvals.
        shutdown_timeout: Seconds a shutdown waits for running turns to reach a safe point.
        service_backoff: The waits before a failed service is restarted.
        services: Named tasks the desks share (a replay several desks trade on), started
            once every desk is ready (so the desks' watchers have subscribed) and run like a
            desk's services until the desks stop (their failures are published for desk
            ``*``).
        clock: Seconds since the epoch.
        kill_switch: The daemon's kill switch, which every desk's risk policy obeys.
        spend: The daily spend caps, for the desks' status.
        reduce_only: The desks' reduce-only states, which every desk's risk policy obeys.
        heap_keeper: Freezes the long-lived heap once every desk has restored, after a desk
            is added and after each compaction (see :mod:`.heap`); None: left alone.
        pins: The desks' standing instructions (:mod:`.pins`); None keeps them in memory.
    """

    def __init__(self, runtimes: Sequence[DeskRuntime], event_bus: EventBus, history: _History,
                 *, approvals: _Approvals | None = None, shutdown_timeout: float = 8.0,
                 service_backoff: Backoff | None = None,
                 services: Sequence[tuple[str, Service]] = (),
                 clock: Callable[[], float] = time.time,
                 kill_switch: KillSwitch | None = None,
                 spend: SpendGuard | None = None,
                 reduce_only: ReduceOnlyStates | None = None,
                 heap_keeper: HeapKeeper | None = None,
                 pins: DeskPins | None = None) -> None:
        self._runtimes: dict[str, DeskRuntime] = {r.desk.name: r for r in runtimes}
        self.event_bus = event_bus
        self._history = history
        self._approvals = approvals
        self.shutdown_timeout = shutdown_timeout
        self._service_backoff = service_backoff or Backoff()
        self.services = list(services)
        """The shared services."""
        self._clock = clock
        self.kill_switch = kill_switch or KillSwitch.in_memory()
        self.spend = spend
        self.reduce_only = reduce_only or ReduceOnlyStates.in_memory()
        self.heap_keeper = heap_keeper
        self.pins = pins or DeskPins(None, lambda: datetime.now(UTC), event_bus)
        """The desks' standing instructions (kept in the store by the daemon)."""
        self.reloader: Reloader | None = None
        """Reads the config again (``reload``, SIGHUP); None when there is no file."""
        self._group: anyio.abc.TaskGroup | None = None
        self._reloading = anyio.Lock()
        self._stop_requested = anyio.Event()
        self.stopped = anyio.Event()
        """Set once every desk has stopped."""
        self.on_shutdown: list[Callable[[], None]] = []
        """Told when a shutdown starts (a fleet's node then takes no more desks)."""

    # ------------------------------------------------------------------ DeskControl

    def desk_names(self) -> Sequence[str]:
        """The desks, in config order."""
        return list(self._runtimes)

    @property
    def runtimes(self) -> Sequence[DeskRuntime]:
        """The desks and their services, in config order."""
        return list(self._runtimes.values())

    def desk(self, name: str) -> Desk:
        """One desk.

        Raises:
            UnknownDeskError: No such desk.
        """
        return self._runtime(name).desk

    async def desk_status(self, desk: str) -> DeskStatus:
        """One desk's status, with its equity, usage today and pending approvals.

        Raises:
            UnknownDeskError: No such desk.
        """
        runtime = self._runtime(desk)
        status = runtime.desk.status()
        update: dict[str, Any] = {}
        usage = await self._history.usage.usage_on(desk)
        update["tokens_today"], update["cost_today"] = usage.total_tokens, usage.cost
        update["prompt_tokens_today"] = usage.input_tokens
        update["cached_tokens_today"] = usage.cached_input_tokens
        update["cache_share_today"] = usage.cache_share
        if self._approvals is not None:
            update["pending_approvals"] = self._approvals.pending_count(desk)
        halt = self.kill_switch.halt_for(desk)
        update["kill_switch"] = halt.describe() if halt is not None else ""
        if self.spend is not None:
            update["spend"] = self.spend.figures(desk)
        # The runtime read at the start: a fleet may hand the desk over during an await.
        held = self.reduce_only.state_for(desk, _clock_of(runtime))
        update["reduce_only"] = held.to_dict() if held is not None else None
        if runtime.account is not None:
            with anyio.move_on_after(_STATUS_PROBE_SECONDS):
                try:
                    update["equity"], update["open_orders"] = await runtime.account()
                except Exception as exc:  # a status must not fail because a price is missing
                    _log.warning("desk_account_unavailable", desk=desk, error=str(exc))
        if runtime.books is not None:
            with anyio.move_on_after(_STATUS_PROBE_SECONDS):
                try:
                    summary = await runtime.books.summary()
                    update["realized_today"] = decimal_text(summary.realized_today)
                    update["unrealized"] = decimal_text(summary.unrealized)
                except Exception as exc:  # nor because the books could not be read
                    _log.warning("desk_books_unavailable", desk=desk, error=str(exc))
        return status.model_copy(update=update)

    async def books(self, desk: str, view: str, *, since: date | None = None,
                    open_only: bool = False, period: str = "daily") -> dict[str, Any]:
        """One view of a desk's own books, JSON-ready (see :mod:`.books_view`).

        Raises:
            UnknownDeskError: No such desk.
            ValueError: An unknown view or period.
        """
        return await read_books(self._runtime(desk).books, desk, view, since=since,
                                open_only=open_only, period=period)

    async def cancel_order(self, desk: str, order_id: str, by: str) -> dict[str, Any]:
        """Cancels one open order of the desk's own books on its exchange.

        Raises:
            UnknownDeskError: No such desk.
            UnknownOrderError: The desk has no open order of that id.
            CancelRefusedError: The desk keeps no books, or the order is not answered yet.
            ExchangeError: The exchange could not cancel it.
        """
        runtime = self._runtime(desk)
        exchange = runtime.risk.exchange if runtime.risk is not None else None
        answer = await cancel_desk_order(runtime.books, exchange, desk, order_id)
        _log.info("order_cancelled_by_operator", desk=desk, by=by,
                  order_id=answer["order"]["order_id"], status=answer["order"]["status"])
        return answer

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: Sequence[ImageBlock] = (), *,
                           message_id: str | None = None) -> str:
        """Stores an operator's message, then steers the running turn or queues a turn
        (a message of ``message_id`` sent before: neither again).

        Returns:
            The message's id.

        Raises:
            UnknownDeskError: No such desk.
            ImageRejectedError: A picture cannot be used; nothing was stored.
        """
        return await self._runtime(desk).desk.send_message(text, source, images,
                                                           message_id=message_id)

    def message_delivery(self, desk: str, message_id: str) -> Delivery:
        """How desk ``desk``'s mailbox took a message just sent: ``steering`` or ``turn``.

        Raises:
            UnknownDeskError: No such desk.
        """
        return self._runtime(desk).desk.message_delivery(message_id)

    def message_limit(self, desk: str) -> int | None:
        """The most characters of one message desk ``desk``'s model reads whole.

        Raises:
            UnknownDeskError: No such desk.
        """
        return self._runtime(desk).desk.message_limit()

    async def compact(self, desk: str) -> bool:
        """Flushes memory and compacts a desk's conversation, after any running turn.

        Raises:
            UnknownDeskError: No such desk.
        """
        return await self._runtime(desk).desk.compact()

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        """A page of a desk's stored messages, newest last.

        Raises:
            UnknownDeskError: No such desk.
        """
        self._runtime(desk)
        return await self._history.transcripts.transcript(desk, before_seq=before, limit=limit)

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        """Stored events with an id above ``after_id``."""
        return await self._history.events.events_since(after_id, desk, limit)

    async def wait_for_reply(self, desk: str, message_id: str) -> DeskReply:
        """Waits for the end of the turn that read an operator's message.

        Raises:
            UnknownDeskError: No such desk.
        """
        return await self._runtime(desk).desk.reply_to(message_id)

    async def reload(self, by: str) -> list[str]:
        """Reads the config file again and applies it (one reload at a time).

        Returns:
            What changed, one line each.

        Raises:
            ConfigError: The new config is not valid (or there is no file); nothing changed.
        """
        if self.reloader is None:
            raise ConfigError("this daemon was not started from a config file: nothing to "
                              "reload")
        async with self._reloading:
            return await self.reloader(by)

    def start_service(self, name: str, service: Service) -> None:
        """Starts a shared service while the desks run (a replay a reload brought in)."""
        self.services.append((name, service))
        self.start_task(name, service)

    def start_task(self, name: str, task: Service, desk: str = "*") -> None:
        """Runs ``task`` beside the desks until it returns or they stop, restarted with
        backoff when it fails, and not kept among the services (a fleet's inbox of a desk
        it holds for a while, a request to another daemon)."""
        assert self._group is not None, "the supervisor is not running"
        self._group.start_soon(self._keep_running, desk, name, task, name=name)

    async def add_desk(self, runtime: DeskRuntime, waiting: Sequence[Trigger] = ()) -> None:
        """Starts a desk a reload built, with the triggers that waited for it."""
        assert self._group is not None, "the supervisor is not running"
        for trigger in waiting:
            runtime.desk.queue.put(trigger)
        self._runtimes[runtime.desk.name] = runtime
        self._group.start_soon(self._run_desk, runtime, name=f"desk {runtime.desk.name}")
        await runtime.desk.ready.wait()
        if self.heap_keeper is not None:
            self.heap_keeper.freeze()

    async def remove_desk(self, name: str, *, finish_turn: bool = False) -> list[Trigger]:
        """Stops a desk and forgets it: at its running turn's next safe point, or once that
        turn has finished (``finish_turn``: a reload replaces the desk).

        Returns:
            The triggers that were still waiting for it.

        Raises:
            UnknownDeskError: No such desk.
        """
        runtime = self._runtime(name)
        if finish_turn:
            runtime.desk.retire()
        else:
            runtime.desk.stop()
        await runtime.done.wait()
        del self._runtimes[name]
        waiting = []
        while (trigger := runtime.desk.queue.take()) is not None:
            waiting.append(trigger)
        return waiting

    def kill_switch_halts(self) -> list[dict[str, str]]:
        """The kill switches that are on, the daemon-wide one first."""
        return [halt.to_dict() for halt in self.kill_switch.halts()]

    def desk_clock(self, desk: str) -> datetime:
        """The desk's clock: its exchange's (replayed time on a paper replay), else the
        wall clock.

        Raises:
            UnknownDeskError: No such desk.
        """
        return _clock_of(self._runtime(desk))

    async def set_reduce_only(self, on: bool, *, desk: str, by: str, reason: str = "",
                              until: datetime | None = None) -> dict[str, Any]:
        """Puts a desk in reduce-only (until an operator lifts it, or until ``until``), or
        lifts it, whoever set it.

        Returns:
            ``on``, ``desk``, ``state`` (the state that holds, None when off) and ``was``
            (the state lifted, when off).

        Raises:
            UnknownDeskError: No such desk.
        """
        now = self.desk_clock(desk)
        if not on:
            was = await self.reduce_only.switch_off(desk, by)
            return {"on": False, "desk": desk, "state": None,
                    "was": was.to_dict() if was is not None else None}
        state = await self.reduce_only.switch_on(ReduceOnly(
            desk, by, reason.strip() or "no reason given", now, until))
        return {"on": True, "desk": desk, "state": state.to_dict()}

    async def pinned(self, desk: str) -> dict[str, Any]:
        """A desk's standing instructions: ``pins`` (its operators', with who and when) and
        ``configured`` (its config's).

        Raises:
            UnknownDeskError: No such desk.
        """
        target = self._runtime(desk).desk
        return {"desk": desk, "pins": [pin.to_dict() for pin in self.pins.of(desk)],
                "configured": list(target.configured_pins)}

    async def pin(self, desk: str, text: str, by: str) -> dict[str, Any]:
        """Pins an instruction to a desk: from its next request on, in every one.

        Returns:
            ``pin`` (the new one) and the desk's pins, as :meth:`pinned`.

        Raises:
            UnknownDeskError: No such desk.
            PinRefusedError: Empty, too long, or too large for the desk's window.
        """
        pin = await self.pins.pin(self._runtime(desk).desk, text, by)
        return {"pin": pin.to_dict(), **await self.pinned(desk)}

    async def unpin(self, desk: str, pin_id: int, by: str) -> dict[str, Any]:
        """Takes a pin off a desk: its next request goes without it.

        Raises:
            UnknownDeskError: No such desk.
            UnknownPinError: It has no pin of that id.
        """
        pin = await self.pins.unpin(self._runtime(desk).desk, pin_id, by)
        return {"unpinned": pin.to_dict(), **await self.pinned(desk)}

    async def pause(self, desk: str, by: str, reason: str) -> bool:
        """Holds a desk until it is resumed (a running turn ends at its next safe point).

        Returns:
            False when it was held already.

        Raises:
            UnknownDeskError: No such desk.
        """
        return await self._runtime(desk).desk.pause(by, reason)

    async def resume(self, desk: str, by: str) -> int | None:
        """Lets a held desk take turns again.

        Returns:
            How many triggers waited, or None when it was not held.

        Raises:
            UnknownDeskError: No such desk.
        """
        held = self._runtime(desk).desk.hold
        resumed = await self._runtime(desk).desk.resume(by)
        if resumed is not None and held is not None and held.by == SPEND_CAP \
                and self.spend is not None:
            await self.spend.resumed(desk)  # an operator's word: no cap pauses it again today
        return resumed

    def cancel_turn(self, desk: str, by: str, *, now: bool = False) -> bool:
        """Ends a desk's running turn at its next safe point, or at once with ``now``.

        Returns:
            False when no turn was running.

        Raises:
            UnknownDeskError: No such desk.
        """
        return self._runtime(desk).desk.cancel_turn(by, now=now)

    async def retry(self, desk: str, by: str) -> int:
        """Runs a desk's last turn again from its trigger, its last answer taken out of what
        is sent (the store keeps it, marked).

        Returns:
            How many messages left what is sent.

        Raises:
            UnknownDeskError: No such desk.
            RetryRefusedError: The desk is in a turn, or has no turn to run again.
        """
        return await self._runtime(desk).desk.retry(by)

    async def set_kill_switch(self, on: bool, *, desk: str | None, by: str, reason: str = "",
                              cancel_orders: bool = False,
                              flatten: bool = False) -> dict[str, Any]:
        """Switches a desk's kill switch (or every desk's, with ``desk`` None) on or off.

        On: from this instant each new order of the desks is refused by their risk policy;
        with ``cancel_orders`` their open orders are cancelled, with ``flatten`` their
        positions closed at market. Off: only the switch of that scope goes off.

        Returns:
            ``on``, ``scope``, the ``halt`` (as :meth:`Halt.to_dict`, None when off),
            ``cancelled`` and ``flattened`` (one line per order) and ``failed`` (one line per
            order or position that could not be handled).

        Raises:
            UnknownDeskError: No such desk.
        """
        names = list(self._runtimes) if desk is None else [self._runtime(desk).desk.name]
        scope = ALL_DESKS if desk is None else desk
        result: dict[str, Any] = {"on": on, "scope": scope, "halt": None, "cancelled": [],
                                  "flattened": [], "failed": []}
        if not on:
            halt = await self.kill_switch.switch_off(scope, by)
            result["was"] = halt.to_dict() if halt is not None else None
            # A desk's own switch stays on when every desk's goes off: say so.
            result["still_on"] = [h.to_dict() for h in self.kill_switch.halts()
                                  if h.scope in names]
            return result
        halt = await self.kill_switch.switch_on(scope, by, reason)
        result["halt"] = halt.to_dict()
        for name in names:
            risk = self._runtimes[name].risk
            if risk is None:
                continue
            if cancel_orders:
                cancelled, failed = await risk.cancel_open_orders()
                result["cancelled"] += [f"{name}: cancelled order {o.id} ({o.side} {o.type} "
                                        f"{o.amount} {o.symbol})" for o in cancelled]
                result["failed"] += [f"{name}: {line}" for line in failed]
            if flatten:
                placed, failed = await risk.flatten()
                result["flattened"] += [f"{name}: order {o.id} {o.side} {o.amount} {o.symbol} "
                                        f"at market ({o.status})" for o in placed]
                result["failed"] += [f"{name}: {line}" for line in failed]
        return result

    def runtime(self, desk: str) -> DeskRuntime:
        """A desk and what runs beside it (its risk policy, its books).

        Raises:
            UnknownDeskError: No such desk.
        """
        return self._runtime(desk)

    def _runtime(self, desk: str) -> DeskRuntime:
        try:
            return self._runtimes[desk]
        except KeyError:
            raise UnknownDeskError(desk) from None

    # ------------------------------------------------------------------ running

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Runs every desk until :meth:`shutdown`, then drains them.

        Args:
            task_status: Told once every desk has restored its conversation.
        """
        # The desks restore first, then start the turns they owe: restoring many desks on
        # one core, a desk's turn would slow every other desk's restore (and the daemon is
        # ready, for systemd, only once all have restored).
        restored = anyio.Event()
        async with anyio.create_task_group() as group:
            self._group = group
            for runtime in self._runtimes.values():
                runtime.desk.start_gate = restored
                group.start_soon(self._run_desk, runtime, name=f"desk {runtime.desk.name}")
            for runtime in self._runtimes.values():
                await runtime.desk.ready.wait()
            if self.heap_keeper is not None:  # before the first turn: the restored heap
                self.heap_keeper.freeze()
                group.start_soon(self.heap_keeper.watch, self.event_bus.subscribe(
                    "heap keeper", accept=is_compaction), name="heap keeper")
            restored.set()
            for name, service in self.services:
                group.start_soon(self._keep_running, "*", name, service, name=name)
            task_status.started()
            await self._stop_requested.wait()
            with anyio.move_on_after(self.shutdown_timeout):
                for runtime in list(self._runtimes.values()):
                    await runtime.done.wait()
            group.cancel_scope.cancel()
        self.stopped.set()

    def shutdown(self) -> None:
        """Stops new turns; running turns stop at their next safe point (idempotent)."""
        if self._stop_requested.is_set():
            return
        _log.info("shutdown_requested", working=[r.desk.name for r in self._runtimes.values()
                                                 if r.desk.state == "working"])
        for callback in self.on_shutdown:
            callback()
        for runtime in self._runtimes.values():
            runtime.desk.stop()
        self._stop_requested.set()

    async def _run_desk(self, runtime: DeskRuntime) -> None:
        try:
            async with anyio.create_task_group() as services:
                for name, service in runtime.services:
                    services.start_soon(self._keep_running, runtime.desk.name, name, service)
                await runtime.desk.run()
                services.cancel_scope.cancel()
        finally:
            runtime.done.set()

    async def _keep_running(self, desk: str, name: str, service: Service) -> None:
        """Runs a service; when it fails, logs it and starts it again after a wait."""
        failures = 0
        while True:
            try:
                await service()
                return
            except Exception as exc:
                failures += 1
                delay = self._service_backoff.delay(failures, paused=False)
                message = f"{name} failed ({type(exc).__name__}: {exc}); restarting in {delay:g} s"
                _log.error("desk_service_failed", desk=desk, service=name, error=str(exc),
                           restart_in=delay, exc_info=exc)
                self.event_bus.publish(ErrorEvent(desk=desk, message=message,
                                                  error_type=type(exc).__name__))
                await anyio.sleep(delay)

    def status_line(self) -> str:
        """One line for ``systemctl status``: the desks' states and the last turn."""
        counts: dict[str, int] = {}
        last: tuple[float, str] | None = None
        for runtime in self._runtimes.values():
            status = runtime.desk.status()
            counts[status.state] = counts.get(status.state, 0) + 1
            if status.last_turn_at is not None and (last is None or status.last_turn_at > last[0]):
                last = (status.last_turn_at, status.name)
        states = ", ".join(f"{count} {state}" for state, count in sorted(counts.items()))
        count = len(self._runtimes)
        line = f"{count} desk{'s' if count != 1 else ''} ({states})"
        if last is not None:
            when = datetime.fromtimestamp(last[0], UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            line += f"; last turn: {last[1]} at {when}"
        return line


def _clock_of(runtime: DeskRuntime) -> datetime:
    """A desk's clock: its exchange's (replayed time on a paper replay), else the wall
    clock."""
    risk = runtime.risk
    return risk.exchange.now() if risk is not None else datetime.now(UTC)
