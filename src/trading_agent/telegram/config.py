"""The Telegram channel's settings (``[telegram]``): the bot's token, where chats start, what
they are told.

The settings file embeds :class:`TelegramSettings`; no ``[telegram]`` table means no bot. The
bot token is never a field: only the *name* of the environment variable holding it is, so no
config file, repr or log line carries it. Operators are the ``[[operator.operators]]`` with a
``telegram_user_id``; their role applies in Telegram as everywhere else::

    [telegram]
    token_env = "TELEGRAM_BOT_TOKEN"
    default_desk = "alpha"
    daily_summary_at = "18:00"          # UTC

    [telegram.notifications]
    fills = "on"
    errors = "silent"                   # delivered without a sound
    spend = "off"
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["NOTIFICATION_KINDS", "NotificationKind", "NotificationLevel", "Notifications",
           "TelegramSettings"]

NotificationLevel = Literal["on", "silent", "off"]
"""How a kind of notification is delivered: with a sound, without one, or not at all."""

NotificationKind = Literal["fills", "approvals", "kill_switch", "pause", "protections", "errors",
                           "spend", "daily_summary"]
"""What operators can be told about:

- ``fills``: one of a desk's orders filled;
- ``approvals``: a tool call waits for an operator (the message carries approve and deny
  buttons);
- ``kill_switch``: a kill switch went on or off;
- ``pause``: a desk was paused (by an operator or a spend cap) or resumed;
- ``protections``: a position's stop or target fired, or the exchange could not hold it;
- ``errors``: a desk's turn or a service failed;
- ``spend``: a daily spend cap is 80% used, or used up;
- ``daily_summary``: each desk's profit, once a day at ``daily_summary_at``.
"""

NOTIFICATION_KINDS: tuple[str, ...] = ("fills", "approvals", "kill_switch", "pause",
                                       "protections", "errors", "spend", "daily_summary")
"""Every :data:`NotificationKind`, in a fixed order."""

_TIME = re.compile(r"^([01]\d|2[0-3]):[0-5]\d$")


class Notifications(BaseModel):
    """Each kind of notification: ``on``, ``silent`` or ``off`` (see
    :data:`NotificationKind`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fills: NotificationLevel = "on"
    approvals: NotificationLevel = "on"
    kill_switch: NotificationLevel = "on"
    pause: NotificationLevel = "on"
    protections: NotificationLevel = "on"
    errors: NotificationLevel = "on"
    spend: NotificationLevel = "on"
    daily_summary: NotificationLevel = "on"

    def level(self, kind: NotificationKind) -> NotificationLevel:
        """How ``kind`` is delivered.

        Args:
            kind: The kind of notification.

        Returns:
            ``on``, ``silent`` or ``off``.
        """
        level: NotificationLevel = getattr(self, kind)
        return level


class TelegramSettings(BaseModel):
    """The Telegram bot (``[telegram]``).

    Attributes:
        token_env: The environment variable holding the bot's token (from BotFather); the
            token itself is never in a file, a log line or an error.
        default_desk: The desk a chat talks to until ``/desk NAME``; must name a desk.
        base_url: A Bot API server of one's own (``http(s)://HOST[:PORT]``), as Telegram
            allows; None: Telegram's.
        notifications: Each kind of notification, on, silent or off.
        daily_summary_at: When the daily summary (each desk's profit) is sent, ``HH:MM``
            in UTC; None: no daily summary.
        edit_interval_seconds: The least time between two edits of a chat's streamed
            answer (Telegram allows about one message a second per chat).
        poll_timeout_seconds: How long one long poll (``getUpdates``) waits for news.
        max_queued: The most messages waiting to be sent while Telegram is slow or down;
            beyond it the oldest notification is dropped (and logged).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    token_env: str = Field(min_length=1)
    default_desk: str = Field(min_length=1)
    base_url: str | None = None
    notifications: Notifications = Field(default_factory=Notifications)
    daily_summary_at: str | None = None
    edit_interval_seconds: float = Field(default=1.0, ge=0.05, le=60)
    poll_timeout_seconds: float = Field(default=30.0, ge=0.1, le=120)
    max_queued: int = Field(default=1000, ge=10, le=100_000)

    @field_validator("token_env")
    @classmethod
    def _check_token_env(cls, value: str) -> str:
        if not value.strip() or "=" in value:
            raise ValueError("token_env must name an environment variable, such as "
                             "TELEGRAM_BOT_TOKEN (the token itself is never in the file)")
        return value

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("base_url must be an http:// or https:// URL with a host, such "
                             "as http://127.0.0.1:8081 (a Bot API server of one's own)")
        return value.rstrip("/")

    @field_validator("daily_summary_at")
    @classmethod
    def _check_daily_summary_at(cls, value: str | None) -> str | None:
        if value is not None and not _TIME.match(value):
            raise ValueError(f"daily_summary_at must be a time of day as HH:MM in UTC, such "
                             f"as \"18:00\" (got {value[:20]!r})")
        return value

    @property
    def daily_summary_minute(self) -> int | None:
        """``daily_summary_at`` as minutes after midnight UTC, or None."""
        if self.daily_summary_at is None:
            return None
        hours, minutes = self.daily_summary_at.split(":")
        return int(hours) * 60 + int(minutes)
