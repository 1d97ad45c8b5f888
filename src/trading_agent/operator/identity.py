"""Who a credential is and what its role allows: the one place every surface asks.

A credential is a bearer token (the TCP listener; each ``[[operator.operators]]`` holds one,
the single token of ``operator.token_env`` is an owner named ``owner``), the Unix socket
(its mode lets in the machine's own user alone: an owner named after the OS user the kernel
says is at the other end, :func:`peer_operator`), or a stream ticket (:mod:`.tickets`, which
opens the event stream and nothing else). The name recorded for an action is the
credential's (:attr:`Operator.name`), never one a request gives.
"""

from __future__ import annotations

import getpass
import hmac
import os
import pwd
import secrets
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from trading_agent.errors import ConfigError
from trading_agent.operator.config import ROLES, OperatorConfig, Role

__all__ = [
    "LEGACY_OWNER",
    "MIN_TOKEN_CHARS",
    "Credentials",
    "Operator",
    "allows",
    "load_credentials",
    "peer_operator",
    "socket_operator",
]

MIN_TOKEN_CHARS = 16
"""The shortest bearer token accepted."""

LEGACY_OWNER = "owner"
"""The name of the single token of ``operator.token_env`` (or the one made at start)."""


@dataclass(frozen=True)
class Operator:
    """Who is asking, as a credential says.

    Attributes:
        name: The name every record of its actions carries.
        role: ``viewer``, ``trader`` or ``owner``.
        socket: Whether it came through the Unix socket (the machine's own user).
    """

    name: str
    role: Role
    socket: bool = False


def allows(role: Role, needed: Role) -> bool:
    """Whether ``role`` may do what ``needed`` may (each role may all the ones below it).

    Args:
        role: The operator's role.
        needed: The role an action needs.

    Returns:
        True when allowed.
    """
    return ROLES.index(role) >= ROLES.index(needed)


def socket_operator(uid: int | None = None) -> Operator:
    """An owner on the Unix socket, named after an OS user.

    Args:
        uid: The user at the other end of the connection (its peer credentials); the
            daemon's own user when None (the socket's mode lets in no other).

    Returns:
        The owner, named after the user's login name (``uid N`` for a user without an entry
        in the password database, as in some containers).
    """
    if uid is None:
        uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = _login_name() if uid == os.geteuid() else f"uid {uid}"
    return Operator(name, "owner", socket=True)


def peer_operator(sock: socket.socket) -> Operator:
    """The Unix socket's peer as an operator: the OS user the kernel says is connected.

    Reads the connection's peer credentials (``SO_PEERCRED``, Linux); where they cannot be
    read (another system, or the peer gone) the daemon's own user, whom the socket's mode
    0600 leaves as the only one who can connect.

    Args:
        sock: An accepted connection on the Unix socket.

    Returns:
        The owner, named after that user.
    """
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return socket_operator()
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
        uid = int(struct.unpack("3i", credentials)[1])
    except OSError:
        return socket_operator()
    return socket_operator(uid)


def _login_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return LEGACY_OWNER


@dataclass
class Credentials:
    """The bearer tokens the TCP listener takes, each naming an operator.

    Attributes:
        tokens: Each token (bytes) with its operator. Left out of ``repr``.
        generated_token: The legacy token when it was made at start (for the banner alone).
    """

    tokens: list[tuple[bytes, Operator]] = field(default_factory=list, repr=False)
    generated_token: str | None = field(default=None, repr=False)

    def identify(self, given: bytes) -> Operator | None:
        """The operator a token belongs to, or None.

        Every token is compared, each in constant time (:func:`hmac.compare_digest`), so the
        time taken tells nothing about which token came close.

        Args:
            given: The token the request carries.

        Returns:
            Its operator, or None for no match.
        """
        found: Operator | None = None
        for token, operator in self.tokens:
            if hmac.compare_digest(given, token):
                found = operator
        return found


def load_credentials(config: OperatorConfig,
                     environ: Mapping[str, str] | None = None) -> Credentials:
    """The TCP listener's tokens, read from the environment.

    Each ``[[operator.operators]]`` entry's variable must hold a token of at least
    :data:`MIN_TOKEN_CHARS` characters. ``operator.token_env`` is the single token of
    before, an owner named :data:`LEGACY_OWNER`: required when no operator is named (made at
    start with ``generate_token`` when unset), used when set otherwise.

    Args:
        config: The operator settings.
        environ: Where the tokens are (``os.environ`` by default).

    Returns:
        The credentials.

    Raises:
        ConfigError: A token is unset, too short, or the same as another's (the message
            names the keys and variables, never a token).
    """
    env = os.environ if environ is None else environ
    credentials = Credentials()
    keys: list[str] = []
    for index, entry in enumerate(config.operators):
        key = f"operator.operators[{index}].token_env"
        token = _token(env, entry.token_env, key, config, required=True)
        assert token is not None
        credentials.tokens.append((token.encode(), Operator(entry.name, entry.role)))
        keys.append(f"{key} ({entry.token_env})")
    named = {entry.name for entry in config.operators}
    legacy = _token(env, config.token_env, "operator.token_env", config,
                    required=not config.operators and not config.generate_token)
    if legacy is None and not config.operators and config.generate_token:
        legacy = secrets.token_urlsafe(32)
        credentials.generated_token = legacy
    if legacy is not None:
        if LEGACY_OWNER in named:
            raise ConfigError(
                f"operator.token_env ({config.token_env}) holds a token, which opens the API "
                f"as an owner named {LEGACY_OWNER!r}, and an [[operator.operators]] entry has "
                "that name too; allowed: rename that operator, or unset "
                f"{config.token_env} and give every operator a token of its own")
        credentials.tokens.append((legacy.encode(), Operator(LEGACY_OWNER, "owner")))
        keys.append(f"operator.token_env ({config.token_env})")
    for later in range(len(credentials.tokens)):
        for earlier in range(later):
            if hmac.compare_digest(credentials.tokens[later][0], credentials.tokens[earlier][0]):
                raise ConfigError(
                    f"{keys[later]} holds the same token as {keys[earlier]}; allowed: a "
                    "token of its own for each operator, so the records name the right one")
    return credentials


def _token(env: Mapping[str, str], variable: str, key: str, config: OperatorConfig, *,
           required: bool) -> str | None:
    token = env.get(variable, "").strip()
    if not token and not required:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        what = "is not set" if not token else f"is shorter than {MIN_TOKEN_CHARS} characters"
        raise ConfigError(
            f"operator.tcp_address is {config.tcp_address}, but the environment variable "
            f"{variable} ({key}), which must hold a bearer token, {what}. Refusing to open "
            "a TCP listener without it. Make one with: python -c "
            "'import secrets; print(secrets.token_urlsafe(32))'")
    return token
