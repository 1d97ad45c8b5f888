"""Opening every service of a daemon from its settings, and closing them on exit.

:func:`open_daemon` is the composition root: it opens everything a run needs and closes it
all, in reverse, on exit:

- the store (SQLite in the state directory, or the fleet's PostgreSQL) and the event bus,
  numbered on from the last stored event;
- the kill switch, the approval book, the price feeds (one per distinct feed config, shared
  by the desks that name it; one replay task for them all, run by the supervisor);
- per desk: its exchange on its feed (paper on a replay by default), its model backend,
  and the desk itself as :func:`~trading_agent.desks.building.build_desk` makes it, with
  the approval book as its gate; a live desk is reconciled with its exchange before its
  first turn;
- the :class:`Supervisor`, the spend caps, traces and webhooks, this daemon's part of a
  fleet (or the config reloader when it runs alone), and the operator API ready to be
  started.
"""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog
from anyio.abc import TaskStatus

from trading_agent.agent.backend import ModelBackend
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import UsageReported
from trading_agent.agent.trigger import Trigger
from trading_agent.app.operator_audit import StoredAudit
from trading_agent.app.reload import ConfigReloader
from trading_agent.app.stop_budget import SinkClose, StopBudget, close_sinks
from trading_agent.backtest.cache import CacheFileError, ResponseCache, sampling_of
from trading_agent.backtest.desk_journal import DeskJournal, journal_paths
from trading_agent.daemon.control import DeskControl
from trading_agent.daemon.events import (
    KillSwitchChanged,
    ModelSwitched,
    ReduceOnlyChanged,
    StorageChanged,
)
from trading_agent.daemon.heap import HeapKeeper
from trading_agent.daemon.pins import DeskPins
from trading_agent.daemon.spend import SPEND_CAP, SpendGuard
from trading_agent.daemon.state_lock import hold_state_lock
from trading_agent.daemon.supervisor import DeskRuntime, Service, Supervisor
from trading_agent.desks.building import ModelBackends, backoff, build_desk
from trading_agent.errors import ConfigError, StorageFullError
from trading_agent.fleet.approvals import FleetApprovals
from trading_agent.logging_setup import secret_values
from trading_agent.operator.approvals import ApprovalBook, Approvals
from trading_agent.operator.events import ReconciliationReported
from trading_agent.operator.server import OperatorEndpoints, serve_operator_api
from trading_agent.settings import DeskSettings, Settings
from trading_agent.store.database import StorageWatcher, prepare_state_directory
from trading_agent.store.fencing import Fence
from trading_agent.store.halts import SqliteHalts
from trading_agent.store.operator_audit import SqliteOperatorAudit
from trading_agent.store.pinned_instructions import SqlitePins
from trading_agent.store.reduce_only import SqliteReduceOnly
from trading_agent.store.store import Store, database_path
from trading_agent.store.targets import PostgresTarget, StoreTarget
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.telegram.config import TelegramSettings
from trading_agent.telemetry.traces import open_tracing
from trading_agent.telemetry.webhooks import open_webhooks
from trading_agent.trading.factory import SharedFeeds, TradingVenue, open_exchange
from trading_agent.trading.kill_switch import ALL_DESKS, Halt, KillSwitch
from trading_agent.trading.order_outcomes import OrderOutcomes
from trading_agent.trading.reduce_only import ReduceOnly, ReduceOnlyStates
from trading_agent.trading.replay import ReplayFeed

if TYPE_CHECKING:  # imported where used: the NATS client and python-telegram-bot load only
    # for a daemon in a fleet, or with a [telegram] table
    from trading_agent.fleet.node import FleetNode
    from trading_agent.telegram.bot import TelegramBot

__all__ = ["Daemon", "open_daemon"]

_log = structlog.get_logger(__name__)

_SINK_SECONDS = 2.0
"""The most a sink (webhooks, traces) spends on what it holds when the daemon stops."""

_STORE_BUFFER = 50_000
"""Events the store's subscription holds while a batch is written."""

_LOG_BUFFER = 10_000

_TELEGRAM_BUFFER = 10_000
"""Events the Telegram bot's subscription holds (text deltas included) while it catches up."""

_EVENT_ID_MARGIN = 1_000_000
"""How far past the store's highest event id a restarted daemon's bus starts.

The operator API streams each event as it is published, but the store writes them in
batches, so after a kill -9 an operator may hold ids the store never saw; reusing them would
make a reconnecting stream (``Last-Event-ID``) skip the new events under them. The store is
behind by at most its subscription's buffer (:data:`_STORE_BUFFER`), a batch being written
(500), and what its subscription dropped meanwhile (logged as ``events_not_stored``): a
million covers that twenty times over. Ids are 63-bit, so a million per restart never runs
out (and stays far below JavaScript's 2**53 for a browser's EventSource)."""


@dataclass
class Daemon:
    """Everything a run needs, opened.

    Attributes:
        store: The SQLite store.
        event_bus: The daemon's bus.
        supervisor: The desks.
        store_subscription: What the store writes (run ``store.events.persist_events`` on it).
        log_subscription: What is logged (run ``log_events`` on it).
        serve_api: Serves the operator API until cancelled (for ``TaskGroup.start``);
            ``refuse_descendants=True`` (``run`` sets it) refuses the socket to this
            process's own descendants.
        venues: Each desk's exchange, feed and risk policy, by desk name.
        fleet: This daemon's part of its fleet; None when it runs alone.
        stop_budget: The shutdown's countdown (``run`` starts it at SIGTERM): the sinks
            closing with the daemon get what is left of its ten seconds.
        telegram: The Telegram bot (run by the supervisor as a service); None without
            ``[telegram]``.
    """

    store: Store
    event_bus: EventBus
    supervisor: Supervisor
    store_subscription: Subscription
    log_subscription: Subscription
    serve_api: Callable[..., Coroutine[Any, Any, None]] | None
    venues: Mapping[str, TradingVenue] = field(default_factory=dict)
    fleet: FleetNode | None = None
    stop_budget: StopBudget = field(default_factory=StopBudget)
    telegram: TelegramBot | None = None


@asynccontextmanager
async def open_daemon(settings: Settings, *, environ: Mapping[str, str] | None = None,
                      config_path: Path | None = None,
                      heap_keeper: HeapKeeper | None = None) -> AsyncIterator[Daemon]:
    """Opens the store, every desk's exchange and model, and builds the supervisor.

    Args:
        settings: The validated settings.
        environ: Where secrets are read from (``os.environ`` by default).
        config_path: The file the settings came from: ``reload`` (and SIGHUP) read it again.
        heap_keeper: Freezes the long-lived heap (the daemon's process passes one; a test
            running a daemon inside its own process leaves its heap alone).

    Yields:
        The daemon, ready to run.

    Raises:
        ConfigError: A secret is missing, a tool name is unknown, a file is wrong, a
            desk's context settings do not fit its model's window.
        StoreError: The store cannot be opened.
    """
    state_dir = settings.state_directory(environ)
    prepare_state_directory(state_dir)  # 0700, its files 0600; one line when it cannot be made
    async with AsyncExitStack() as stack:
        stack.enter_context(hold_state_lock(state_dir))  # one daemon per state directory
        database = _store_target(settings, state_dir, environ)
        node: FleetNode | None = None
        if settings.in_fleet:
            from trading_agent.fleet.node import open_node
            node = await stack.enter_async_context(open_node(settings, database, environ))
        fence = node.member if node is not None else None
        store = await Store.open(database, fence=fence)
        stack.push_async_callback(store.close)
        # Past any id a stream may have sent before a kill (see _EVENT_ID_MARGIN); in a
        # fleet, ids of this daemon's own that no other daemon uses.
        bus = EventBus(first_id=await node.first_event_id() if node is not None
                       else await store.events.last_event_id() + 1 + _EVENT_ID_MARGIN)
        store_subscription = bus.subscribe("store", max_buffer=_STORE_BUFFER)
        stack.callback(store.database.watch_storage(_announce_storage(bus)))
        log_subscription = bus.subscribe("log", max_buffer=_LOG_BUFFER)
        audit_table = await SqliteOperatorAudit.open(database)
        stack.push_async_callback(audit_table.close)
        audit = StoredAudit(audit_table)
        kill_switch = await KillSwitch.restore(await SqliteHalts.open(database))
        stack.push_async_callback(kill_switch.close)
        kill_switch.on_change = _announce(bus)
        reduce_only = await ReduceOnlyStates.restore(await SqliteReduceOnly.open(database))
        stack.push_async_callback(reduce_only.close)
        reduce_only.on_change = _announce_reduce_only(bus)
        # Operators' standing instructions: a desk built (at start, on reload) sends them.
        pins = await DeskPins.restore(await SqlitePins.open(database),
                                      lambda: datetime.now(UTC), bus)
        stack.push_async_callback(pins.close)
        venues: dict[str, TradingVenue] = {}
        approvals = ApprovalBook.from_config(
            settings.operator,
            # The venue in force (a reload may rebuild it); a desk unknown here: ask.
            is_live=lambda desk: desk not in venues or venues[desk].mode == "live",
            price_lookup=functools.partial(_last_price, venues), records=store.held_calls)
        backends = ModelBackends(stack, environ)
        feeds = await stack.enter_async_context(SharedFeeds())

        async def build(name: str, desk_settings: DeskSettings, in_force: Settings,
                        desk_stack: AsyncExitStack = stack) -> DeskRuntime:
            feed = await feeds.get(desk_settings.exchange, symbols=desk_settings.symbols,
                                   risk_limits=desk_settings.risk)
            venue = await desk_stack.enter_async_context(open_exchange(
                desk_settings.exchange,
                state=TradingStateFile(database, fence=fence, desk=name), account=name,
                symbols=desk_settings.symbols, risk_limits=desk_settings.risk, environ=environ,
                feed=feed, kill_switch=kill_switch,
                account_peers=_account_peers(name, desk_settings, in_force),
                reduce_only=reduce_only, protections=desk_settings.protections))
            venues[name] = venue
            # A call cut off by a crash is looked up on restore: the desk reads what happened.
            store.transcripts.set_call_outcomes(name, OrderOutcomes(venue.exchange))
            backend = await backends.get(desk_settings)
            journal = None
            if desk_settings.exchange.mode == "paper" and isinstance(feed, ReplayFeed):
                # Its day can be replayed (backtest --from-desk): its answers and what drove
                # it are kept (desk_journal).
                journal = DeskJournal(journal_paths(state_dir, name)[0], venue.feed.now)
                desk_stack.callback(journal.close)
                backend = journal.noted(
                    await _recorded(backend, state_dir, name, desk_stack), backend)
            runtime = await _build_desk(
                name, desk_settings, venue, backend, stack=desk_stack, database=database,
                fence=fence, store=store, bus=bus, approvals=approvals, settings=in_force,
                environ=environ, pinned=pins.texts(name))
            if journal is not None:
                journal.attach(runtime.desk, venue)
            return runtime

        runtimes = []
        # In a fleet the desks are built as this daemon takes their leases.
        for name, desk_settings in (settings.desks.items() if node is None else ()):
            runtimes.append(await build(name, desk_settings, settings))
        # Every desk's fills made while the daemon was down are its own before any desk's
        # account is reconciled: only what no desk made is reported.
        for name in venues:
            await venues[name].count_fills_while_away()
        for runtime in runtimes:
            await _reconcile(runtime.desk.name, venues[runtime.desk.name], runtime, bus)
        services = _replays(feeds)
        supervisor = Supervisor(
            runtimes, bus, store, approvals=approvals,
            shutdown_timeout=settings.daemon.shutdown_timeout_seconds,
            service_backoff=backoff(settings), services=services, kill_switch=kill_switch,
            reduce_only=reduce_only, heap_keeper=heap_keeper, pins=pins)
        spend = supervisor.spend = await _spend_guard(settings, supervisor, bus, store,
                                                      backends)
        # Always counted: a reload may set a cap.
        usage = bus.subscribe("spend caps", accept=lambda e: isinstance(e, UsageReported))
        supervisor.services.append(("spend caps", functools.partial(spend.run, usage)))
        stop_budget = StopBudget()
        await _telemetry(settings, supervisor, bus, stack, environ, stop_budget)
        control: DeskControl = supervisor
        api_approvals: Approvals = approvals
        if node is not None:

            async def build_taken(name: str, desk_stack: AsyncExitStack) -> DeskRuntime:
                await kill_switch.refresh()  # a switch its last daemon set holds here too
                await reduce_only.refresh()  # and so does its reduce-only
                runtime = await build(name, settings.desks[name], settings, desk_stack)
                await venues[name].count_fills_while_away()
                await _reconcile(name, venues[name], runtime, bus)
                return runtime

            control = node.attach(supervisor, store, build_taken, approvals)
            api_approvals = FleetApprovals(approvals, control, store.held_calls)
            shared = bus.subscribe("fleet", max_buffer=_STORE_BUFFER)
            supervisor.services += [("fleet", node.run),
                                    ("fleet events", functools.partial(node.share_events, shared))]
            supervisor.reloader = _no_reload_in_fleet
        elif config_path is not None:

            async def rebuild(name: str, desk_settings: DeskSettings,
                              in_force: Settings) -> DeskRuntime:
                """A desk built on reload; a replay no desk used before runs as the others."""
                known = list(feeds.feeds)
                runtime = await build(name, desk_settings, in_force)
                for feed in feeds.feeds:
                    if isinstance(feed, ReplayFeed) and feed not in known:
                        supervisor.start_service(f"replay ({', '.join(feed.symbols)})",
                                                 feed.run)
                return runtime

            reloader = ConfigReloader(config_path, settings, supervisor, rebuild, spend, bus,
                                      environ)
            supervisor.reloader = reloader

        bot = None
        if settings.telegram is not None:
            # Subscribed now, before the desks run; run beside them, and stopped with them.
            bot = _telegram(settings.telegram, settings, control, api_approvals, audit, bus,
                            store, environ)
            supervisor.services.append(("telegram", bot.run))

        async def serve_api(*, refuse_descendants: bool = False,
                            task_status: TaskStatus[OperatorEndpoints]
                            = anyio.TASK_STATUS_IGNORED) -> None:
            await serve_operator_api(control, api_approvals, settings.operator,
                                     state_dir=state_dir, environ=environ,
                                     equity_samples=store.equity, audit=audit,
                                     refuse_descendants=refuse_descendants,
                                     task_status=task_status)

        yield Daemon(store, bus, supervisor, store_subscription, log_subscription, serve_api,
                     venues, node, stop_budget, bot)


async def _recorded(backend: ModelBackend, state_dir: Path, name: str,
                    stack: AsyncExitStack) -> ModelBackend:
    """The desk's model, each request and answer kept in the response cache's format for
    ``backtest --from-desk`` (always asked: a recorded answer is never replayed live)."""
    recorder = ResponseCache(backend, journal_paths(state_dir, name)[1], "record",
                             sampling=sampling_of(backend), replay_recorded=False)
    try:
        await recorder.open()
    except CacheFileError as exc:  # the desk trades; its day cannot be replayed
        _log.warning("desk_answers_not_kept", desk=name, error=str(exc))
        return backend
    stack.push_async_callback(recorder.aclose)
    return recorder


def _store_target(settings: Settings, state_dir: Path,
                  environ: Mapping[str, str] | None) -> StoreTarget:
    """The SQLite file in the state directory, or the fleet's PostgreSQL database with the
    password from the variable ``store.password_env`` names."""
    if settings.store.url is None:
        return database_path(state_dir)
    password = None
    if settings.store.password_env:
        password = (os.environ if environ is None else environ).get(settings.store.password_env)
    return PostgresTarget(settings.store.url, password)


async def _no_reload_in_fleet(by: str) -> list[str]:
    raise ConfigError("a daemon of a fleet does not reload its config: every daemon reads the "
                      "same file, so change it and restart the daemons one at a time (each "
                      "hands its desks to the others on the way)")


async def _telemetry(settings: Settings, supervisor: Supervisor, bus: EventBus,
                     stack: AsyncExitStack, environ: Mapping[str, str] | None,
                     budget: StopBudget) -> None:
    """Traces and webhooks read the bus like the store and the log; subscribed now, before
    the desks run, so they miss nothing."""

    def model_of(desk: str) -> str | None:
        return supervisor.desk(desk).profile.model if desk in supervisor.desk_names() else None

    closers: list[SinkClose] = []
    tracing = open_tracing(settings.telemetry, bus, environ=environ, model_of=model_of)
    if tracing is not None:
        closers.append(tracing.aclose)
        supervisor.services.append(("traces", tracing.run))
    webhooks = open_webhooks(settings.webhooks, bus, environ=environ,
                             redact=secret_values(settings.secret_env_vars(), environ))
    if webhooks is not None:
        closers.append(webhooks.aclose)
        supervisor.services.append(("webhooks", webhooks.run))
    if closers:
        # Together, within what is left of the ten seconds a SIGTERM allows.
        stack.push_async_callback(close_sinks, closers, budget, _SINK_SECONDS)


def _telegram(telegram: TelegramSettings, settings: Settings, control: DeskControl,
              approvals: Approvals, audit: StoredAudit, bus: EventBus, store: Store,
              environ: Mapping[str, str] | None) -> TelegramBot:
    """The Telegram bot, its token read from the environment; it reaches Telegram once run
    (again and again in the background while it cannot: the desks never wait for it)."""
    token = (os.environ if environ is None else environ).get(telegram.token_env, "").strip()
    if not token:
        raise ConfigError(f"telegram.token_env names {telegram.token_env}, which is not set in "
                          "the daemon's environment; allowed: the bot's token from BotFather "
                          "in that variable, or no [telegram] table (no bot)")
    from trading_agent.telegram.bot import TelegramBot

    subscription = bus.subscribe("telegram", max_buffer=_TELEGRAM_BUFFER)
    return TelegramBot(telegram, settings.operator, token, control, approvals, audit,
                       subscription, pictures=store.images.image)


async def _spend_guard(settings: Settings, supervisor: Supervisor, bus: EventBus,
                       store: Store, backends: ModelBackends) -> SpendGuard:
    """The daily spend caps, counting from what the store has counted today; a cap used up
    does to each desk what its ``controls.on_cap`` says."""

    async def pause(desk: str, reason: str, until: float) -> None:
        if desk not in supervisor.desk_names():  # a desk a reload just removed
            return
        # The caps in force (a reload hands the guard new ones) say what a cap does.
        controls = guard.caps(desk)
        on_cap = getattr(controls, "on_cap", "pause")
        fallback_model = getattr(controls, "fallback_model", None)
        if on_cap == "reduce_only":
            await supervisor.set_reduce_only(
                True, desk=desk, by=SPEND_CAP, reason=reason,
                until=datetime.fromtimestamp(until, UTC))
        elif on_cap == "fallback" and isinstance(fallback_model, str) \
                and desk in settings.desks:
            await _fall_back(supervisor, settings.desks[desk], desk, fallback_model, reason,
                             backends, bus)
        else:
            await supervisor.desk(desk).pause(SPEND_CAP, reason, until=until)

    async def usage_today(desk: str) -> tuple[int, float | None]:
        usage = await store.usage.usage_on(desk)
        return usage.total_tokens, usage.cost

    guard = SpendGuard({name: desk.controls for name, desk in settings.desks.items()},
                       settings.daemon.spend, bus, pause,
                       record_resume=store.spend.record_spend_resume)
    if guard.active:
        today = datetime.now(UTC).date()
        await guard.load(usage_today, await store.spend.spend_resumes(today))
    return guard


async def _fall_back(supervisor: Supervisor, desk_settings: DeskSettings, desk: str,
                     model: str, reason: str, backends: ModelBackends, bus: EventBus) -> None:
    """A desk's spend cap is used up and its ``on_cap`` is ``fallback``: from its next model
    request it talks to ``fallback_model`` (same provider and server), until the daemon
    restarts (or the config is reloaded) and the day's caps are read again."""
    running = supervisor.desk(desk)
    previous = running.loop.backend.model
    if previous == model:
        return
    own: Any = desk_settings.model  # a provider's pydantic table (ModelTable to the checker)
    fallback = desk_settings.model_copy(update={
        "model": own.model_copy(update={"model": model})})
    backend = await backends.get(fallback)
    running.switch_model(backend)
    _log.warning("model_switched", desk=desk, model=model, previous=previous, reason=reason)
    bus.publish(ModelSwitched(desk=desk, model=model, previous=previous,
                              reason=f"{reason}; on_cap = \"fallback\""))


async def _reconcile(name: str, venue: TradingVenue, runtime: DeskRuntime,
                     bus: EventBus) -> None:
    """Compares a live desk's exchange with its order journal before its first turn: every
    difference goes to the desk as its next turn, and to the operators as an event once the
    desk runs (so the streams that open with the API see it)."""
    report = await venue.reconcile()
    notice = None if report is None else report.notice()
    if report is None or notice is None:
        return
    event = ReconciliationReported(desk=name, exchange=report.exchange,
                                   differences=tuple(report.differences),
                                   adopted=tuple(o.id for o in report.adopted))

    async def announce() -> None:
        bus.publish(event)

    runtime.services.append(("reconciliation report", announce))
    runtime.desk.fire(Trigger(kind="command", text=notice, source="reconciliation"))


async def _build_desk(name: str, config: DeskSettings, venue: TradingVenue,
                      backend: ModelBackend, *, stack: AsyncExitStack, database: StoreTarget,
                      fence: Fence | None, store: Store, bus: EventBus,
                      approvals: ApprovalBook, settings: Settings,
                      environ: Mapping[str, str] | None,
                      pinned: Sequence[str] = ()) -> DeskRuntime:
    """One desk and the services beside it."""
    parts = await build_desk(name, config, venue, backend, stack=stack, database=database,
                             fence=fence, store=store, bus=bus, approvals=approvals,
                             settings=settings, environ=environ, pinned=pinned)
    services: list[tuple[str, Service]] = [("market", parts.watcher.run)]
    if parts.schedules is not None:
        services.append(("schedules", parts.schedules.run))
    services.extend((f"mcp {source.config.name}", source.run) for source in parts.mcp_sources)
    return DeskRuntime(parts.desk, services, parts.account, risk=venue.risk, books=venue.books)


def _account_peers(name: str, desk: DeskSettings, settings: Settings) -> list[str]:
    """The other desks of the config that trade the same account as ``name``."""
    key = desk.exchange.account_key(name)
    return [other for other, settings_of in settings.desks.items()
            if other != name and settings_of.exchange.account_key(other) == key]


def _halt_after(name: str, limit: int,
                venue: TradingVenue) -> Callable[[int, str], Coroutine[Any, Any, None]] | None:
    """The kill switch goes on by itself after ``limit`` failed turns in a row."""
    risk = venue.risk
    if limit <= 0 or risk is None:
        return None

    async def failed(failures: int, error: str) -> None:
        if failures != limit or risk.kill_switch.halt_for(name) is not None:
            return
        await risk.kill_switch.switch_on(
            name, "daemon", f"{failures} turns in a row failed; the last: {error}")

    return failed


def _announce(bus: EventBus) -> Callable[[Halt, bool, str], None]:
    """Every kill switch that goes on or off, whoever switched it, reaches the operators."""

    def changed(halt: Halt, on: bool, by: str) -> None:
        whose = "every desk" if halt.scope == ALL_DESKS else halt.scope
        text = (f"kill switch ON ({whose}): {halt.describe()}" if on
                else f"kill switch off ({whose}) by {by}; it was {halt.describe()}")
        _log.warning("kill_switch", scope=halt.scope, on=on, by=by, reason=halt.reason)
        bus.publish(KillSwitchChanged(desk=halt.scope, on=on, by=by, reason=halt.reason,
                                      text=text))

    return changed




def _announce_storage(bus: EventBus) -> StorageWatcher:
    """A full disk under the store, and the first write that gets through again, reach the
    operators (stream, metric, ``storage`` webhook) and the log."""
    where = {"location": ""}

    def changed(error: StorageFullError | None) -> None:
        if error is not None:
            where["location"] = error.location
            _log.error("storage_full", location=error.location, error=str(error))
            bus.publish(StorageChanged(
                desk="*", full=True, location=error.location,
                text=f"STORAGE FULL: {error}. Operator messages are refused (HTTP 507) and "
                     "desks wait until space is freed."))
        else:
            _log.warning("storage_writable", location=where["location"])
            bus.publish(StorageChanged(
                desk="*", full=False, location=where["location"],
                text=f"storage writable again ({where['location']}): desks carry on"))

    return changed


def _announce_reduce_only(bus: EventBus) -> Callable[[ReduceOnly, bool, str], None]:
    """Every desk that goes into reduce-only or out of it, whoever did it, reaches the
    operators."""

    def changed(state: ReduceOnly, on: bool, by: str) -> None:
        text = (f"REDUCE-ONLY ON ({state.desk}): {state.describe()}" if on
                else f"reduce-only off ({state.desk}) by {by}; it was {state.describe()}")
        _log.warning("reduce_only", desk=state.desk, on=on, by=by, reason=state.reason,
                     protection=state.protection)
        bus.publish(ReduceOnlyChanged(
            desk=state.desk, on=on, by=by, reason=state.reason,
            until=None if state.until is None else state.until.isoformat(),
            protection=state.protection, text=text))

    return changed


def _replays(feeds: SharedFeeds) -> list[tuple[str, Service]]:
    """One task per shared replay: it moves the clock of every desk trading on it."""
    replays = [feed for feed in feeds.feeds if isinstance(feed, ReplayFeed)]
    return [(f"replay {index} ({', '.join(feed.symbols)})", feed.run)
            for index, feed in enumerate(replays, start=1)]


async def _last_price(venues: Mapping[str, TradingVenue], desk: str, symbol: str) -> float | None:
    """The approval book's price lookup: the desk's feed's last price."""
    venue = venues.get(desk)
    if venue is None:
        return None
    return float((await venue.feed.ticker(symbol)).last)


