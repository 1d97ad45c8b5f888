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

The settings are data: no class here builds a runtime object, and importing them imports no
agent loop, tool or backend (a test holds it). The modules: ``root`` (:class:`Settings`, the
whole file), ``daemon``, ``desk``, ``context``, ``triggers`` and ``model`` (the tables of
their parts; the fleet's, the operator API's, telemetry's, the exchange's, the backends' and
the tools' own tables live beside those parts, in their ``config`` modules), ``defaults``
(what a desk inherits), ``loading`` (the file and the environment), ``toml_types`` (the file
held to its types) and ``report`` (the error lines).

The file is held to its TOML types: an integer key takes an integer (not ``true``, not
``3.0``, not ``"3"``), a boolean key ``true`` or ``false`` (not ``"no"``, not ``0``), a number
key a finite number; pydantic alone would convert them. An environment variable is text, so
there ``"5"`` and ``"false"`` still spell the number and the boolean. Sizes and durations have
upper bounds (a context window at most :data:`~trading_agent.backends.config.MAX_CONTEXT_WINDOW`).
"""

from __future__ import annotations

from trading_agent.settings.context import ContextSettings
from trading_agent.settings.daemon import MAX_SHUTDOWN_TIMEOUT_SECONDS, DaemonSettings, SpendCaps
from trading_agent.settings.desk import (
    DESK_TOOL_NAMES,
    ControlSettings,
    DeskSettings,
    ImageSettings,
)
from trading_agent.settings.loading import load_settings, missing_secrets
from trading_agent.settings.model import ModelSettings
from trading_agent.settings.root import ENV_PREFIX, Settings
from trading_agent.settings.triggers import ScheduleSettings, TickTriggerSettings, TriggerSettings

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
