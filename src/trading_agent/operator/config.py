"""The operator API's settings: where it listens, who may talk to it, how approvals behave.

The settings file embeds :class:`OperatorConfig` (``[operator]``). The bearer token for a TCP
listener is never a field: only the *name* of the environment variable that holds it is, so
no config file, repr or log line can carry the secret.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DEFAULT_TOKEN_ENV",
    "ROLES",
    "SOCKET_NAME",
    "OperatorConfig",
    "OperatorEntry",
    "Role",
    "format_tcp_address",
    "parse_tcp_address",
]

DEFAULT_TOKEN_ENV = "TRADING_AGENT_OPERATOR_TOKEN"
"""The environment variable that holds the TCP listener's bearer token, unless configured."""

SOCKET_NAME = "operator.sock"
"""The Unix socket's file name in the state directory."""

Role = Literal["viewer", "trader", "owner"]
"""What an operator may do: a viewer watches, a trader also steers and decides, an owner
also holds the kill switch, flattening, reloading and the spend caps."""

ROLES: tuple[Role, ...] = ("viewer", "trader", "owner")
"""The roles, each allowed everything the ones before it are."""

_NAME_PATTERN = r"^[\w .@+-]+$"


def _check_env_name(value: str) -> str:
    if not value.strip() or "=" in value:
        raise ValueError("token_env must name an environment variable")
    return value


class OperatorEntry(BaseModel):
    """One operator (``[[operator.operators]]``): a name, a role and where the token is.

    Attributes:
        name: How the records (approvals, pauses, the kill switch, the audit) name this
            operator; letters, digits, spaces and ``.@+-``.
        role: ``viewer``, ``trader`` or ``owner`` (see :data:`ROLES`).
        token_env: The environment variable holding this operator's API token (at least
            16 characters); the token itself is never in a file, a log line or an error.
        telegram_user_id: The operator's Telegram user id, for the chat adapter.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=_NAME_PATTERN)
    role: Role
    token_env: str = Field(min_length=1)
    telegram_user_id: int | None = Field(default=None, gt=0)

    @field_validator("token_env")
    @classmethod
    def _check_token_env(cls, value: str) -> str:
        return _check_env_name(value)


def parse_tcp_address(address: str) -> tuple[str, int]:
    """Splits ``host:port`` (``[::1]:8765`` for IPv6).

    Args:
        address: The address, as configured.

    Returns:
        The host and the port (0 lets the system pick one).

    Raises:
        ValueError: Not ``host:port`` with an IP address and a port in 0..65535.
    """
    host, separator, port_text = address.rpartition(":")
    if not separator or not host or not port_text.isdigit():
        raise ValueError(f"{address!r} is not host:port (such as 127.0.0.1:8765)")
    host = host.removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{address!r}: the host must be an IP address such as 127.0.0.1, "
                         "so the listener never depends on a name lookup") from None
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{address!r}: the port must be in 0..65535")
    return host, port


def format_tcp_address(host: str, port: int) -> str:
    """The inverse of :func:`parse_tcp_address`: ``host:port``, ``[::1]:port`` for IPv6.

    Args:
        host: An IP address.
        port: The port.

    Returns:
        The address as it is configured.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class OperatorConfig(BaseModel):
    """How the daemon serves its operators.

    Attributes:
        socket_path: The Unix socket (mode 0600); None means ``<state_dir>/operator.sock``.
        tcp_address: Also listen on this ``host:port`` (such as ``127.0.0.1:8765``), for the
            web page from another machine or a browser; every request there needs the bearer
            token. None: Unix socket only.
        token_env: The environment variable holding the TCP listener's bearer token. The
            daemon refuses to open the TCP listener when it is unset or empty, unless
            ``generate_token`` is set.
        generate_token: When ``token_env`` is unset or empty, make a token at start
            (:func:`secrets.token_urlsafe`) instead of refusing; it lives as long as the
            daemon runs and is shown once, in the banner on the terminal that started it
            (the web page's address), never in a log line. Only for a loopback
            ``tcp_address`` (127.0.0.0/8, ::1): a token printed on a terminal must not open a
            port other machines reach. For the demo (``make run``).
        tcp_port_tries: How many ports to try, from ``tcp_address``'s port upwards, when
            that one is taken (another daemon, another program); 1: that port or a
            :class:`~trading_agent.errors.ConfigError`. The banner names the port in use.
        approval_timeout_seconds: How long a dangerous tool call waits for an operator's
            decision; no answer in time means deny.
        approval_notional_threshold: Any order above this notional (quote currency) waits for
            approval, paper desks included; None: only live orders wait. It also bounds a
            desk's unapproved orders per rolling hour: an order waits when it plus those that
            passed without approval in the hour before would exceed it (no splitting). Sells
            are valued at the higher of their limit price and the last price.
        max_message_chars: The longest message an operator may send to a desk.
        max_image_bytes: The largest picture an operator may send with a message (as
            uploaded; the desk then sizes it to its model's limits).
        event_buffer_size: How many recent events (text deltas included) the API keeps in
            memory for streams that reconnect; older ones come from the store.
        equity_sample_seconds: How often each desk's equity is sampled for the web page's
            chart.
        operators: The named operators (``[[operator.operators]]``), each with a role and
            a token of its own. The single token of ``token_env`` (or ``generate_token``)
            still opens the API too, as an owner named ``owner``. Names, token variables
            and Telegram ids are each unique.
        tls_cert_file: The TCP listener's certificate (PEM, the chain after it); with
            ``tls_key_file`` the listener speaks HTTPS only.
        tls_key_file: The certificate's private key (PEM).
        allow_plaintext: Let a ``tcp_address`` other machines can reach speak plain HTTP
            (tokens and everything else in the clear, e.g. behind a TLS-terminating proxy
            on the same host). Without it, such an address needs the TLS files.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    socket_path: Path | None = None
    tcp_address: str | None = None
    token_env: str = Field(default=DEFAULT_TOKEN_ENV, min_length=1)
    generate_token: bool = False
    tcp_port_tries: int = Field(default=1, ge=1, le=100)
    approval_timeout_seconds: float = Field(default=300.0, gt=0, le=7 * 86400)
    approval_notional_threshold: float | None = Field(default=None, ge=0)
    max_message_chars: int = Field(default=8000, ge=1, le=1_000_000)
    max_image_bytes: int = Field(default=10_000_000, ge=1024, le=50_000_000)
    event_buffer_size: int = Field(default=20_000, ge=100, le=10_000_000)
    equity_sample_seconds: float = Field(default=60.0, gt=0, le=86400)
    operators: tuple[OperatorEntry, ...] = ()
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    allow_plaintext: bool = False

    @field_validator("operators")
    @classmethod
    def _check_operators_unique(
            cls, value: tuple[OperatorEntry, ...]) -> tuple[OperatorEntry, ...]:
        for key in ("name", "token_env", "telegram_user_id"):
            first: dict[object, int] = {}
            for index, entry in enumerate(value):
                given = getattr(entry, key)
                if given is None:
                    continue
                if given in first:
                    raise ValueError(
                        f"operators[{index}].{key} {given!r} is also operators[{first[given]}]"
                        f"'s; allowed: a {key} of its own for each operator")
                first[given] = index
        return value

    @field_validator("tcp_address")
    @classmethod
    def _check_tcp_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_tcp_address(value)
        return value

    @field_validator("token_env")
    @classmethod
    def _check_token_env(cls, value: str) -> str:
        return _check_env_name(value)

    @model_validator(mode="after")
    def _check_generate_token(self) -> OperatorConfig:
        if self.generate_token and not self.tcp_is_loopback:
            raise ValueError(
                "generate_token needs a loopback tcp_address such as 127.0.0.1:8765 (got "
                f"{self.tcp_address!r}): a token made at start is printed on the terminal, "
                f"so it may only open a port this machine alone reaches; elsewhere set "
                f"{self.token_env} (token_env) in the daemon's environment")
        return self

    @model_validator(mode="after")
    def _check_tls(self) -> OperatorConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            given, missing = (("tls_cert_file", "tls_key_file") if self.tls_key_file is None
                              else ("tls_key_file", "tls_cert_file"))
            raise ValueError(f"{given} is set but {missing} is not; allowed: both (the "
                             "certificate and its key, PEM files) or neither")
        if (self.tcp_address is not None and not self.tcp_is_loopback
                and self.tls_cert_file is None and not self.allow_plaintext):
            raise ValueError(
                f"tcp_address {self.tcp_address!r} is reachable from other machines, and "
                "tokens would cross the network in the clear; allowed: set tls_cert_file "
                "and tls_key_file (HTTPS), or allow_plaintext = true to say so explicitly, "
                "or a loopback address such as 127.0.0.1:8765")
        return self

    @property
    def tls(self) -> bool:
        """Whether the TCP listener speaks HTTPS."""
        return self.tls_cert_file is not None

    @property
    def tcp_is_loopback(self) -> bool:
        """Whether ``tcp_address`` is set and only this machine can reach it."""
        if self.tcp_address is None:
            return False
        host, _ = parse_tcp_address(self.tcp_address)
        return ipaddress.ip_address(host).is_loopback

    def socket_in(self, state_dir: Path) -> Path:
        """The Unix socket's path for a daemon whose state lives in ``state_dir``.

        Args:
            state_dir: The daemon's state directory.

        Returns:
            ``socket_path`` when set, else ``state_dir / "operator.sock"``.
        """
        return self.socket_path if self.socket_path is not None else state_dir / SOCKET_NAME
