"""What the bot tells operators unasked: the desk's streamed answer, approvals waiting, and
notifications of each kind.

:class:`EventWatcher` reads the daemon's bus (a subscription of its own, bounded: the bus
never waits for it) and posts to the :class:`~trading_agent.telegram.outbox.Outbox`:

- the answer of a turn an operator's message started or steered, in that operator's chat,
  as one message edited as it streams, tool steps as short lines in it;
- every approval waiting, to every operator's chat, with approve and deny buttons; once it
  is decided (here or elsewhere: the API, the CLI, the web page), each of those messages is
  edited to say how and by whom;
- notifications of the kinds ``[telegram.notifications]`` turns on, to every operator's
  chat (a private chat's id is its user's id); a daily summary of each desk's profit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import anyio
import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import (
    ErrorEvent,
    Event,
    TextDelta,
    ToolCallStarted,
    TurnEnded,
    TurnStarted,
)
from trading_agent.daemon.control import DeskControl
from trading_agent.daemon.events import (
    DeskPaused,
    DeskResumed,
    KillSwitchChanged,
    OrderFilled,
    ProtectionReported,
    SpendAlert,
)
from trading_agent.operator.events import ApprovalRequested, ApprovalResolved
from trading_agent.operator.render import format_money, printable
from trading_agent.telegram.actions import profit_text
from trading_agent.telegram.config import NotificationKind, TelegramSettings
from trading_agent.telegram.outbox import (
    EditMessage,
    Outbox,
    SendMessage,
    SentMessages,
    StreamMessage,
)

__all__ = ["APPROVE_PREFIX", "DENY_PREFIX", "EventWatcher", "notification_kind"]

_log = structlog.get_logger(__name__)

APPROVE_PREFIX = "approve:"
"""A button's callback data: ``approve:<approval id>``."""

DENY_PREFIX = "deny:"
"""A button's callback data: ``deny:<approval id>``."""

_OUTCOMES = {"approved": "✅ approved", "denied": "❌ denied",
             "timed_out": "⌛ timed out (nobody answered)", "cancelled": "✖ cancelled (its turn "
             "ended)"}

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


def notification_kind(event: Event) -> NotificationKind | None:
    """Which kind of notification an event is, if any.

    Args:
        event: An event of the daemon's bus.

    Returns:
        Its kind, or None.
    """
    if isinstance(event, OrderFilled):
        return "fills"
    if isinstance(event, KillSwitchChanged):
        return "kill_switch"
    if isinstance(event, DeskPaused | DeskResumed):
        return "pause"
    if isinstance(event, ProtectionReported):
        return "protections"
    if isinstance(event, ErrorEvent):
        return "errors"
    if isinstance(event, SpendAlert):
        return "spend"
    return None


def _notice(event: Event) -> str:
    """A notification's line."""
    if isinstance(event, OrderFilled | KillSwitchChanged | ProtectionReported | SpendAlert):
        text = event.text
    elif isinstance(event, DeskPaused):
        text = f"paused by {event.by}: {event.reason}"
    elif isinstance(event, DeskResumed):
        text = f"resumed by {event.by}"
    elif isinstance(event, ErrorEvent):
        text = f"error: {event.message}"
    else:
        text = event.type
    where = "every desk" if event.desk == "*" else event.desk
    return printable(f"{where}: {text}")


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def approval_text(event: ApprovalRequested) -> str:
    """The message of an approval waiting.

    Args:
        event: The approval.

    Returns:
        Its text.
    """
    try:
        arguments = json.loads(event.arguments)
        shown = ", ".join(f"{k}={v}" for k, v in arguments.items()
                          if v is not None) if isinstance(arguments, dict) else event.arguments
    except ValueError:
        shown = event.arguments
    notional = (f"; about {format_money(event.notional)}"
                if event.notional is not None and "notional" not in event.reason else "")
    seconds = max(0, round(event.expires_at - time.time()))
    return printable(f"{event.desk} asks to run {event.tool}({_short(shown, 300)}): "
                     f"{event.reason}{notional}. Denied unless answered within {seconds} s "
                     f"(approval {event.approval_id}).")


@dataclass
class _Approval:
    text: str
    sent: SentMessages = field(default_factory=SentMessages)


class EventWatcher:
    """Turns the bus's events into what operators read in Telegram.

    Args:
        settings: The ``[telegram]`` settings.
        control: The running daemon (the daily summary reads its books).
        outbox: Where messages go.
        chats: Every operator's chat id.
        clock: Seconds since the epoch (injectable for the daily summary).
        sleep: How the daily summary waits.
    """

    def __init__(self, settings: TelegramSettings, control: DeskControl, outbox: Outbox,
                 chats: Sequence[int], *, clock: Clock = time.time,
                 sleep: Sleep = anyio.sleep) -> None:
        self._settings = settings
        self._control = control
        self._outbox = outbox
        self._chats = list(chats)
        self._clock = clock
        self._sleep = sleep
        self._running: dict[str, str] = {}
        """Each desk's running turn (not a silent one)."""
        self._waiting: dict[str, set[int]] = {}
        """Chats whose message starts a desk's next turn."""
        self._streams: dict[str, dict[int, StreamMessage]] = {}
        """Each followed turn's streamed message in each chat."""
        self._approvals: dict[str, _Approval] = {}

    def follow(self, chat: int, desk: str, steering: bool) -> None:
        """A chat sent the desk a message: it reads the answer of the turn that reads it.

        Args:
            chat: The chat.
            desk: The desk.
            steering: The message steers the running turn (else it starts the next).
        """
        turn = self._running.get(desk)
        if steering and turn is not None:
            self._stream(turn, desk, chat)
        else:
            self._waiting.setdefault(desk, set()).add(chat)

    def _stream(self, turn: str, desk: str, chat: int) -> StreamMessage:
        streams = self._streams.setdefault(turn, {})
        if chat not in streams:
            streams[chat] = StreamMessage(chat, desk, turn)
        return streams[chat]

    async def run(self, subscription: Subscription) -> None:
        """Reads events until the subscription ends.

        Args:
            subscription: The bus's events.
        """
        async for event in subscription:
            try:
                self.on_event(event)
            except Exception as exc:  # one bad event must not end what operators read
                _log.exception("telegram_event_failed", event_type=event.type, error=repr(exc))

    def on_event(self, event: Event) -> None:
        """Handles one event (never waits).

        Args:
            event: An event of the daemon's bus.
        """
        if event.subagent is not None:
            return
        if isinstance(event, TurnStarted):
            if not event.silent and event.turn is not None:
                self._running[event.desk] = event.turn
                for chat in self._waiting.pop(event.desk, set()):
                    self._stream(event.turn, event.desk, chat)
        elif isinstance(event, TextDelta):
            self._grow(event.turn, event.text)
        elif isinstance(event, ToolCallStarted):
            self._grow(event.turn, f"\n▸ {event.name} {_short(event.arguments, 80)}\n")
        elif isinstance(event, TurnEnded):
            if self._running.get(event.desk) == event.turn:
                del self._running[event.desk]
            for stream in self._streams.pop(event.turn or "", {}).values():
                if event.final_text.strip() and not stream.text.strip():
                    stream.text = event.final_text
                stream.final = True
                self._outbox.update_stream(stream)
        elif isinstance(event, ApprovalRequested):
            self._approval_requested(event)
        elif isinstance(event, ApprovalResolved):
            self._approval_resolved(event)
        else:
            kind = notification_kind(event)
            if kind is not None:
                self.notify(kind, _notice(event))

    def _grow(self, turn: str | None, text: str) -> None:
        for stream in self._streams.get(turn or "", {}).values():
            stream.text += text
            self._outbox.update_stream(stream)

    def notify(self, kind: NotificationKind, text: str,
               buttons: Sequence[tuple[str, str]] | None = None,
               sent: SentMessages | None = None) -> None:
        """Tells every operator's chat, as ``kind`` is configured (not at all when off).

        Args:
            kind: The kind of notification.
            text: What it says.
            buttons: Inline buttons under it.
            sent: Where the messages' ids are noted.
        """
        level = self._settings.notifications.level(kind)
        if level == "off":
            return
        for chat in self._chats:
            self._outbox.post(SendMessage(chat, text, silent=level == "silent",
                                          buttons=buttons, sent=sent, kind=kind))

    def _approval_requested(self, event: ApprovalRequested) -> None:
        approval = self._approvals[event.approval_id] = _Approval(approval_text(event))
        self.notify("approvals", approval.text,
                    [("Approve", APPROVE_PREFIX + event.approval_id),
                     ("Deny", DENY_PREFIX + event.approval_id)], approval.sent)

    def _approval_resolved(self, event: ApprovalResolved) -> None:
        approval = self._approvals.pop(event.approval_id, None)
        if approval is None:
            return
        outcome = _OUTCOMES.get(event.outcome, event.outcome)
        who = f" by {event.operator}" if event.operator else ""
        note = f": {event.note}" if event.note else ""
        self._outbox.post(EditMessage(approval.sent,
                                      printable(f"{approval.text}\n\n{outcome}{who}{note}")))

    async def daily_summaries(self) -> None:
        """Sends each desk's profit at ``daily_summary_at`` (UTC) every day, until
        cancelled; returns at once when no time is set."""
        minute = self._settings.daily_summary_minute
        if minute is None or self._settings.notifications.daily_summary == "off":
            return
        while True:
            now = self._clock()
            midnight = now - now % 86400
            due = midnight + minute * 60
            if due <= now:
                due += 86400
            await self._sleep(due - now)
            await self.send_daily_summary()

    async def send_daily_summary(self) -> None:
        """Sends each desk's profit now, as the daily summary."""
        lines = ["Daily summary"]
        for desk in self._control.desk_names():
            try:
                lines.append(profit_text(await self._control.books(desk, "profit")))
            except Exception as exc:  # one desk's books must not hide the others'
                lines.append(f"{desk}: profit unknown ({exc})")
        self.notify("daily_summary", printable("\n".join(lines)))
