"""Building one desk from its settings, the same for the daemon and for a backtest.

:func:`build_desk` makes a desk and what drives it: its tools (trading tools through its
risk policy, ``remember``/``recall`` on its notes, ``delegate``; narrowed to the desk's
``tools`` list; then its MCP servers'), its hooks (``desks.<name>.hooks``, see
:mod:`trading_agent.desks.hooks`), an executor whose approval gate is given by the caller
(the daemon's approval book; none in a backtest), a context compressor sized to the
backend's window, an image preparer, the desk's mailbox, the :class:`AgentLoop`, the
:class:`Desk`, its schedules, and its market watcher (on each new candle the venue matches
the orders it simulates, each fill is published, then the tick and candle triggers fire).

Nothing here opens a daemon's services (the fleet, the operator API, telemetry): the
application layer (:mod:`trading_agent.app`) and the backtest engine both build their
desks with it. :func:`check_fixed_part` and :func:`offline_tool_definitions` serve
``check-config``; :class:`ModelBackends` opens the desks' models.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import structlog

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.context_compressor import compressor_for
from trading_agent.agent.conversation import ToolResultBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.fixed_part import (
    DEFAULT_ANSWER_RESERVE,
    TokenCounter,
    measure_fixed_part,
)
from trading_agent.agent.image_preparer import ImageLimits, ImagePreparer
from trading_agent.agent.tool_call_executor import ApprovalGate, ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.backends.providers import ProviderContext, provider
from trading_agent.daemon.desk import Backoff, Desk, DeskProfile
from trading_agent.daemon.events import ProtectionReported, order_filled
from trading_agent.daemon.mailbox import Mailbox
from trading_agent.daemon.pins import pinned_prompt
from trading_agent.daemon.schedules import Schedule, ScheduleRunner
from trading_agent.daemon.triggers import MarketWatcher
from trading_agent.desks.hooks import load_hooks
from trading_agent.errors import BackendError, ConfigError, TradingAgentError
from trading_agent.settings import DeskSettings, Settings
from trading_agent.store.fencing import Fence
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.store.store import Store
from trading_agent.store.targets import StoreTarget
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.tools.config import DELEGATE_TOOL_NAME, McpServerConfig
from trading_agent.tools.delegate import Delegator, register_delegate_tool
from trading_agent.tools.mcp import McpServerError, McpToolSource
from trading_agent.tools.trading_tools import register_trading_tools
from trading_agent.trading.exchange import Candle, timeframe_delta
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.protection_keeper import ProtectionEvent
from trading_agent.trading.protections import ProtectionGuard
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.timing import Clock, Sleep

__all__ = ["DeskParts", "McpRegistrar", "ModelBackends", "backoff", "build_desk",
           "check_fixed_part", "offline_tool_definitions"]

_log = structlog.get_logger(__name__)


McpRegistrar = Callable[[McpServerConfig, ToolRegistry], Coroutine[Any, Any, None]]
"""Registers one MCP server's tools without connecting to it (see :func:`build_desk`)."""


def backoff(settings: Settings) -> Backoff:
    """A desk's (and a daemon service's) waits before a restart, from ``[daemon]``."""
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
                     store: Store, bus: EventBus, approvals: ApprovalGate | None,
                     fence: Fence | None = None,
                     settings: Settings, clock: Clock | None = None,
                     sleep: Sleep = anyio.sleep,
                     environ: Mapping[str, str] | None = None,
                     mcp_tools: McpRegistrar | None = None,
                     pinned: Sequence[str] = ()) -> DeskParts:
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
        mcp_tools: Registers each MCP server's tools instead of connecting to it (a
            backtest replays recorded answers and never starts a server); None connects.
        pinned: The operators' standing instructions kept for it (after a restart or a
            reload), sent after those its config pins (``pinned``).

    Raises:
        ConfigError: An unknown tool name, context settings that do not fit the window, or
            an MCP server whose tools could not be listed.
    """
    registry, delegator, sources = await _tools(
        name, config, venue, backend, stack=stack, database=database, fence=fence,
        store=store, approvals=approvals, environ=environ, mcp_tools=mcp_tools)
    await check_fixed_part(name, config, registry.definitions(), backend)
    preparer = ImagePreparer(ImageLimits(**config.images.model_dump()))
    executor = ToolCallExecutor(registry, approval_gate=approvals, image_preparer=preparer)
    # Checked when the settings were loaded, against model.context_window; checked again
    # here against the backend's window, with the same ConfigError.
    compressor = compressor_for(config.context, backend.context_window,
                                key=f"desks.{name}.context")
    mailbox = Mailbox()
    hooks = load_hooks(name, config.hooks)
    if venue.risk is not None and venue.risk.protections is not None:
        hooks.append(_ToolErrors(venue.risk.protections))  # tool_error_guard's count
    loop = AgentLoop(name, backend, executor, bus, config.maximum_rounds, compressor=compressor,
                     steering_inbox=mailbox, image_preparer=preparer, hooks=hooks)
    profile = DeskProfile(name, mode=venue.mode, model=backend.model,
                          symbols=tuple(config.symbols))
    timing: dict[str, Any] = {} if clock is None else {
        "clock": lambda: clock().timestamp()}
    desk = Desk(profile, loop, config.system_prompt, store, mailbox=mailbox, event_bus=bus,
                backoff=backoff(settings), sleep=sleep, image_preparer=preparer,
                when_paused=config.controls.when_paused,
                on_failed_turns=_halt_after(name, config.controls.halt_after_failed_turns,
                                            venue),
                pinned=pinned, configured_pins=config.pinned, **timing)
    if delegator is not None:
        desk.on_stop.append(functools.partial(delegator.request_stop, name))

    ticks = config.triggers.ticks
    watcher = MarketWatcher(venue.feed, config.symbols, desk.fire,
                            move_percent=ticks.move_percent,
                            candle_timeframes=ticks.on_candle_close,
                            on_step=functools.partial(_keep_books, name, venue))
    venue.exchange.on_fill = lambda fill: bus.publish(order_filled(name, fill))
    if venue.protection is not None:
        venue.protection.on_event = functools.partial(_tell_protection, name, bus, desk)
    desk.on_turn_start.append(watcher.desk_looked)
    schedules = [Schedule(s.key, s.message, every=s.interval, cron=s.cron, timezone=config.zone)
                 for s in config.triggers.schedules]
    runner = None
    if schedules:
        timing = {} if clock is None else {
            "clock": clock, "tolerance": timeframe_delta(venue.feed.timeframe)}
        runner = ScheduleRunner(schedules, desk.fire,
                                last_fired=functools.partial(
                                    store.schedules.schedule_last_fired, name),
                                **timing)
    quote = config.risk.quote_currency

    async def account() -> tuple[float | None, int]:
        # The desk's own equity (a live desk's by its books), as its daily loss reads it.
        valuation = await venue.equity(quote)
        return float(valuation.total), len(await venue.exchange.fetch_open_orders())

    return DeskParts(desk, watcher, runner, account, sources)


def _tell_protection(name: str, bus: EventBus, desk: Desk, event: ProtectionEvent) -> None:
    """A stop or target fired (or the daemon watches one the exchange could not hold):
    the operators see an event, and the desk is told as its next turn."""
    order = event.order
    bus.publish(ProtectionReported(
        desk=name, what=event.what, symbol=order.symbol, kind=order.kind,
        trigger_price=str(order.trigger_price),
        exit_price="" if order.exit_price is None else str(order.exit_price),
        profit="" if event.profit is None else str(event.profit), while_down=event.while_down,
        text=event.text))
    desk.fire(Trigger(kind="command", text=event.text, source="protection"))


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


async def check_fixed_part(name: str, config: DeskSettings,
                           tools: Sequence[Mapping[str, Any]],
                           backend: ModelBackend | None = None,
                           count: TokenCounter | None = None) -> None:
    """Refuses a desk whose system prompt (with the instructions its config pins) and tool
    definitions, with a reserve for the answer, do not fit its model's window: every
    request would be refused.

    Measured with the model's tokenizer when there is one (the backend's server, llama.cpp
    or vLLM; else ``count``), else estimated on the large side (see
    :mod:`~trading_agent.agent.fixed_part`).

    Raises:
        ConfigError: It does not fit; the message names the numbers.
    """
    window = backend.context_window if backend is not None else config.model.context_window
    reserve = config.model.max_output_tokens or DEFAULT_ANSWER_RESERVE
    counter: TokenCounter | None = getattr(backend, "count_tokens", None) or count
    part = await measure_fixed_part(pinned_prompt(config.system_prompt, config.pinned), tools,
                                    window=window,
                                    reserve=reserve, count=counter)
    if not part.fits:
        raise ConfigError(part.describe(name, len(config.pinned)))


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


async def _keep_books(desk: str, venue: TradingVenue) -> None:
    """A new candle on the desk's feed: the orders the venue simulates are matched against
    it, the desk's books count what its orders filled (each fill announced as it is
    counted), and the risk policy records the day (its starting value is the day's first
    candle's, and a loss past the limit halts new orders even if prices recover before the
    next order)."""
    try:
        fills = await venue.match_resting_orders()
        if fills:
            _log.info("desk_orders_filled", desk=desk,
                      orders=[fill.order_id for fill in fills])
        if venue.risk is not None:
            await venue.risk.observe()
            if venue.risk.protections is not None:  # a trip shows before the next order
                await venue.risk.protections.observe()
    except TradingAgentError as exc:  # no price yet, the exchange unreachable: next candle
        _log.warning("desk_books_not_updated", desk=desk, error=f"{type(exc).__name__}: {exc}")


class _ToolErrors:
    """A hook that tells the desk's protections of each tool call that failed or was
    refused (``tool_error_guard``)."""

    def __init__(self, guard: ProtectionGuard) -> None:
        self._guard = guard

    def after_tool_result(self, call: ToolUseBlock, result: ToolResultBlock,
                          context: ToolContext) -> None:
        self._guard.note_tool_result(
            result.is_error, _refused_limit(result.text) if result.is_error else None)


def _refused_limit(text: str) -> str | None:
    """The limit a refusal's text names (``Refused (reduce_only, ...``), if any."""
    head = text.removeprefix("Error: ")
    if head.startswith("Refused (") and ")" in head:
        return head[len("Refused ("):].split(")", 1)[0].split(",", 1)[0].strip()
    return None


async def _tools(name: str, config: DeskSettings, venue: TradingVenue, backend: ModelBackend, *,
                 stack: AsyncExitStack, database: StoreTarget, fence: Fence | None,
                 store: Store, approvals: ApprovalGate | None,
                 environ: Mapping[str, str] | None = None,
                 mcp_tools: McpRegistrar | None = None
                 ) -> tuple[ToolRegistry, Delegator | None, list[McpToolSource]]:
    """The desk's tools: trading and memory tools, then ``delegate``, narrowed to the
    desk's ``tools`` list; then those of its MCP servers (listed now; each source holds its
    connection as a desk service)."""
    assert venue.risk is not None  # open_exchange builds one when given the limits
    memory = await SqliteMemory.open(database, name, clock=venue.exchange.now, fence=fence)
    stack.push_async_callback(memory.close)
    everything = register_trading_tools(ToolRegistry(), exchange=venue.exchange,
                                        risk_policy=venue.risk, symbols=config.symbols,
                                        memory=memory, books=venue.books,
                                        protection=venue.protection)
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
    sources: list[McpToolSource] = []
    if mcp_tools is not None:
        for server in config.mcp_servers:
            await mcp_tools(server, registry)
        return registry, delegator, sources
    for index, server in enumerate(config.mcp_servers):
        source = McpToolSource(server, registry, environ=environ)
        try:
            await source.register()
        except McpServerError as exc:
            if exc.lasting:  # its command does not exist: waiting cannot help
                raise ConfigError(f"desks.{name}.mcp_servers[{index}] ({server.name}): its "
                                  f"tools could not be listed: {exc}") from None
            # Down for now: the desk starts, and the tools come when the server does.
            source.register_later(str(exc))
        sources.append(source)
    return registry, delegator, sources


class ModelBackends:
    """The desks' model backends, opened by their providers (see
    :mod:`trading_agent.backends.providers`): one per distinct model config, shared by the
    desks that use it, closed with the daemon."""

    def __init__(self, stack: AsyncExitStack, environ: Mapping[str, str] | None) -> None:
        self._context = ProviderContext(stack, environ)

    async def get(self, config: DeskSettings) -> ModelBackend:
        """The backend of a desk's model."""
        return await provider(config.model.provider).open_backend(config.model, self._context)
