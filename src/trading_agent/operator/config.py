"""The operator API's settings: where it listens, who may talk to it, how approvals behave.

The settings file embeds :class:`OperatorConfig` (``[operator]``). The bearer token for a TCP
listener is never a field: only the *name* of the environment variable that holds it is, so
no config file, repr or log line can carry the secret.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "DEFAULT_TOKEN_ENV",
    "SOCKET_NAME",
    "OperatorConfig",
    "format_tcp_address",
    "parse_tcp_address",
]

DEFAULT_TOKEN_ENV = "TRADING_AGENT_OPERATOR_TOKEN"
"""The environment variable that holds the TCP listener's bearer token, unless configured."""

SOCKET_NAME = "operator.sock"
"""The Unix socket's file name in the state directory."""


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

    @field_validator("tcp_address")
    @classmethod
    def _check_tcp_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_tcp_address(value)
        return value

    @field_validator("token_env")
    @classmethod
    def _check_token_env(cls, value: str) -> str:
        if not value.strip() or "=" in value:
            raise ValueError("token_env must name an environment variable")
        return value

    @model_validator(mode="after")
    def _check_generate_token(self) -> OperatorConfig:
        if self.generate_token and not self.tcp_is_loopback:
            raise ValueError(
                "generate_token needs a loopback tcp_address such as 127.0.0.1:8765 (got "
                f"{self.tcp_address!r}): a token made at start is printed on the terminal, "
                f"so it may only open a port this machine alone reaches; elsewhere set "
                f"{self.token_env} (token_env) in the daemon's environment")
        return self

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
