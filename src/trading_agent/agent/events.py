"""The typed events a desk publishes for every step of its work.

Every event carries the desk and the turn it belongs to; a subagent's events also carry the
subagent's id and the parent's tool call, so an operator sees them nested. ``to_dict()`` gives
the JSON shape the store, the logs and the operator stream use.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "CompactionEnded",
    "CompactionStarted",
    "ContextCleared",
    "ErrorEvent",
    "Event",
    "EventsDropped",
    "HookFailed",
    "MemoryFlush",
    "ModelRequest",
    "OverflowRecovery",
    "RetryScheduled",
    "SteeringDelivered",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallStarted",
    "ToolHeartbeat",
    "ToolResultReady",
    "TurnEnded",
    "TurnStarted",
    "UsageReported",
]


@dataclass(frozen=True, kw_only=True)
class Event:
    """The fields every event has.

    Attributes:
        desk: The desk it belongs to (a subagent's events carry its parent desk).
        turn: The turn's id, or None outside a turn.
        subagent: The subagent's id when a subagent published it.
        parent_call: The parent's tool call that started the subagent.
        at: When it happened, seconds since the epoch.
        id: A sequence number the bus gives it, increasing per bus.
    """

    type: ClassVar[str] = "event"
    desk: str
    turn: str | None = None
    subagent: str | None = None
    parent_call: str | None = None
    at: float = field(default_factory=time.time)
    id: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The event as plain JSON-ready data, with its ``type``."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["type"] = self.type
        return data


@dataclass(frozen=True, kw_only=True)
class TurnStarted(Event):
    """A turn began.

    Attributes:
        silent: True for the memory-flush turn before a compaction: it is not chat, its
            text is never streamed, and its messages stay out of the transcript.
    """

    type: ClassVar[str] = "turn_start"
    trigger_kind: str
    trigger_text: str
    silent: bool = False


@dataclass(frozen=True, kw_only=True)
class TurnEnded(Event):
    """A turn finished (or stopped).

    Attributes:
        cached_input_tokens: How many of the turn's prompt tokens the server served from its
            prompt cache.
    """

    type: ClassVar[str] = "turn_end"
    rounds: int
    hit_round_limit: bool
    final_text: str
    input_tokens: int
    output_tokens: int
    cost: float | None
    stopped: bool = False
    silent: bool = False
    cached_input_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class ModelRequest(Event):
    """A request is about to go to the model."""

    type: ClassVar[str] = "model_request"
    round: int
    message_count: int
    tool_count: int
    estimated_tokens: int
    image_count: int


@dataclass(frozen=True, kw_only=True)
class TextDelta(Event):
    """A piece of the model's text, as it streams."""

    type: ClassVar[str] = "text_delta"
    text: str


@dataclass(frozen=True, kw_only=True)
class ToolCallStarted(Event):
    """A tool call is about to run."""

    type: ClassVar[str] = "tool_call"
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, kw_only=True)
class ToolHeartbeat(Event):
    """A tool call is still running."""

    type: ClassVar[str] = "tool_heartbeat"
    call_id: str
    name: str
    elapsed: float


@dataclass(frozen=True, kw_only=True)
class ToolResultReady(Event):
    """A tool call finished; ``text`` is what the model reads; ``refused_limit`` names the
    risk limit that refused it, when one did."""

    type: ClassVar[str] = "tool_result"
    call_id: str
    name: str
    text: str
    is_error: bool
    image_count: int
    duration: float
    refused_limit: str | None = None


@dataclass(frozen=True, kw_only=True)
class RetryScheduled(Event):
    """A model request failed and will be retried after ``delay`` seconds."""

    type: ClassVar[str] = "retry"
    attempt: int
    delay: float
    reason: str
    status_code: int | None


@dataclass(frozen=True, kw_only=True)
class UsageReported(Event):
    """Tokens used by one model request, and their cost when prices are configured.

    Attributes:
        input_tokens: Prompt tokens, the cached ones included.
        cached_input_tokens: How many of them the server served from its prompt cache (they
            cost less, and are read faster).
    """

    type: ClassVar[str] = "usage"
    input_tokens: int
    output_tokens: int
    estimated: bool
    cost: float | None
    context_tokens: int
    context_window: int
    cached_input_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class ErrorEvent(Event):
    """Something failed; ``message`` says what."""

    type: ClassVar[str] = "error"
    message: str
    error_type: str


@dataclass(frozen=True, kw_only=True)
class SteeringDelivered(Event):
    """An operator's mid-turn message was added to the conversation (``at`` says when).

    Attributes:
        text: What the operator wrote.
        queued_at: When it was put in the inbox.
        after_round: The model calls the turn had made before it was delivered (0: before
            the turn's first model call).
        message_id: The steering message's id (the store's id for it).
        started_turn: True when it arrived too late for the turn it was sent to (while the
            model wrote its final answer) and opened the next turn instead.
    """

    type: ClassVar[str] = "steering_delivered"
    text: str
    queued_at: float
    after_round: int
    message_id: str = ""
    started_turn: bool = False


@dataclass(frozen=True, kw_only=True)
class HookFailed(Event):
    """A hook raised, or answered something the loop cannot use; that step went on without
    it (see :mod:`trading_agent.agent.hooks`)."""

    type: ClassVar[str] = "hook_failed"
    hook: str
    method: str
    error: str


@dataclass(frozen=True, kw_only=True)
class ThinkingDelta(Event):
    """A piece of the model's reasoning as it streams (Anthropic's extended thinking, the
    ``reasoning_content`` of OpenAI-compatible servers): shown dimmed, never sent back to
    another provider, not stored."""

    type: ClassVar[str] = "thinking_delta"
    text: str


@dataclass(frozen=True, kw_only=True)
class CompactionStarted(Event):
    """Compaction began; ``reason`` is threshold, mid_turn, overflow or command, and the
    trigger is the one that asked for it (the ``/compact`` command, or the turn's)."""

    type: ClassVar[str] = "compaction_start"
    reason: str
    tokens_before: int
    trigger_kind: str = ""
    trigger_text: str = ""


@dataclass(frozen=True, kw_only=True)
class CompactionEnded(Event):
    """Compaction finished; the message counts are of what is sent (the summary included)."""

    type: ClassVar[str] = "compaction_end"
    reason: str
    tokens_before: int
    tokens_after: int
    messages_summarized: int
    messages_before: int = 0
    messages_after: int = 0
    trigger_kind: str = ""
    trigger_text: str = ""


@dataclass(frozen=True, kw_only=True)
class ContextCleared(Event):
    """Old tool results were stubbed in what is sent (the cheap step before a summary)."""

    type: ClassVar[str] = "context_cleared"
    tokens_before: int
    tokens_after: int
    enough: bool
    """Whether that was enough (no summary needed)."""


@dataclass(frozen=True, kw_only=True)
class MemoryFlush(Event):
    """The silent memory-flush turn before a compaction ran (``turn`` is its id).

    Attributes:
        tool_calls: The memory-tool calls the desk made (calls to any other tool refused).
        no_op: True when it saved nothing (it answered the no-op token at once).
    """

    type: ClassVar[str] = "memory_flush"
    tool_calls: int
    no_op: bool


@dataclass(frozen=True, kw_only=True)
class OverflowRecovery(Event):
    """The server said the prompt was too long; the loop compacted and replays once."""

    type: ClassVar[str] = "overflow_recovery"
    message: str


@dataclass(frozen=True, kw_only=True)
class EventsDropped(Event):
    """A subscriber fell behind and ``count`` events were dropped for it."""

    type: ClassVar[str] = "events_dropped"
    subscriber: str
    count: int
