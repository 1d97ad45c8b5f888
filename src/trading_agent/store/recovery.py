"""Recovery: what a restart (or a failed turn) finds in the store, and what the desk is told.

A desk's conversation is read back from the store, the source of truth. When its last turn
was cut off (by ``kill -9``, a crash, a stop, or a turn that failed), it is repaired so the
next request is valid, and the desk reads a notice:

- each tool call left without a result is answered: with what really became of it when a
  resolver registered for the desk can say (the trading layer's ``OrderOutcomes`` looks a
  ``place_order`` up by the client order id its turn and call give); a call that was waiting
  for an operator's approval, or was denied, never ran; any other may or may not have taken
  effect;
- then :data:`INTERRUPTED_NOTICE`, with why the turn stopped when the caller knows.

What it reads are plain facts the store keeps as they happen, never event JSON: the turn
each message was made in (stored with the message), how each turn ended (stored once it
returned: answered, at its round limit, stopped; ``cut_off`` when recovery found it cut
off), and each call held for an operator's approval with how that ended (stored before the
call went on). The repair appends and stores; nothing stored is rewritten. A conversation
that already ends with a notice is not cut off, so restoring it again adds no second one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from trading_agent.agent.conversation import (
    ContentBlock,
    Conversation,
    ConversationObserver,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    repair,
)

__all__ = ["INTERRUPTED_NOTICE", "LOOKED_UP_NOTE", "CallOutcome", "CallOutcomes",
           "HeldCallFacts", "InterruptedCall", "RecoveryFacts", "TurnEnd", "restore"]

_log = structlog.get_logger(__name__)

INTERRUPTED_NOTICE = (
    "[Notice from the daemon] Your previous turn was interrupted before it finished (the "
    "daemon stopped, or the turn failed). Tool calls that had not returned are marked as "
    "interrupted: they may or may not have taken effect, so check your open orders, positions "
    "and balances before repeating any of them."
)
"""What a desk is told when its conversation is restored after a turn was cut off: by a
stop or crash of the daemon, or by a turn that failed in a running one (the model
unavailable, an error). When the caller of
:meth:`~trading_agent.store.transcripts.SqliteTranscripts.restore_conversation` knows which, the
notice goes on with ``"\nWhy it stopped: "`` and its reason."""

LOOKED_UP_NOTE = (
    "Some of those calls were looked up after the restart: their results above say what "
    "really happened, and only what they leave uncertain needs checking.")
"""Added to the notice when a resolver said what became of an interrupted call."""

_FINISHED = frozenset({"answered", "round_limit"})
"""Turn ends after which nothing is owed to the desk."""

TurnEnd = str
"""How a turn ended: ``answered``, ``round_limit``, ``stopped``, or ``cut_off`` (found cut
off by recovery)."""


@dataclass(frozen=True)
class InterruptedCall:
    """A tool call of a desk that never got its result (the daemon stopped during it).

    Attributes:
        desk: The desk.
        tool: The tool's name.
        arguments: The arguments, as the raw JSON text the model wrote.
        call_id: The call's id.
        turn_id: The id of the turn it was made in, as stored with its message; None for a
            message stored before turns were (an older file).
        approval: None when the call was never held for an operator's approval;
            ``"pending"`` when it was still waiting for one when the daemon stopped; else
            the approval's outcome (``approved``, ``denied``, ``timed_out``, ``cancelled``).
    """

    desk: str
    tool: str
    arguments: str
    call_id: str
    turn_id: str | None
    approval: str | None = None


class CallOutcome(Protocol):
    """What became of an interrupted call (``trading.order_outcomes.OrderOutcome`` has this
    shape; the store does not import the trading layer)."""

    @property
    def text(self) -> str:
        """The tool result the model reads."""
        ...

    @property
    def is_error(self) -> bool:
        """Whether the result reports that the call did not do what it was asked."""
        ...


CallOutcomes = Callable[[InterruptedCall], Awaitable[CallOutcome | None]]
"""Says what became of an interrupted call, or None to leave it to the default answer (it
may or may not have taken effect). It must not raise (the store logs and ignores it if it
does) and should bound its own time: the desk waits for it before its first turn."""


class HeldCallFacts(Protocol):
    """What recovery reads of the calls held for approval
    (:class:`~trading_agent.store.held_calls.SqliteHeldCalls` has it)."""

    async def held_calls(self, desk: str, turn: str) -> dict[str, str]:
        """The turn's calls held for an operator's approval: ``pending`` or the outcome."""
        ...


class RecoveryFacts(Protocol):
    """What recovery reads of the transcripts
    (:class:`~trading_agent.store.transcripts.SqliteTranscripts` has it)."""

    async def restored_window(self, desk: str) -> tuple[Message | None, list[Message]]:
        """The desk's latest summary and the messages after it (an operator's retracted
        ones left out), oldest first."""
        ...

    async def turn_of(self, desk: str, message_id: str) -> str | None:
        """The turn a message of the desk was made in; None when not stored with one."""
        ...

    async def turn_end(self, desk: str, turn: str) -> TurnEnd | None:
        """How the desk's turn ended, or None when it never did."""
        ...

    async def record_turn_end(self, desk: str, turn: str, how: TurnEnd) -> None:
        """Records how the desk's turn ended."""
        ...

    def observer(self, desk: str) -> ConversationObserver:
        """What stores the desk's conversation from then on."""
        ...

    def now(self) -> float:
        """The store's clock."""
        ...


async def restore(facts: RecoveryFacts, held_calls: HeldCallFacts, desk: str,
                  system_prompt: str, reason: str | None = None, *,
                  outcomes: CallOutcomes | None = None) -> Conversation:
    """A desk's conversation as it was, a cut-off turn repaired and followed by a notice.

    Args:
        facts: The transcripts.
        held_calls: The calls held for approval.
        desk: The desk.
        system_prompt: The desk's system prompt (from the config, which may have changed).
        reason: Why the turn stopped, when the caller knows (``"the model was
            unavailable: ..."``); it must hold no secret. None after a restart, when nobody
            knows.
        outcomes: Says what became of each interrupted call.

    Returns:
        The conversation, with the store as its observer.

    Raises:
        StoreError: The store failed, or a stored message cannot be decoded.
    """
    summary, messages = await facts.restored_window(desk)
    last = messages[-1] if messages else None
    turn = await facts.turn_of(desk, last.id) if last is not None else None
    # A turn stopped at a safe point (a shutdown) never answered: it is told, as one cut off.
    ended = turn is not None and await facts.turn_end(desk, turn) in _FINISHED
    repaired = repair(messages)
    # Messages repair added after the last stored one are stored; a fix inside the history
    # is only in memory (repair is deterministic, so every restore redoes it).
    stored_ids = {m.id for m in messages}
    tail = len(repaired)
    while tail > 0 and repaired[tail - 1].id not in stored_ids:
        tail -= 1
    conversation = Conversation(system_prompt, repaired[:tail], summary=summary,
                                observer=facts.observer(desk))
    added = repaired[tail:]
    looked_up = 0
    if added and last is not None and last.role == "assistant":
        # Only the last message's calls can be answered here: earlier repairs are fixes
        # inside the history, made again on every restore and never stored.
        held = await held_calls.held_calls(desk, turn) if turn is not None else {}
        added[0], looked_up = await _answer_interrupted(desk, turn, held, last, added[0],
                                                        outcomes)
    for message in added:
        await conversation.append(Message(role=message.role, content=message.content,
                                          kind=message.kind, created_at=facts.now()))
    if added or _cut_off(messages, ended):
        if turn is not None:
            await facts.record_turn_end(desk, turn, "cut_off")  # kept if it had ended
        text = _notice(reason) + (f"\n{LOOKED_UP_NOTE}" if looked_up else "")
        await conversation.append(Message(role="user", kind="notice",
                                          content=(TextBlock(text),),
                                          created_at=facts.now()))
        _log.warning("turn_interrupted", desk=desk, turn=turn, repaired_messages=len(added),
                     looked_up=looked_up, reason=reason)
    return conversation


async def _answer_interrupted(desk: str, turn: str | None, held: dict[str, str],
                              calls_message: Message, answer: Message,
                              outcomes: CallOutcomes | None) -> tuple[Message, int]:
    """``answer`` (repair's results for ``calls_message``'s calls, none of which had one)
    with each call's real outcome where it is known, and how many were known."""
    calls = {call.id: call for call in calls_message.tool_uses}
    content: list[ContentBlock] = []
    looked_up = 0
    for block in answer.content:
        call = calls.get(block.tool_use_id) if isinstance(block, ToolResultBlock) else None
        if call is None:
            content.append(block)
            continue
        approval = held.get(call.id)
        interrupted = InterruptedCall(desk, call.name, call.arguments, call.id, turn, approval)
        outcome = await _look_up(outcomes, interrupted) if outcomes is not None else None
        if outcome is not None:
            looked_up += 1
            content.append(ToolResultBlock(call.id, (TextBlock(outcome.text),),
                                           is_error=outcome.is_error))
        elif approval is not None and approval != "approved":
            content.append(_never_ran(call, approval))
        else:
            content.append(block)
    return Message(role=answer.role, content=tuple(content), kind=answer.kind,
                   id=answer.id, created_at=answer.created_at), looked_up


def _notice(reason: str | None) -> str:
    """The interrupted notice, with why the turn stopped when that is known."""
    reason = (reason or "").strip()
    return f"{INTERRUPTED_NOTICE}\nWhy it stopped: {reason}" if reason else INTERRUPTED_NOTICE


def _cut_off(messages: Sequence[Message], ended: bool) -> bool:
    """Whether the transcript ends inside a turn: a call, results, or an unanswered trigger.

    A turn that hit its round limit ends on tool results without being cut off: the store
    holds its end (``ended``: the last message's turn finished), written once the turn
    returned, after its last message.
    """
    if not messages or ended:
        return False
    last = messages[-1]
    if last.role == "assistant":
        return bool(last.tool_uses)
    return last.kind in ("trigger", "operator", "steering", "tool_results")


async def _look_up(outcomes: CallOutcomes, call: InterruptedCall) -> CallOutcome | None:
    """The resolver's answer; a resolver that fails leaves the default answer."""
    try:
        return await outcomes(call)
    except Exception as exc:  # a lookup must never keep a desk from restoring
        _log.exception("call_outcome_failed", desk=call.desk, tool=call.tool,
                       call_id=call.call_id, error=repr(exc))
        return None


_NOT_APPROVED = {
    "pending": "was waiting for an operator's approval when the daemon stopped",
    "denied": "was denied by an operator",
    "timed_out": "timed out waiting for an operator's approval",
    "cancelled": "had its approval cancelled",
}


def _never_ran(call: ToolUseBlock, approval: str) -> ToolResultBlock:
    """The result of a held call that was never approved: a held call runs only once
    approved, so it never ran."""
    why = _NOT_APPROVED.get(approval, f"was not approved ({approval})")
    return ToolResultBlock(call.id, (TextBlock(
        f"Error: the call to {call.name} {why}, so it never ran. Make it again if it is "
        "still wanted (it will wait for approval again)."),), is_error=True)
