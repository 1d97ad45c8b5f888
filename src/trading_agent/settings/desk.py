"""One desk (``[desks.<name>]``), its images and its controls."""

from __future__ import annotations

from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import Field, ValidationInfo, field_validator, model_validator

from trading_agent.errors import ConfigError
from trading_agent.plugins import HOOK_GROUP, find_factory
from trading_agent.settings.context import ContextSettings
from trading_agent.settings.daemon import SpendCaps
from trading_agent.settings.model import ModelSettings, priced
from trading_agent.settings.table import Table
from trading_agent.settings.triggers import TriggerSettings
from trading_agent.tools.config import (
    DELEGATE_TOOL_NAME,
    TRADING_TOOL_NAMES,
    McpServerConfig,
    SubagentConfig,
)
from trading_agent.trading.config import ExchangeConfig, ProtectionsConfig, RiskLimits

__all__ = ["DESK_TOOL_NAMES", "MAX_PINNED_CHARS", "ControlSettings", "DeskSettings",
           "ImageSettings"]

MAX_PINNED_CHARS = 4000
"""The longest pinned instruction (the daemon's ``daemon.pins.MAX_PIN_CHARS``, which the
runtime cannot import from the settings)."""

DESK_TOOL_NAMES: tuple[str, ...] = (*TRADING_TOOL_NAMES, "remember", "recall",
                                    DELEGATE_TOOL_NAME)
"""Every tool a desk can be given, what ``desks.<name>.tools`` may list (the daemon's wiring
registers exactly these: the trading tools, the memory tools and ``delegate``)."""


class ControlSettings(SpendCaps):
    """How a desk is held back (``[desks.<name>.controls]``).

    Attributes:
        when_paused: What happens to a trigger (a tick, a schedule) that comes while the
            desk is paused: ``wait`` (queued, ticks coalesced, run on resume) or ``drop``.
            An operator's message always waits.
        halt_after_failed_turns: The kill switch goes on by itself for the desk after this
            many failed turns in a row; 0 never.
        on_cap: What a spend cap used up (the desk's or the daemon's) does to the desk:
            ``pause`` it until 00:00 UTC, switch it to ``fallback`` (its
            ``fallback_model``) for the rest of the day, or put it in ``reduce_only`` until
            00:00 UTC (it keeps thinking, and may only shrink its positions).
        fallback_model: The model name the desk switches to with ``on_cap = "fallback"``
            (same provider and server as its own model).
    """

    when_paused: Literal["wait", "drop"] = "wait"
    halt_after_failed_turns: int = Field(default=5, ge=0, le=1000)
    on_cap: Literal["pause", "fallback", "reduce_only"] = "pause"
    fallback_model: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _fallback_named(self) -> ControlSettings:
        if self.on_cap == "fallback" and self.fallback_model is None:
            raise ValueError('on_cap = "fallback" needs fallback_model (the model name to '
                             "switch to); or set on_cap to \"pause\" or \"reduce_only\"")
        return self


class ImageSettings(Table):
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


class DeskSettings(Table):
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
        protections: The rules that put it in reduce-only for a while when it loses or
            flails (:mod:`trading_agent.trading.protections`).
        pinned: Standing instructions sent verbatim at the end of its system prompt in
            every request, before those operators pin while it runs (a backtest's way to
            run with pins; see :mod:`trading_agent.daemon.pins`).
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
    protections: ProtectionsConfig = Field(default_factory=ProtectionsConfig)
    pinned: list[str] = Field(default_factory=list)

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

    @field_validator("pinned")
    @classmethod
    def _check_pinned(cls, value: list[str]) -> list[str]:
        for index, text in enumerate(value):
            if not text.strip():
                raise ValueError(f"[{index}] is empty: each pinned instruction needs text")
            if len(text.strip()) > MAX_PINNED_CHARS:
                raise ValueError(f"[{index}] is {len(text.strip()):,} characters; a pinned "
                                 f"instruction may be at most {MAX_PINNED_CHARS:,}")
        return [text.strip() for text in value]

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
                value.check_window(model.context_window)
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
        if self.controls.max_cost_per_day is not None and not priced(self.model):
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
