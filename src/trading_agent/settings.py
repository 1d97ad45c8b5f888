"""The daemon's configuration: one TOML file plus ``TRADING_AGENT_*`` environment variables.

The schema is pydantic (pydantic-settings for the environment); every table forbids unknown
keys, so a typo is an error rather than a silently ignored default. Environment variables
win over the file and nest with ``__``: ``TRADING_AGENT_MODEL__BASE_URL`` sets
``[model] base_url``, ``TRADING_AGENT_DESKS__ALPHA__MAXIMUM_ROUNDS`` sets
``[desks.alpha] maximum_rounds``.

Secrets never appear in the file: a key that needs one names the environment variable that
holds it (``api_key_env = "OPENAI_API_KEY"``). :meth:`Settings.secret_env_vars` lists them,
for the log redactor and for :func:`missing_secrets`.

Each desk inherits the top-level ``[model]`` and ``[exchange]`` tables and overrides single
keys in ``[desks.<name>.model]`` / ``[desks.<name>.exchange]`` (a desk naming a different
``provider`` replaces the model table whole). A desk's ``risk.allowed_symbols`` defaults to
its ``symbols``. Relative paths in the file are relative to the file's folder.

Example::

    [daemon]
    state_dir = "../state"          # $STATE_DIRECTORY wins under systemd
    log_level = "info"
    log_format = "auto"             # json when stdout is not a terminal

    [model]
    provider = "openai"
    base_url = "https://api.openai.com/v1"
    model = "gpt-4o-mini"
    api_key_env = "OPENAI_API_KEY"
    context_window = 128000

    [exchange]
    mode = "paper"

    [desks.alpha]
    system_prompt = "You trade BTC/USDT on a paper account."
    symbols = ["BTC/USDT"]
    timezone = "Europe/Paris"

    [desks.alpha.triggers]
    ticks = { move_percent = 0.5, on_candle_close = ["1h"] }
    schedules = [{ cron = "0 9 * * mon-fri", message = "Morning review." }]

:func:`load_settings` reads and validates the file and raises :class:`ConfigError` listing
every problem, one a line, as ``FILE: key.path: message (got VALUE; allowed ...)``.

The file is held to its TOML types: an integer key takes an integer (not ``true``, not
``3.0``, not ``"3"``), a boolean key ``true`` or ``false`` (not ``"no"``, not ``0``), a number
key a finite number; pydantic alone would convert them. An environment variable is text, so
there ``"5"`` and ``"false"`` still spell the number and the boolean. Sizes and durations have
upper bounds (a context window at most :data:`~trading_agent.backends.config.MAX_CONTEXT_WINDOW`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from croniter import croniter
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.exceptions import SettingsError

from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.image_preparer import ImageLimits
from trading_agent.backends.config import MAX_CONTEXT_WINDOW
from trading_agent.backends.providers import ModelTable, model_settings, provider
from trading_agent.errors import ConfigError
from trading_agent.fleet.config import FleetSettings, StoreSettings
from trading_agent.operator.config import OperatorConfig
from trading_agent.plugins import HOOK_GROUP, find_factory
from trading_agent.telemetry.config import TelemetrySettings, WebhookSettings
from trading_agent.tools.delegate import DELEGATE_TOOL_NAME, SubagentConfig
from trading_agent.tools.mcp import McpServerConfig
from trading_agent.tools.trading_tools import TRADING_TOOL_NAMES
from trading_agent.trading.config import ExchangeConfig, RiskLimits
from trading_agent.trading.exchange import timeframe_delta

__all__ = [
    "DESK_TOOL_NAMES",
    "ENV_PREFIX",
    "MAX_SHUTDOWN_TIMEOUT_SECONDS",
    "ContextSettings",
    "ControlSettings",
    "DaemonSettings",
    "DeskSettings",
    "ImageSettings",
    "ModelSettings",
    "ScheduleSettings",
    "Settings",
    "SpendCaps",
    "TickTriggerSettings",
    "TriggerSettings",
    "load_settings",
    "missing_secrets",
]

ENV_PREFIX = "TRADING_AGENT_"
"""The prefix of every environment variable the settings read."""

DESK_TOOL_NAMES: tuple[str, ...] = (*TRADING_TOOL_NAMES, "remember", "recall",
                                    DELEGATE_TOOL_NAME)
"""Every tool a desk can be given, what ``desks.<name>.tools`` may list (the daemon's wiring
registers exactly these: the trading tools, the memory tools and ``delegate``)."""

MAX_SHUTDOWN_TIMEOUT_SECONDS = 8.0
"""The longest ``daemon.shutdown_timeout_seconds``: on SIGTERM the daemon must exit within
10 s, and cancelling what still runs, then storing it, takes the last second."""

_DESK_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_INTERVAL = re.compile(r"(\d+)([smhd])")
_INTERVAL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_SECRET_KEY = re.compile(r"(^|_)(api_?key|secret|token|password|passphrase)$", re.IGNORECASE)


class _Strict(BaseModel):
    """A config table: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SpendCaps(_Strict):
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


class ControlSettings(SpendCaps):
    """How a desk is held back (``[desks.<name>.controls]``).

    Attributes:
        when_paused: What happens to a trigger (a tick, a schedule) that comes while the
            desk is paused: ``wait`` (queued, ticks coalesced, run on resume) or ``drop``.
            An operator's message always waits.
        halt_after_failed_turns: The kill switch goes on by itself for the desk after this
            many failed turns in a row; 0 never.
    """

    when_paused: Literal["wait", "drop"] = "wait"
    halt_after_failed_turns: int = Field(default=5, ge=0, le=1000)


class DaemonSettings(_Strict):
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
    """

    state_dir: Path | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "json", "console"] = "auto"
    watchdog: bool = True
    shutdown_timeout_seconds: float = Field(default=8.0, gt=0)
    restart_backoff_seconds: float = Field(default=1.0, gt=0, le=3600)
    restart_backoff_max_seconds: float = Field(default=300.0, gt=0, le=86400)
    spend: SpendCaps = Field(default_factory=SpendCaps)

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


if TYPE_CHECKING:
    ModelSettings = ModelTable
else:
    ModelSettings = model_settings()
"""One model: one of the registered providers' tables, by ``provider``
(:mod:`trading_agent.backends.providers`)."""


class ContextSettings(_Strict):
    """When a desk's conversation is compacted (``[desks.<name>.context]``).

    Attributes:
        flush_threshold: The share of the window at which a turn starts with a memory flush
            and a compaction.
        hard_threshold: The share past which the loop summarizes at once between tool rounds.
        keep_recent_tokens: How many tokens of the newest messages stay verbatim after a
            compaction; by default a fifth of the window.
        summary_max_tokens: The longest summary the model may write; it shrinks to what
            the window has left.
        tool_result_max_tokens: Longer messages (tool results, an operator's paste, a
            notice) are cut to this in what the model is sent (the stored text stays
            whole); by default half of ``keep_recent_tokens``.
        flush_max_rounds: The most model calls of the silent memory-flush turn that comes
            before a compaction.
        clear_tool_results: Before any summary, tool results older than the newest
            ``clear_keep_rounds`` tool rounds are first cut to a one-line stub in what is
            sent (the store keeps them whole); the summary runs only when that is not
            enough.
        clear_keep_rounds: How many of the newest tool rounds clearing keeps whole.

    ``keep_recent_tokens`` plus a summary of 64 tokens must be at most half the model's
    ``context_window``, checked when the file is loaded.
    """

    flush_threshold: float = Field(default=0.70, gt=0, lt=1)
    hard_threshold: float = Field(default=0.85, gt=0, lt=1)
    keep_recent_tokens: int | None = Field(default=None, gt=0, le=MAX_CONTEXT_WINDOW)
    summary_max_tokens: int = Field(default=1200, gt=0, le=MAX_CONTEXT_WINDOW)
    tool_result_max_tokens: int | None = Field(default=None, ge=64, le=MAX_CONTEXT_WINDOW)
    flush_max_rounds: int = Field(default=3, ge=1, le=20)
    clear_tool_results: bool = True
    clear_keep_rounds: int = Field(default=3, ge=0, le=1000)

    @model_validator(mode="after")
    def _ordered(self) -> ContextSettings:
        if not self.flush_threshold < self.hard_threshold:
            raise ValueError(f"flush_threshold ({self.flush_threshold}) must be below "
                             f"hard_threshold ({self.hard_threshold})")
        return self

    def compressor(self, context_window: int, *, key: str = "context") -> ContextCompressor:
        """The agent core's ``ContextCompressor`` for these settings and a model's window.

        Args:
            context_window: The model's window, in tokens.
            key: Where these settings are in the config, for the error message
                (``desks.alpha.context``).

        Returns:
            The compressor.

        Raises:
            ConfigError: The settings cannot work for this window; the message names the
                keys, their values and the window.
        """
        try:
            return ContextCompressor(
                context_window, flush_threshold=self.flush_threshold,
                hard_threshold=self.hard_threshold, keep_recent_tokens=self.keep_recent_tokens,
                summary_max_tokens=self.summary_max_tokens,
                tool_result_max_tokens=self.tool_result_max_tokens,
                flush_max_rounds=self.flush_max_rounds,
                clear_keep_rounds=self.clear_keep_rounds if self.clear_tool_results else None)
        except ValueError as exc:
            keep = (str(self.keep_recent_tokens) if self.keep_recent_tokens is not None
                    else f"{context_window // 5} by default, a fifth of the window")
            raise ConfigError(
                f"{key}: {exc}; lower {key}.keep_recent_tokens (now {keep}), or use a model "
                f"with a larger context_window (now {context_window})") from exc


class ImageSettings(_Strict):
    """What pictures the model is sent (``[desks.<name>.images]``).

    Attributes:
        max_side: The longest side in pixels.
        max_bytes: The largest encoded size.
        keep: How many of the newest images are sent with each request; older ones become
            text placeholders.
    """

    max_side: int = Field(default=1568, ge=64, le=16_384)
    max_bytes: int = Field(default=3_750_000, ge=10_000, le=50_000_000)
    keep: int = Field(default=4, ge=1, le=16)


class TickTriggerSettings(_Strict):
    """Market triggers (``[desks.<name>.triggers] ticks = {...}``).

    Attributes:
        move_percent: Wake the desk when a symbol moved this many percent since it last
            looked; None for no move triggers.
        on_candle_close: Timeframes whose candle closes wake the desk (``["5m", "1h"]``).
    """

    move_percent: float | None = Field(default=None, gt=0, le=100)
    on_candle_close: list[str] = Field(default_factory=list)

    @field_validator("on_candle_close")
    @classmethod
    def _timeframes(cls, value: list[str]) -> list[str]:
        for timeframe in value:
            timeframe_delta(timeframe)
        return value


def _parse_interval(text: str) -> timedelta:
    """``"15m"``, ``"1h30m"``, ``"90s"``, ``"1d"`` as a duration."""
    compact = text.replace(" ", "")
    parts = _INTERVAL.findall(compact)
    if not compact or "".join(n + u for n, u in parts) != compact:
        raise ValueError(f"{text!r} is not an interval; use a number and a unit s, m, h or d, "
                         "such as 30s, 15m, 4h, 1d or 1h30m")
    seconds = sum(int(number) * _INTERVAL_UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"{text!r}: the interval must be longer than zero")
    return timedelta(seconds=seconds)


class ScheduleSettings(_Strict):
    """One schedule of a desk: ``{ every = "15m" }`` or ``{ cron = "*/30 * * * *" }``.

    Attributes:
        every: A fixed interval (``30s``, ``15m``, ``4h``, ``1d``, ``1h30m``).
        cron: A cron expression of five fields (minute hour day month weekday), read on the
            desk's wall clock (its ``timezone``).
        message: What the desk is told when the schedule fires.
        name: The schedule's name, unique per desk: its key for the last time it fired. By
            default ``every 15m`` or ``cron */30 * * * *``.
    """

    every: str | None = None
    cron: str | None = None
    message: str = Field(default="Scheduled check: review the market, your positions and "
                                 "your open orders, and act if needed.", min_length=1)
    name: str | None = Field(default=None, min_length=1)

    @field_validator("every")
    @classmethod
    def _check_every(cls, value: str | None) -> str | None:
        if value is not None:
            _parse_interval(value)
        return value

    @field_validator("cron")
    @classmethod
    def _check_cron(cls, value: str | None) -> str | None:
        if value is None:
            return value
        allowed = ("five fields: minute hour day-of-month month day-of-week, such as "
                   "'*/30 * * * *' or '0 9 * * mon-fri'")
        if len(value.split()) != 5 or not croniter.is_valid(value):
            raise ValueError(f"{value!r} is not a valid cron expression ({allowed})")
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleSettings:
        if (self.every is None) == (self.cron is None):
            raise ValueError("a schedule needs exactly one of every (such as \"15m\") or cron "
                             "(such as \"*/30 * * * *\")")
        return self

    @property
    def key(self) -> str:
        """The schedule's name: as configured, else derived from how it repeats."""
        if self.name is not None:
            return self.name
        return f"every {self.every}" if self.every is not None else f"cron {self.cron}"

    @property
    def interval(self) -> timedelta | None:
        """``every`` as a duration, or None for a cron schedule."""
        return _parse_interval(self.every) if self.every is not None else None


class TriggerSettings(_Strict):
    """What wakes a desk besides operators (``[desks.<name>.triggers]``).

    Attributes:
        ticks: Market moves and candle closes.
        schedules: Intervals and cron schedules.
    """

    ticks: TickTriggerSettings = Field(default_factory=TickTriggerSettings)
    schedules: list[ScheduleSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> TriggerSettings:
        seen: set[str] = set()
        for schedule in self.schedules:
            if schedule.key in seen:
                raise ValueError(f"two schedules are named {schedule.key!r}; give each a "
                                 "distinct name")
            seen.add(schedule.key)
        return self


class DeskSettings(_Strict):
    """One desk (``[desks.<name>]``).

    Attributes:
        system_prompt: What the desk's model is told before every request.
        symbols: The markets it watches and trades.
        tools: The names of the tools it may call (from :data:`DESK_TOOL_NAMES`); None
            for all of them.
        maximum_rounds: The most model calls in one turn.
        model: Its model: the top-level ``[model]`` with this desk's overrides.
        exchange: Its exchange: the top-level ``[exchange]`` with this desk's overrides.
        risk: Its risk limits (``allowed_symbols`` defaults to ``symbols``).
        context: When its conversation is compacted (checked against its model's window).
        images: What pictures its model is sent.
        timezone: An IANA time zone name; cron schedules and the desk's dates use it.
        subagents: What its ``delegate`` tool may do.
        triggers: What wakes it.
        controls: Its spend caps, what triggers do while it is paused, and when the kill
            switch goes on by itself.
        mcp_servers: MCP servers whose tools it gets besides its own
            (``[[desks.<name>.mcp_servers]]``), each under its server's name as a prefix.
    """

    system_prompt: str = Field(min_length=1)
    symbols: list[str] = Field(min_length=1)
    tools: list[str] | None = None
    maximum_rounds: int = Field(default=20, ge=1, le=1000)
    model: ModelSettings
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig)
    risk: RiskLimits = Field(default_factory=RiskLimits)
    # Validated even when left out: the defaults may not fit a small window.
    context: ContextSettings = Field(default_factory=ContextSettings, validate_default=True)
    images: ImageSettings = Field(default_factory=ImageSettings)
    timezone: str = "UTC"
    subagents: SubagentConfig = Field(default_factory=SubagentConfig)
    triggers: TriggerSettings = Field(default_factory=TriggerSettings)
    controls: ControlSettings = Field(default_factory=ControlSettings)
    mcp_servers: list[McpServerConfig] = Field(default_factory=list)

    # Hooks: each ``package.module:factory`` or an entry point of group trading_agent.hooks,
    # made in order when the desk is built, before the approval gate (desks/hooks.py).
    hooks: list[str] = Field(default_factory=list)

    @field_validator("hooks")
    @classmethod
    def _check_hooks(cls, value: list[str]) -> list[str]:
        for index, name in enumerate(value):
            try:
                find_factory(name, HOOK_GROUP)
            except ValueError as exc:
                raise ValueError(f"[{index}] {name!r}: {exc}") from None
        return value

    @field_validator("mcp_servers")
    @classmethod
    def _check_mcp_servers(cls, value: list[McpServerConfig]) -> list[McpServerConfig]:
        names = [server.name for server in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"two servers are named {', '.join(map(repr, twice))}: each "
                             "name prefixes its server's tools, so it must be unique")
        return value

    @field_validator("timezone")
    @classmethod
    def _check_timezone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{value!r} is not an IANA time zone name; use one such as UTC, "
                             "Europe/London or America/New_York") from None
        return value

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return value
        unknown = [name for name in value if name not in DESK_TOOL_NAMES]
        if unknown:
            raise ValueError(f"unknown tool(s) {', '.join(unknown)}; allowed: "
                             f"{', '.join(DESK_TOOL_NAMES)}")
        if len(set(value)) != len(value):
            raise ValueError("a tool is listed twice")
        return value

    @field_validator("context")
    @classmethod
    def _context_fits_the_window(cls, value: ContextSettings,
                                 info: ValidationInfo) -> ContextSettings:
        model = info.data.get("model")  # absent when the model table itself is wrong
        if model is not None:
            try:
                value.compressor(model.context_window)
            except ConfigError as exc:
                raise ValueError(str(exc).removeprefix("context: ")) from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> DeskSettings:
        replay = self.exchange.replay.files
        if self.exchange.feed == "replay":
            missing = [symbol for symbol in self.symbols if symbol not in replay]
            if missing:
                raise ValueError(f"no replayed candles for {', '.join(missing)}: the replay "
                                 f"has {', '.join(replay)} (add files under exchange.replay."
                                 "files, or use feed = \"ccxt\")")
        if self.controls.max_cost_per_day is not None and not _priced(self.model):
            raise ValueError("controls.max_cost_per_day needs the model's prices "
                             "(model.price_input_per_million and model.price_output_per_million)"
                             "; or cap tokens with controls.max_tokens_per_day")
        refused = [s for s in self.symbols if s not in self.risk.allowed_symbols]
        if refused:
            raise ValueError(f"{', '.join(refused)} not in risk.allowed_symbols "
                             f"({', '.join(self.risk.allowed_symbols)}): every order would be "
                             "refused")
        return self

    @property
    def zone(self) -> ZoneInfo:
        """The desk's time zone."""
        return ZoneInfo(self.timezone)

    def image_limits(self) -> ImageLimits:
        """The agent core's ``ImageLimits`` for these settings."""
        return ImageLimits(**self.images.model_dump())


_toml_data: ContextVar[dict[str, Any] | None] = ContextVar("_toml_data", default=None)


class _TomlDataSource(PydanticBaseSettingsSource):
    """The TOML file's contents, parsed by :func:`load_settings` (which reports syntax errors
    with the line and column) and handed over through a context variable."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_toml_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_toml_data.get() or {})


def _priced(model: ModelSettings) -> bool:
    """Whether a model's cost can be counted (its prices are configured)."""
    return getattr(model, "price_input_per_million", None) is not None


def _check_desk_name(name: str) -> str:
    if not _DESK_NAME.match(name):
        raise ValueError(f"bad desk name {name!r}: use lowercase letters, digits, '-' and '_' "
                         "(at most 64, starting with a letter or digit), so that environment "
                         "variables and URLs can name the desk")
    return name


DeskName = Annotated[str, AfterValidator(_check_desk_name)]


class Settings(BaseSettings):
    """The whole configuration.

    Attributes:
        daemon: The daemon as a whole.
        model: The default model of every desk (a desk may override keys or replace it).
        exchange: The default exchange of every desk.
        operator: The operator API.
        telemetry: OpenTelemetry traces of the desks' turns, model and tool calls.
        webhooks: Signed POSTs of the events chosen (fills, approvals waiting, ...).
        store: Where the state lives: SQLite in the state directory, or PostgreSQL shared by
            a fleet of daemons.
        fleet: How the daemons of a fleet meet (NATS) and hold their desks (leases).
        desks: The desks, by name, in file order.
    """

    model_config = SettingsConfigDict(
        extra="forbid", env_prefix=ENV_PREFIX, env_nested_delimiter="__",
        case_sensitive=False, nested_model_default_partial_update=False)

    daemon: DaemonSettings = Field(default_factory=DaemonSettings)
    model: ModelSettings | None = None
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig)
    operator: OperatorConfig = Field(default_factory=OperatorConfig)
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    webhooks: list[WebhookSettings] = Field(default_factory=list)
    store: StoreSettings = Field(default_factory=StoreSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    desks: dict[DeskName, DeskSettings] = Field(min_length=1)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment wins over the file; no dotenv or secrets directory: secrets come
        # from the process environment only.
        return init_settings, env_settings, _TomlDataSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _inherit_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return _apply_desk_defaults(data)
        return data

    @model_validator(mode="after")
    def _daemon_cost_cap_priced(self) -> Settings:
        unpriced = [name for name, desk in self.desks.items() if not _priced(desk.model)]
        if self.daemon.spend.max_cost_per_day is not None and unpriced:
            raise ValueError(
                f"daemon.spend.max_cost_per_day needs every desk's model prices; "
                f"{', '.join(unpriced)} has none (set model.price_input_per_million and "
                "model.price_output_per_million), or cap tokens with "
                "daemon.spend.max_tokens_per_day")
        return self

    @model_validator(mode="after")
    def _fleet_complete(self) -> Settings:
        if self.store.url is not None and self.fleet.nats_url is None:
            raise ValueError(
                "store.url puts the state on PostgreSQL, which makes this daemon one of a "
                "fleet: set fleet.nats_url (nats://HOST:PORT) too, or leave store.url out for "
                "the embedded SQLite file")
        if self.store.url is None and self.fleet.nats_url is not None:
            raise ValueError(
                "fleet.nats_url needs the desks' state shared: set store.url "
                "(postgresql://USER@HOST:PORT/DB), or leave [fleet] out for one daemon")
        return self

    @property
    def in_fleet(self) -> bool:
        """Whether this daemon is one of a fleet (state on PostgreSQL, daemons on NATS)."""
        return self.store.url is not None

    def state_directory(self, environ: Mapping[str, str] | None = None) -> Path:
        """Where state lives: ``$STATE_DIRECTORY`` (systemd), else ``daemon.state_dir``, else
        ``./state``.

        Args:
            environ: The environment (``os.environ`` by default).

        Returns:
            The directory (not created here).
        """
        environ = os.environ if environ is None else environ
        # systemd passes a colon-separated list when the unit names several directories.
        from_systemd = environ.get("STATE_DIRECTORY", "").split(":")[0]
        if from_systemd:
            return Path(from_systemd)
        return self.daemon.state_dir if self.daemon.state_dir is not None else Path("state")

    def secret_env_vars(self) -> dict[str, str]:
        """Every environment variable the config names as holding a secret.

        Returns:
            The variable's name, mapped to the key path that names it (the first, when
            several do).
        """
        found: dict[str, str] = {}
        for path, name, _ in self._secret_references():
            found.setdefault(name, path)
        return found

    def _secret_references(self) -> Iterator[tuple[str, str, bool]]:
        """(key path, variable name, whether the daemon cannot run without it)."""
        # Required on TCP, unless the daemon makes one itself (a loopback demo).
        yield ("operator.token_env", self.operator.token_env,
               self.operator.tcp_address is not None and not self.operator.generate_token)
        if self.telemetry.otlp_headers_env:
            yield ("telemetry.otlp_headers_env", self.telemetry.otlp_headers_env,
                   self.telemetry.otlp_endpoint is not None)
        for index, hook in enumerate(self.webhooks):
            yield f"webhooks[{index}].secret_env", hook.secret_env, True
        if self.store.password_env:
            yield "store.password_env", self.store.password_env, self.store.url is not None
        for key in ("nats_password_env", "nats_token_env"):
            name = getattr(self.fleet, key)
            if name:
                yield f"fleet.{key}", name, self.in_fleet
        for desk_name, desk in self.desks.items():
            prefix = f"desks.{desk_name}"
            key_variable = provider(desk.model.provider).key_variable(desk.model)
            if key_variable:
                yield f"{prefix}.model.api_key_env", key_variable, True
            for index, server in enumerate(desk.mcp_servers):
                where = f"{prefix}.mcp_servers[{index}]"
                for header, variable in server.headers_env.items():
                    yield f"{where}.headers_env.{header}", variable, True
                for variable in server.env:
                    yield f"{where}.env", variable, True
            ccxt = desk.exchange.ccxt
            if ccxt is not None:
                live = desk.exchange.mode == "live"
                for key in ("api_key_env", "secret_env", "password_env"):
                    name = getattr(ccxt, key)
                    if name:
                        yield f"{prefix}.exchange.ccxt.{key}", name, live


def _deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _inherits_model(default: Any, own: Any) -> bool:
    """Whether a desk's model table is merged over the default (same provider, or none)."""
    if not isinstance(default, Mapping):
        return False
    if own is None:
        return True
    return isinstance(own, Mapping) and own.get("provider", default.get("provider")) == (
        default.get("provider"))


def _apply_desk_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Each desk's model and exchange: the top-level tables with the desk's keys over them."""
    desks = data.get("desks")
    if not isinstance(desks, Mapping):
        return data
    default_model = data.get("model")
    default_exchange = data.get("exchange", {})
    resolved: dict[str, Any] = {}
    for name, desk in desks.items():
        if not isinstance(desk, Mapping):
            resolved[name] = desk
            continue
        desk = dict(desk)
        own_model = desk.get("model")
        if isinstance(default_model, Mapping) and _inherits_model(default_model, own_model):
            desk["model"] = _deep_merge(default_model, own_model or {})
        own_exchange = desk.get("exchange")
        if isinstance(default_exchange, Mapping) and (own_exchange is None
                                                      or isinstance(own_exchange, Mapping)):
            desk["exchange"] = _deep_merge(default_exchange, own_exchange or {})
        risk = desk.get("risk", {})
        symbols = desk.get("symbols")
        if isinstance(risk, Mapping) and "allowed_symbols" not in risk and isinstance(
                symbols, list):
            desk["risk"] = {**risk, "allowed_symbols": list(symbols)}
        resolved[name] = desk
    return {**data, "desks": resolved}


# --- loading and error reports -------------------------------------------------------------

_RELATIVE_PATHS: tuple[tuple[str, ...], ...] = (
    ("daemon", "state_dir"),
    ("operator", "socket_path"),
)


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Makes the file's relative paths relative to the file's folder (in place)."""

    def fix(table: Any, key: str) -> None:
        if isinstance(table, dict) and isinstance(table.get(key), str):
            path = Path(table[key]).expanduser()
            table[key] = os.path.normpath(path if path.is_absolute() else base / path)

    for section, key in _RELATIVE_PATHS:
        fix(data.get(section), key)
    fix(data.get("model"), "cache_dir")

    def fix_replay(exchange: Any) -> None:
        if isinstance(exchange, dict) and isinstance(exchange.get("replay"), dict):
            files = exchange["replay"].get("files")
            if isinstance(files, dict):
                for symbol in list(files):
                    fix(files, symbol)

    fix_replay(data.get("exchange"))
    desks = data.get("desks")
    if isinstance(desks, dict):
        for desk in desks.values():
            if isinstance(desk, dict):
                fix_replay(desk.get("exchange"))
                fix(desk.get("model"), "cache_dir")


class _WrongType:
    """A value of the file whose TOML type is not the key's, put in its place so that the
    schema refuses it there, where pydantic would convert it (``true`` to 1, ``"no"`` to
    false, ``1e27`` to an integer).

    Only the file is held to its types: an environment variable is text, and ``"5"`` or
    ``"false"`` there is read as the number or the boolean it spells.

    Attributes:
        value: The value as the file has it.
        reason: What is wrong, for the error line.
    """

    __slots__ = ("reason", "value")

    def __init__(self, value: Any, reason: str) -> None:
        self.value = value
        self.reason = reason

    def __repr__(self) -> str:
        return _toml_repr(self.value)


def _mark_loose_types(data: dict[str, Any]) -> None:
    """Replaces, in place, each value of the file whose TOML type is not its key's with a
    :class:`_WrongType`: an integer key takes only an integer, a boolean key only ``true`` or
    ``false``, a number key only a finite integer or float, a decimal key no boolean, a date
    key no number."""
    model = data.get("model")
    provider = model.get("provider") if isinstance(model, Mapping) else None
    _check_types(data, Settings, provider)


def _check_types(value: Any, annotation: Any, provider: Any) -> Any:
    """``value``, or a :class:`_WrongType` in its place; tables and arrays are checked (and
    changed) in place.

    Args:
        value: A value of the file.
        annotation: The type its key has in the schema.
        provider: The top-level model's ``provider``, which a desk's model table without one
            inherits (it picks the table's keys).
    """
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        models = _union_members(annotation)
        if models and isinstance(value, dict):
            tag = value.get("provider", provider)
            for member in models:
                if tag in typing.get_args(member.model_fields["provider"].annotation):
                    return _check_types(value, member, provider)
        return value  # several plain types (bool | str) have validators of their own
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if isinstance(value, dict):
            for key, item in value.items():
                field = annotation.model_fields.get(key)
                if field is not None:
                    value[key] = _check_types(item, field.annotation, provider)
        return value
    if origin is dict and isinstance(value, dict):
        item_type = typing.get_args(annotation)[1]
        for key, item in value.items():
            value[key] = _check_types(item, item_type, provider)
        return value
    if origin in (list, tuple) and isinstance(value, list):
        item_type = typing.get_args(annotation)[0]
        value[:] = [_check_types(item, item_type, provider) for item in value]
        return value
    reason = _type_mismatch(value, annotation)
    return value if reason is None else _WrongType(value, reason)


def _type_mismatch(value: Any, annotation: Any) -> str | None:
    """Why a value of the file cannot be taken for a key of this type, or None."""
    written = ("a boolean" if isinstance(value, bool) else
               "a string" if isinstance(value, str) else
               "a number with a fraction or an exponent" if isinstance(value, float) else
               "an integer" if isinstance(value, int) else None)
    if written is None:
        return None  # a table, an array or a date: the schema's own check refuses them
    unquote = "; write the number without quotes" if isinstance(value, str) else ""
    if annotation is bool and not isinstance(value, bool):
        hint = "; write true or false without quotes" if isinstance(value, str) else ""
        return f"{written} where true or false is expected{hint}"
    if annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{written} where an integer is expected{unquote}"
    if annotation in (float, Decimal) and isinstance(value, float) and not math.isfinite(value):
        return "inf or nan where a finite number is expected"
    if annotation is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        return f"{written} where a number is expected{unquote}"
    if annotation is Decimal and isinstance(value, bool):
        return f"{written} where a number is expected"
    if annotation is datetime and isinstance(value, int | float):
        return f"{written} where a date and time is expected"
    return None


def _toml_repr(value: Any) -> str:
    """A value as the file writes it (``true``, not ``True``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def load_settings(path: Path | str, *, check_environment: bool = False) -> Settings:
    """Reads and validates a config file, with the ``TRADING_AGENT_*`` variables over it.

    Args:
        path: The TOML file.
        check_environment: Also require every secret the config names to be set in the
            environment (what ``run`` needs; ``check-config`` only warns).

    Returns:
        The settings.

    Raises:
        ConfigError: The file cannot be read, is not valid TOML, or breaks the schema; the
            message lists every problem, one a line, as
            ``FILE: key.path: message (got VALUE; allowed ...)``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {_describe_toml_error(exc, text)}") from exc
    _resolve_paths(data, path.resolve().parent)
    _mark_loose_types(data)
    token = _toml_data.set(data)
    try:
        settings = Settings()
    except SettingsError as exc:
        raise ConfigError(f"{path}: environment: {exc}") from exc
    except ValidationError as exc:
        problems = _ErrorReport(path, data, _environment_data()).lines(exc)
        raise ConfigError("\n".join(problems)) from exc
    finally:
        _toml_data.reset(token)
    if check_environment:
        missing = missing_secrets(settings, path)
        if missing:
            raise ConfigError("\n".join(missing))
    return settings


def missing_secrets(settings: Settings, path: Path | str,
                    environ: Mapping[str, str] | None = None) -> list[str]:
    """The secrets the daemon needs that the environment does not hold.

    Args:
        settings: The settings.
        path: The config file, named in each line.
        environ: The environment (``os.environ`` by default).

    Returns:
        One line per missing variable, naming the key that refers to it.
    """
    environ = os.environ if environ is None else environ
    lines: list[str] = []
    seen: set[str] = set()
    for key_path, name, required in settings._secret_references():
        if required and not environ.get(name) and name not in seen:
            seen.add(name)
            lines.append(f"{path}: {key_path}: the environment variable {name} is not set or "
                         f"empty (got {name!r}; allowed: the name of a variable set in the "
                         "daemon's environment, such as in /etc/trading-agent/env)")
    return lines


def _describe_toml_error(exc: tomllib.TOMLDecodeError, text: str) -> str:
    message = str(exc)
    if message.endswith("(at end of document)"):
        return _describe_unclosed(message.removesuffix("(at end of document)").strip(), text)
    found = re.search(r"\(at line (\d+), column (\d+)\)", message)
    if found is None:
        return f"invalid TOML: {message}"
    reason = message[:found.start()].strip()
    line = int(found.group(1))
    lines = text.splitlines()
    shown = f" (the line: {lines[line - 1].strip()!r})" if 0 < line <= len(lines) else ""
    return f"line {line}, column {found.group(2)}: invalid TOML: {reason}{shown}"


def _describe_unclosed(reason: str, text: str) -> str:
    """An error at the end of the file: a string, array, inline table or table header was
    opened and never closed. tomllib reports the end of the file; the line named here is
    the one where that value opens."""
    line = _unclosed_line(text)
    if line is None:
        return f"invalid TOML at the end of the file: {reason}"
    shown = text.splitlines()[line - 1].strip()
    return (f"line {line}: invalid TOML: the string, array or table opened on this line is "
            f"never closed (at the end of the file: {reason}; the line: {shown!r})")


def _unclosed_line(text: str) -> int | None:
    """The line (from 1) where the outermost value still open at the end of ``text`` opens.

    A small scan of TOML's brackets, strings and comments, enough for a file that tomllib
    read without error up to its end.
    """
    opened: list[int] = []  # the lines of the brackets still open, outermost first
    header: int | None = None  # the line of a [table] header still open
    line, index, size = 1, 0, len(text)
    while index < size:
        char = text[index]
        if char == "\n":
            line += 1
        elif char == "#":
            end = text.find("\n", index)
            index = size if end < 0 else end
            continue
        elif char in "\"'":
            quote = char * 3 if text.startswith(char * 3, index) else char
            start_line, index = line, index + len(quote)
            while index < size and not text.startswith(quote, index):
                if text[index] == "\\" and char == '"':
                    index += 1  # an escape: the next character never ends the string
                elif text[index] == "\n":
                    line += 1
                index += 1
            if index >= size:
                return start_line
            # A multi-line string may end in up to two quotes of its own before its closing three.
            for _ in range(2 if len(quote) == 3 else 0):
                if text.startswith(char, index + 3):
                    index += 1
            index += len(quote)
            continue
        elif char == "[" and not opened and header is None and (
                not text[text.rfind("\n", 0, index) + 1:index].strip()):
            header = line
            if text.startswith("[[", index):
                index += 1
        elif char == "]" and header is not None and not opened:
            header = None
        elif char in "[{":
            opened.append(line)
        elif char in "]}" and opened:
            opened.pop()
        index += 1
    if opened:
        return opened[0]
    return header


def _environment_data() -> dict[str, Any]:
    """What the environment variables set, nested like the file (for naming error sources)."""
    try:
        return EnvSettingsSource(Settings)()
    except SettingsError:
        return {}


class _ErrorReport:
    """Turns pydantic's errors into one line each, naming the file (or variable) and key."""

    def __init__(self, path: Path, file_data: dict[str, Any], env_data: dict[str, Any]) -> None:
        self.path = path
        self.file_data = file_data
        self.env_data = env_data
        self.raw = _deep_merge(file_data, env_data)

    def lines(self, exc: ValidationError) -> list[str]:
        found: list[tuple[list[str | int], str]] = []
        for error in exc.errors(include_url=False):
            keys, line = self._line(error)
            if (keys, line) not in found:
                found.append((keys, line))
        # A desk's copy of a problem in the top-level [model] or [exchange] it inherits is
        # the same problem: it is reported once, at the top level.
        top_level = {(tuple(keys), line.split(": ", 2)[-1]) for keys, line in found}
        lines: list[str] = []
        for keys, line in found:
            if (len(keys) >= 3 and keys[0] == "desks" and keys[2] in ("model", "exchange")
                    and (tuple(keys[2:]), line.split(": ", 2)[-1]) in top_level):
                continue
            lines.append(line)
        return lines

    def _line(self, error: Any) -> tuple[list[str | int], str]:
        keys, parent, annotation = _walk(tuple(error["loc"]))
        keys = self._inherited_from(keys)
        kind = error["type"]
        message = str(error["msg"]).removeprefix("Value error, ")
        value = error.get("input")
        details: list[str] = []
        if kind in ("union_tag_not_found", "union_tag_invalid"):
            keys = [*keys, "provider"]
            tags = _union_tags(annotation)
            message = ("missing the key that picks the kind" if kind == "union_tag_not_found"
                       else "unknown kind")
            value = error.get("ctx", {}).get("tag") if kind == "union_tag_invalid" else None
            if value is not None:
                details.append(f"got {_show(value, keys)}")
            details.append("allowed: " + ", ".join(repr(tag) for tag in tags))
        elif kind == "missing" and len(keys) == 3 and keys[0] == "desks" and keys[2] == "model":
            message = (f"no model: add a top-level [model] table or a [desks.{keys[1]}.model] "
                       "table")
            details.append("allowed: " + _describe(annotation, parent, keys))
        elif isinstance(value, _WrongType):
            message = value.reason
            details.append(f"got {_show(value.value, keys)}")
            if annotation is not None:
                details.append("allowed: " + _describe(annotation, parent, keys))
        elif kind == "missing":
            message = "required key is missing"
            details.append("allowed: " + _describe(annotation, parent, keys))
        elif kind == "extra_forbidden":
            message = "unknown key"
            details.append(f"got {_show(value, keys)}")
            fields = sorted(parent.model_fields) if parent is not None else []
            close = difflib.get_close_matches(str(keys[-1]), fields, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            if _SECRET_KEY.search(str(keys[-1])):
                hint += ("secrets never go in the file: name the environment variable that "
                         "holds it (such as api_key_env). ")
            details.append(f"{hint}allowed keys: {', '.join(fields)}")
        else:
            shown = _show(value, keys)
            if not isinstance(value, Mapping | BaseModel) and shown not in message:
                details.append(f"got {shown}")
            if kind != "value_error" and annotation is not None:
                details.append("allowed: " + _describe(annotation, parent, keys))
        place = self._source(keys)
        where = _format_path(keys) or "(top level)"
        suffix = f" ({'; '.join(details)})" if details else ""
        return keys, f"{place}: {where}: {message}{suffix}"

    def _inherited_from(self, keys: list[str | int]) -> list[str | int]:
        """A desk's error about a key it inherited is reported at the top-level key."""
        if len(keys) < 4 or keys[0] != "desks" or keys[2] not in ("model", "exchange"):
            return keys
        desk = self.raw.get("desks", {}).get(keys[1], {})
        section = keys[2]
        own = desk.get(section) if isinstance(desk, Mapping) else None
        if section == "model" and not _inherits_model(self.raw.get("model"), own):
            return keys
        if _has_path(own, keys[3:]):
            return keys
        if _has_path(self.raw.get(section), keys[3:]) or (
                section == "model" and isinstance(self.raw.get("model"), Mapping)):
            return [section, *keys[3:]]
        return keys

    def _source(self, keys: list[str | int]) -> str:
        """The file, or the environment variable that set the value."""
        if not keys:
            return str(self.path)
        node: Any = self.env_data
        names: list[str] = []
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                return str(self.path)
            names.append(str(key))
            node = node[key]
            if not isinstance(node, Mapping):
                break
        variable = ENV_PREFIX + "__".join(names).upper()
        return f"environment variable {variable}"


def _has_path(node: Any, keys: Sequence[str | int]) -> bool:
    for key in keys:
        found = (key in node if isinstance(node, Mapping) else
                 isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node))
        if not found:
            return False
        node = node[key]
    return True


def _unwrap(annotation: Any) -> Any:
    """Drops ``Annotated`` and ``None`` from an annotation."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _unwrap(members[0])
    return annotation


def _union_members(annotation: Any) -> list[type[BaseModel]]:
    annotation = _unwrap(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [a for a in typing.get_args(annotation)
                if isinstance(a, type) and issubclass(a, BaseModel)]
    return []


def _union_tags(annotation: Any) -> list[str]:
    tags: list[str] = []
    for member in _union_members(annotation):
        field = member.model_fields.get("provider")
        if field is not None:
            tags.extend(typing.get_args(field.annotation))
    return tags


def _walk(loc: tuple[Any, ...]) -> tuple[list[str | int], type[BaseModel] | None, Any]:
    """Follows an error's location through the schema.

    Returns:
        The key path as a user writes it (discriminator tags dropped), the model holding the
        last key, and the annotation of the last key (None when unknown).
    """
    keys: list[str | int] = []
    parent: type[BaseModel] | None = None
    annotation: Any = Settings
    field: FieldInfo | None = None
    for part in loc:
        current = _unwrap(annotation)
        members = _union_members(current)
        if members and isinstance(part, str) and part in _union_tags(current):
            for member in members:
                if part in typing.get_args(member.model_fields["provider"].annotation):
                    annotation = member
            continue
        if part == "[key]":  # the error is about a table's key itself, not its value
            annotation = None
            continue
        keys.append(part)
        if isinstance(current, type) and issubclass(current, BaseModel):
            parent = current
            field = current.model_fields.get(str(part))
            annotation = field.annotation if field is not None else None
            if field is not None and field.metadata:
                annotation = Annotated[(annotation, *field.metadata)]
        elif typing.get_origin(current) is dict:
            parent, annotation = None, typing.get_args(current)[1]
        elif typing.get_origin(current) in (list, tuple):
            parent, annotation = None, typing.get_args(current)[0]
        else:
            parent, annotation = None, None
    return keys, parent, annotation


def _format_path(keys: Sequence[str | int]) -> str:
    text = ""
    for key in keys:
        if isinstance(key, int):
            text += f"[{key}]"
        elif re.fullmatch(r"[A-Za-z0-9_-]+", key):
            text += f".{key}" if text else key
        else:
            quoted = '"' + key.replace('"', '\\"') + '"'
            text += f".{quoted}" if text else quoted
    return text


def _show(value: Any, keys: Sequence[str | int]) -> str:
    """A value for an error line: short, and hidden when its key looks like a secret."""
    if keys and _SECRET_KEY.search(str(keys[-1])):
        return "<hidden>"
    # A URL's password (postgresql://user:secret@host) is a secret whatever its key's name.
    text = _URL_PASSWORD.sub(r"\1:<hidden>@", _toml_repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


_URL_PASSWORD = re.compile(r"(://[^/@:\s]*):[^/@\s]*@")


def _constraints(metadata: Sequence[Any]) -> str:
    parts: list[str] = []
    for item in metadata:
        if isinstance(item, Gt):
            parts.append(f"> {_bound(item.gt)}")
        elif isinstance(item, Ge):
            parts.append(f">= {_bound(item.ge)}")
        elif isinstance(item, Lt):
            parts.append(f"< {_bound(item.lt)}")
        elif isinstance(item, Le):
            parts.append(f"<= {_bound(item.le)}")
        elif isinstance(item, MinLen) and item.min_length > 1:
            parts.append(f"at least {item.min_length} long")
        elif isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length} long")
    return " " + ", ".join(parts) if parts else ""


def _bound(value: Any) -> str:
    """A bound as a config file writes it: ``3600``, not ``3600.0`` (pydantic shares one
    constraint object between equal bounds, so whether it holds an int or a float depends
    on which model was defined first)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _describe(annotation: Any, parent: type[BaseModel] | None = None,
              keys: Sequence[str | int] = ()) -> str:
    """What a key accepts, in the words of a config file."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is Annotated:
        args = typing.get_args(annotation)
        annotation, metadata = args[0], [*metadata, *args[1:]]
    bounds = _constraints(metadata)
    article = "a non-empty" if any(isinstance(m, MinLen) and m.min_length == 1
                                   for m in metadata) else "a"
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(members) < len(typing.get_args(annotation))
        tags = _union_tags(annotation)
        if tags:
            text = "a table with provider = " + " or ".join(repr(t) for t in tags)
        else:
            text = " or ".join(_describe(m) for m in members) + bounds
        return text + (", or leave the key out" if optional else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list or origin is tuple:
        return f"{article} list{bounds}, each {_describe(typing.get_args(annotation)[0])}"
    if origin is dict:
        return f"{article} table{bounds}, each value {_describe(typing.get_args(annotation)[1])}"
    if annotation is str:
        return f"{article} string{bounds}"
    simple = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        Decimal: "a number (a string such as \"0.001\" keeps it exact)",
        str: "a string",
        Path: "a file path",
        datetime: "a date and time such as 2024-05-01T00:00:00Z",
    }
    if annotation in simple:
        return simple[annotation] + bounds
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a table with keys " + ", ".join(annotation.model_fields)
    return "a value of the right kind"
