"""The ``delegate`` tool: a desk hands a research task to a subagent and reads its report.

A subagent is an :class:`~trading_agent.agent.AgentLoop` of its own: a fresh
:class:`~trading_agent.agent.Conversation` (it sees none of the desk's), a subset of the
desk's tools, no steering inbox (operator messages to the desk never reach it), its own
round limit and a wall-clock timeout, and a compressor sized to the backend's window (long
tool results cut, compaction when full, overflow recovery; no memory flush). Its final text
is the tool result; however it ends (a failure, the timeout, the round limit) the desk reads
a result, never an exception.

- **Depth 1.** A subagent is never given ``delegate``, so it cannot delegate further; nor
  ``place_order`` (or any other tool marked dangerous) unless the config allows it, and then
  its calls still pass the desk's approval gate.
- **Concurrency.** The executor runs a round's calls at once, so several ``delegate`` calls
  in one reply run in parallel, at most ``max_concurrent`` per desk; the others wait for a
  slot (at most ``timeout_seconds``).
- **Events.** The subagent publishes on the desk's bus through
  ``events.child(subagent=<id>, parent_call=<the delegate call's id>)`` with the desk's
  name, so an operator sees its steps nested under the call. Its events carry its own turn
  id; a consumer totalling usage per desk should count ``TurnEnded`` of parent turns only
  (``subagent is None``), which already include the subagents' tokens.
- **Usage.** Every model call the subagent made (even one that then timed out) is returned
  in ``ToolOutput.usage``, which the loop adds to the parent turn's usage.
- **Transcripts.** When given a :class:`SubagentTranscripts`, its observer is told of every
  message of the subagent's conversation, linked to the parent's turn and tool call.
- **Shutdown.** Cancelling the parent turn cancels its subagents; the cancellation
  propagates as usual, after the subagent's conversation was made valid (an interrupted
  tool call gets an error result). For a gentler drain, :meth:`Delegator.request_stop`
  ends running subagents at their next safe point, like the desk loop's ``request_stop``.

Example::

    delegator = register_delegate_tool(
        registry, SubagentConfig(max_concurrent=2), backend=desk_backend,
        transcripts=store.transcripts, approval_gate=desk_gate)  # SqliteTranscripts has it
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import anyio
from pydantic import BaseModel, ConfigDict, Field

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import Conversation, ConversationObserver
from trading_agent.agent.events import ErrorEvent
from trading_agent.agent.tool_call_executor import ApprovalGate, ToolCallExecutor
from trading_agent.agent.tool_registry import Tool, ToolContext, ToolOutput, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult
from trading_agent.errors import BackendError, ToolError
from trading_agent.tools.config import DELEGATE_TOOL_NAME, SubagentConfig

__all__ = [
    "DelegateArguments",
    "Delegator",
    "SubagentLink",
    "SubagentTranscripts",
    "register_delegate_tool",
]

PLACE_ORDER_TOOL_NAME = "place_order"

_SLOT_GRACE_SECONDS = 5.0
"""Margin of the executor's own timeout past ours, so ours (with partial text) fires first."""

_PARTIAL_LIMIT = 4000
"""The most characters of a stopped subagent's partial text given back to the desk."""

_SUBAGENT_SUMMARY_MAX_TOKENS = 1200
"""The longest summary a subagent's compaction asks for (less in windows under 9,600)."""


@dataclass(frozen=True)
class SubagentLink:
    """Where a subagent comes from: what a transcript store links its messages to.

    Attributes:
        desk: The parent desk.
        subagent_id: The subagent's id, as on its events (``subagent``).
        parent_turn: The parent turn's id.
        parent_call_id: The id of the parent's ``delegate`` tool call (``parent_call``).
        task: The task the desk gave.
        tools: The names of the tools the subagent was given.
    """

    desk: str
    subagent_id: str
    parent_turn: str
    parent_call_id: str
    task: str
    tools: tuple[str, ...]


class SubagentTranscripts(Protocol):
    """Stores subagents' conversations (the daemon's store implements it)."""

    async def observer_for(self, link: SubagentLink) -> ConversationObserver | None:
        """The observer that stores the conversation of the subagent ``link`` describes.

        Called once per subagent, before its first message; every message of its
        conversation then goes to the observer's ``message_appended``.

        Args:
            link: The subagent's desk, id, parent turn and parent tool call.

        Returns:
            The observer, or None not to store this transcript.
        """
        ...


class DelegateArguments(BaseModel):
    """The arguments of a ``delegate`` call."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        min_length=1,
        description="The task, self-contained: the subagent sees none of your conversation, "
                    "so name the markets, periods and figures you want back.")
    tools: list[str] | None = Field(
        default=None,
        description="Names of your tools the subagent may use; by default all it may have. "
                    "Give only what the task needs to keep it focused.")


class _MeteredBackend:
    """Counts a subagent's usage and keeps the text of the answer streaming now.

    The loop only reports usage at the end of a turn; this keeps it when the turn is cut
    short (timeout, failure), and keeps the half-written answer a timeout interrupts.
    """

    def __init__(self, inner: ModelBackend) -> None:
        self._inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self.usage = Usage()
        self.requests = 0
        self.streaming: list[str] = []

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        streaming: list[str] = []
        self.streaming = streaming

        def sink(text: str) -> None:
            streaming.append(text)
            if on_text is not None:
                on_text(text)

        reply = await self._inner.complete(request, sink, on_thinking)
        self.usage = self.usage + reply.usage
        self.requests += 1
        self.streaming = []
        return reply


class Delegator:
    """Runs a desk's subagents; its :meth:`tool` is the ``delegate`` tool.

    One delegator may serve several desks: slots are counted per desk name.

    Args:
        config: The subagent settings.
        tools: The desk's tools, which subagents get a subset of (``delegate`` never).
        backend: The model subagents ask (the desk's own, normally).
        backend_factory: Instead of ``backend``, called for each subagent; it must return
            a backend the caller owns and closes (this class never closes one).
        transcripts: Stores subagents' conversations; None keeps them in memory only.
        approval_gate: Reviews subagents' dangerous calls (the desk's gate).
        heartbeat_seconds: How often a running subagent tool call publishes a heartbeat.

    Raises:
        ValueError: Neither or both of ``backend`` and ``backend_factory`` were given.
    """

    def __init__(
        self,
        config: SubagentConfig,
        *,
        tools: ToolRegistry,
        backend: ModelBackend | None = None,
        backend_factory: Callable[[], ModelBackend] | None = None,
        transcripts: SubagentTranscripts | None = None,
        approval_gate: ApprovalGate | None = None,
        heartbeat_seconds: float = 5.0,
    ) -> None:
        if (backend is None) == (backend_factory is None):
            raise ValueError("give exactly one of backend and backend_factory")
        self.config = config
        self._tools = tools
        self._backend = backend
        self._backend_factory = backend_factory
        self._transcripts = transcripts
        self._approval_gate = approval_gate
        self._heartbeat_seconds = heartbeat_seconds
        # Created on first use: an anyio semaphore belongs to a running event loop.
        self._slots: dict[str, anyio.Semaphore] = {}
        self._loops: dict[str, set[AgentLoop]] = {}

    def tool(self) -> Tool:
        """The ``delegate`` tool, ready to add to the desk's registry."""
        config = self.config
        description = (
            "Hand a self-contained research task to a subagent: a fresh assistant with your "
            "tools (or those you name) and none of your conversation, which works alone and "
            "returns its final report as this tool's result. Use it for research that would "
            "clutter your context (compare markets, read long data). Several delegate calls "
            f"in one reply run at once, at most {config.max_concurrent} at a time. A "
            f"subagent has {config.maximum_rounds} model calls and "
            f"{config.timeout_seconds:g} s; it cannot delegate further"
            + ("." if config.allow_place_order else " or place orders."))
        return Tool(
            name=DELEGATE_TOOL_NAME,
            description=description,
            arguments=DelegateArguments,
            handler=self._handle,
            # Ours fire first (with the partial text): the wait for a slot and the run are
            # each bounded by timeout_seconds.
            timeout_seconds=2 * config.timeout_seconds + _SLOT_GRACE_SECONDS,
        )

    def running(self, desk: str) -> int:
        """How many subagents of ``desk`` are running now."""
        return len(self._loops.get(desk, ()))

    def request_stop(self, desk: str) -> None:
        """Asks ``desk``'s running subagents to end at their next safe point (a drain).

        Each reports what it had written so far, as an error result. Call it with the desk
        loop's own ``request_stop``; a subagent started afterwards is not affected (the desk
        stops after the round anyway), and cancelling the desk's turn stops them all at once.
        """
        for loop in self._loops.get(desk, ()):
            loop.request_stop()

    def available_tools(self) -> list[str]:
        """The desk's tools a subagent may be given, in registration order."""
        return [tool for tool in self._tools.names if self._may_have(tool)]

    def _may_have(self, name: str) -> bool:
        if name == DELEGATE_TOOL_NAME:
            return False
        if self.config.allow_place_order:
            return True
        tool = self._tools.get(name)
        return name != PLACE_ORDER_TOOL_NAME and not (tool is not None and tool.dangerous)

    def _registry_for(self, requested: list[str] | None) -> ToolRegistry:
        """The subagent's tools: all it may have, or the requested ones if it may have them."""
        available = self.available_tools()
        if requested is None:
            return self._tools.subset(available)
        unknown = [name for name in requested if name not in self._tools]
        if unknown:
            raise ToolError(f"not among your tools: {', '.join(unknown)}. A subagent may be "
                            f"given: {', '.join(available) or 'none'}.")
        refused = [name for name in requested if not self._may_have(name)]
        if refused:
            raise ToolError(f"a subagent may not be given {', '.join(refused)} (it cannot "
                            f"delegate further or place orders). It may be given: "
                            f"{', '.join(available) or 'none'}.")
        return self._tools.subset(dict.fromkeys(requested))

    def _slots_for(self, desk: str) -> anyio.Semaphore:
        slots = self._slots.get(desk)
        if slots is None:
            slots = self._slots[desk] = anyio.Semaphore(self.config.max_concurrent)
        return slots

    async def _handle(self, arguments: DelegateArguments, context: ToolContext) -> ToolOutput:
        registry = self._registry_for(arguments.tools)
        slots = self._slots_for(context.desk)
        timeout = self.config.timeout_seconds
        with anyio.move_on_after(timeout) as waiting:
            await slots.acquire()
        if waiting.cancelled_caught:
            return ToolOutput(
                f"Error: no subagent slot became free within {timeout:g} s "
                f"({self.config.max_concurrent} subagents were already running). Try again "
                "when they have reported.", is_error=True)
        try:
            return await self._run(arguments.task, registry, context)
        finally:
            slots.release()

    async def _run(self, task: str, registry: ToolRegistry, context: ToolContext) -> ToolOutput:
        link = SubagentLink(desk=context.desk, subagent_id=f"sub-{uuid.uuid4().hex[:10]}",
                            parent_turn=context.turn, parent_call_id=context.call_id,
                            task=task, tools=tuple(registry.names))
        observer = (await self._transcripts.observer_for(link)
                    if self._transcripts is not None else None)
        backend = self._backend if self._backend_factory is None else self._backend_factory()
        assert backend is not None
        metered = _MeteredBackend(backend)
        conversation = Conversation(self.config.system_prompt.replace("{desk}", context.desk),
                                    observer=observer)
        events = context.events.child(subagent=link.subagent_id, parent_call=context.call_id)
        # The desk's image limits hold for its subagents' pictures too.
        executor = ToolCallExecutor(registry, approval_gate=self._approval_gate,
                                    heartbeat_seconds=self._heartbeat_seconds,
                                    image_preparer=context.image_preparer)
        loop = AgentLoop(context.desk, metered, executor, events, self.config.maximum_rounds,
                         compressor=_subagent_compressor(metered.context_window),
                         image_preparer=context.image_preparer)
        trigger = Trigger(kind="subagent", text=task, source=context.desk)
        result: TurnResult | None = None
        failure: str | None = None
        running = self._loops.setdefault(context.desk, set())
        running.add(loop)
        try:
            with anyio.move_on_after(self.config.timeout_seconds):
                try:
                    result = await loop.run_turn(conversation, trigger)
                except BackendError as exc:  # the loop already published it
                    failure = f"the subagent failed: {exc}"
                except Exception as exc:
                    failure = f"the subagent failed: {type(exc).__name__}: {exc}"
                    events.publish(ErrorEvent(desk=context.desk, message=failure,
                                              error_type=type(exc).__name__))
        finally:
            running.discard(loop)
        if result is not None and not (result.hit_round_limit or result.stopped):
            text = result.text.strip() or "(The subagent finished without writing a report.)"
            return ToolOutput(text, usage=metered.usage)
        if failure is None:
            failure = self._why_unfinished(result, metered.requests)
        return ToolOutput(f"Error: {failure}.{_partial(conversation, metered)}", is_error=True,
                          usage=metered.usage)

    def _why_unfinished(self, result: TurnResult | None, requests: int) -> str:
        if result is None:
            return (f"the subagent did not finish within {self.config.timeout_seconds:g} s "
                    f"and was stopped after {requests} model calls")
        if result.stopped:
            return (f"the subagent was stopped after {requests} model calls because the "
                    "daemon is shutting down")
        return (f"the subagent used all {self.config.maximum_rounds} of its model calls "
                "(maximum_rounds) without a final answer")


def _subagent_compressor(context_window: int) -> ContextCompressor | None:
    """A subagent's compressor: long tool results cut, compaction past the hard mark, and
    overflow recovery, without the memory flush (a subagent has no memory to save to).

    The summary cap scales down with the window so the settings are valid for small ones;
    a window too small for any summary (under ~800 tokens) gets none.
    """
    try:
        return ContextCompressor(
            context_window, memory_tool="",
            summary_max_tokens=max(1, min(_SUBAGENT_SUMMARY_MAX_TOKENS, context_window // 8)))
    except ValueError:
        return None


def _partial(conversation: Conversation, backend: _MeteredBackend) -> str:
    """What a stopped subagent had written, newest last (the tail when it is long)."""
    pieces = [m.text.strip() for m in conversation.messages
              if m.role == "assistant" and m.text.strip()]
    streaming = "".join(backend.streaming).strip()
    if streaming:
        pieces.append(streaming)
    text = "\n".join(pieces)
    if not text:
        return " It had written nothing yet."
    if len(text) > _PARTIAL_LIMIT:
        text = "…" + text[-_PARTIAL_LIMIT:]
    return f" What it had written so far:\n{text}"


def register_delegate_tool(
    registry: ToolRegistry,
    config: SubagentConfig,
    *,
    backend: ModelBackend | None = None,
    backend_factory: Callable[[], ModelBackend] | None = None,
    transcripts: SubagentTranscripts | None = None,
    parent_tools: ToolRegistry | None = None,
    approval_gate: ApprovalGate | None = None,
) -> Delegator | None:
    """Adds the ``delegate`` tool to a desk's registry, unless ``config.enabled`` is False.

    Register it last or first, it does not matter: the subagent's tools are read from
    ``parent_tools`` at each call.

    Args:
        registry: The desk's registry, which gets the tool.
        config: The desk's subagent settings.
        backend: The model subagents ask (the desk's own, normally).
        backend_factory: Instead of ``backend``, called for each subagent (the caller owns
            and closes what it returns).
        transcripts: Stores subagents' conversations, linked to the parent's tool call.
        parent_tools: The tools subagents get a subset of; ``registry`` by default.
        approval_gate: The desk's approval gate, for subagents' dangerous calls.

    Returns:
        The delegator (for :meth:`Delegator.running`), or None when subagents are disabled.

    Raises:
        ValueError: Neither or both of ``backend`` and ``backend_factory`` were given, or the
            registry already has a ``delegate`` tool.
    """
    if not config.enabled:
        return None
    delegator = Delegator(config, tools=parent_tools if parent_tools is not None else registry,
                          backend=backend, backend_factory=backend_factory,
                          transcripts=transcripts, approval_gate=approval_gate)
    registry.add(delegator.tool())
    return delegator
