"""Real desks for the daemon tests: AgentLoops against the scripted server, a SQLite store.

A test builds desks with :func:`build_desk` on a :class:`Store` in ``tmp_path``, runs them in
a task group (or a :class:`Supervisor`), drives them with triggers and operator messages, and
waits on what a user would see (turns finished, desk states, the stored transcript).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from pydantic import BaseModel

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.conversation import Message, repair
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event
from trading_agent.agent.retry import RetryPolicy
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import Tool, ToolContext, ToolRegistry
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.desk import Backoff, Desk, DeskProfile
from trading_agent.daemon.mailbox import Mailbox
from trading_agent.store.store import Store

FAST_BACKOFF = Backoff(crash_first=0.01, crash_max=0.05, pause_first=0.01, pause_max=0.05)


async def wait_for(condition: Callable[[], bool], within: float = 10.0,
                   what: str = "the condition") -> None:
    """Polls ``condition`` until it holds (the state is spread over the desk, the store and
    the server thread: there is no one event to wait on).

    Raises:
        TimeoutError: It did not hold within ``within`` seconds.
    """
    try:
        with anyio.fail_after(within):
            while not condition():  # noqa: ASYNC110
                await anyio.sleep(0.005)
    except TimeoutError:
        raise TimeoutError(f"timed out waiting for {what}") from None


@asynccontextmanager
async def open_store(tmp_path: Path) -> AsyncIterator[Store]:
    """A store in a file under ``tmp_path``."""
    store = await Store.open(tmp_path / "state" / "trading-agent.sqlite3")
    try:
        yield store
    finally:
        await store.close()


class _Wait(BaseModel):
    label: str = "x"


class _Boom(BaseModel):
    pass


@dataclass
class ToolGate:
    """Holds the ``wait_for_release`` tool until the test releases it."""

    entered: anyio.Event = field(default_factory=anyio.Event)
    release: anyio.Event = field(default_factory=anyio.Event)
    calls: int = 0


def gate_tools(gate: ToolGate | None = None) -> list[Tool]:
    """``wait_for_release`` (held by the test) and ``explode`` (always raises)."""
    gate = gate or ToolGate()
    registry = ToolRegistry()

    @registry.tool(description="Waits until the test releases it.")
    async def wait_for_release(arguments: _Wait, context: ToolContext) -> str:
        gate.calls += 1
        gate.entered.set()
        await gate.release.wait()
        return f"released {arguments.label}"

    @registry.tool(description="Always fails.")
    async def explode(arguments: _Boom, context: ToolContext) -> str:
        raise RuntimeError("the tool blew up")

    return [tool for name in registry.names if (tool := registry.get(name)) is not None]


def backend_for(base_url: str, *, timeout: float = 10.0) -> OpenAICompatibleBackend:
    """A backend for the scripted server (or any URL)."""
    return OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=base_url, model="scripted-model", context_window=32_000,
        request_timeout=timeout))


def build_desk(name: str, store: Store, base_url: str, bus: EventBus, *,
               tools: Iterable[Tool] = (), backoff: Backoff = FAST_BACKOFF,
               sleep: Callable[[float], Any] = anyio.sleep, max_retries: int = 1,
               maximum_rounds: int = 6) -> Desk:
    """A desk with a real loop, backend, executor and mailbox."""
    backend = backend_for(base_url)
    mailbox = Mailbox()
    loop = AgentLoop(name, backend, ToolCallExecutor(ToolRegistry(tools)), bus,
                     maximum_rounds=maximum_rounds, steering_inbox=mailbox)
    loop.retry_policy = RetryPolicy(max_retries=max_retries, base_delay=0.001, max_delay=0.002)
    return Desk(DeskProfile(name, model=backend.model, symbols=("BTC/USDT",)), loop,
                f"You are the trading desk {name}.", store, mailbox=mailbox, event_bus=bus,
                backoff=backoff, sleep=sleep)


class ManualSleep:
    """A sleep that records each delay and returns when the test releases it."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._release = anyio.Event()

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)
        await self._release.wait()
        self._release = anyio.Event()

    def release(self) -> None:
        self._release.set()


def is_valid_transcript(messages: Sequence[Message]) -> bool:
    """Whether the messages are valid to send as they are (repair changes nothing)."""
    repaired = repair(messages)
    return len(repaired) == len(messages) and all(
        a is b for a, b in zip(repaired, messages, strict=True))


def last_user_text(request: Any) -> str:
    """The text of the last user message a recorded request sent."""
    for message in reversed(request.messages):
        if message["role"] == "user":
            content = message["content"]
            if isinstance(content, str):
                return content
            return "\n".join(part.get("text", "") for part in content)
    return ""


class EventLog:
    """Collects a bus's events (for assertions)."""

    def __init__(self, bus: EventBus) -> None:
        self.events: list[Event] = []
        self._subscription = bus.subscribe("test", max_buffer=100_000)

    def drain(self) -> list[Event]:
        while (event := self._subscription.get_nowait()) is not None:
            self.events.append(event)
        return self.events

    def of_type(self, kind: str) -> list[Event]:
        return [event for event in self.drain() if event.type == kind]


async def stop_desk(desk: Desk, group: anyio.abc.TaskGroup | None = None) -> None:
    """Stops a desk, waits until it has, closes its backend, and cancels ``group``."""
    desk.stop()
    await wait_for(lambda: desk.state == "stopped", what=f"desk {desk.name} to stop")
    if group is not None:
        group.cancel_scope.cancel()
    await close_backend(desk)


async def close_backend(desk: Desk) -> None:
    """Closes the desk's HTTP client (its connections)."""
    backend = desk.loop.backend
    if isinstance(backend, OpenAICompatibleBackend):
        with anyio.CancelScope(shield=True):
            await backend.aclose()
