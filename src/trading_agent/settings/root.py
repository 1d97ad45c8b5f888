"""The whole configuration: :class:`Settings`, the file's tables with the environment over them."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from trading_agent.backends.providers import provider
from trading_agent.fleet.config import FleetSettings, StoreSettings
from trading_agent.operator.config import OperatorConfig
from trading_agent.settings.daemon import DaemonSettings
from trading_agent.settings.defaults import apply_desk_defaults
from trading_agent.settings.desk import DeskSettings
from trading_agent.settings.model import ModelSettings, priced
from trading_agent.telegram.config import TelegramSettings
from trading_agent.telemetry.config import TelemetrySettings, WebhookSettings
from trading_agent.trading.config import ExchangeConfig

__all__ = ["ENV_PREFIX", "Settings", "toml_data"]

ENV_PREFIX = "TRADING_AGENT_"
"""The prefix of every environment variable the settings read."""

_DESK_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


toml_data: ContextVar[dict[str, Any] | None] = ContextVar("toml_data", default=None)
"""The parsed file that :class:`Settings` reads under the environment; set by
:func:`~trading_agent.settings.loading.load_settings` while it validates."""


class _TomlDataSource(PydanticBaseSettingsSource):
    """The TOML file's contents, parsed by
    :func:`~trading_agent.settings.loading.load_settings` (which reports syntax errors
    with the line and column) and handed over through a context variable."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (toml_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(toml_data.get() or {})


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
        telegram: The Telegram bot; None (no ``[telegram]`` table): no bot.
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
    telegram: TelegramSettings | None = None
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
            return apply_desk_defaults(data)
        return data

    @model_validator(mode="after")
    def _daemon_cost_cap_priced(self) -> Settings:
        unpriced = [name for name, desk in self.desks.items() if not priced(desk.model)]
        if self.daemon.spend.max_cost_per_day is not None and unpriced:
            raise ValueError(
                f"daemon.spend.max_cost_per_day needs every desk's model prices; "
                f"{', '.join(unpriced)} has none (set model.price_input_per_million and "
                "model.price_output_per_million), or cap tokens with "
                "daemon.spend.max_tokens_per_day")
        return self

    @model_validator(mode="after")
    def _telegram_desk(self) -> Settings:
        telegram = self.telegram
        if telegram is not None and telegram.default_desk not in self.desks:
            raise ValueError(
                f"telegram.default_desk {telegram.default_desk!r} is not a desk; allowed: "
                f"{', '.join(self.desks)}")
        if telegram is not None and self.in_fleet:
            raise ValueError(
                "telegram: not yet in a fleet (every daemon would poll the one bot, and "
                "Telegram lets one poller per token); leave [telegram] out of a fleet's config")
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
        if self.in_fleet and not self.fleet.key_env:
            raise ValueError(
                "fleet.key_env is required in a fleet: name the environment variable that "
                "holds the fleet's shared key (at least 32 bytes, the same on every daemon; "
                "openssl rand -hex 32 makes one), which seals every message between the "
                "daemons")
        if self.in_fleet and not self.fleet.signs_in and not self.fleet.trusted_network:
            raise ValueError(
                "fleet.nats_url signs in to NATS with nothing, so whoever reaches the server "
                "may use it: set fleet.nats_password_env (with the user in the URL), "
                "fleet.nats_token_env, fleet.nats_creds_file or a client certificate "
                "(fleet.nats_cert_file), or say fleet.trusted_network = true when only the "
                "fleet can reach NATS")
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
        for path, name, _ in self.secret_references():
            found.setdefault(name, path)
        return found

    def secret_references(self) -> Iterator[tuple[str, str, bool]]:
        """Every reference the config makes to a secret in the environment.

        Yields:
            The key path, the variable's name, and whether the daemon cannot run without it.
        """
        # Required on TCP, unless the daemon makes one itself (a loopback demo) or named
        # operators hold tokens of their own.
        operator = self.operator
        yield ("operator.token_env", operator.token_env,
               operator.tcp_address is not None and not operator.generate_token
               and not operator.operators)
        for index, entry in enumerate(operator.operators):
            yield (f"operator.operators[{index}].token_env", entry.token_env,
                   operator.tcp_address is not None)
        if self.telemetry.otlp_headers_env:
            yield ("telemetry.otlp_headers_env", self.telemetry.otlp_headers_env,
                   self.telemetry.otlp_endpoint is not None)
        for index, hook in enumerate(self.webhooks):
            yield f"webhooks[{index}].secret_env", hook.secret_env, True
        if self.telegram is not None:
            yield "telegram.token_env", self.telegram.token_env, True
        if self.store.password_env:
            yield "store.password_env", self.store.password_env, self.store.url is not None
        for key in ("nats_password_env", "nats_token_env", "key_env"):
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
