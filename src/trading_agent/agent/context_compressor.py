"""Keeping a months-long conversation inside the model's window.

The context size is the prompt size the backend last reported plus an estimate (characters
/ 4, a fixed cost per image) of every message added since: measured, not a running guess.

- Before a turn, at ``flush_threshold`` (70%) of the window, the loop runs a silent
  memory-flush turn (the desk saves what it will need with its memory tool), then calls
  :meth:`ContextCompressor.compress`. At most one flush per compaction cycle.
- Between the tool rounds of one turn, past ``hard_threshold`` (85%), the loop compresses at
  once, without the flush.

Compression replaces, in what is *sent*, the older messages by a structured summary; a later
compaction updates the previous summary instead of summarizing a summary blind. The newest
messages (``keep_recent_tokens``) stay verbatim, and the cut never separates a tool call
from its result. The full transcript stays in the conversation and the store.
"""

from __future__ import annotations

from collections.abc import Sequence

from trading_agent.agent.backend import ModelBackend, ModelRequestSpec
from trading_agent.agent.conversation import (
    Conversation,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import CompactionEnded, CompactionStarted, MemoryFlush
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult

__all__ = [
    "FLUSH_NO_OP",
    "SUMMARY_SECTIONS",
    "ContextCompressor",
    "context_tokens",
    "find_cut",
]

FLUSH_NO_OP = "NO_REPLY"
"""What the desk may answer to the memory flush when it has nothing to save."""

SUMMARY_SECTIONS = (
    "Goal",
    "Positions and open orders",
    "Decisions and why",
    "Risks",
    "Next steps",
)

_FLUSH_PROMPT = (
    "[Memory flush] The conversation is about to be compacted: older messages will be "
    "replaced by a summary. Save now, with the remember tool, whatever you will need later "
    "and cannot look up again: positions and open orders with your reasons, plans, levels "
    "you watch, lessons learned. Do not trade. When done, or if there is nothing to save, "
    f"answer only {FLUSH_NO_OP}."
)

_SUMMARY_SYSTEM = (
    "You maintain the running summary of a trading desk's conversation. Write it under "
    "exactly these headings, in this order, as short bullet points: "
    + "; ".join(f"## {name}" for name in SUMMARY_SECTIONS)
    + ". Keep every number that matters (prices, sizes, order ids, limits). When a previous "
    "summary is given, update it with the new messages: keep what still holds, change what "
    "changed, drop what is finished. Answer with the summary only."
)

_TOOL_RESULT_CHARS = 600
"""How much of each tool result the summarizer reads."""


def context_tokens(conversation: Conversation) -> int:
    """The size of what the next request would send, in tokens.

    The backend's last reported figure plus an estimate of each message added since; a full
    estimate when nothing was reported since the last compaction.

    Args:
        conversation: The conversation.

    Returns:
        Tokens.
    """
    reported = conversation.reported_input_tokens
    if reported is not None:
        added = conversation.messages[conversation.reported_message_count:]
        return reported + sum(estimate_tokens(m) for m in added)
    return 500 + sum(estimate_tokens(m) for m in conversation.window())


def find_cut(messages: Sequence[Message], keep_recent_tokens: int) -> int:
    """Where to cut: the index of the oldest message kept verbatim.

    The newest messages worth ``keep_recent_tokens`` are kept; the cut then moves back so it
    never falls between a tool call and its results (a kept results message keeps its call).

    Args:
        messages: The window's messages (without the summary), oldest first.
        keep_recent_tokens: The budget of recent messages kept verbatim.

    Returns:
        An index in ``0..len(messages)``; 0 means nothing can be summarized.
    """
    cut = len(messages)
    budget = keep_recent_tokens
    while cut > 0:
        cost = estimate_tokens(messages[cut - 1])
        if cost > budget:
            break
        budget -= cost
        cut -= 1
    while 0 < cut < len(messages) and messages[cut].kind == "tool_results":
        cut -= 1
    return cut


class ContextCompressor:
    """Decides when to compress, and writes the summary.

    Args:
        context_window: The model's window, in tokens.
        flush_threshold: The share of the window at which a turn starts with flush + summary.
        hard_threshold: The share past which the loop summarizes mid-turn, without flush.
        keep_recent_tokens: Recent messages worth this many tokens stay verbatim.
        summary_max_tokens: The longest summary asked for.
    """

    def __init__(self, context_window: int, *, flush_threshold: float = 0.70,
                 hard_threshold: float = 0.85, keep_recent_tokens: int | None = None,
                 summary_max_tokens: int = 1200) -> None:
        if not 0 < flush_threshold < hard_threshold < 1:
            raise ValueError("need 0 < flush_threshold < hard_threshold < 1")
        self.context_window = context_window
        self.flush_threshold = flush_threshold
        self.hard_threshold = hard_threshold
        self.keep_recent_tokens = (keep_recent_tokens if keep_recent_tokens is not None
                                   else context_window // 5)
        self.summary_max_tokens = summary_max_tokens
        self._flushed = False

    def context_tokens(self, conversation: Conversation) -> int:
        """The size of what the next request would send (see :func:`context_tokens`)."""
        return context_tokens(conversation)

    def is_full(self, conversation: Conversation) -> bool:
        """Whether a turn should start with a flush and a compaction (the 70% mark)."""
        return self.context_tokens(conversation) >= self.flush_threshold * self.context_window

    def is_overfull(self, conversation: Conversation) -> bool:
        """Whether to summarize at once between tool rounds (past the 85% mark)."""
        return self.context_tokens(conversation) > self.hard_threshold * self.context_window

    def can_compress(self, conversation: Conversation) -> bool:
        """Whether there is anything old enough to summarize."""
        window = conversation.messages[conversation.window_start:]
        return find_cut(window, self.keep_recent_tokens) > 0

    def flush_trigger(self, trigger: Trigger) -> Trigger | None:
        """The silent memory-flush turn's trigger, or None if this cycle already flushed."""
        if self._flushed:
            return None
        self._flushed = True
        return Trigger(kind="command", text=_FLUSH_PROMPT, source="memory-flush")

    def flush_done(self, events: EventBus, desk: str, result: TurnResult) -> None:
        """Publishes what the flush turn did."""
        events.publish(MemoryFlush(desk=desk, turn=result.turn_id, tool_calls=result.rounds - 1,
                                   no_op=FLUSH_NO_OP in result.text))

    async def compress(self, conversation: Conversation, backend: ModelBackend,
                       events: EventBus, desk: str, reason: str) -> bool:
        """Replaces older messages, in what is sent, by an updated summary.

        Args:
            conversation: The conversation to compress.
            backend: The model that writes the summary.
            events: Where compaction start and end are published.
            desk: The desk, for events.
            reason: ``threshold``, ``mid_turn``, ``overflow`` or ``command``.

        Returns:
            True when something was summarized.
        """
        start = conversation.window_start
        window = conversation.messages[start:]
        cut = find_cut(window, self.keep_recent_tokens)
        if cut == 0:
            return False
        before = self.context_tokens(conversation)
        events.publish(CompactionStarted(desk=desk, reason=reason, tokens_before=before))
        summary_text = await self._summarize(backend, conversation.summary, window[:cut])
        summary = Message(role="user", kind="summary", content=(TextBlock(
            "[Summary of the earlier conversation, which was compacted]\n" + summary_text),))
        await conversation.compact(summary, start + cut)
        self._flushed = False
        events.publish(CompactionEnded(desk=desk, reason=reason, tokens_before=before,
                                       tokens_after=self.context_tokens(conversation),
                                       messages_summarized=cut))
        return True

    async def _summarize(self, backend: ModelBackend, previous: Message | None,
                         messages: Sequence[Message]) -> str:
        """Asks the model for the summary, in chunks that fit its window."""
        budget_chars = max(2_000, int(self.context_window * 0.5) * 4)
        summary = previous.text if previous is not None else ""
        for chunk in _chunks([_render(m) for m in messages], budget_chars):
            prompt = (
                f"Previous summary:\n{summary or '(none yet)'}\n\n"
                f"New messages:\n{chunk}\n\nWrite the updated summary."
            )
            request = ModelRequestSpec(_SUMMARY_SYSTEM, [Message.user_text(prompt)], [],
                                       max_output_tokens=self.summary_max_tokens)
            reply = await backend.complete(request)
            summary = reply.text.strip() or summary
        return summary


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


def _render(message: Message) -> str:
    """One message as plain text for the summarizer."""
    parts: list[str] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, ImageBlock):
            parts.append(f"[image: {block.description}]")
        elif isinstance(block, ToolUseBlock):
            parts.append(f"[called {block.name}({block.arguments[:300]})]")
        elif isinstance(block, ToolResultBlock):
            flag = " error" if block.is_error else ""
            parts.append(f"[result{flag}: {block.text[:_TOOL_RESULT_CHARS]}]")
    who = {"assistant": "desk"}.get(message.role, message.kind)
    return f"{who}: " + " ".join(parts)
