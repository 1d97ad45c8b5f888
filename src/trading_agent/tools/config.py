"""The tools' settings: what the daemon's config names and embeds, without the tools.

Kept apart from the tools themselves, so that reading the settings imports no agent loop,
no MCP client and no exchange: the names of the trading tools and of ``delegate``, a desk's
subagent settings and its MCP servers.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "DEFAULT_SUBAGENT_PROMPT",
    "DELEGATE_TOOL_NAME",
    "TRADING_TOOL_NAMES",
    "McpServerConfig",
    "SubagentConfig",
]

TRADING_TOOL_NAMES = (
    "get_ticker", "get_order_book", "get_candles", "render_chart", "get_balance",
    "get_positions", "place_order", "cancel_order", "get_order", "list_open_orders",
    "set_protection", "get_trade_record",
)
"""The tools :func:`~trading_agent.tools.trading_tools.register_trading_tools` registers
(``remember`` and ``recall`` besides, when a memory is given; ``get_trade_record`` when the
desk's books are; ``set_protection`` when its protection keeper is)."""

DELEGATE_TOOL_NAME = "delegate"
"""The name the model calls the ``delegate`` tool by."""

DEFAULT_SUBAGENT_PROMPT = (
    "You are a research assistant working for the trading desk {desk}. The desk gave you one "
    "task. Do it with your tools, on your own: nobody will answer questions, and you see none "
    "of the desk's conversation. Be economical with tool calls. End with a concise, "
    "self-contained report of your findings, with the figures that support them; that final "
    "answer is all the desk will read."
)
"""The subagent's system prompt by default; ``{desk}`` is replaced by the desk's name."""

_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")


class SubagentConfig(BaseModel):
    """A desk's subagent settings (``[desks.<name>.subagents]`` in the config).

    Attributes:
        enabled: Whether the desk gets the ``delegate`` tool at all.
        max_concurrent: The most subagents one desk runs at once; more calls wait for a slot.
        maximum_rounds: The most model calls one subagent may make.
        timeout_seconds: The wall-clock limit of one subagent's run (and, separately, of its
            wait for a free slot).
        allow_place_order: Whether a subagent may be given ``place_order`` and other tools
            marked dangerous; their calls still pass the desk's approval gate.
        system_prompt: The subagent's system prompt; ``{desk}`` is replaced by the desk's name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    max_concurrent: int = Field(default=2, ge=1, le=32)
    maximum_rounds: int = Field(default=8, ge=1, le=1000)
    timeout_seconds: float = Field(default=180.0, gt=0, le=86_400, allow_inf_nan=False)
    allow_place_order: bool = False
    system_prompt: str = Field(default=DEFAULT_SUBAGENT_PROMPT, min_length=1)


class McpServerConfig(BaseModel):
    """One MCP server of a desk (``[[desks.<name>.mcp_servers]]``).

    Attributes:
        name: Prefixes its tools' names (``news`` gives ``news__search``): lowercase letters,
            digits and ``_``.
        command: The stdio server to start: the program and its arguments.
        url: The streamable HTTP endpoint (``https://host/mcp``). Exactly one of ``command``
            and ``url``.
        env: Names of environment variables handed to a stdio server (it gets only these and
            a few basics such as ``PATH`` and ``HOME``).
        headers_env: HTTP header name -> the environment variable holding its value (a
            token); read when connecting, never logged.
        timeout: Seconds one call may take before it is abandoned.
        connect_timeout: Seconds starting or reaching the server may take.
        tools: The server's tools the desk gets (their names on the server); None for all.
        max_result_chars: A result's text is cut to this many characters.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=32, pattern=r"^[a-z0-9_]+$")
    command: list[str] | None = Field(default=None, min_length=1)
    url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    env: list[str] = Field(default_factory=list)
    headers_env: dict[str, str] = Field(default_factory=dict)
    timeout: float = Field(default=30.0, gt=0, le=3600)
    connect_timeout: float = Field(default=15.0, gt=0, le=600)
    tools: list[str] | None = None
    max_result_chars: int = Field(default=20_000, ge=1_000)

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (a stdio server) and url (a "
                             "streamable HTTP server)")
        if self.command is not None and not self.command[0]:
            raise ValueError("command: the program's name is empty")
        if self.headers_env and self.url is None:
            raise ValueError("headers_env is for an HTTP server (url); a stdio server gets "
                             "variables through env")
        if self.env and self.command is None:
            raise ValueError("env is for a stdio server (command); an HTTP server gets "
                             "secrets through headers_env")
        names = [*self.env, *self.headers_env.values()]
        bad = [n for n in names if not _VARIABLE.fullmatch(n)]
        if bad:
            raise ValueError(f"not an environment variable name: {', '.join(map(repr, bad))}")
        headers = [h for h in self.headers_env if not _HEADER.fullmatch(h)]
        if headers:
            raise ValueError(f"not an HTTP header name: {', '.join(map(repr, headers))}")
        return self

    @property
    def transport(self) -> Literal["stdio", "http"]:
        """``stdio`` or ``http``."""
        return "stdio" if self.command is not None else "http"
