"""The daemon as a whole (``[daemon]``) and the daily spend caps."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from trading_agent.settings.table import Table

__all__ = ["MAX_SHUTDOWN_TIMEOUT_SECONDS", "DaemonSettings", "SpendCaps"]

MAX_SHUTDOWN_TIMEOUT_SECONDS = 8.0
"""The longest ``daemon.shutdown_timeout_seconds``: on SIGTERM the daemon must exit within
10 s, and cancelling what still runs, then storing it, takes the last second."""


class SpendCaps(Table):
    """A daily cap on what a model may spend (a desk's, or the whole daemon's).

    At 80% of a cap an alert event goes out; at 100% the desk (every desk, for the daemon's
    cap) pauses with a notice in its chat until the next UTC day or until an operator
    resumes it.

    Attributes:
        max_tokens_per_day: Prompt plus completion tokens per UTC day; None for no cap.
        max_cost_per_day: Their cost per UTC day, in the currency the model's prices are
            in; None for no cap. Needs the model's prices (``price_input_per_million`` and
            ``price_output_per_million``).
    """

    max_tokens_per_day: int | None = Field(default=None, gt=0, le=1_000_000_000_000)
    max_cost_per_day: float | None = Field(default=None, gt=0, le=1_000_000_000)


class DaemonSettings(Table):
    """The daemon as a whole (``[daemon]``).

    Attributes:
        state_dir: Where the SQLite file and the operator socket live. ``$STATE_DIRECTORY``
            (set by systemd's ``StateDirectory=``) wins over it; without either, ``./state``.
        log_level: The lowest level logged.
        log_format: ``json`` lines (for journald), a readable ``console``, or ``auto``: JSON
            unless stdout is a terminal.
        watchdog: Ping systemd's watchdog from the main loop when the unit asks for it.
        shutdown_timeout_seconds: How long a SIGTERM waits for desks to reach a safe point
            before cancelling them; at most 8, so the daemon exits within 10 s.
        restart_backoff_seconds: The first wait before a crashed desk is restarted; it
            doubles on each crash in a row.
        restart_backoff_max_seconds: The longest wait between restarts of a crashing desk.
        spend: Daily caps over every desk together (each desk has its own in
            ``[desks.<name>.controls]``).
        event_loop: The event loop every desk's turns run on: ``auto`` (uvloop where it is
            installed, else asyncio's), ``uvloop`` (refuse to start without it) or
            ``asyncio`` (see :mod:`trading_agent.app.event_loop`).
    """

    state_dir: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    watchdog: bool = True
    shutdown_timeout_seconds: float = Field(default=8.0, gt=0)
    restart_backoff_seconds: float = Field(default=1.0, gt=0, le=3600)
    restart_backoff_max_seconds: float = Field(default=300.0, gt=0, le=86400)
    spend: SpendCaps = Field(default_factory=SpendCaps)
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    @field_validator("shutdown_timeout_seconds")
    @classmethod
    def _check_shutdown_timeout(cls, value: float) -> float:
        if value > MAX_SHUTDOWN_TIMEOUT_SECONDS:
            raise ValueError(
                f"at most {MAX_SHUTDOWN_TIMEOUT_SECONDS:g} seconds: on SIGTERM the daemon must "
                "exit within 10 s (systemd and operators count on it); turns still running "
                "when it ends are cancelled, and their unfinished tool calls stored as "
                "interrupted")
        return value
