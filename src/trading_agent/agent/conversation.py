"""A desk's conversation: messages made of content blocks.

The internal shape is the richest one (text, image, tool_use, tool_result and thinking
blocks, as in Anthropic's API); each backend translates it to its own wire format, and a
thinking block goes back only to the provider that made it. What is sent is a
summary message followed by the newest messages. The full transcript is kept by the store
(the observer), not in memory: a compaction drops the summarized messages (with their images
and cached encodings) from :attr:`Conversation.messages`, so a desk that runs for months
holds only what it still sends.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from trading_agent.agent.ids import random_hex

__all__ = [
    "IMAGE_TOKEN_COST",
    "ContentBlock",
    "Conversation",
    "ConversationObserver",
    "ImageBlock",
    "Message",
    "MessageKind",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
    "estimate_tokens",
    "repair",
]

IMAGE_TOKEN_COST = 800
"""The fixed token estimate of one image, whatever its size (providers bill images by tiles)."""

Role = Literal["user", "assistant"]
MessageKind = Literal[
    "trigger",  # why a turn started: a tick, a schedule, a command
    "operator",  # a person's message that started a turn
    "steering",  # a person's message delivered mid-turn
    "assistant",  # the model's answer, possibly with tool calls
    "tool_results",  # the results of the model's tool calls
    "summary",  # a compaction summary standing for older messages
    "notice",  # a note from the daemon (an interrupted turn, a repair)
]


@dataclass(frozen=True, slots=True)
class TextBlock:
    """Plain text."""

    text: str
    type: Literal["text"] = "text"


@dataclass(frozen=True, slots=True)
class ImageBlock:
    """A picture, already encoded for the model (PNG or JPEG bytes).

    Attributes:
        data: The encoded image.
        media_type: ``image/png`` or ``image/jpeg``.
        description: What the picture shows, used for the placeholder when it is pruned.
    """

    data: bytes
    media_type: str = "image/png"
    description: str = "image"
    type: Literal["image"] = "image"

    def data_url(self) -> str:
        """The image as a ``data:`` URL."""
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode('ascii')}"


@dataclass(frozen=True, slots=True)
class ToolUseBlock:
    """A tool call the model made.

    Attributes:
        id: The call id, as the model gave it.
        name: The tool's name.
        arguments: The arguments, as the raw JSON text the model wrote (maybe invalid).
    """

    id: str
    name: str
    arguments: str
    type: Literal["tool_use"] = "tool_use"


@dataclass(frozen=True, slots=True)
class ToolResultBlock:
    """The result of one tool call.

    Attributes:
        tool_use_id: The id of the call this answers.
        content: Text and images the tool returned.
        is_error: Whether the call failed (the text says how).
    """

    tool_use_id: str
    content: tuple[TextBlock | ImageBlock, ...]
    is_error: bool = False
    type: Literal["tool_result"] = "tool_result"

    @property
    def text(self) -> str:
        """The text parts of the result, joined."""
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))


@dataclass(frozen=True, slots=True)
class ThinkingBlock:
    """The model's reasoning before an answer, kept with the answer's message (and stored
    with it) so that the provider that made it can be sent it back unchanged: some want the
    reasoning of an answer that called tools, signed, while the tool loop goes on, a
    restart included.

    Opaque to the agent: it is no part of the answer's text, and only the backend of the
    provider named by ``source`` sends it; every other backend leaves it out.

    Attributes:
        text: The reasoning as the model wrote it (empty when the provider redacted it).
        signature: What the provider signed it with (it checks it when sent back).
        source: The provider that made it, as its backend names itself.
        redacted: The provider's opaque data for reasoning it redacted; else empty.
    """

    text: str
    signature: str = ""
    source: str = ""
    redacted: str = ""
    type: Literal["thinking"] = "thinking"


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


def _new_id() -> str:
    return random_hex()


@dataclass(frozen=True, eq=False)
class Message:
    """One message of a conversation.

    Attributes:
        role: ``user`` or ``assistant``.
        content: The blocks, in order.
        kind: What the message is for (trigger, operator, steering, assistant...).
        id: A unique id, stable in the store.
        created_at: Seconds since the epoch.
        cache: Per-message memo of derived values (wire encodings, token estimate); never
            stored and never compared.
    """

    role: Role
    content: tuple[ContentBlock, ...]
    kind: MessageKind = "assistant"
    id: str = field(default_factory=_new_id)
    created_at: float = field(default_factory=time.time)
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def user_text(cls, text: str, kind: MessageKind = "trigger") -> Message:
        """A user message holding one text block."""
        return cls(role="user", content=(TextBlock(text),), kind=kind)

    @property
    def text(self) -> str:
        """The message's text blocks, joined."""
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))

    @property
    def tool_uses(self) -> list[ToolUseBlock]:
        """The tool calls in this message."""
        return [b for b in self.content if isinstance(b, ToolUseBlock)]

    @property
    def tool_results(self) -> list[ToolResultBlock]:
        """The tool results in this message."""
        return [b for b in self.content if isinstance(b, ToolResultBlock)]

    @property
    def image_count(self) -> int:
        """How many images the message holds, tool results included (memoized: it is asked
        of every message before every request)."""
        cached = self.cache.get("images")
        if cached is None:
            cached = 0
            for block in self.content:
                if isinstance(block, ImageBlock):
                    cached += 1
                elif isinstance(block, ToolResultBlock):
                    cached += sum(1 for b in block.content if isinstance(b, ImageBlock))
            self.cache["images"] = cached
        return int(cached)


def _block_chars(block: ContentBlock) -> tuple[int, int]:
    """Characters and images in one block."""
    if isinstance(block, TextBlock):
        return len(block.text), 0
    if isinstance(block, ImageBlock):
        return 0, 1
    if isinstance(block, ToolUseBlock):
        return len(block.name) + len(block.arguments) + 16, 0
    if isinstance(block, ThinkingBlock):
        return len(block.text) + len(block.redacted) // 4 + 16, 0
    chars, images = 16, 0
    for inner in block.content:
        c, i = _block_chars(inner)
        chars, images = chars + c, images + i
    return chars, images


def estimate_tokens(message: Message) -> int:
    """A cheap token estimate: characters / 4, plus a fixed cost per image; memoized.

    Args:
        message: The message to measure.

    Returns:
        The estimated number of tokens.
    """
    cached = message.cache.get("tokens")
    if cached is None:
        chars, images = 0, 0
        for block in message.content:
            c, i = _block_chars(block)
            chars, images = chars + c, images + i
        cached = 4 + chars // 4 + images * IMAGE_TOKEN_COST
        message.cache["tokens"] = cached
    return int(cached)


def repair(messages: Sequence[Message]) -> list[Message]:
    """Makes a message list valid to send: every tool call answered, no stray results.

    Deterministic and idempotent: repairing a repaired list changes nothing, and a valid list
    comes back as the same message objects (so their cached encodings are reused).

    - A tool call whose result is missing gets an error result saying it was interrupted,
      in a tool_results message right after the call's message.
    - A tool result with no call in the message just before it is dropped.
    - Results come in the order of their calls.

    Args:
        messages: The messages, oldest first.

    Returns:
        A new list; unchanged messages are the same objects.
    """
    repaired: list[Message] = []
    index = 0
    count = len(messages)
    while index < count:
        message = messages[index]
        index += 1
        if message.role == "assistant" and message.tool_uses:
            repaired.append(message)
            following = messages[index] if index < count else None
            if following is not None and following.kind == "tool_results":
                index += 1
                # A pair never changes, and every request repairs every pair: memoize.
                key = "answers:" + message.id
                answer = following.cache.get(key)
                if answer is None:
                    answer = _answer_calls(message.tool_uses, following)
                    following.cache[key] = True if answer is following else answer
                repaired.append(following if answer is True else answer)
            else:
                repaired.append(_answer_calls(message.tool_uses, None))
            continue
        if message.role == "user" and message.tool_results:
            # Results with no call just before them: keep only the other blocks, if any.
            rest = tuple(b for b in message.content if not isinstance(b, ToolResultBlock))
            if rest:
                repaired.append(Message(role="user", content=rest, kind=message.kind,
                                        id=message.id, created_at=message.created_at))
            continue
        repaired.append(message)
    return repaired


def _answer_calls(calls: list[ToolUseBlock], results: Message | None) -> Message:
    """The tool_results message that answers exactly ``calls``, reusing ``results`` if valid."""
    by_id: dict[str, ToolResultBlock] = {}
    extra: list[ContentBlock] = []
    if results is not None:
        for block in results.content:
            if isinstance(block, ToolResultBlock):
                by_id.setdefault(block.tool_use_id, block)
            else:
                extra.append(block)
    answered = [
        by_id.get(call.id)
        or ToolResultBlock(
            tool_use_id=call.id,
            content=(TextBlock(f"Error: the call to {call.name} was interrupted before it "
                               "finished; it may or may not have taken effect. Check before "
                               "repeating it."),),
            is_error=True,
        )
        for call in calls
    ]
    if results is not None and len(results.content) == len(answered) + len(extra) and all(
        a is b for a, b in zip(answered, results.tool_results, strict=False)
    ):
        return results
    return Message(
        role="user",
        content=(*answered, *extra),
        kind="tool_results",
        id=results.id if results is not None else f"repair-{calls[0].id}",
        created_at=results.created_at if results is not None else 0.0,
    )


class ConversationObserver(Protocol):
    """Told of every change to a conversation, so it can be stored as it happens."""

    async def message_appended(self, conversation: Conversation, message: Message) -> None:
        """A message was added at the end."""

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        """Older messages were replaced, in what is sent, by ``summary``."""


class Conversation:
    """The messages of one desk (or one subagent task).

    Args:
        system_prompt: What the model is told before every request.
        messages: Messages to start from (a restored transcript window).
        summary: The latest compaction summary, standing for messages before ``messages``.
        observer: Told of every append and compaction (the store).

    Attributes:
        messages: The messages after the latest compaction, oldest first: what is sent after
            the summary. Older ones are only in the store.
        window_start: Index in ``messages`` of the oldest message sent; 0, since a
            compaction drops the summarized messages instead of moving past them.
    """

    def __init__(
        self,
        system_prompt: str = "",
        messages: Iterable[Message] = (),
        *,
        summary: Message | None = None,
        observer: ConversationObserver | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.messages: list[Message] = list(messages)
        self.summary = summary
        self.window_start = 0
        self.observer = observer
        self.reported_input_tokens: int | None = None
        """The prompt tokens the backend reported for the last request (None since the last
        compaction, until the next request reports)."""
        self.reported_message_count = 0
        """``len(messages)`` when that request was built: later messages were not in it."""
        self.memory_flushed = False
        """Whether the memory-flush turn ran since the last compaction (one per cycle)."""
        self.cleared_until = 0
        """Tool results in ``messages`` before this index are sent as short stubs (see
        :meth:`ContextCompressor.clear`); it moves only when a clearing runs, so what is sent
        stays byte-identical from one call to the next in between."""
        self.token_scale = 1.0
        """Tokens the server counts per estimated token (characters / 4): learnt from the
        usage it reports, and raised when it refuses a prompt the estimate said would fit,
        so a digit-heavy conversation is not taken for smaller than it is."""
        self.picture_limit: int | None = None
        """The most pictures sent (None: the image preparer's ``keep``), lowered when the
        server refused a request that nothing could be summarized from: its pictures were
        what did not fit. A compaction lifts it (the window it was learnt on is gone)."""
        self.turn_id: str | None = None
        """The turn running on it, or the last one that ran (the loop sets it as a turn
        starts): the observer stores it with each message, a fact recovery reads."""

    def window(self) -> list[Message]:
        """What is sent: the summary (if any), then the messages after the last compaction."""
        kept = self.messages[self.window_start:] if self.window_start else self.messages
        if self.summary is None:
            return list(kept)
        return [self.summary, *kept]

    async def append(self, message: Message) -> None:
        """Adds a message at the end and tells the observer (which stores it).

        Args:
            message: The new message.
        """
        self.messages.append(message)
        if self.observer is not None:
            await self.observer.message_appended(self, message)

    async def compact(self, summary: Message, first_kept: int) -> None:
        """Replaces the messages before ``first_kept`` with ``summary``.

        The replaced messages are dropped from memory (the store, told by the observer,
        keeps the full transcript); ``messages`` then starts at the oldest kept one.

        Args:
            summary: The summary message.
            first_kept: Index into ``messages`` of the oldest message still sent verbatim.
        """
        first_kept_id = self.messages[first_kept].id if first_kept < len(self.messages) else None
        self.summary = summary
        del self.messages[:first_kept]
        self.window_start = 0
        # It indexes ``messages``: shift it with them (unused until the next report, anyway).
        self.reported_message_count = max(0, self.reported_message_count - first_kept)
        self.cleared_until = max(0, self.cleared_until - first_kept)
        self.reported_input_tokens = None
        self.memory_flushed = False
        self.picture_limit = None
        if self.observer is not None:
            await self.observer.compacted(self, summary, first_kept_id)

    def note_reported_usage(self, input_tokens: int, message_count: int,
                            estimated_tokens: int | None = None) -> None:
        """Remembers the prompt size the backend reported for a request.

        Args:
            input_tokens: The prompt tokens it reported.
            message_count: ``len(messages)`` when the request was built; every message after
                that is estimated on top of the reported figure.
            estimated_tokens: The estimate of that whole request; with it, the token scale
                is calibrated (a moving average, so one odd request does not swing it).
        """
        self.reported_input_tokens = input_tokens
        self.reported_message_count = message_count
        if estimated_tokens:
            measured = input_tokens / estimated_tokens
            self.token_scale = _clamp_scale(0.5 * self.token_scale + 0.5 * measured)

    def note_refused(self, context_window: int, estimated_tokens: int) -> None:
        """A prompt estimated at ``estimated_tokens`` was refused as longer than the window:
        the server counts at least ``context_window / estimated_tokens`` per estimated
        token (a margin on top, so the next try is smaller for sure)."""
        if estimated_tokens > 0:
            floor = 1.2 * context_window / estimated_tokens
            self.token_scale = _clamp_scale(max(self.token_scale * 1.2, floor))

    def fork(self) -> Conversation:
        """A scratch copy of what is sent, with no observer: what is appended to it is never
        stored and never seen by this conversation (the silent memory-flush turn runs on one).

        Returns:
            A conversation holding the same summary and window messages (the same objects,
            so their cached encodings are reused and the provider's prompt cache still hits).
        """
        scratch = Conversation(self.system_prompt, self.messages[self.window_start:],
                               summary=self.summary)
        scratch.token_scale = self.token_scale
        scratch.picture_limit = self.picture_limit
        scratch.cleared_until = max(0, self.cleared_until - self.window_start)
        if self.reported_input_tokens is not None:
            scratch.note_reported_usage(self.reported_input_tokens,
                                        max(0, self.reported_message_count - self.window_start))
        return scratch


_MIN_SCALE, _MAX_SCALE = 0.5, 16.0


def _clamp_scale(scale: float) -> float:
    return min(_MAX_SCALE, max(_MIN_SCALE, scale))
