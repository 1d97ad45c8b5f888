"""What the bot sends, queued apart from the desks: a desk never waits for Telegram.

Everything the bot says (answers to commands, notifications, the streamed answer's edits,
approvals and their outcome) is a :class:`Job` posted to the :class:`Outbox`, which never
waits. One task sends them in order. When Telegram asks to slow down (429 with
``retry_after``) the job waits that long and is sent again; when Telegram cannot be reached
the job is tried again, backing off to half a minute, until it goes through: nothing that
still matters is lost. A streamed answer is one :class:`StreamMessage` whose edits are
throttled (at most one per ``edit_interval`` per message, and only when its text changed)
and never pile up: while one waits to be sent, a newer text replaces it. Past ``max_queued``
jobs the oldest is dropped, counted and logged.

Failures are logged once per outage (and once when Telegram answers again), never with the
token: python-telegram-bot puts it in every request's URL, so error texts are cleaned of it.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import anyio
import structlog
from telegram.error import BadRequest, Forbidden, NetworkError, RetryAfter, TelegramError

from telegram import Bot, InlineKeyboardButton, InlineKeyboardMarkup, Message

__all__ = ["MAX_MESSAGE_CHARS", "AnswerCallback", "EditMessage", "Job", "Outbox", "SendMessage",
           "SendPhoto", "SentMessages", "StreamMessage", "split_text"]

_log = structlog.get_logger(__name__)

# python-telegram-bot 22 warns on every rate limit's retry_after read as seconds, the type
# its next major version drops: opt into the timedelta it will be.
os.environ.setdefault("PTB_TIMEDELTA", "true")

MAX_MESSAGE_CHARS = 4096
"""The longest text of one Telegram message."""

_FIRST_BACKOFF_SECONDS = 0.25
_MAX_BACKOFF_SECONDS = 30.0

Sleep = Callable[[float], Awaitable[None]]
Buttons = Sequence[tuple[str, str]]
"""Inline buttons in one row: ``(label, callback data)``."""


def split_text(text: str, limit: int = MAX_MESSAGE_CHARS) -> list[str]:
    """Text cut into pieces Telegram takes, at a line break where one is near the limit.

    Args:
        text: The text.
        limit: The most characters of one piece.

    Returns:
        The pieces, in order (none for empty text).
    """
    pieces: list[str] = []
    while len(text) > limit:
        cut = text.rfind("\n", limit // 2, limit)
        cut = limit if cut <= 0 else cut + 1
        pieces.append(text[:cut])
        text = text[cut:]
    if text:
        pieces.append(text)
    return pieces


def _markup(buttons: Buttons | None) -> InlineKeyboardMarkup | None:
    if not buttons:
        return None
    return InlineKeyboardMarkup([[InlineKeyboardButton(label, callback_data=data)
                                  for label, data in buttons]])


class Job:
    """One thing to send; :meth:`send` may run more than once (each attempt)."""

    kind = "message"

    async def send(self, bot: Bot) -> None:
        """Sends it (one attempt).

        Args:
            bot: The bot.
        """
        raise NotImplementedError


@dataclass
class SentMessages:
    """Where the messages of one notification went (for editing them later)."""

    ids: list[tuple[int, int]] = field(default_factory=list)
    """``(chat id, message id)`` of each message sent."""


@dataclass
class SendMessage(Job):
    """A message to a chat.

    Attributes:
        chat_id: The chat.
        text: The text (cut into several messages past the limit).
        silent: Delivered without a sound.
        buttons: Inline buttons under the (last) message.
        sent: Where the message's id is noted.
        kind: What it is, for the log (``reply``, ``fills``...).
    """

    chat_id: int
    text: str
    silent: bool = False
    buttons: Buttons | None = None
    sent: SentMessages | None = None
    kind: str = "reply"
    _done: int = 0

    async def send(self, bot: Bot) -> None:
        """Sends each piece not sent yet."""
        pieces = split_text(self.text) or ["(empty)"]
        while self._done < len(pieces):
            last = self._done == len(pieces) - 1
            message = await bot.send_message(
                self.chat_id, pieces[self._done], disable_notification=self.silent,
                reply_markup=_markup(self.buttons) if last else None)
            self._done += 1
            if last and self.sent is not None:
                self.sent.ids.append((self.chat_id, message.message_id))


@dataclass
class EditMessage(Job):
    """The messages of a notification edited (an approval's outcome), buttons taken off.

    Attributes:
        sent: The messages.
        text: Their new text.
    """

    sent: SentMessages
    text: str
    kind: str = "edit"
    _done: int = 0

    async def send(self, bot: Bot) -> None:
        """Edits each message not edited yet."""
        text = split_text(self.text)[0] if self.text else "(empty)"
        while self._done < len(self.sent.ids):
            chat_id, message_id = self.sent.ids[self._done]
            try:
                await bot.edit_message_text(text, chat_id=chat_id, message_id=message_id,
                                            reply_markup=None)
            except BadRequest as exc:
                if "not modified" not in str(exc).lower():
                    raise
            self._done += 1


@dataclass
class SendPhoto(Job):
    """A picture (a chart) to a chat.

    Attributes:
        chat_id: The chat.
        photo: The picture's bytes (PNG, JPEG).
        caption: A line under it.
    """

    chat_id: int
    photo: bytes
    caption: str = ""
    kind: str = "photo"

    async def send(self, bot: Bot) -> None:
        """Sends it."""
        await bot.send_photo(self.chat_id, self.photo, caption=self.caption[:1024] or None)


@dataclass
class AnswerCallback(Job):
    """The answer to a pressed button (a short notice on the presser's screen).

    Attributes:
        query_id: The callback query.
        text: What it says.
        alert: Shown as an alert the presser must dismiss.
    """

    query_id: str
    text: str
    alert: bool = False
    kind: str = "callback"

    async def send(self, bot: Bot) -> None:
        """Answers it."""
        await bot.answer_callback_query(self.query_id, self.text[:200], show_alert=self.alert)


@dataclass
class StreamMessage(Job):
    """A desk's answer in one chat, as it streams: one message (more past the limit),
    edited as the text grows.

    Attributes:
        chat_id: The chat.
        desk: The desk.
        turn: The turn.
        text: Everything so far (answer text and tool steps).
        final: The turn ended: the last edit is due at once.
    """

    chat_id: int
    desk: str
    turn: str
    text: str = ""
    final: bool = False
    kind: str = "stream"
    sent: list[tuple[int, str]] = field(default_factory=list)
    """Each message sent: its id and the text it shows."""
    queued: bool = False
    last_flush: float = -math.inf

    def shown(self) -> str:
        """What the chat should see now."""
        if self.text.strip():
            return self.text
        return f"{self.desk}: the turn ended without an answer." if self.final else ""

    async def send(self, bot: Bot) -> None:
        """Brings the chat's messages up to the newest text."""
        self.queued = False
        for index, piece in enumerate(split_text(self.shown())):
            if index < len(self.sent):
                message_id, shown = self.sent[index]
                if shown == piece:
                    continue
                try:
                    await bot.edit_message_text(piece, chat_id=self.chat_id,
                                                message_id=message_id)
                except BadRequest as exc:
                    if "not modified" not in str(exc).lower():
                        raise
                self.sent[index] = (message_id, piece)
            else:
                message: Message = await bot.send_message(self.chat_id, piece)
                self.sent.append((message.message_id, piece))


def _seconds(retry_after: int | float | timedelta) -> float:
    if isinstance(retry_after, timedelta):
        return retry_after.total_seconds()
    return float(retry_after)


class Outbox:
    """The bot's queue of what to send, and the task that sends it.

    Args:
        bot: The bot (its requests reach Telegram, or the stand-in of a test).
        token: The bot's token, cleaned out of every error text logged.
        edit_interval: The least time between two edits of one streamed message.
        max_queued: The most jobs waiting; beyond it the oldest is dropped.
        sleep: How the sender waits (injectable so tests of backoff run fast).
        clock: Monotonic seconds.
    """

    def __init__(self, bot: Bot, token: str, *, edit_interval: float = 1.0,
                 max_queued: int = 1000, sleep: Sleep = anyio.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._bot = bot
        self._token = token
        self._edit_interval = edit_interval
        self._max_queued = max_queued
        self._sleep = sleep
        self._clock = clock
        self._jobs: deque[Job] = deque()
        self._due: list[StreamMessage] = []
        self._wakeup = anyio.Event()
        self._failing_since: float | None = None
        self._limited = False
        self.dropped = 0
        """Jobs dropped because the queue was full."""
        self.sent = 0
        """Jobs sent."""

    @property
    def waiting(self) -> int:
        """How many jobs wait to be sent."""
        return len(self._jobs)

    def post(self, job: Job) -> None:
        """Queues a job (never waits).

        Args:
            job: What to send.
        """
        if len(self._jobs) >= self._max_queued:
            dropped = self._jobs.popleft()
            if isinstance(dropped, StreamMessage):
                dropped.queued = False
            self.dropped += 1
            _log.warning("telegram_queue_full", dropped_kind=dropped.kind,
                         dropped_total=self.dropped, queued=len(self._jobs))
        self._jobs.append(job)
        self._wakeup.set()

    def update_stream(self, stream: StreamMessage) -> None:
        """Says a streamed message's text changed: its edit is queued now, or when
        ``edit_interval`` has passed since its last one (at once when it is final).

        Args:
            stream: The streamed message.
        """
        if stream.queued:
            return
        now = self._clock()
        if stream.final or now - stream.last_flush >= self._edit_interval:
            if stream in self._due:
                self._due.remove(stream)
            stream.queued = True
            stream.last_flush = now
            self.post(stream)
        elif stream not in self._due:
            self._due.append(stream)
            self._wakeup.set()

    def _promote_due(self) -> float | None:
        """Queues the streamed messages whose interval passed; the seconds until the next."""
        now = self._clock()
        waiting: float | None = None
        for stream in list(self._due):
            left = stream.last_flush + self._edit_interval - now
            if left <= 0:
                self._due.remove(stream)
                self.update_stream(stream)
            else:
                waiting = left if waiting is None else min(waiting, left)
        return waiting

    async def run(self) -> None:
        """Sends jobs in order until cancelled."""
        while True:
            waiting = self._promote_due()
            if not self._jobs:
                self._wakeup = anyio.Event()
                with anyio.move_on_after(math.inf if waiting is None else waiting):
                    await self._wakeup.wait()
                continue
            job = self._jobs.popleft()
            await self._deliver(job)

    async def _deliver(self, job: Job) -> None:
        """Sends one job, waiting out rate limits and outages; drops it when Telegram refuses
        it for good (a bad request, a chat that blocked the bot)."""
        backoff = _FIRST_BACKOFF_SECONDS
        while True:
            try:
                await job.send(self._bot)
            except RetryAfter as exc:
                seconds = _seconds(exc.retry_after)
                if not self._limited:
                    self._limited = True
                    _log.warning("telegram_rate_limited", retry_after=seconds, kind=job.kind)
                await self._sleep(seconds)
                continue
            except (BadRequest, Forbidden) as exc:
                _log.warning("telegram_refused", kind=job.kind, error=self._clean(exc))
                self._back()
                return
            except NetworkError as exc:
                if self._failing_since is None:
                    self._failing_since = self._clock()
                    _log.warning("telegram_unreachable", kind=job.kind, error=self._clean(exc),
                                 note="sending again until it answers; desks go on")
                await self._sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
                continue
            except TelegramError as exc:
                _log.warning("telegram_refused", kind=job.kind, error=self._clean(exc))
                self._back()
                return
            self.sent += 1
            self._back()
            return

    def _back(self) -> None:
        """Telegram answered: an outage or a rate limit is over."""
        self._limited = False
        if self._failing_since is not None:
            _log.info("telegram_reachable_again",
                      after_seconds=round(self._clock() - self._failing_since, 1))
            self._failing_since = None

    def _clean(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        return text.replace(self._token, "[REDACTED]") if self._token else text
