"""One desk: its trigger queue and the loop that runs its turns, one at a time.

The desk takes the next trigger from its :class:`Mailbox` and runs a turn for it with its
:class:`AgentLoop`. What can go wrong is contained here, so other desks never notice:

- The model unavailable (:class:`BackendUnavailableError`, after the loop's own retries),
  or the disk under the store full (:class:`StorageFullError`): the desk is **paused** with
  the reason and tries again after a growing wait (no restart counted, no kill switch).
- Anything else raised by a turn: logged, published as an error event, and the desk
  restarts after a growing wait (reset by a turn that succeeds).

Either way, and at start, the desk *restores*: it reads its conversation back from the
store (the source of truth), answers any tool call left without a result, tells the desk
in a notice that its last turn was interrupted (and why, when the desk caught the failure:
the model unavailable, or the turn's error), and queues again every operator message the
store holds that the conversation does not. So a crash, a failure and a
``kill -9`` all recover the same way, and an operator message is neither lost nor repeated.

A retry adds nothing to the conversation while the model has not answered: when it ends
with a notice nobody answered (the model failed before replying to its trigger, or to the
resume notice), the next turn *replays* that notice, the message already stored, instead of
appending another; the store adds no notice after a notice, so the first one's text, with
the first failure's reason, is kept. A day of outage leaves the trigger, one notice, then
the answer.

Triggers and operator messages share one owner, the desk's :class:`Mailbox`. Operator
messages are stored before they are acknowledged; during a turn they wait there for the
next model call, else they queue a turn. One that comes while the model writes its final
answer opens the next turn at once, ahead of every other trigger (``run_turn`` runs one
turn); after a failed turn every waiting message queues a turn of its own. Each keeps its id
from the store all the way into the conversation, and is taken once.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, Protocol

import anyio
import structlog
from anyio.abc import TaskStatus

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelBackend
from trading_agent.agent.conversation import (
    Conversation,
    ConversationObserver,
    ImageBlock,
    Message,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ErrorEvent
from trading_agent.agent.fixed_part import FixedPart, answer_reserve, measure_fixed_part
from trading_agent.agent.image_preparer import OPERATOR_FORMATS, ImagePreparer
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger, TriggerKind
from trading_agent.agent.turn_runner import TurnResult
from trading_agent.daemon.control import DeskReply, DeskState, DeskStatus
from trading_agent.daemon.events import DeskPaused, DeskResumed, TurnCancelled, TurnRetried
from trading_agent.daemon.mailbox import Delivery, Mailbox
from trading_agent.daemon.pins import pinned_prompt
from trading_agent.errors import (
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    RetryRefusedError,
    StorageFullError,
    StoreError,
)
from trading_agent.logging_setup import redact_secrets
from trading_agent.store.desk_holds import HoldFields
from trading_agent.store.fencing import FencedError
from trading_agent.store.transcripts import DeskConversationStore
from trading_agent.trading.order_outcomes import CANCEL_ORDER, PLACE_ORDER

__all__ = [
    "RESUME_TEXT",
    "Backoff",
    "Desk",
    "DeskHolds",
    "DeskInbox",
    "DeskProfile",
    "DeskSchedules",
    "DeskStore",
    "DeskTranscripts",
    "Hold",
]

_log = structlog.get_logger(__name__)

_KEPT_REPLIES = 64
"""How many answers to operator messages a desk keeps for senders that ask late."""

Sleep = Callable[[float], Awaitable[None]]

RESUME_TEXT = ("Carry on from where your previous turn stopped (see the notice above), or say "
               "briefly that nothing is left to do.")
"""What a desk is told in the turn it runs after an interrupted one."""


class DeskTranscripts(Protocol):
    """What a desk needs of its stored conversation
    (:class:`trading_agent.store.transcripts.SqliteTranscripts` has it)."""

    async def restore_conversation(self, desk: str, system_prompt: str,
                                   reason: str | None = None) -> Conversation:
        """The desk's conversation as stored, an interrupted turn repaired and followed by a
        notice (a message of kind ``notice``; with ``reason`` when given, none added after
        a notice), with the store as its observer."""
        ...

    async def has_message(self, desk: str, message_id: str) -> bool:
        """Whether the desk's conversation ever held a message of this id (compacted or
        not)."""
        ...

    async def record_turn_end(self, desk: str, turn: str, how: str) -> None:
        """Records how a turn of the desk ended (``answered``, ``round_limit``,
        ``stopped``): a turn without an end was cut off."""
        ...

    async def retract_messages(self, desk: str, message_ids: Sequence[str], by: str) -> None:
        """Takes messages out of what a restored conversation holds; the transcript keeps
        them, marked."""
        ...


class DeskInbox(Protocol):
    """What a desk needs of its stored operator messages
    (:class:`trading_agent.store.operator_inbox.SqliteOperatorInbox` has it)."""

    async def undelivered_operator_messages(self, desk: str) -> list[SteeringMessage]:
        """Operator messages stored and not yet in the conversation, oldest first."""
        ...

    async def add_operator_message(self, desk: str, message: SteeringMessage) -> None:
        """Stores an operator message before it is acknowledged; it counts as delivered
        once a conversation message with its id is appended."""
        ...

    async def has_operator_message(self, desk: str, message_id: str) -> bool:
        """Whether a message of this id was stored for the desk."""
        ...


class DeskSchedules(Protocol):
    """Where a desk records its schedules' slots
    (:class:`trading_agent.store.schedule_state.SqliteScheduleState` has it)."""

    async def record_schedule_fired(self, desk: str, schedule: str, slot: datetime) -> None:
        """Records the slot a schedule last fired for."""
        ...


class DeskHolds(Protocol):
    """Where a desk records its pause
    (:class:`trading_agent.store.desk_holds.SqliteDeskHolds` has it)."""

    async def desk_hold(self, desk: str) -> HoldFields | None:
        """Why the desk is paused, as last recorded, or None."""
        ...

    async def record_desk_hold(self, desk: str, hold: HoldFields | None) -> None:
        """Records that the desk is paused, or (None) no longer is."""
        ...


class DeskStore(Protocol):
    """The parts of the store a desk uses (:class:`trading_agent.store.store.Store` hands
    them out)."""

    @property
    def transcripts(self) -> DeskTranscripts:
        """Its conversation."""
        ...

    @property
    def inbox(self) -> DeskInbox:
        """Its operator messages."""
        ...

    @property
    def schedules(self) -> DeskSchedules:
        """Its schedules' slots."""
        ...

    @property
    def holds(self) -> DeskHolds:
        """Its pause."""
        ...


@dataclass(frozen=True)
class DeskProfile:
    """What an operator sees of a desk that does not change while it runs.

    Attributes:
        name: The desk's name.
        mode: ``paper`` or ``live``.
        model: The model it talks to.
        symbols: The markets it trades.
    """

    name: str
    mode: str = "paper"
    model: str = ""
    symbols: tuple[str, ...] = ()


@dataclass(frozen=True)
class Backoff:
    """How long a failing desk waits before it tries again: doubling, up to a cap.

    Attributes:
        crash_first: The first wait after a turn raised, in seconds.
        crash_max: The longest such wait.
        pause_first: The first wait while the model is unavailable.
        pause_max: The longest such wait.
    """

    crash_first: float = 1.0
    crash_max: float = 60.0
    pause_first: float = 15.0
    pause_max: float = 600.0

    def delay(self, failures: int, *, paused: bool) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (1-based)."""
        first, cap = ((self.pause_first, self.pause_max) if paused
                      else (self.crash_first, self.crash_max))
        return float(min(first * 2.0 ** max(failures - 1, 0), cap))


@dataclass(frozen=True)
class Hold:
    """Why a desk takes no turns: an operator paused it, or a spend cap is used up.

    Attributes:
        by: Who paused it.
        reason: Why.
        at: When (seconds since the epoch).
        until: When it resumes by itself, or None for when an operator resumes it.
    """

    by: str
    reason: str
    at: float
    until: float | None = None

    def describe(self) -> str:
        """``paused by NAME at TIME: REASON (until ...)``, for the desk's status."""
        when = datetime.fromtimestamp(self.at, UTC).strftime("%Y-%m-%d %H:%M UTC")
        text = f"paused by {self.by} at {when}: {self.reason}"
        if self.until is not None:
            until = datetime.fromtimestamp(self.until, UTC).strftime("%Y-%m-%d %H:%M UTC")
            return f"{text} (until {until}, or until an operator resumes it)"
        return f"{text} (until an operator resumes it)"


FailedTurns = Callable[[int, str], Awaitable[None]]
"""Told after each failed turn: how many failed in a row, and the last error."""


@dataclass
class _Outcome:
    """What the desk remembers of its last turn."""

    at: float | None = None
    text: str = ""
    turns: int = 0
    failures: int = 0
    crashes: int = 0
    """Failed turns in a row that were not the model's outage (the kill switch counts
    these)."""
    reason: str = ""
    cause: str | None = None
    """Why the last turn failed, for the next restore's notice (None when not known)."""
    unfinished: Trigger | None = None
    unfinished_appended: bool = False
    """Whether the unfinished trigger reached the conversation (a compaction may since have
    taken it out of the window)."""


@dataclass(frozen=True)
class _Replay(Trigger):
    """A turn that opens with a message the conversation already ends with (stored, never
    answered): the turn re-appends that very message, which the store, idempotent on ids,
    does not store again."""

    message: Message = field(default_factory=lambda: Message(role="user", content=()))

    def to_message(self) -> Message:
        """The stored message itself."""
        return self.message


class Desk:
    """Runs one desk's turns, one trigger at a time.

    Args:
        profile: Name, mode, model and symbols, for status.
        loop: The desk's agent loop.
        system_prompt: The desk's own system prompt (its config's).
        store: Where the desk's conversation, operator messages and schedules are kept.
        mailbox: The desk's triggers and operator messages (the loop's steering too).
        event_bus: Where the desk's own failures are published (the loop's bus).
        backoff: The waits after failures.
        clock: Seconds since the epoch (for status and usage).
        sleep: The sleep used for backoff (tests pass a fast one).
        on_turn_start: Called with each trigger as its turn starts (a market watcher moves
            its price mark).
        on_stop: Called when a running turn is asked to stop (its subagents stop too).
        image_preparer: Sizes an operator's pictures to the desk's limits before they are
            stored (the loop's, built from ``[desks.<name>.images]``); None for the defaults.
        when_paused: What a trigger that fires while the desk is held does: ``wait`` in the
            queue (ticks coalesced) or ``drop``. An operator's message always waits.
        on_failed_turns: Told after each failed turn (the kill switch goes on after enough).
        redact: Hides secrets in what an operator writes (a message, a pause's reason)
            before it is stored, published or shown to the model; by default the secrets
            the process's logs hide (:func:`~trading_agent.logging_setup.redact_secrets`).
        pinned: Its operators' standing instructions, sent at the end of the system prompt
            (see :mod:`~trading_agent.daemon.pins`); :meth:`set_pinned` changes them.
        configured_pins: Those its config pins (``desks.<name>.pinned``), sent first.
    """

    def __init__(self, profile: DeskProfile, loop: AgentLoop, system_prompt: str,
                 store: DeskStore, *,
                 mailbox: Mailbox, event_bus: EventBus, backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.time, sleep: Sleep = anyio.sleep,
                 on_turn_start: Sequence[Callable[[Trigger], None]] = (),
                 on_stop: Sequence[Callable[[], None]] = (),
                 image_preparer: ImagePreparer | None = None,
                 when_paused: Literal["wait", "drop"] = "wait",
                 on_failed_turns: FailedTurns | None = None,
                 redact: Callable[[str], str] = redact_secrets,
                 pinned: Sequence[str] = (), configured_pins: Sequence[str] = ()) -> None:
        self.profile = profile
        self.name = profile.name
        self.loop = loop
        self.base_prompt = system_prompt
        self.configured_pins = tuple(configured_pins)
        self.pinned = tuple(pinned)
        self.system_prompt = pinned_prompt(system_prompt, self.configured_pins + self.pinned)
        """What the model is told before every request: the desk's prompt and its pins."""
        self.store = store
        self.mailbox = mailbox
        self.queue = mailbox.triggers
        self.event_bus = event_bus
        self.backoff = backoff or Backoff()
        self.conversation: Conversation | None = None
        self.ready = anyio.Event()
        """Set once the desk restored its conversation (or failed its first try)."""
        self.prepared = anyio.Event()
        """Set once the desk prepared its first request after a restore (see
        :meth:`AgentLoop.prepare`), or found a trigger waiting and went straight to it."""
        self.start_gate: anyio.Event | None = None
        """When set by the supervisor: the desk's first turn waits for it (every desk of a
        restarting daemon restores first, then the turns they owe run)."""
        self.on_turn_start = list(on_turn_start)
        self.on_stop = list(on_stop)
        self.image_preparer = image_preparer or ImagePreparer()
        self._clock = clock
        self._sleep = sleep
        self._outcome = _Outcome()
        self._turn_lock = anyio.Lock()
        self._in_turn = False
        self._stopping = False
        self._paused = False
        self._nap: anyio.CancelScope | None = None
        self.when_paused = when_paused
        self.on_failed_turns = on_failed_turns
        self._redact = redact
        self._hold: Hold | None = None
        self._dropped = 0
        self._turn_scope: anyio.CancelScope | None = None
        self._cancelled_by: str | None = None
        self._overflows = 0
        """Turns in a row refused as too long for the window even after compacting."""
        self._serving = False
        """Run by :meth:`run` (a daemon's desk, which an overflow may pause), not by
        :meth:`run_pending` (a backtest's, which reports its failures itself)."""
        self._cut = False
        """The running turn was cut at once (``cancel --now``): the conversation is read
        back from the store, without a resume turn."""
        self._replies: dict[str, _Reply] = {}  # in the order sent: the oldest go first
        """The answers to the latest operator messages, waited for or not: a sender that
        asks after the turn ended (another daemon of a fleet, whose ask came late) still
        gets it (``send --wait``)."""
        self._log = _log.bind(desk=self.name)

    # ------------------------------------------------------------------ what others call

    def fire(self, trigger: Trigger) -> None:
        """Queues a trigger (a tick, a schedule...); never blocks. While the desk is held and
        ``when_paused`` is ``drop``, the trigger is dropped (and counted)."""
        if self._hold is not None and self.when_paused == "drop":
            self._dropped += 1
            return
        self.queue.put(trigger)

    async def send_message(self, text: str, source: str = "operator",
                           images: Sequence[ImageBlock] = (), *,
                           message_id: str | None = None) -> str:
        """Gives an operator's message to the desk; it is stored before this returns.

        A secret of the daemon's pasted in it (the value of a variable the config names as
        one) is replaced by ``[REDACTED]`` first: the README promises it never shows in
        events, the stream or the store, and the model has no use for it either.

        Args:
            text: What the operator wrote.
            source: Who wrote it.
            images: Pictures attached, as sent: each is sized to the desk's limits (a PNG,
                JPEG, GIF or WebP) before anything is stored.
            message_id: The id it was sent with: by a client's idempotency key, or by
                another daemon of a fleet. A message of that id sent before (a client's
                retry, a copy the fleet's inbox delivered again) is neither stored nor taken
                again. None for a new one.

        Returns:
            The message's id.

        Raises:
            ImageRejectedError: A picture is not one, not an accepted format, or too large;
                nothing was stored.
        """
        if message_id is not None and (
                self.mailbox.delivery(message_id) is not None
                or await self.store.inbox.has_operator_message(self.name, message_id)):
            return message_id
        prepared = [await self.image_preparer.prepare_async(
                        image.data, self._redact(image.description), formats=OPERATOR_FORMATS)
                    for image in images]
        message = SteeringMessage(text=self._redact(text), source=source,
                                  images=tuple(prepared))
        if message_id is not None:
            message = dataclasses.replace(message, id=message_id)
        self._keep_reply(message.id)  # before the await: a restore meanwhile may read it
        await self.store.inbox.add_operator_message(self.name, message)
        # A restore during the await may have taken it already: the mailbox takes it once.
        if (self.mailbox.put_message(message) and not self.mailbox.in_turn and self._paused
                and self._nap is not None):
            self._nap.cancel()  # a person is there: try again now
        return message.id

    def message_delivery(self, message_id: str) -> Delivery:
        """How the desk's mailbox took a message :meth:`send_message` gave it: steering the
        running turn, or a turn of its own (ask right after, with no await between)."""
        return self.mailbox.delivery(message_id) or "turn"

    def message_limit(self) -> int | None:
        """The most characters of an operator's message the model reads whole (the longer
        rest is cut in the middle in what is sent; the store keeps it all); None for no
        limit."""
        return self.loop.message_max_chars(self.conversation)

    def set_pinned(self, pinned: Sequence[str]) -> None:
        """Sets the desk's operators' standing instructions: they are in its next request (the next
        model call of a running turn too), and in every one after, a compaction's
        included."""
        self.pinned = tuple(pinned)
        self.system_prompt = pinned_prompt(self.base_prompt, self.configured_pins + self.pinned)
        if self.conversation is not None:
            self.conversation.system_prompt = self.system_prompt

    async def fixed_part_with(self, pinned: Sequence[str]) -> FixedPart:
        """The part of every request no compaction can shrink (the system prompt with these
        pins, the tool definitions, the answer's room), measured against the window as
        ``check-config`` measures it."""
        backend = self.loop.backend
        return await measure_fixed_part(
            pinned_prompt(self.base_prompt, [*self.configured_pins, *pinned]),
            self.loop.tool_definitions(),
            window=backend.context_window, reserve=answer_reserve(backend),
            count=getattr(backend, "count_tokens", None))

    async def compact(self) -> bool:
        """Flushes memory and compacts the conversation now, after any running turn.

        Returns:
            True when something was compacted.
        """
        async with self._turn_lock:
            if self.conversation is None:
                return False
            trigger = Trigger(kind="command", text="/compact", source="operator")
            return await self.loop.compact(self.conversation, trigger)

    async def pause(self, by: str, reason: str, *, until: float | None = None) -> bool:
        """Holds the desk: no turn starts until :meth:`resume` (or ``until``); a running turn
        ends at its next safe point. Triggers wait or are dropped (``when_paused``);
        operator messages wait. Stored before this returns: it outlives a restart.

        Returns:
            False when the desk was already held (the first hold stands).
        """
        if self._hold is not None:
            return False
        hold = self._hold = Hold(by, self._redact(reason), self._clock(), until)
        self._dropped = 0
        await self.store.holds.record_desk_hold(self.name, hold)
        self._log.info("desk_held", by=by, reason=hold.reason, until=until)
        self.event_bus.publish(DeskPaused(desk=self.name, by=by, reason=hold.reason,
                                          until=until))
        if self._in_turn:
            self._stop_turn(f"the desk was paused by {by}")
        return True

    async def resume(self, by: str) -> int | None:
        """Lets a held desk take turns again; what waited runs now.

        Returns:
            How many triggers waited, or None when it was not held.
        """
        if self._hold is None:
            return None
        self._hold, waiting = None, len(self.queue)
        self.queue.wake()
        await self.store.holds.record_desk_hold(self.name, None)
        self._log.info("desk_resumed", by=by, waiting=waiting, dropped=self._dropped)
        self.event_bus.publish(DeskResumed(desk=self.name, by=by, waiting=waiting))
        return waiting

    def switch_model(self, backend: ModelBackend) -> None:
        """Talks to ``backend`` from the next model request on (a spend cap's fallback);
        the desk's status shows its model. Subagents keep the model they were built with."""
        self.loop.backend = backend
        self.profile = dataclasses.replace(self.profile, model=backend.model)

    @property
    def hold(self) -> Hold | None:
        """Why the desk is held, or None."""
        return self._hold

    def cancel_turn(self, by: str, *, now: bool = False) -> bool:
        """Ends the running turn: at its next safe point (every tool call answered), or at
        once with ``now`` (calls in flight are stored as interrupted). The desk then takes
        its next trigger; the cancelled turn is not resumed.

        Returns:
            False when no turn was running.
        """
        if not self._in_turn:
            return False
        self._cancelled_by = by
        self.event_bus.publish(TurnCancelled(desk=self.name, by=by, now=now))
        if now and self._turn_scope is not None:
            self._cut = True
            self._turn_scope.cancel()
        else:
            self._stop_turn(f"an operator ({by}) cancelled the turn")
        return True

    async def retry(self, by: str) -> int:
        """Runs the last turn again from its trigger: every message after the trigger (the
        desk's answer, its tool calls and results) leaves what is sent, kept in the store
        and marked retracted; the trigger is not added twice. The turn runs next, ahead of
        any other trigger (once the desk is resumed, when it is paused).

        Returns:
            How many messages left what is sent.

        Raises:
            RetryRefusedError: The desk is in a turn, or has no turn to run again (none yet,
                compacted away, or one that read an operator's message mid-turn, which a
                retry would lose).
        """
        if self._in_turn:
            raise RetryRefusedError("the desk is in a turn: cancel it first (cancel), then "
                                    "retry")
        async with self._turn_lock:
            conversation = self.conversation
            if self._in_turn or conversation is None:
                raise RetryRefusedError("the desk is starting or in a turn; try again")
            messages = conversation.messages
            opening = next((index for index in range(len(messages) - 1,
                                                     conversation.window_start - 1, -1)
                            if messages[index].kind in _OPENINGS), None)
            if opening is None:
                raise RetryRefusedError("there is no turn to run again: none yet, or the last "
                                        "one's trigger was compacted into the summary")
            dropped = messages[opening + 1:]
            if not dropped:
                raise RetryRefusedError("the last trigger has no answer yet: it is answered "
                                        "next")
            if any(message.kind == "steering" for message in dropped):
                raise RetryRefusedError("the last turn also read an operator's message sent "
                                        "while it worked, which a retry would lose; send "
                                        "your correction as a new message instead")
            orders = _order_calls(dropped)
            if orders:
                raise RetryRefusedError(
                    f"the last turn {'; '.join(orders)}. A retry would hide that from the "
                    "model, which could then place it again: send your correction as a new "
                    "message instead (the desk still sees its order), and cancel a resting "
                    "order first if it should not stand")
            trigger = messages[opening]
            await self.store.transcripts.retract_messages(self.name, [m.id for m in dropped],
                                                          by)
            del messages[opening + 1:]
            self.queue.put_first(_Replay(kind=_replayed_kind(trigger), text=trigger.text,
                                         source=by, id=trigger.id, at=trigger.created_at,
                                         message=trigger))
        self._log.info("turn_retried", by=by, dropped=len(dropped))
        self.event_bus.publish(TurnRetried(desk=self.name, by=by, dropped=len(dropped),
                                           trigger_text=trigger.text))
        return len(dropped)

    async def reply_to(self, message_id: str) -> DeskReply:
        """Waits for the answer to an operator's message: how the turn that read it (opened
        or steered by it) ended. The answer is kept from :meth:`send_message` on (for the
        latest :data:`_KEPT_REPLIES` messages), so an ask after the turn ended gets it at
        once: another daemon of a fleet may ask late."""
        reply = self._keep_reply(message_id)
        reply.waiters += 1
        try:
            await reply.done.wait()
        finally:
            reply.waiters -= 1
        assert reply.result is not None
        return reply.result

    def _keep_reply(self, message_id: str) -> _Reply:
        """The answer to a message, kept from its sending (or its first ask) with the
        latest :data:`_KEPT_REPLIES`; the oldest ones nobody waits for go first."""
        reply = self._replies.get(message_id)
        if reply is None:
            reply = self._replies[message_id] = _Reply()
            if len(self._replies) > _KEPT_REPLIES:
                for old in [key for key, kept in self._replies.items()
                            if not kept.waiters and key != message_id
                            ][:len(self._replies) - _KEPT_REPLIES]:
                    del self._replies[old]
        return reply

    def _stop_turn(self, reason: str) -> None:
        self.loop.request_stop(reason)
        for hook in self.on_stop:
            hook()

    def retire(self) -> None:
        """No new turns; a running turn finishes as it would (a reload replaces the desk
        once it has: the new settings apply from the next turn)."""
        self._stopping = True
        self.queue.wake()
        if self._nap is not None:
            self._nap.cancel()

    def stop(self) -> None:
        """No new turns; a running turn stops at its next safe point."""
        self._stopping = True
        self.queue.wake()
        if self._nap is not None:
            self._nap.cancel()
        if self._in_turn:
            self._stop_turn("the daemon is shutting down")

    def status(self) -> DeskStatus:
        """The desk as an operator sees it (exchange and usage figures are the caller's)."""
        return DeskStatus(
            name=self.name, state=self.state, mode=self.profile.mode,
            model=self.profile.model, symbols=list(self.profile.symbols),
            last_turn_at=self._outcome.at, last_turn_text=self._outcome.text,
            queued_triggers=len(self.queue),
            paused_reason=(self._hold.describe() if self._hold is not None
                           else self._outcome.reason if self._paused else ""),
            dropped_triggers=self._dropped)

    @property
    def state(self) -> DeskState:
        """idle, working, paused or stopped."""
        if self._stopping and not self._in_turn:
            return "stopped"
        if self._in_turn:
            return "working"
        return "paused" if self._paused or self._hold is not None else "idle"

    @property
    def turns(self) -> int:
        """How many turns finished since the desk started."""
        return self._outcome.turns

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Runs the desk until :meth:`stop`: restore, then turns; after a failure, back off
        and restore again.

        Args:
            task_status: Told at once (the desk restores in its own time; see :attr:`ready`).
        """
        task_status.started()
        self._serving = True
        try:
            await self._load_hold()
            while not self._stopping:
                try:
                    await self._restore()
                    self.ready.set()
                    if self.start_gate is not None:
                        await self.start_gate.wait()
                    if self.conversation is not None and not self.queue:
                        await self.loop.prepare(self.conversation)  # while nothing waits
                    self.prepared.set()
                    await self._serve()
                except BackendUnavailableError as exc:
                    await self._failed(exc, paused=True)
                except FencedError as exc:
                    # A fleet's lease moved on: another daemon runs the desk now, and every
                    # write of this one would be refused. Stop; the lease's loss stops the rest.
                    self._log.error("desk_fenced", error=str(exc))
                    return
                except Exception as exc:
                    await self._failed(exc, paused=False)
                finally:
                    self.ready.set()
        finally:
            self.ready.set()
            self.prepared.set()

    async def _load_hold(self) -> None:
        """A desk paused before a restart stays paused (until its hold's end, if it has one)."""
        stored = await self.store.holds.desk_hold(self.name)
        if stored is None or self._hold is not None:
            return
        if stored.until is not None and stored.until <= self._clock():
            await self.store.holds.record_desk_hold(self.name, None)
            return
        self._hold = Hold(stored.by, stored.reason, stored.at, stored.until)
        self._log.info("desk_still_held", by=stored.by, reason=stored.reason)

    async def run_pending(self, *, max_failures: int = 3) -> None:
        """Runs the queued turns until none is left, in the caller's task: a backtest drives
        its desk this way between candles, so the simulated clock stands still while the
        desk thinks.

        Restores first (once). A turn that fails is handled as :meth:`run` handles it (the
        conversation restored, the desk told), after the desk's backoff ``sleep``.

        Args:
            max_failures: Failed turns in a row after which the last failure is raised.

        Raises:
            BackendError: The model failed (unavailable after retries, or refused); a
                request too long for the window is not one: the desk is told and goes on.
            Exception: A turn failed ``max_failures`` times in a row.
        """
        while True:
            try:
                if self.conversation is None:
                    await self._restore()
                    self.ready.set()
                await self._drain()
                return
            except BackendError:
                raise
            except Exception as exc:
                failure: Exception = exc
            if self._outcome.failures + 1 >= max_failures:
                raise failure
            await self._failed(failure, paused=False)
            self.conversation = None

    async def _serve(self) -> None:
        while not self._stopping:
            await self._drain()
            if self._stopping:
                return
            self._paused = False  # nothing to try again: the desk just waits
            await self._wait()

    async def _wait(self) -> None:
        """Waits for a trigger, or while held (whatever is queued), for a resume or the
        hold's end."""
        hold = self._hold
        if hold is None:
            await self.queue.wait()
            return
        if hold.until is None:
            await self.queue.changed()
            return
        with anyio.move_on_after(max(hold.until - self._clock(), 0.0)) as waited:
            await self.queue.changed()
        if waited.cancelled_caught and self._hold is hold:
            await self.resume("daemon")

    async def _drain(self) -> None:
        """Runs turns while triggers are queued and the desk is not held."""
        while not self._stopping and self._hold is None:
            trigger = self.queue.take()
            if trigger is None:
                return
            self._outcome.unfinished = trigger
            self._outcome.unfinished_appended = False
            try:
                result = await self._run_turn(trigger)
            except ContextOverflowError as exc:
                self._answer(DeskReply(ok=False, error=f"the turn failed: {exc}"))
                await self._overflowed(exc)
                continue
            except BaseException as exc:
                self._answer(DeskReply(ok=False, error=f"the turn failed: "
                                                       f"{type(exc).__name__}: {exc}"))
                raise
            self._outcome.unfinished = None
            cancelled_by, self._cancelled_by = self._cancelled_by, None
            if self._cut:
                await self._after_cut(cancelled_by or "an operator")
            elif result is not None:
                self._finished(result, cancelled_by)
                if result.stopped and not self._stopping:
                    await self._tell_stopped(result.text)

    async def _overflowed(self, error: ContextOverflowError) -> None:
        """The turn's request did not fit the window even after compacting. Running it again
        would fail again: the desk is told in a notice (which the store keeps, and the
        operator's stream shows with the loop's error event), and the next trigger runs as
        usual; the loop has already shrunk what it sends.

        Unless the desk cannot fit at all: when its fixed part (system prompt, tools, the
        answer's room), measured by the model's tokenizer, is larger than the window, or a
        second turn in a row is refused, the daemon's desk is **paused** with the numbers
        and what to change, instead of failing every message.
        """
        self._outcome.unfinished = None
        self._outcome.text = f"The last turn failed: {error}"
        self._overflows += 1
        self._log.warning("turn_did_not_fit", error=str(error), in_a_row=self._overflows)
        conversation = self.conversation
        if conversation is not None:
            await conversation.append(Message.user_text(
                "[notice] The previous request could not be answered: it did not fit the "
                f"model's window even after compacting ({error}). Older and longer messages "
                "are now shortened further in what is sent; the full texts stay in the store.",
                kind="notice"))
            if self._serving:
                part = await self.loop.fixed_part(conversation)
                if not (part.measured and not part.fits) and self._overflows < 2:
                    return
                pins = len(self.configured_pins) + len(self.pinned)
                await self.pause("daemon", (
                    f"{self._overflows} turn(s) in a row were refused as too long for the "
                    f"model's window even after compacting (the server said: "
                    f"{error.message}). {part.describe(self.name, pins)}; then resume the "
                    "desk"))

    async def _run_turn(self, trigger: Trigger) -> TurnResult | None:
        for hook in self.on_turn_start:
            hook(trigger)
        async with self._turn_lock:
            conversation = self.conversation
            if self._stopping or conversation is None:
                self.queue.put_first(trigger)
                return None
            if isinstance(trigger, _Replay):
                if not conversation.messages or conversation.messages[-1].id != trigger.id:
                    return None  # something came after the notice: that is answered instead
                conversation.messages.pop()  # the turn appends it again, as its opening
            # No await between this check and run_turn's start, so a stop() from here on
            # reaches the running turn.
            self._in_turn = self.mailbox.in_turn = True
            result: TurnResult | None = None  # stays None when cut by cancel_turn(now=True)
            try:
                with anyio.CancelScope() as self._turn_scope:
                    result = await self.loop.run_turn(conversation, trigger)
            finally:
                self._in_turn = False
                self._turn_scope = None
                self.mailbox.turn_ended()
            if result is not None and result.turn_id:
                with anyio.CancelScope(shield=True):  # a fact recovery reads: never half-said
                    await self.store.transcripts.record_turn_end(self.name, result.turn_id,
                                                     _turn_end(result))
            return result

    def _finished(self, result: TurnResult, cancelled_by: str | None) -> None:
        outcome = self._outcome
        outcome.at, outcome.text = self._clock(), result.text
        outcome.turns += 1
        outcome.failures, outcome.crashes, outcome.reason, self._paused = 0, 0, "", False
        outcome.cause = None
        self._overflows = 0
        if cancelled_by is not None and result.stopped:
            self._answer(DeskReply(ok=False, text=result.text,
                                   error=f"the turn was cancelled by {cancelled_by}"))
        else:
            self._answer(DeskReply(ok=not result.stopped, text=result.text,
                                   error="" if not result.stopped else result.text))

    async def _tell_stopped(self, text: str) -> None:
        """A turn an operator (or a spend cap) ended early: the desk reads why, so its next
        turn does not take the silence for a finished task."""
        if self.conversation is not None:
            await self.conversation.append(Message.user_text(
                f"[notice] Your previous turn was ended early. {text} Every tool call in it "
                "was answered; read those results before you act again.", kind="notice"))

    async def _after_cut(self, by: str) -> None:
        """The turn was cut at once: the conversation is read back from the store (which
        answers the calls left in flight as interrupted), and the turn is not resumed."""
        self._cut = False
        self._outcome.unfinished = None
        self._outcome.cause = f"an operator ({by}) cancelled it at once"
        self._answer(DeskReply(ok=False, error=f"the turn was cancelled at once by {by}"))
        await self._restore(resume=False)

    def _answer(self, reply: DeskReply) -> None:
        """Gives the turn's outcome to those waiting for the answer to a message it read."""
        for waiting in self._replies.values():
            if waiting.in_turn and not waiting.done.is_set():
                waiting.result = reply
                waiting.done.set()

    # ------------------------------------------------------------------ failures

    async def _failed(self, error: Exception, *, paused: bool) -> None:
        outcome = self._outcome
        outcome.failures += 1
        delay = self.backoff.delay(outcome.failures, paused=paused)
        described = f"{type(error).__name__}: {error}"
        if isinstance(error, StorageFullError):
            # Not the desk's fault, and not a crash: no kill switch, no restart count (the
            # restart waits, though: space may come back soon). What it was given is in the
            # store already; it waits for space, then goes on.
            outcome.reason = f"waiting for disk space ({error}); trying again in {delay:g} s"
            outcome.cause = f"the store could not be written: {error}"
            self._log.error("desk_waiting_for_storage", error=str(error), retry_in=delay)
        elif paused:
            outcome.reason = f"the model is unavailable ({error}); trying again in {delay:g} s"
            # str(error): the backend has already redacted its API key from the message.
            outcome.cause = f"the model was unavailable: {error}"
            self._log.warning("desk_paused", error=described, retry_in=delay)
        else:
            outcome.reason = f"the desk failed ({described}); restarting in {delay:g} s"
            outcome.cause = f"the turn failed: {described}"
            self._log.error("desk_failed", error=described, restart_in=delay, exc_info=error)
            if not isinstance(error, BackendError):  # the loop published those already
                self.event_bus.publish(ErrorEvent(desk=self.name, message=described,
                                                  error_type=type(error).__name__))
            outcome.crashes += 1
            if self.on_failed_turns is not None:
                try:
                    await self.on_failed_turns(outcome.crashes, described)
                except StoreError as exc:  # the kill switch could not be recorded
                    self._log.error("failed_turns_action_failed", error=str(exc))
        self._paused = True
        self.mailbox.to_triggers()
        with anyio.CancelScope() as self._nap:
            if not self._stopping:
                await self._sleep(delay)
        self._nap = None

    # ------------------------------------------------------------------ restore

    async def _restore(self, *, resume: bool = True) -> None:
        """Reads the conversation back (the store repairs an interrupted turn and adds a
        notice, saying why when the desk caught the failure), then queues what is owed: the
        unfinished trigger if it never reached the conversation, else a resume turn after an
        interruption (see :func:`_resume_for`), and undelivered messages."""
        self.mailbox.to_triggers()
        self.mailbox.forget()
        # Used once: a later restore (after a restart or a success) has no reason to give.
        cause, self._outcome.cause = self._outcome.cause, None
        conversation = await self.store.transcripts.restore_conversation(
            self.name, self.system_prompt, reason=cause)
        conversation.observer = _ScheduleObserver(conversation.observer, self)
        self.conversation = conversation
        last = conversation.messages[-1] if conversation.messages else None
        interrupted = last is not None and last.kind == "notice"
        delivered = {message.id for message in conversation.messages}
        unfinished, self._outcome.unfinished = self._outcome.unfinished, None
        if unfinished is not None and not await self._reached(unfinished, delivered):
            self.queue.put_first(unfinished)  # it never reached the conversation: run it again
        elif interrupted and resume:
            self.queue.put_first(_resume_for(conversation.messages))
        for message in await self.store.inbox.undelivered_operator_messages(self.name):
            if message.id not in delivered:
                self.mailbox.put_message(message)
        if self._outcome.at is None and last is not None and last.role == "assistant":
            self._outcome.at, self._outcome.text = last.created_at, last.text

    async def _reached(self, trigger: Trigger, window: set[str]) -> bool:
        """Whether the trigger got into the conversation. The window is not enough: a
        compaction during the turn may have summarised the trigger away."""
        if self._outcome.unfinished_appended or trigger.id in window:
            return True
        return await self.store.transcripts.has_message(self.name, trigger.id)


def _turn_end(result: TurnResult) -> str:
    """How a turn that returned ended, as the store keeps it."""
    if result.stopped:
        return "stopped"
    return "round_limit" if result.hit_round_limit else "answered"


def _resume_for(messages: Sequence[Message]) -> Trigger:
    """The turn after an interruption, the conversation ending with a notice.

    A new resume notice (:data:`RESUME_TEXT`; why the turn stopped is in the store's notice
    above it) only after a turn in which the model answered something (its tool calls are to
    be checked); else the model never saw the last notice, so it is replayed: a trigger the
    model never answered gets one notice, the store's; a resume notice is not repeated
    however often the retry fails.
    """
    last = len(messages) - 1
    before = last - 1
    while before >= 0 and messages[before].kind == "notice":
        before -= 1
    unanswered = before >= 0 and messages[before].kind in ("trigger", "operator", "steering")
    if unanswered or last - before > 1:
        message = messages[last]
        return _Replay(kind="resume", text=message.text, source="daemon", id=message.id,
                       at=message.created_at, message=message)
    return Trigger(kind="resume", text=RESUME_TEXT, source="daemon")


_OPENINGS = frozenset({"trigger", "operator", "notice"})
"""The kinds of message a turn opens with (a resume turn's is a notice)."""


_ORDER_TOOLS = {PLACE_ORDER: "placed an order", CANCEL_ORDER: "cancelled an order"}


def _order_calls(messages: Sequence[Message]) -> list[str]:
    """The order calls among ``messages`` that may have reached the exchange (all but the
    ones the risk limits refused before sending), each as "placed an order (result)"."""
    results = {result.tool_use_id: result for message in messages
               for result in message.tool_results}
    found = []
    for message in messages:
        for call in message.tool_uses:
            what = _ORDER_TOOLS.get(call.name)
            result = results.get(call.id)
            if what is None or (result is not None and result.is_error
                                and result.text.removeprefix("Error: ").startswith("Refused")):
                continue  # the risk limits refused it: it never left
            said = result.text.strip().splitlines()[0] if result and result.text.strip() else (
                "no answer recorded")
            found.append(f"{what} ({said[:200]})")
    return found


def _replayed_kind(message: Message) -> TriggerKind:
    """The trigger kind a stored opening message came from (its text starts ``[tick...``)."""
    if message.kind == "operator":
        return "operator"
    if message.kind == "notice":
        return "resume"
    label = message.text[1:].split("]", 1)[0].split(":", 1)[0].split(",", 1)[0]
    return label if label in typing.get_args(TriggerKind) else "command"  # type: ignore[return-value]


class _ScheduleObserver:
    """Passes every change to the store; notes when the running turn's trigger reached the
    conversation (so a restore does not run it again), and for a schedule's trigger records
    its slot as fired with the message, in its transaction (so a trigger lost to a crash
    fires again, and a stored one does not)."""

    def __init__(self, inner: ConversationObserver | None, desk: Desk) -> None:
        self._inner = inner
        self._desk = desk

    async def message_appended(self, conversation: Conversation, message: Message) -> None:
        trigger = self._desk._outcome.unfinished
        if trigger is None or message.id != trigger.id:
            trigger = None  # not the running turn's opening message
        fired = (None if trigger is None or trigger.kind != "schedule" else
                 (trigger.source, datetime.fromtimestamp(trigger.at, UTC)))
        if isinstance(self._inner, DeskConversationStore):
            # The slot is stored with its trigger, in one transaction (one commit to wait
            # for before the model is asked, and no crash between the two).
            await self._inner.message_appended(conversation, message, fired_schedule=fired)
            fired = None
        elif self._inner is not None:
            await self._inner.message_appended(conversation, message)
        waiting = self._desk._replies.get(message.id)
        if waiting is not None:
            waiting.in_turn = True
        if trigger is None:
            return
        self._desk._outcome.unfinished_appended = True  # stored: the inner observer returned
        if fired is not None:
            await self._desk.store.schedules.record_schedule_fired(self._desk.name, *fired)

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        if self._inner is not None:
            await self._inner.compacted(conversation, summary, first_kept_id)



@dataclass
class _Reply:
    """Someone waits for the answer to an operator message."""

    in_turn: bool = False
    """The message reached the conversation: the running turn's end answers it."""
    waiters: int = 0
    """How many wait for it now (kept however old)."""
    result: DeskReply | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
