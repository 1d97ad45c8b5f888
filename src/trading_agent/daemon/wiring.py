"""Building the daemon from its settings: the store, the bus, and each desk with its parts.

:func:`open_daemon` opens everything a run needs and closes it all, in reverse, on exit:

- the store (SQLite in the state directory) and the event bus, numbered on from the last
  stored event;
- the price feeds, one per distinct feed config, shared by the desks that name it (one
  replay task for them all, run by the supervisor);
- per desk: its exchange on its feed (paper on a replay by default), its model backend
  (an OpenAI-compatible server, or the embedded local server for ``provider = "local"``),
  its tools (trading tools through its risk policy, ``remember``/``recall`` on its notes in
  the same SQLite file, ``delegate``; narrowed to the desk's ``tools`` list), an
  executor whose approval gate is the daemon's :class:`ApprovalBook`, a context compressor
  sized to the backend's window, an image preparer, the desk's mailbox, the
  :class:`AgentLoop`, the :class:`Desk`, and the services beside it (schedules, and the
  market watcher: on each new candle it matches resting paper orders and records the risk
  day, then fires the tick and candle triggers);
- the :class:`Supervisor`, and the operator API ready to be started.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.event_bus import EventBus, Subscription
from trading_agent.agent.events import UsageReported
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.providers import ProviderContext, provider
from trading_agent.daemon.control import DeskControl
from trading_agent.daemon.desk import Backoff, Desk, DeskProfile
from trading_agent.daemon.events import KillSwitchChanged, OrderFilled
from trading_agent.daemon.mailbox import Mailbox
from trading_agent.daemon.reload import ConfigReloader
from trading_agent.daemon.schedules import Schedule, ScheduleRunner
from trading_agent.daemon.spend import SPEND_CAP, SpendGuard
from trading_agent.daemon.state_lock import hold_state_lock
from trading_agent.daemon.supervisor import DeskRuntime, Service, Supervisor
from trading_agent.daemon.triggers import MarketWatcher
from trading_agent.errors import BackendError, ConfigError, TradingAgentError
from trading_agent.fleet.approvals import FleetApprovals
from trading_agent.fleet.node import FleetNode, open_node
from trading_agent.logging_setup import secret_values
from trading_agent.operator.approvals import ApprovalBook, Approvals
from trading_agent.operator.events import ReconciliationReported
from trading_agent.operator.server import OperatorEndpoints, serve_operator_api
from trading_agent.settings import DeskSettings, Settings
from trading_agent.store.database import prepare_state_directory
from trading_agent.store.fencing import Fence
from trading_agent.store.halts import SqliteHalts
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.store import Store, database_path
from trading_agent.store.targets import PostgresTarget, StoreTarget
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.telemetry.traces import open_tracing
from trading_agent.telemetry.webhooks import open_webhooks
from trading_agent.tools.delegate import DELEGATE_TOOL_NAME, Delegator, register_delegate_tool
from trading_agent.tools.mcp import McpServerError, McpToolSource
from trading_agent.tools.trading_tools import register_trading_tools
from trading_agent.trading.exchange import Candle, timeframe_delta
from trading_agent.trading.factory import SharedFeeds, TradingVenue, open_exchange
from trading_agent.trading.kill_switch import ALL_DESKS, Halt, KillSwitch
from trading_agent.trading.order_outcomes import OrderOutcomes
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.timing import Clock, Sleep
from trading_agent.trading.valuation import value_account

__all__ = ["Daemon", "DeskParts", "ModelBackends", "build_desk", "check_fixed_part",
           "offline_tool_definitions", "open_daemon"]

_log = structlog.get_logger(__name__)

_STORE_BUFFER = 50_000
"""Events the store's subscription holds while a batch is written."""

_LOG_BUFFER = 10_000

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
        serve_api: Serves the operator API until cancelled (for ``TaskGroup.start``).
        venues: Each desk's exchange, feed and risk policy, by desk name.
        fleet: This daemon's part of its fleet; None when it runs alone.
    """

    store: Store
    event_bus: EventBus
    supervisor: Supervisor
    store_subscription: Subscription
    log_subscription: Subscription
    serve_api: Callable[..., Coroutine[Any, Any, None]] | None
    venues: Mapping[str, TradingVenue] = field(default_factory=dict)
    fleet: FleetNode | None = None


@asynccontextmanager
async def open_daemon(settings: Settings, *, environ: Mapping[str, str] | None = None,
                      config_path: Path | None = None) -> AsyncIterator[Daemon]:
    """Opens the store, every desk's exchange and model, and builds the supervisor.

    Args:
        settings: The validated settings.
        environ: Where secrets are read from (``os.environ`` by default).
        config_path: The file the settings came from: ``reload`` (and SIGHUP) read it again.

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
        node = (await stack.enter_async_context(open_node(settings, database, environ))
                if settings.in_fleet else None)
        fence = node.member if node is not None else None
        store = await Store.open(database, fence=fence)
        stack.push_async_callback(store.close)
        # Past any id a stream may have sent before a kill (see _EVENT_ID_MARGIN); in a
        # fleet, ids of this daemon's own that no other daemon uses.
        bus = EventBus(first_id=await node.first_event_id() if node is not None
                       else await store.events.last_event_id() + 1 + _EVENT_ID_MARGIN)
        store_subscription = bus.subscribe("store", max_buffer=_STORE_BUFFER)
        log_subscription = bus.subscribe("log", max_buffer=_LOG_BUFFER)
        kill_switch = await KillSwitch.restore(await SqliteHalts.open(database))
        stack.push_async_callback(kill_switch.close)
        kill_switch.on_change = _announce(bus)
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
                feed=feed, kill_switch=kill_switch))
            venues[name] = venue
            # A call cut off by a crash is looked up on restore: the desk reads what happened.
            store.transcripts.set_call_outcomes(name, OrderOutcomes(venue.exchange))
            backend = await backends.get(desk_settings)
            return await _build_desk(
                name, desk_settings, venue, backend, stack=desk_stack, database=database,
                fence=fence, store=store, bus=bus, approvals=approvals, settings=in_force,
                environ=environ)

        runtimes = []
        # In a fleet the desks are built as this daemon takes their leases.
        for name, desk_settings in (settings.desks.items() if node is None else ()):
            runtime = await build(name, desk_settings, settings)
            runtimes.append(runtime)
            await _reconcile(name, venues[name], runtime, bus)
        services = _replays(feeds)
        supervisor = Supervisor(
            runtimes, bus, store, approvals=approvals,
            shutdown_timeout=settings.daemon.shutdown_timeout_seconds,
            service_backoff=_backoff(settings), services=services, kill_switch=kill_switch)
        spend = supervisor.spend = await _spend_guard(settings, supervisor, bus, store)
        # Always counted: a reload may set a cap.
        usage = bus.subscribe("spend caps", accept=lambda e: isinstance(e, UsageReported))
        supervisor.services.append(("spend caps", functools.partial(spend.run, usage)))
        await _telemetry(settings, supervisor, bus, stack, environ)
        control: DeskControl = supervisor
        api_approvals: Approvals = approvals
        if node is not None:

            async def build_taken(name: str, desk_stack: AsyncExitStack) -> DeskRuntime:
                await kill_switch.refresh()  # a switch its last daemon set holds here too
                runtime = await build(name, settings.desks[name], settings, desk_stack)
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

        async def serve_api(*, task_status: TaskStatus[OperatorEndpoints]
                            = anyio.TASK_STATUS_IGNORED) -> None:
            await serve_operator_api(control, api_approvals, settings.operator,
                                     state_dir=state_dir, environ=environ,
                                     equity_samples=store.equity, task_status=task_status)

        yield Daemon(store, bus, supervisor, store_subscription, log_subscription, serve_api,
                     venues, node)


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
                     stack: AsyncExitStack, environ: Mapping[str, str] | None) -> None:
    """Traces and webhooks read the bus like the store and the log; subscribed now, before
    the desks run, so they miss nothing."""

    def model_of(desk: str) -> str | None:
        return supervisor.desk(desk).profile.model if desk in supervisor.desk_names() else None

    tracing = open_tracing(settings.telemetry, bus, environ=environ, model_of=model_of)
    if tracing is not None:
        stack.push_async_callback(tracing.aclose)
        supervisor.services.append(("traces", tracing.run))
    webhooks = open_webhooks(settings.webhooks, bus, environ=environ,
                             redact=secret_values(settings.secret_env_vars(), environ))
    if webhooks is not None:
        stack.push_async_callback(webhooks.aclose)
        supervisor.services.append(("webhooks", webhooks.run))


async def _spend_guard(settings: Settings, supervisor: Supervisor, bus: EventBus,
                       store: Store) -> SpendGuard:
    """The daily spend caps, counting from what the store has counted today."""

    async def pause(desk: str, reason: str, until: float) -> None:
        if desk in supervisor.desk_names():  # a desk a reload just removed: nothing to pause
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


async def _reconcile(name: str, venue: TradingVenue, runtime: DeskRuntime,
                     bus: EventBus) -> None:
    """Compares a live desk's exchange with its order journal before its first turn: every
    difference goes to the desk as its next turn, and to the operators as an event once the
    desk runs (so the streams that open with the API see it)."""
    if venue.mode != "live":
        return
    from trading_agent.trading.ccxt_exchange import CcxtExchange
    from trading_agent.trading.reconciliation import reconcile

    exchange = venue.exchange
    if not isinstance(exchange, CcxtExchange) or exchange.order_journal is None:
        return
    report = await reconcile(exchange)
    notice = report.notice()
    if notice is None:
        return
    event = ReconciliationReported(desk=name, exchange=report.exchange,
                                   differences=tuple(report.differences),
                                   adopted=tuple(o.id for o in report.adopted))

    async def announce() -> None:
        bus.publish(event)

    runtime.services.append(("reconciliation report", announce))
    runtime.desk.fire(Trigger(kind="command", text=notice, source="reconciliation"))


def _backoff(settings: Settings) -> Backoff:
    return Backoff(crash_first=settings.daemon.restart_backoff_seconds,
                   crash_max=settings.daemon.restart_backoff_max_seconds)


@dataclass
class DeskParts:
    """One desk as built from its settings, and what drives it.

    The daemon runs the watcher and the schedule runner as services beside the desk; a
    backtest steps them itself, candle by candle, on its simulated clock.

    Attributes:
        desk: The desk (its loop, tools, risk policy, compressor, image preparer, mailbox).
        watcher: Fires the desk's tick and candle triggers from its feed.
        schedules: Fires its schedule triggers; None when it has none.
        account: The desk's equity and open orders, for its status.
        mcp_sources: Its MCP servers' connections, run as services beside it.
    """

    desk: Desk
    watcher: MarketWatcher
    schedules: ScheduleRunner | None
    account: Callable[[], Coroutine[Any, Any, tuple[float | None, int]]]
    mcp_sources: list[McpToolSource] = field(default_factory=list)


async def build_desk(name: str, config: DeskSettings, venue: TradingVenue,
                     backend: ModelBackend, *, stack: AsyncExitStack, database: StoreTarget,
                     store: Store, bus: EventBus, approvals: ApprovalBook | None,
                     fence: Fence | None = None,
                     settings: Settings, clock: Clock | None = None,
                     sleep: Sleep = anyio.sleep,
                     environ: Mapping[str, str] | None = None) -> DeskParts:
    """Builds one desk the way the daemon runs it.

    Args:
        name: The desk's name.
        config: Its settings.
        venue: Its exchange, feed and risk policy.
        backend: Its model.
        stack: Closes what the desk opens (its memory).
        database: The store of its memory.
        fence: Refuses its memory's writes once this daemon no longer holds it (a fleet).
        store: Its transcripts, operator messages and schedules.
        bus: Where its loop publishes.
        approvals: The approval gate of dangerous tools; None lets every call run (a
            backtest, where nobody is there to approve; the risk limits still apply).
        settings: The daemon's settings (backoff).
        clock: The time of schedules and of the desk's status; the wall clock by default,
            the feed's replayed time in a backtest.
        sleep: The desk's backoff sleep.
        environ: Where its MCP servers' secrets are read from (``os.environ`` by default).

    Raises:
        ConfigError: An unknown tool name, context settings that do not fit the window, or
            an MCP server whose tools could not be listed.
    """
    registry, delegator, sources = await _tools(
        name, config, venue, backend, stack=stack, database=database, fence=fence,
        store=store, approvals=approvals, environ=environ)
    await check_fixed_part(name, config, registry.definitions(), backend)
    preparer = ImagePreparer(config.image_limits())
    executor = ToolCallExecutor(registry, approval_gate=approvals, image_preparer=preparer)
    # Checked when the settings were loaded, against model.context_window; checked again
    # here against the backend's window, with the same ConfigError.
    compressor = config.context.compressor(backend.context_window, key=f"desks.{name}.context")
    mailbox = Mailbox()
    loop = AgentLoop(name, backend, executor, bus, config.maximum_rounds, compressor=compressor,
                     steering_inbox=mailbox, image_preparer=preparer)
    profile = DeskProfile(name, mode=venue.mode, model=backend.model,
                          symbols=tuple(config.symbols))
    timing: dict[str, Any] = {} if clock is None else {
        "clock": lambda: clock().timestamp()}
    desk = Desk(profile, loop, config.system_prompt, store, mailbox=mailbox, event_bus=bus,
                backoff=_backoff(settings), sleep=sleep, image_preparer=preparer,
                when_paused=config.controls.when_paused,
                on_failed_turns=_halt_after(name, config.controls.halt_after_failed_turns,
                                            venue), **timing)
    if delegator is not None:
        desk.on_stop.append(functools.partial(delegator.request_stop, name))

    ticks = config.triggers.ticks
    watcher = MarketWatcher(venue.feed, config.symbols, desk.fire,
                            move_percent=ticks.move_percent,
                            candle_timeframes=ticks.on_candle_close,
                            on_step=functools.partial(_keep_books, name, venue, bus))
    desk.on_turn_start.append(watcher.desk_looked)
    schedules = [Schedule(s.key, s.message, every=s.interval, cron=s.cron, timezone=config.zone)
                 for s in config.triggers.schedules]
    runner = None
    if schedules:
        timing = {} if clock is None else {
            "clock": clock, "tolerance": timeframe_delta(venue.feed.timeframe)}
        runner = ScheduleRunner(schedules, desk.fire, last_fired=functools.partial(
                                    store.schedules.schedule_last_fired, name),
                                **timing)
    quote = config.risk.quote_currency

    async def account() -> tuple[float | None, int]:
        valuation = await value_account(venue.exchange, quote)
        return float(valuation.total), len(await venue.exchange.fetch_open_orders())

    return DeskParts(desk, watcher, runner, account, sources)


async def _build_desk(name: str, config: DeskSettings, venue: TradingVenue,
                      backend: ModelBackend, *, stack: AsyncExitStack, database: StoreTarget,
                      fence: Fence | None, store: Store, bus: EventBus,
                      approvals: ApprovalBook, settings: Settings,
                      environ: Mapping[str, str] | None) -> DeskRuntime:
    """One desk and the services beside it."""
    parts = await build_desk(name, config, venue, backend, stack=stack, database=database,
                             fence=fence, store=store, bus=bus, approvals=approvals,
                             settings=settings, environ=environ)
    services: list[tuple[str, Service]] = [("market", parts.watcher.run)]
    if parts.schedules is not None:
        services.append(("schedules", parts.schedules.run))
    services.extend((f"mcp {source.config.name}", source.run) for source in parts.mcp_sources)
    return DeskRuntime(parts.desk, services, parts.account, risk=venue.risk)


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


_ANSWER_RESERVE = 512
"""Tokens kept for the answer when the model config sets no ``max_output_tokens``."""


async def check_fixed_part(name: str, config: DeskSettings,
                           tools: Sequence[Mapping[str, Any]],
                           backend: ModelBackend | None = None) -> None:
    """Refuses a desk whose system prompt and tool definitions, with a reserve for the
    answer, do not fit its model's window: every request would be refused.

    Measured with the model server's tokenizer when it has one (llama.cpp, vLLM), else
    estimated (characters / 4).

    Raises:
        ConfigError: It does not fit; the message names the numbers.
    """
    window = backend.context_window if backend is not None else config.model.context_window
    reserve = config.model.max_output_tokens or _ANSWER_RESERVE
    tools_text = json.dumps(list(tools), separators=(",", ":")) if tools else ""
    count = getattr(backend, "count_tokens", None)
    measured = None
    if count is not None:
        prompt_tokens, tool_tokens = await count(config.system_prompt), await count(tools_text)
        if prompt_tokens is not None and tool_tokens is not None:
            measured = (prompt_tokens, tool_tokens)
    how = "by the model's tokenizer"
    if measured is None:
        measured = (len(config.system_prompt) // 4, len(tools_text) // 4)
        how = "estimated at 4 characters a token"
    prompt_tokens, tool_tokens = measured
    need = prompt_tokens + tool_tokens + reserve
    if need > window:
        raise ConfigError(
            f"desks.{name}: the system prompt ({prompt_tokens:,} tokens) and the "
            f"{len(tools)} tool definitions ({tool_tokens:,} tokens), {how}, plus "
            f"{reserve:,} tokens for the answer (model.max_output_tokens) need {need:,} "
            f"tokens: more than the model's context_window ({window:,}); shorten the "
            f"system prompt, narrow desks.{name}.tools, or use a larger window")


async def offline_tool_definitions(name: str, config: DeskSettings,
                                   environ: Mapping[str, str] | None = None
                                   ) -> list[dict[str, Any]]:
    """The tool definitions desk ``name`` would be offered, without running anything: its
    tools registered on a paper exchange over one made-up candle in a scratch folder (for
    ``check-config``; definitions never depend on the exchange's state). Its MCP servers
    are asked for their tools, briefly."""
    with tempfile.TemporaryDirectory(prefix="trading-agent-check-") as folder:
        database = Path(folder) / "check.sqlite3"
        at = datetime(2024, 1, 1, tzinfo=UTC)
        price = Decimal(1)
        feed = ReplayFeed({symbol: [Candle(symbol, "5m", at, price, price, price, price,
                                           Decimal(0))] for symbol in config.symbols},
                          speed=0, start_offset=1)
        paper = config.exchange.model_copy(update={"mode": "paper", "feed": "replay"})
        async with AsyncExitStack() as stack:
            store = await Store.open(database)
            stack.push_async_callback(store.close)
            venue = await stack.enter_async_context(open_exchange(
                paper, state=TradingStateFile(database), account=name, symbols=config.symbols,
                risk_limits=config.risk, feed=feed))
            backend = _DefinitionsOnly(config.model.context_window)
            registry, _, _ = await _tools(name, config, venue, backend, stack=stack,
                                          database=database, fence=None, store=store,
                                          approvals=None, environ=environ)
            return registry.definitions()


class _DefinitionsOnly:
    """The model a desk is built with to read its tool definitions: never asked."""

    model = "(none)"

    def __init__(self, context_window: int) -> None:
        self.context_window = context_window

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        raise BackendError("the model is not asked while the config is checked")


def _replays(feeds: SharedFeeds) -> list[tuple[str, Service]]:
    """One task per shared replay: it moves the clock of every desk trading on it."""
    replays = [feed for feed in feeds.feeds if isinstance(feed, ReplayFeed)]
    return [(f"replay {index} ({', '.join(feed.symbols)})", feed.run)
            for index, feed in enumerate(replays, start=1)]


async def _keep_books(desk: str, venue: TradingVenue, bus: EventBus) -> None:
    """A new candle on the desk's feed: resting paper orders are matched against it (each
    fill published), and the risk policy records the day (its starting value is the day's
    first candle's, and a loss past the limit halts new orders even if prices recover before
    the next order)."""
    try:
        if isinstance(venue.exchange, PaperExchange):
            fills = await venue.exchange.sync()
            if fills:
                _log.info("paper_orders_filled", desk=desk,
                          orders=[fill.order_id for fill in fills])
            for fill in fills:
                base = fill.symbol.partition("/")[0]
                bus.publish(OrderFilled(
                    desk=desk, order_id=fill.order_id, symbol=fill.symbol, side=fill.side,
                    amount=str(fill.amount), price=str(fill.price), fee=str(fill.fee),
                    fee_currency=fill.fee_currency,
                    text=f"order {fill.order_id} filled: {fill.side} {fill.amount} {base} on "
                         f"{fill.symbol} at {fill.price} (fee {fill.fee} "
                         f"{fill.fee_currency})"))
        if venue.risk is not None:
            await venue.risk.observe()
    except TradingAgentError as exc:  # no price yet, the exchange unreachable: next candle
        _log.warning("desk_books_not_updated", desk=desk, error=f"{type(exc).__name__}: {exc}")


async def _tools(name: str, config: DeskSettings, venue: TradingVenue, backend: ModelBackend, *,
                 stack: AsyncExitStack, database: StoreTarget, fence: Fence | None,
                 store: Store, approvals: ApprovalBook | None,
                 environ: Mapping[str, str] | None = None
                 ) -> tuple[ToolRegistry, Delegator | None, list[McpToolSource]]:
    """The desk's tools: trading and memory tools, then ``delegate``, narrowed to the
    desk's ``tools`` list; then those of its MCP servers (listed now; each source holds its
    connection as a desk service)."""
    assert venue.risk is not None  # open_exchange builds one when given the limits
    memory = await SqliteMemory.open(database, name, clock=venue.exchange.now, fence=fence)
    stack.push_async_callback(memory.close)
    everything = register_trading_tools(ToolRegistry(), exchange=venue.exchange,
                                        risk_policy=venue.risk, symbols=config.symbols,
                                        memory=memory)
    known = [*everything.names, DELEGATE_TOOL_NAME]
    wanted = config.tools
    if wanted is not None:
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            raise ConfigError(f"desks.{name}.tools: unknown tool(s) {', '.join(unknown)}; "
                              f"allowed: {', '.join(known)}")
    registry = everything if wanted is None else everything.subset(wanted)
    delegator = None
    if wanted is None or DELEGATE_TOOL_NAME in wanted:
        delegator = register_delegate_tool(registry, config.subagents, backend=backend,
                                           transcripts=store.transcripts, approval_gate=approvals)
    sources = []
    for index, server in enumerate(config.mcp_servers):
        source = McpToolSource(server, registry, environ=environ)
        try:
            await source.register()
        except McpServerError as exc:
            raise ConfigError(f"desks.{name}.mcp_servers[{index}] ({server.name}): its tools "
                              f"could not be listed: {exc}") from None
        sources.append(source)
    return registry, delegator, sources


async def _last_price(venues: Mapping[str, TradingVenue], desk: str, symbol: str) -> float | None:
    """The approval book's price lookup: the desk's feed's last price."""
    venue = venues.get(desk)
    if venue is None:
        return None
    return float((await venue.feed.ticker(symbol)).last)


class ModelBackends:
    """The desks' model backends, opened by their providers (see
    :mod:`trading_agent.backends.providers`): one per distinct model config, shared by the
    desks that use it, closed with the daemon."""

    def __init__(self, stack: AsyncExitStack, environ: Mapping[str, str] | None) -> None:
        self._context = ProviderContext(stack, environ)

    async def get(self, config: DeskSettings) -> ModelBackend:
        """The backend of a desk's model."""
        return await provider(config.model.provider).open_backend(config.model, self._context)
