"""Keeping a months-long conversation inside the model's window.

**Size.** The context size is the prompt size the backend last reported plus an estimate
(characters / 4, a fixed cost per image) of every message added since: measured, not a
running guess. After a compaction, until the next request reports, the whole request is
estimated (system prompt, tool definitions and every message as it would be sent).

**When.** The loop asks, and this module decides:

- Before a turn, at ``flush_threshold`` (70%) of the window: first a silent memory-flush
  turn, then :meth:`ContextCompressor.compress`. The flush turn runs on a scratch copy of the
  conversation (:meth:`Conversation.fork`): the desk sees everything it is about to lose, is
  asked to save what it will need with its memory tool (``remember``), and may answer
  :data:`FLUSH_NO_OP`. Only the memory tool runs in it (the others are offered, so the
  prompt's prefix and the provider's cache stay the same, but calling one is refused); its
  text is never streamed, and none of its messages reach the transcript: it is not chat. It
  runs at most once per compaction cycle, only when the desk has the memory tool, and only
  while the conversation has room for it (below ``hard_threshold``).
- Between the tool rounds of one turn (and before any model call), past ``hard_threshold``
  (85%): compress at once, without the flush, and go on with the turn.
- When the server still says the prompt is too long, the loop compresses once more with
  half the recent budget and replays the request once.

**How.** Compression replaces, in what is *sent*, the older messages by a summary with a
fixed structure (:data:`~trading_agent.agent.context_budget.SUMMARY_SECTIONS`). A later
compaction updates the previous summary with the newly summarized messages instead of
summarizing a summary blind. The newest messages (``keep_recent_tokens``) stay verbatim, and
the cut never separates a tool call from its results. The summarizer reads the messages as
plain text, in chunks small enough that each summary request (instructions, previous
summary, chunk and answer) fits the window (:mod:`~trading_agent.agent.context_budget`).
The summarized messages leave the conversation's memory; the full transcript stays in the
store.

**Very long messages** are cut (head and tail kept) to ``tool_result_max_tokens`` in what
is sent, never in the store: tool results, operator messages, and the model's own answers,
whose too long tool-call arguments are replaced by a short placeholder naming their size. So
one huge message cannot keep the window full forever: after a compaction what is sent is at
most the summary, the recent budget (plus the tool call that a kept result needs) and the
request's fixed part.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trading_agent.agent.backend import ModelReply, ModelRequestSpec
from trading_agent.agent.context_budget import (
    SUMMARY_CHARS_PER_TOKEN,
    SUMMARY_INSTRUCTIONS,
    SUMMARY_SECTIONS,
    context_budget,
)
from trading_agent.agent.conversation import (
    ContentBlock,
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import CompactionEnded, CompactionStarted
from trading_agent.agent.trigger import Trigger
from trading_agent.errors import ContextOverflowError

if TYPE_CHECKING:
    from trading_agent.settings import ContextSettings

__all__ = [
    "FLUSH_NO_OP",
    "FLUSH_TRIGGER_PREFIX",
    "SUMMARY_HEADER",
    "AskModel",
    "ContextCompressor",
    "compressor_for",
    "context_tokens",
    "find_cut",
    "overhead_tokens",
    "request_tokens",
]

_MIN_MESSAGE_CHARS = 256
"""The fewest characters one message may send, whatever the token scale."""

AskModel = Callable[[ModelRequestSpec], Awaitable[ModelReply]]
"""How the compressor asks the model for a summary: the loop's call, with its retries."""

FLUSH_NO_OP = "NO_REPLY"
"""What the desk may answer to the memory flush when it has nothing (more) to save."""

FLUSH_TRIGGER_PREFIX = "memory-flush-"
"""The id prefix of the memory-flush turn's trigger."""

SUMMARY_HEADER = "[Summary of the earlier conversation; older messages were compacted]\n"
"""The first line of the summary message the model reads."""

_TOOL_RESULT_CHARS = 600
"""How much of each tool result the summarizer reads."""

_TOOL_ARGUMENT_CHARS = 300
"""How much of each tool call's arguments the summarizer reads."""

_MIN_CHUNK_CHARS = 1_000
"""A summary chunk is never split below this when the server says it is too long."""

_CLEARED_ARGUMENT_CHARS = 120
"""How much of a cleared call's arguments its stub repeats."""

_MIN_BLOCK_CHARS = 256
"""The smallest share of an answer's budget one of its blocks gets."""



def overhead_tokens(system_prompt: str, tools: Sequence[Mapping[str, Any]]) -> int:
    """The estimate of a request's fixed part: the system prompt and the tool definitions.

    Args:
        system_prompt: The system prompt.
        tools: The function-calling definitions.

    Returns:
        Tokens (characters / 4).
    """
    chars = len(system_prompt)
    if tools:
        chars += len(json.dumps(list(tools), separators=(",", ":")))
    return 4 + chars // 4


def request_tokens(request: ModelRequestSpec) -> int:
    """The estimate of a whole request: its fixed part plus every message as sent.

    Args:
        request: The request.

    Returns:
        Tokens.
    """
    return overhead_tokens(request.system_prompt, request.tools) + sum(
        estimate_tokens(m) for m in request.messages)


def context_tokens(conversation: Conversation, estimate_request: Callable[[], int]) -> int:
    """The size of what the next request would send, in tokens.

    The backend's last reported prompt size plus an estimate of each message added since;
    the whole request's estimate when nothing was reported since the last compaction. Every
    estimate is scaled by the conversation's calibrated :attr:`~Conversation.token_scale`.

    Args:
        conversation: The conversation.
        estimate_request: Estimates the whole next request (called only when needed).

    Returns:
        Tokens.
    """
    scale = conversation.token_scale
    reported = conversation.reported_input_tokens
    if reported is None:
        return math.ceil(estimate_request() * scale)
    added = conversation.messages[conversation.reported_message_count:]
    return reported + math.ceil(sum(estimate_tokens(m) for m in added) * scale)


def find_cut(messages: Sequence[Message], keep_recent_tokens: int,
             cost: Callable[[Message], int] = estimate_tokens) -> int:
    """Where to cut: the index of the oldest message kept verbatim.

    The newest messages worth ``keep_recent_tokens`` are kept; then the cut moves back so it
    never falls between a tool call and its results (a kept results message keeps its call).
    When even the newest message does not fit the budget, everything the model has answered
    is summarized; what it has not answered yet (the messages after its last one) is always
    kept, cut to fit in what is sent.

    Args:
        messages: The window's messages (without the summary), oldest first.
        keep_recent_tokens: The budget of recent messages kept verbatim.
        cost: What one message costs (as sent).

    Returns:
        An index in ``0..len(messages)``; 0 means nothing can be summarized.
    """
    cut = len(messages)
    budget = keep_recent_tokens
    while cut > 0:
        price = cost(messages[cut - 1])
        if price > budget:
            break
        budget -= price
        cut -= 1
    # What the model has not answered yet (a trigger, an operator's message, steering) is
    # sent, cut to fit, never only summarized: it is what the next answer must read.
    unanswered = next((index + 1 for index in range(len(messages) - 1, -1, -1)
                       if messages[index].role == "assistant"), 0)
    cut = min(cut, unanswered)
    while 0 < cut < len(messages) and messages[cut].kind == "tool_results":
        cut -= 1
    return cut


class ContextCompressor:
    """Decides when to compress, and writes the summary.

    One compressor may serve several conversations: what it remembers between calls (the
    flush already done in this cycle) lives on the :class:`Conversation`.

    Args:
        context_window: The model's window, in tokens.
        flush_threshold: The share of the window at which a turn starts with flush + summary.
        hard_threshold: The share past which the loop summarizes before the next model
            call, without flush.
        keep_recent_tokens: Recent messages worth this many tokens stay verbatim; a fifth of
            the window by default.
        summary_max_tokens: The longest summary asked for.
        tool_result_max_tokens: Longer tool results are cut to this in what is sent; half the
            recent budget by default, so the newest result always fits in it.
        memory_tool: The tool the memory flush asks the desk to use; without it, no flush.
        flush_max_rounds: The most model calls the memory-flush turn may make.
        clear_keep_rounds: Tool rounds kept whole when older tool results are cleared;
            None never clears (a summary is the only way down).

    Raises:
        ValueError: The settings cannot work for this window (thresholds out of order, or
            the summary and recent budget leave no room).
    """

    def __init__(self, context_window: int, *, flush_threshold: float = 0.70,
                 hard_threshold: float = 0.85, keep_recent_tokens: int | None = None,
                 summary_max_tokens: int = 1200, tool_result_max_tokens: int | None = None,
                 memory_tool: str = "remember", flush_max_rounds: int = 3,
                 clear_keep_rounds: int | None = 3) -> None:
        budget = context_budget(
            context_window, flush_threshold=flush_threshold, hard_threshold=hard_threshold,
            keep_recent_tokens=keep_recent_tokens, summary_max_tokens=summary_max_tokens,
            flush_max_rounds=flush_max_rounds)
        keep = budget.keep_recent_tokens
        self.context_window = context_window
        self.flush_threshold = flush_threshold
        self.hard_threshold = hard_threshold
        self.keep_recent_tokens = keep
        self.summary_max_tokens = budget.summary_max_tokens
        self.tool_result_max_tokens = max(64, tool_result_max_tokens if tool_result_max_tokens
                                          is not None else keep // 2)
        self.message_max_tokens = self.tool_result_max_tokens
        """Any one message longer than this (an operator's paste, a notice, a tool result) is
        cut to it in what is sent: the newest message always fits the recent budget."""
        self.memory_tool = memory_tool
        self.flush_max_rounds = flush_max_rounds
        self.clear_keep_rounds = clear_keep_rounds if clear_keep_rounds is None else max(
            0, clear_keep_rounds)
        self._chunk_chars = budget.chunk_tokens * 4

    # ------------------------------------------------------------------ decisions

    def is_full(self, tokens: int) -> bool:
        """Whether a turn should start with a flush and a compaction (the 70% mark)."""
        return tokens >= self.flush_threshold * self.context_window

    def is_overfull(self, tokens: int) -> bool:
        """Whether to summarize before the next model call, without flush (past 85%)."""
        return tokens > self.hard_threshold * self.context_window

    def can_compress(self, conversation: Conversation,
                     keep_recent_tokens: int | None = None) -> bool:
        """Whether there is anything old enough to summarize."""
        window = conversation.messages[conversation.window_start:]
        scale = conversation.token_scale
        max_chars = self.max_message_chars(scale)
        return find_cut(window, int((keep_recent_tokens or self.keep_recent_tokens) / scale),
                        lambda m: self._sent_tokens(m, max_chars)) > 0

    def should_flush(self, conversation: Conversation, tokens: int,
                     tool_names: Sequence[str]) -> bool:
        """Whether the memory-flush turn runs before this compaction.

        Only when the desk has the memory tool, the flush has not run in this compaction
        cycle, and the conversation has room for it (below the hard mark).
        """
        return (self.memory_tool in tool_names and not conversation.memory_flushed
                and not self.is_overfull(tokens))

    def flush_trigger(self) -> Trigger:
        """The silent memory-flush turn's trigger."""
        text = (
            "[Memory flush] The conversation is about to be compacted: older messages will "
            f"be replaced by a summary. Save now, with the {self.memory_tool} tool, whatever "
            "you will need later and cannot look up again: positions and open orders with "
            "your reasons, plans and levels you watch, lessons learned. Do not trade; no "
            f"other tool runs now. When done, or if there is nothing to save, answer only "
            f"{FLUSH_NO_OP}."
        )
        return Trigger(kind="command", text=text, source="memory-flush",
                       id=FLUSH_TRIGGER_PREFIX + uuid.uuid4().hex)

    # ------------------------------------------------------------------ what is sent

    def trim(self, messages: Sequence[Message], scale: float = 1.0) -> list[Message]:
        """Cuts very long messages in what is sent (head and tail kept); memoized.

        Tool results, operator messages, triggers and notices longer than
        :attr:`message_max_tokens` are cut, with a line saying how much and that the whole
        text is in the store. The model's own messages get the same budget, whatever its
        output cap said: a long text is cut the same way, and tool-call arguments that do not
        fit are replaced by a short JSON object saying how long they were (a server that
        ignored the cap must not fill every later request with one answer).

        Args:
            messages: What would be sent, oldest first.
            scale: The conversation's tokens per estimated token (see
                :attr:`Conversation.token_scale`): a digit-heavy conversation gets fewer
                characters for the same budget.

        Returns:
            The messages to send; unchanged ones are the same objects.
        """
        max_chars = self.max_message_chars(scale)
        return [self._trimmed(m, max_chars) for m in messages]

    def may_trim(self, message: Message) -> bool:
        """Whether :meth:`trim` could cut this message at some scale: a text of it is longer
        than the fewest characters a message may ever send."""
        if message.role != "user" or message.kind == "summary":
            return False
        return any(len(block.text) > _MIN_MESSAGE_CHARS for block in message.content
                   if isinstance(block, TextBlock | ToolResultBlock))

    def max_message_chars(self, scale: float = 1.0) -> int:
        """How many characters one message may send at this token scale (in steps of about
        19%, so a drifting scale does not change what is sent every call)."""
        step = 2 ** (round(math.log2(max(scale, 0.25)) * 4) / 4)
        return max(_MIN_MESSAGE_CHARS, int(self.message_max_tokens * 4 / step))

    def _trimmed(self, message: Message, max_chars: int) -> Message:
        if message.kind == "summary":
            return message
        key = f"trimmed:{max_chars}"
        cached = message.cache.get(key)
        if cached is None:
            cached = _trim_message(message, max_chars) or True
            message.cache[key] = cached
        return cached if isinstance(cached, Message) else message

    def _sent_tokens(self, message: Message, max_chars: int) -> int:
        return estimate_tokens(self._trimmed(message, max_chars))

    # ------------------------------------------------------------------ clearing

    def clear(self, conversation: Conversation, keep: int | None = None,
              enough: int = 0) -> bool:
        """Stubs, in what is sent, the tool results older than the last ``keep`` tool rounds:
        each becomes one line naming the tool, its arguments and where the whole result is
        stored. The cheap step before a summary (the cycls seed's ``clear(keep, enough)``).

        Args:
            conversation: The conversation.
            keep: How many of the newest tool rounds stay whole; :attr:`clear_keep_rounds`
                by default.
            enough: The tokens that must be freed for the clearing to count.

        Returns:
            True when it freed at least ``enough`` tokens (then no summary is needed).
        """
        keep = self.clear_keep_rounds if keep is None else keep
        if keep is None:
            return False
        messages = conversation.messages
        rounds = [index for index in range(conversation.window_start, len(messages))
                  if messages[index].kind == "tool_results"]
        until = rounds[-keep] if 0 < keep <= len(rounds) else (
            len(messages) if keep == 0 else conversation.cleared_until)
        if until <= conversation.cleared_until:
            return enough <= 0
        max_chars = self.max_message_chars(conversation.token_scale)
        calls = _calls_before(messages, until)
        freed = 0
        for index in range(max(conversation.cleared_until, conversation.window_start), until):
            message = messages[index]
            if message.kind == "tool_results":
                freed += (self._sent_tokens(message, max_chars)
                          - estimate_tokens(_cleared(message, calls)))
        conversation.cleared_until = until
        conversation.reported_input_tokens = None  # the last report no longer holds
        return freed * conversation.token_scale >= enough

    def cleared(self, conversation: Conversation, messages: Sequence[Message]) -> list[Message]:
        """``messages`` (the window, as sent) with the cleared tool results stubbed.

        Args:
            conversation: Whose window it is (its ``cleared_until``).
            messages: The window's messages, the summary first if there is one.

        Returns:
            The messages to send; unchanged ones are the same objects.
        """
        until = conversation.cleared_until
        if until <= conversation.window_start:
            return list(messages)
        stubbed = {id(m) for m in conversation.messages[conversation.window_start:until]
                   if m.kind == "tool_results"}
        if not stubbed:
            return list(messages)
        calls: dict[str, ToolUseBlock] = {}
        sent: list[Message] = []
        for message in messages:
            for call in message.tool_uses:
                calls[call.id] = call
            sent.append(_cleared(message, calls) if id(message) in stubbed else message)
        return sent

    # ------------------------------------------------------------------ compaction

    async def compress(self, conversation: Conversation, *, ask: AskModel,
                       measure: Callable[[], int], events: EventBus, desk: str, reason: str,
                       keep_recent_tokens: int | None = None, fixed_tokens: int = 0,
                       trigger: Trigger | None = None) -> bool:
        """Replaces older messages by an updated summary (they leave memory, not the store).

        Args:
            conversation: The conversation to compress.
            ask: Sends one summary request (with the loop's retries).
            measure: The conversation's context size now (before and after).
            events: Where compaction start and end are published.
            desk: The desk, for events.
            reason: ``threshold``, ``mid_turn``, ``overflow`` or ``command``.
            keep_recent_tokens: A smaller recent budget than configured (overflow recovery).
            fixed_tokens: The request's fixed part (system prompt and tools), estimated:
                the summary and the recent messages share what is left of the window.
            trigger: What asked for it (the ``/compact`` command, or the turn's trigger),
                named in its events.

        Returns:
            True when something was summarized; False when there was nothing to summarize.

        Raises:
            BackendError: The summary could not be written; the conversation is unchanged.
        """
        start = conversation.window_start
        window = conversation.messages[start:]
        scale = conversation.token_scale
        keep, summary_tokens = self.budgets(fixed_tokens * scale,
                                            keep_recent_tokens or self.keep_recent_tokens)
        max_chars = self.max_message_chars(scale)
        cut = find_cut(window, int(keep / scale), lambda m: self._sent_tokens(m, max_chars))
        if cut == 0:
            return False
        before, messages_before = measure(), len(conversation.window())
        kind, text = (trigger.kind, trigger.text) if trigger is not None else ("", "")
        events.publish(CompactionStarted(desk=desk, reason=reason, tokens_before=before,
                                         trigger_kind=kind, trigger_text=text))
        summary_text = await self._summarize(ask, conversation.summary, window[:cut],
                                             summary_tokens, scale)
        summary = Message(role="user", kind="summary",
                          content=(TextBlock(SUMMARY_HEADER + summary_text),))
        await conversation.compact(summary, start + cut)
        events.publish(CompactionEnded(desk=desk, reason=reason, tokens_before=before,
                                       tokens_after=measure(), messages_summarized=cut,
                                       messages_before=messages_before,
                                       messages_after=len(conversation.window()),
                                       trigger_kind=kind, trigger_text=text))
        return True

    def budgets(self, fixed_tokens: float, keep_recent_tokens: int) -> tuple[int, int]:
        """The recent messages' and the summary's budgets, in tokens, for a request whose
        fixed part is ``fixed_tokens``: each shrinks to what the window has left (a tenth of
        the window is kept for the answer).

        Returns:
            ``(keep_recent_tokens, summary_max_tokens)``, each at least a little.
        """
        room = int(self.context_window * 0.9 - fixed_tokens)
        keep = max(32, min(keep_recent_tokens, room // 2))
        return keep, max(32, min(self.summary_max_tokens, room - keep))

    async def _summarize(self, ask: AskModel, previous: Message | None,
                         messages: Sequence[Message], max_tokens: int | None = None,
                         scale: float = 1.0) -> str:
        """Folds the messages, chunk by chunk (sized at the conversation's token scale),
        into the previous summary."""
        max_tokens = max_tokens or self.summary_max_tokens
        summary = _summary_body(previous)
        chunk_chars = max(_MIN_CHUNK_CHARS, int(self._chunk_chars / max(scale, 1.0)))
        pending = deque(_chunks([_render(m) for m in messages], chunk_chars))
        while pending:
            chunk = pending.popleft()
            prompt = (f"Previous summary:\n{summary or '(none yet: this is the first one)'}\n\n"
                      f"New messages, oldest first:\n{chunk}\n\nWrite the updated summary.")
            request = ModelRequestSpec(SUMMARY_INSTRUCTIONS, [Message.user_text(prompt)], [],
                                       max_output_tokens=max_tokens)
            try:
                reply = await ask(request)
            except ContextOverflowError:
                # The server counts tokens its own way; halve the chunk and try again.
                if len(chunk) <= _MIN_CHUNK_CHARS:
                    raise
                pending.extendleft(reversed(_halves(chunk)))
                continue
            summary = _normalize(reply.text, max_tokens) or summary
        return summary or "\n\n".join(f"## {name}\n- (nothing noted)"
                                       for name in SUMMARY_SECTIONS)


def _summary_body(previous: Message | None) -> str:
    if previous is None:
        return ""
    text = previous.text
    return text[len(SUMMARY_HEADER):] if text.startswith(SUMMARY_HEADER) else text


def _normalize(text: str, max_tokens: int) -> str:
    """The summary with every heading present (in its place or added) and cut to size."""
    text = text.strip()
    if not text:
        return ""
    text = text[:max_tokens * SUMMARY_CHARS_PER_TOKEN]
    missing = [name for name in SUMMARY_SECTIONS if f"## {name}" not in text]
    return text + "".join(f"\n\n## {name}\n- (nothing noted)" for name in missing)


def _chunks(lines: list[str], budget_chars: int) -> list[str]:
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in lines:
        line = line[:budget_chars]
        if current and size + len(line) > budget_chars:
            chunks.append("\n".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    if current:
        chunks.append("\n".join(current))
    return chunks


def _halves(chunk: str) -> list[str]:
    middle = len(chunk) // 2
    split = chunk.rfind("\n", 0, middle)
    if split <= 0:
        split = middle
    return [chunk[:split], chunk[split:].lstrip("\n")]


def _render(message: Message) -> str:
    """One message as plain text for the summarizer."""
    parts: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ImageBlock):
            parts.append(f"[image: {block.description}]")
        elif isinstance(block, ToolUseBlock):
            parts.append(f"[called {block.name}({block.arguments[:_TOOL_ARGUMENT_CHARS]})]")
        elif isinstance(block, ToolResultBlock):
            flag = " error" if block.is_error else ""
            images = sum(1 for b in block.content if isinstance(b, ImageBlock))
            pictures = f" +{images} image(s)" if images else ""
            parts.append(f"[result{flag}{pictures}: {block.text[:_TOOL_RESULT_CHARS]}]")
    who = {"assistant": "desk"}.get(message.role, message.kind)
    return f"{who}: " + " ".join(parts)


def _cut(text: str, max_chars: int, what: str) -> str:
    """``text`` with its middle cut out to ``max_chars``, saying so."""
    head = max_chars * 2 // 3
    tail = max_chars - head
    note = (f"\n[... {len(text) - head - tail:,} characters of this {what} were cut here to fit "
            "the model's window; the whole text is kept in the desk's store ...]\n")
    return text[:head] + note + text[-tail:]


def _trim_message(message: Message, max_chars: int) -> Message | None:
    """The message with each long text (its own, or a tool result's) cut to ``max_chars``,
    or None when nothing is that long.

    The model's own messages share ``max_chars`` among their blocks: when the text and the
    tool calls' arguments together are longer, each argument text longer than its share is
    replaced by a placeholder (:func:`_omitted_arguments`) and a long text is cut.
    """
    if message.role == "assistant":
        return _trim_answer(message, max_chars)
    content: list[ContentBlock] = []
    changed = False
    what = "result" if message.kind == "tool_results" else "message"
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            text = block.text
            if len(text) > max_chars:
                images = tuple(b for b in block.content if isinstance(b, ImageBlock))
                block = ToolResultBlock(block.tool_use_id,
                                        (TextBlock(_cut(text, max_chars, what)), *images),
                                        block.is_error)
                changed = True
        elif isinstance(block, TextBlock) and len(block.text) > max_chars:
            block = TextBlock(_cut(block.text, max_chars, what))
            changed = True
        content.append(block)
    if not changed:
        return None
    return Message(role=message.role, content=tuple(content), kind=message.kind,
                   id=message.id, created_at=message.created_at)


def _trim_answer(message: Message, max_chars: int) -> Message | None:
    """An answer of the model's within ``max_chars``, or None when it already is."""
    sizes = [len(b.arguments) if isinstance(b, ToolUseBlock)
             else len(b.text) if isinstance(b, TextBlock) else 0 for b in message.content]
    if sum(sizes) <= max_chars:
        return None
    share = max(_MIN_BLOCK_CHARS, max_chars // max(1, sum(1 for size in sizes if size)))
    content: list[ContentBlock] = []
    for block, size in zip(message.content, sizes, strict=True):
        if size > share:
            if isinstance(block, ToolUseBlock):
                block = ToolUseBlock(block.id, block.name, _omitted_arguments(size))
            elif isinstance(block, TextBlock):
                block = TextBlock(_cut(block.text, share, "answer"))
        content.append(block)
    return Message(role=message.role, content=tuple(content), kind=message.kind,
                   id=message.id, created_at=message.created_at)


def _omitted_arguments(size: int) -> str:
    """What a tool call's too long arguments are sent as: a JSON object (every provider
    takes one) the model can read."""
    return json.dumps({"omitted_arguments": (
        f"[{size:,} characters of arguments were left out here to fit the model's window; "
        "the whole call is kept in the desk's store]")})


def _calls_before(messages: Sequence[Message], until: int) -> dict[str, ToolUseBlock]:
    return {call.id: call for message in messages[:until] for call in message.tool_uses}


def _cleared(message: Message, calls: Mapping[str, ToolUseBlock]) -> Message:
    """A tool results message with each result stubbed to one line; memoized."""
    cached = message.cache.get("cleared")
    if isinstance(cached, Message):
        return cached
    content: list[ContentBlock] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            call = calls.get(block.tool_use_id)
            what = (f"{call.name}({call.arguments[:_CLEARED_ARGUMENT_CHARS]})" if call
                    else "a tool call")
            images = sum(1 for b in block.content if isinstance(b, ImageBlock))
            pictures = f" and {images} image(s)" if images else ""
            outcome = "failed" if block.is_error else "returned"
            block = ToolResultBlock(block.tool_use_id, (TextBlock(
                f"[cleared: {what} {outcome} {len(block.text):,} characters{pictures}; the "
                f"whole result is kept in the desk's store (tool call {block.tool_use_id}). "
                "Call the tool again if you need it now.]"),), block.is_error)
        content.append(block)
    stub = Message(role=message.role, content=tuple(content), kind=message.kind,
                   id=message.id, created_at=message.created_at)
    message.cache["cleared"] = stub
    return stub


def compressor_for(settings: ContextSettings, context_window: int, *,
                   key: str = "context") -> ContextCompressor:
    """The compressor a desk's ``[context]`` settings ask for, sized to its model's window.

    Args:
        settings: The desk's context settings.
        context_window: The model's window, in tokens (as its backend reports it).
        key: Where the settings are in the config, for the error message
            (``desks.alpha.context``).

    Returns:
        The compressor.

    Raises:
        ConfigError: The settings cannot work for this window; the message names the keys,
            their values and the window.
    """
    settings.check_window(context_window, key=key)
    return ContextCompressor(
        context_window, flush_threshold=settings.flush_threshold,
        hard_threshold=settings.hard_threshold, keep_recent_tokens=settings.keep_recent_tokens,
        summary_max_tokens=settings.summary_max_tokens,
        tool_result_max_tokens=settings.tool_result_max_tokens,
        flush_max_rounds=settings.flush_max_rounds,
        clear_keep_rounds=settings.clear_keep_rounds if settings.clear_tool_results else None)
