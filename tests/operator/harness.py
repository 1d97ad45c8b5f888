"""A small but real daemon for the operator tests: AgentLoops against the scripted server.

:class:`LoopDeskControl` implements :class:`~trading_agent.daemon.control.DeskControl` the
way the supervisor does, in miniature: one task per desk running triggers one at a time, a
real :class:`SteeringInbox` that a message goes to while a turn runs, ``/compact`` through
:meth:`AgentLoop.compact`, and an in-memory "store" of events that keeps everything but
text deltas and heartbeats, as the SQLite store does.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
from anyio.abc import TaskGroup
from pydantic import BaseModel, Field

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import UsageReported
from trading_agent.agent.steering_inbox import SteeringInbox, SteeringMessage
from trading_agent.agent.tool_call_executor import ApprovalGate, ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.app.services import Daemon, open_daemon
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.books_view import cancel_desk_order, decimal_text, read_books
from trading_agent.daemon.control import DeskStatus, UnknownDeskError
from trading_agent.daemon.mailbox import Delivery
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.client import StreamEvent, parse_sse
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import OperatorEndpoints, serve_operator_api
from trading_agent.operator.tickets import TICKET_SECONDS
from trading_agent.settings import load_settings
from trading_agent.trading.desk_books import DeskBooks
from trading_agent.trading.exchange import Exchange

__all__ = [
    "LoopDesk",
    "LoopDeskControl",
    "ToolGate",
    "build_control",
    "collect_events",
    "running_api",
    "tool_registry",
    "uds_client",
]

_NOT_STORED = frozenset({"text_delta", "tool_heartbeat"})


class PriceArguments(BaseModel):
    """Arguments of the ``get_price`` test tool."""

    symbol: str = "BTC/USDT"


class MemoryArguments(BaseModel):
    """Arguments of the test ``remember`` tool."""

    note: str


class WaitArguments(BaseModel):
    """Arguments of the ``wait_for_release`` test tool."""

    label: str = "x"


class OrderArguments(BaseModel):
    """Arguments of the test ``place_order`` (the names the approval book reads)."""

    symbol: str = "BTC/USDT"
    side: str = "buy"
    amount: float = Field(gt=0)
    price: float | None = None


@dataclass
class ToolGate:
    """Lets the test hold the ``wait_for_release`` tool until it releases it."""

    entered: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)
    orders: list[dict[str, Any]] = field(default_factory=list)
    memories: list[str] = field(default_factory=list)


def tool_registry(gate: ToolGate) -> ToolRegistry:
    """``get_price`` (instant), ``wait_for_release`` (held by the test), ``place_order``
    (dangerous)."""
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_price(arguments: PriceArguments, context: ToolContext) -> str:
        return f"{arguments.symbol} last 64000"

    @registry.tool(description="Waits until the test releases it.")
    async def wait_for_release(arguments: WaitArguments, context: ToolContext) -> str:
        gate.entered.set()
        await gate.release.wait()
        return f"released {arguments.label}"

    @registry.tool(description="Saves a note to long-term memory.")
    async def remember(arguments: MemoryArguments, context: ToolContext) -> str:
        gate.memories.append(arguments.note)
        return "saved"

    @registry.tool(description="Places an order.", dangerous=True)
    async def place_order(arguments: OrderArguments, context: ToolContext) -> str:
        gate.orders.append(arguments.model_dump())
        return f"order placed: {arguments.side} {arguments.amount} {arguments.symbol}"

    return registry


@dataclass
class LoopDesk:
    """One desk: its loop, conversation, inbox and queue."""

    name: str
    loop: AgentLoop
    conversation: Conversation
    inbox: SteeringInbox
    mode: str = "paper"
    state: str = "idle"
    last_turn_at: float | None = None
    last_turn_text: str = ""
    tokens_today: int = 0
    queue: list[Trigger] = field(default_factory=list)
    wakeup: anyio.Event = field(default_factory=anyio.Event)
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    turns: list[str] = field(default_factory=list)
    equity: float = 10_000.0


class LoopDeskControl:
    """The DeskControl of the test daemon."""

    def __init__(self, bus: EventBus, desks: Sequence[LoopDesk]) -> None:
        self.event_bus = bus
        self.desks = {desk.name: desk for desk in desks}
        self.stored: list[dict[str, Any]] = []
        self.sent: list[tuple[str, str, str]] = []
        self.refuse_messages: list[Exception] = []
        """Raised by send_message, one per call, first first (a fleet's NATS down)."""
        self._deliveries: dict[str, Delivery] = {}
        self._store_subscription = bus.subscribe("test-store")
        self.desk_books: dict[str, DeskBooks | None] = {name: None for name in self.desks}
        """Each desk's books (none until a test opens them), as a supervisor's runtimes."""
        self.exchanges: dict[str, Exchange | None] = {name: None for name in self.desks}
        """Each desk's exchange (for a cancelled order)."""

    def _desk(self, desk: str) -> LoopDesk:
        try:
            return self.desks[desk]
        except KeyError:
            raise UnknownDeskError(desk) from None

    def desk_names(self) -> Sequence[str]:
        return list(self.desks)

    async def desk_status(self, desk: str) -> DeskStatus:
        d = self._desk(desk)
        books = self.desk_books.get(desk)
        summary = await books.summary() if books is not None else None
        return DeskStatus(name=d.name, state=d.state,  # type: ignore[arg-type]
                          mode=d.mode, model=d.loop.backend.model, symbols=["BTC/USDT"],
                          last_turn_at=d.last_turn_at, last_turn_text=d.last_turn_text,
                          equity=d.equity, open_orders=0, tokens_today=d.tokens_today,
                          queued_triggers=len(d.queue),
                          realized_today=decimal_text(summary.realized_today)
                          if summary else None,
                          unrealized=decimal_text(summary.unrealized) if summary else None)

    async def books(self, desk: str, view: str, *, since: Any = None,
                    open_only: bool = False, period: str = "daily") -> dict[str, Any]:
        """As the supervisor answers: through the same reading of the desk's books."""
        self._desk(desk)
        return await read_books(self.desk_books.get(desk), desk, view, since=since,
                                open_only=open_only, period=period)

    async def cancel_order(self, desk: str, order_id: str, by: str) -> dict[str, Any]:
        self._desk(desk)
        return await cancel_desk_order(self.desk_books.get(desk), self.exchanges.get(desk), desk,
                                       order_id)

    def kill_switch_halts(self) -> list[dict[str, str]]:
        """No kill switch is ever on in the test daemon (the page asks on every load)."""
        return []

    def message_limit(self, desk: str) -> int | None:
        d = self._desk(desk)
        return d.loop.message_max_chars(d.conversation)

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: Sequence[ImageBlock] = (), *,
                           message_id: str | None = None) -> str:
        d = self._desk(desk)
        if message_id in self._deliveries:  # sent before under this id: taken once
            return message_id
        if self.refuse_messages:
            raise self.refuse_messages.pop(0)
        self.sent.append((desk, text, source))
        ids = {} if message_id is None else {"id": message_id}
        if d.state == "working":
            message = SteeringMessage(text, source, images=tuple(images), **ids)
            d.inbox.put(message)
            self._deliveries[message.id] = "steering"
            return message.id
        trigger = Trigger(kind="operator", text=text, source=source, images=tuple(images),
                          **ids)
        d.queue.append(trigger)
        d.wakeup.set()
        self._deliveries[trigger.id] = "turn"
        return trigger.id

    def message_delivery(self, desk: str, message_id: str) -> Delivery:
        self._desk(desk)
        return self._deliveries[message_id]

    async def compact(self, desk: str) -> bool:
        d = self._desk(desk)
        async with d.lock:
            return await d.loop.compact(d.conversation, Trigger(kind="command", text="/compact",
                                                                source="operator"))

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        d = self._desk(desk)
        rows = [{"seq": seq, "id": m.id, "desk": desk, "role": m.role, "kind": m.kind,
                 "created_at": m.created_at, "subagent": None, "parent_call": None,
                 "text": m.text, "content": _content(m)}
                for seq, m in enumerate(d.conversation.messages, start=1)]
        if before is not None:
            rows = [row for row in rows if row["seq"] < before]
        return rows[-limit:]

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        rows = [row for row in self.stored
                if row["id"] > after_id and (desk is None or row["desk"] == desk)]
        return rows[:limit]

    async def run(self) -> None:
        """Runs the store and every desk until cancelled."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._store)
            for desk in self.desks.values():
                group.start_soon(self._desk_loop, desk)

    async def _store(self) -> None:
        async for event in self._store_subscription:
            if isinstance(event, UsageReported):
                self.desks[event.desk].tokens_today += event.input_tokens + event.output_tokens
            if event.type not in _NOT_STORED and event.id:
                self.stored.append(event.to_dict())

    async def _desk_loop(self, desk: LoopDesk) -> None:
        while True:
            while not desk.queue:
                await desk.wakeup.wait()
                desk.wakeup = anyio.Event()
            trigger = desk.queue.pop(0)
            async with desk.lock:
                desk.state = "working"
                try:
                    result = await desk.loop.run_turn(desk.conversation, trigger)
                    desk.last_turn_text = result.text
                    desk.turns.append(result.text)
                except Exception as exc:  # a failing turn must not end the test daemon
                    desk.last_turn_text = f"turn failed: {exc}"
                finally:
                    desk.state = "idle"
                    desk.last_turn_at = time.time()
            # Steering that came as the turn ended starts the next one (nothing is lost).
            for message in desk.inbox.take_all():
                desk.queue.append(Trigger(kind="operator", text=message.text,
                                          source=message.source))

    async def wait_turns(self, desk: str, count: int) -> list[str]:
        """Waits until ``desk`` has finished ``count`` turns (bound it with fail_after)."""
        d = self._desk(desk)
        while len(d.turns) < count:  # noqa: ASYNC110
            await anyio.sleep(0.005)
        return d.turns


def build_control(base_url: str, desk_names: Sequence[str] = ("alpha", "beta"), *,
                  approvals: ApprovalGate | None = None, gate: ToolGate | None = None,
                  context_window: int = 32_000, keep_recent_tokens: int = 60,
                  bus: EventBus | None = None) -> tuple[LoopDeskControl, ToolGate]:
    """A control with one real AgentLoop per desk, all talking to ``base_url``."""
    bus = bus or EventBus()
    gate = gate or ToolGate()
    registry = tool_registry(gate)
    desks = []
    for name in desk_names:
        backend = OpenAICompatibleBackend(OpenAIBackendConfig(
            base_url=base_url, model="scripted-model", context_window=context_window,
            request_timeout=10))
        inbox = SteeringInbox()
        executor = ToolCallExecutor(registry, approval_gate=approvals, heartbeat_seconds=30)
        compressor = ContextCompressor(context_window, keep_recent_tokens=keep_recent_tokens)
        loop = AgentLoop(name, backend, executor, bus, maximum_rounds=8, compressor=compressor,
                         steering_inbox=inbox)
        loop.retry_policy.sleep = _no_sleep
        desks.append(LoopDesk(name, loop, Conversation(f"You are the {name} desk."), inbox))
    return LoopDeskControl(bus, desks), gate


def _content(message: Message) -> list[dict[str, Any]]:
    """A message's blocks in the store's public shape."""
    blocks: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            blocks.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolUseBlock):
            blocks.append({"type": "tool_use", "id": block.id, "name": block.name,
                           "arguments": block.arguments})
        elif isinstance(block, ToolResultBlock):
            blocks.append({"type": "tool_result", "tool_use_id": block.tool_use_id,
                           "is_error": block.is_error,
                           "content": [{"type": "text", "text": block.text}]})
    return blocks


async def _no_sleep(delay: float) -> None:
    await anyio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def running_api(control: LoopDeskControl, approvals: ApprovalBook, config: OperatorConfig,
                      state_dir: Path, *, environ: dict[str, str] | None = None,
                      keepalive_seconds: float | None = None,
                      ticket_seconds: float = TICKET_SECONDS,
                      ) -> AsyncIterator[tuple[OperatorEndpoints, TaskGroup]]:
    """Runs the desks and the API; yields where it listens, and stops both on exit."""
    async with anyio.create_task_group() as group:
        group.start_soon(control.run)
        endpoints = await group.start(_serve, control, approvals, config, state_dir,
                                      environ or {}, ticket_seconds)
        try:
            yield endpoints, group
        finally:
            group.cancel_scope.cancel()
    for desk in control.desks.values():
        await desk.loop.backend.aclose()  # type: ignore[attr-defined]


async def _serve(control: LoopDeskControl, approvals: ApprovalBook, config: OperatorConfig,
                 state_dir: Path, environ: dict[str, str], ticket_seconds: float, *,
                 task_status: anyio.abc.TaskStatus[OperatorEndpoints]) -> None:
    await serve_operator_api(control, approvals, config, state_dir=state_dir, environ=environ,
                             ticket_seconds=ticket_seconds, task_status=task_status)


def uds_client(socket_path: Path, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client on the daemon's Unix socket."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
                             base_url="http://operator", timeout=10, **kwargs)


async def collect_events(client: httpx.AsyncClient, *, until: Any,
                         params: dict[str, Any] | None = None,
                         headers: dict[str, str] | None = None) -> list[StreamEvent]:
    """Reads the event stream until ``until(events)`` is true (or it ends), then
    disconnects; fails after 10 s."""
    events: list[StreamEvent] = []
    with anyio.fail_after(10):
        async with client.stream("GET", "/api/events", params=params or {},
                                 headers=headers or {}) as response:
            assert response.status_code == 200, await response.aread()
            async for event_id, data in parse_sse(response.aiter_lines()):
                events.append(StreamEvent(int(event_id) if event_id else None, json.loads(data)))
                if until(events):
                    break
    return events


@dataclass
class InProcessDaemon:
    """A daemon opened by the wiring ``trading-agent run`` uses, running in this process."""

    daemon: Daemon
    endpoints: OperatorEndpoints


@contextlib.asynccontextmanager
async def in_process_daemon(config: Path, environ: Mapping[str, str] | None = None
                            ) -> AsyncIterator[InProcessDaemon]:
    """The daemon's store, desks and API running, as ``run`` runs them (without signals);
    ``environ`` is what it reads secrets from (none by default)."""
    async with open_daemon(load_settings(config), environ=environ or {},
                           config_path=config) as daemon, \
            anyio.create_task_group() as group:
        group.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
        assert daemon.serve_api is not None
        endpoints = await group.start(daemon.serve_api)
        await group.start(daemon.supervisor.run)
        try:
            yield InProcessDaemon(daemon, endpoints)
        finally:
            group.cancel_scope.cancel()
