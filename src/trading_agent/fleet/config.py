"""The settings of a fleet: where the shared state lives and how the daemons meet.

Two tables of the config file, embedded by :class:`~trading_agent.settings.Settings`::

    [store]
    url = "postgresql://trading@db.internal:5432/trading"   # none: SQLite in the state dir
    password_env = "TRADING_AGENT_DB_PASSWORD"

    [fleet]
    nats_url = "tls://trading@nats.internal:4222"   # the user NATS signs in
    nats_password_env = "TRADING_AGENT_NATS_PASSWORD"   # or nats_token_env, nats_creds_file
    nats_ca_file = "/etc/trading-agent/nats-ca.pem"     # tls://: the CA that signed NATS
    key_env = "TRADING_AGENT_FLEET_KEY"   # the fleet's shared key (32 bytes or more)
    daemon_id = "host-a"            # default: the host name and the process id
    lease_seconds = 15              # a dead daemon's desks move within about this

Every daemon of a fleet reads the same file. A store on PostgreSQL makes the daemon one of a
fleet: each desk is run by the one daemon that holds its lease, and the daemons reach each
other's desks through NATS, so ``fleet.nats_url`` is required with ``store.url``. Without
``[store] url`` the daemon is alone: SQLite in its state directory, and ``[fleet]`` is an
error (the desks' state could not be shared).

Trust: every message between the daemons is sealed with the fleet's key (``key_env``,
required in a fleet; see :mod:`trading_agent.fleet.sealing`). NATS' own sign-in is the outer
wall: a fleet whose ``nats_url`` signs in with nothing (no password, token, credentials file
or client certificate) is refused unless ``trusted_network = true`` says that whoever can
reach NATS may (the key still guards the desks; sign-in keeps strangers off the server).
"""

from __future__ import annotations

import os
import re
import socket
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["MIN_KEY_BYTES", "FleetSettings", "NatsSignIn", "StoreSettings",
           "default_daemon_id"]

MIN_KEY_BYTES = 32
"""The shortest fleet key accepted: 256 bits, the HMAC's own strength."""

_DAEMON_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")


def default_daemon_id() -> str:
    """The host name and the process id: unique among running daemons, and readable."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


class StoreSettings(BaseModel):
    """Where the daemon keeps its state.

    Attributes:
        url: ``postgresql://USER@HOST:PORT/DB``: the shared store of a fleet. None: the
            embedded SQLite file in the state directory.
        password_env: The environment variable holding the database user's password (none
            with trust or peer authentication).
    """

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    password_env: str | None = Field(default=None, min_length=1)

    @field_validator("url")
    @classmethod
    def _postgresql_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("postgresql", "postgres"):
            raise ValueError("must be a PostgreSQL URL, postgresql://USER@HOST:PORT/DB (leave "
                             "it out for the embedded SQLite file)")
        if parts.password is not None:
            raise ValueError("must not hold a password: put it in an environment variable "
                             "and name that variable in store.password_env")
        if not parts.hostname or not parts.path.strip("/"):
            raise ValueError("needs a host and a database: postgresql://USER@HOST:PORT/DB")
        return url


class NatsSignIn(NamedTuple):
    """How a daemon signs in to NATS.

    Attributes:
        url: The servers, comma-separated, without a user (given beside them).
        user: The user, with ``password``; None for none.
        password: That user's password.
        token: A token, instead of a user.
        credentials_file: A NATS credentials file (a user's JWT and nkey seed).
        tls: The TLS context for ``tls://`` (its CA, and a client certificate when given).
    """

    url: str
    user: str | None = None
    password: str | None = None
    token: str | None = None
    credentials_file: str | None = None
    tls: ssl.SSLContext | None = None


class FleetSettings(BaseModel):
    """How this daemon meets the others of its fleet.

    Attributes:
        nats_url: The NATS server (with JetStream) that carries events, operator messages
            and triggers between the daemons: ``nats://HOST:PORT``.
        daemon_id: This daemon's name in the fleet (the ``DAEMON`` column of ``desks``);
            default: the host name and the process id.
        lease_seconds: How long a desk's lease lasts unless renewed (it is renewed every
            third of it). A daemon that dies keeps its desks this long at most, then another
            takes them over.
        nats_prefix: The prefix of the fleet's NATS subjects and streams, so that several
            fleets can share one NATS server.
        nats_password_env: The environment variable holding the password of the user that
            ``nats_url`` names (``nats://USER@HOST:PORT``).
        nats_token_env: The environment variable holding a NATS token (instead of a user).
        nats_creds_file: A NATS credentials file (a user's JWT and nkey seed, as ``nsc``
            makes them), instead of a password or token.
        nats_ca_file: The CA certificate (PEM) that signed the NATS server's, for
            ``tls://`` URLs; the system's CAs by default.
        nats_cert_file: A client certificate (PEM) for NATS servers that verify clients;
            ``nats_key_file`` with it.
        nats_key_file: That certificate's private key (PEM).
        key_env: The environment variable holding the fleet's shared key, at least 32 bytes
            (``openssl rand -hex 32`` makes one): every message between the daemons is sealed
            with it, and one that is not is refused. Required in a fleet; every daemon of it
            holds the same.
        trusted_network: Whether whoever can reach NATS may sign in to it without a secret;
            false by default, so that a fleet whose ``nats_url`` signs in with nothing is
            refused.
    """

    model_config = ConfigDict(extra="forbid")

    nats_url: str | None = None
    daemon_id: str | None = None
    lease_seconds: float = Field(default=15.0, ge=1.0, le=600.0)
    nats_prefix: str = Field(default="trading_agent", pattern=r"^[A-Za-z0-9_-]{1,32}$")
    nats_password_env: str | None = Field(default=None, min_length=1)
    nats_token_env: str | None = Field(default=None, min_length=1)
    nats_creds_file: Path | None = None
    nats_ca_file: Path | None = None
    nats_cert_file: Path | None = None
    nats_key_file: Path | None = None
    key_env: str | None = Field(default=None, min_length=1)
    trusted_network: bool = False

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        for server in url.split(","):
            parts = urlsplit(server.strip())
            if parts.scheme not in ("nats", "tls") or not parts.hostname:
                raise ValueError("must be a NATS URL, nats://HOST:PORT")
            if parts.password is not None:
                raise ValueError("must not hold a password: put it in an environment "
                                 "variable and name that variable in fleet.nats_password_env")
        return url

    @model_validator(mode="after")
    def _one_way_in(self) -> FleetSettings:
        if self.nats_password_env and self.nats_token_env:
            raise ValueError("give fleet.nats_password_env (a user's password) or "
                             "fleet.nats_token_env (a token), not both")
        users = {urlsplit(server.strip()).username
                 for server in (self.nats_url or "").split(",") if server.strip()}
        if self.nats_password_env and None in users:
            raise ValueError("fleet.nats_password_env needs the user in fleet.nats_url: "
                             "nats://USER@HOST:PORT")
        if users - {None} and not self.nats_password_env:
            raise ValueError("fleet.nats_url names a user but fleet.nats_password_env is not "
                             "set (a name alone would be sent as a token: put a token in an "
                             "environment variable named by fleet.nats_token_env)")
        if self.nats_creds_file and (self.nats_password_env or self.nats_token_env):
            raise ValueError("give fleet.nats_creds_file or a password or token, not both")
        if (self.nats_cert_file is None) != (self.nats_key_file is None):
            raise ValueError("fleet.nats_cert_file and fleet.nats_key_file go together (a "
                             "client certificate and its private key)")
        schemes = {urlsplit(server.strip()).scheme
                   for server in (self.nats_url or "").split(",") if server.strip()}
        if (self.nats_ca_file or self.nats_cert_file) and schemes != {"tls"}:
            raise ValueError("fleet.nats_ca_file and fleet.nats_cert_file need tls:// URLs in "
                             "fleet.nats_url (a nats:// server would be sent them for nothing)")
        return self

    @property
    def signs_in(self) -> bool:
        """Whether the daemon proves who it is to NATS (a password, a token, a credentials
        file or a client certificate)."""
        return bool(self.nats_password_env or self.nats_token_env or self.nats_creds_file
                    or self.nats_cert_file)

    def fleet_key(self, environ: Mapping[str, str]) -> bytes:
        """The fleet's shared key, from the variable ``key_env`` names.

        Raises:
            ValueError: No variable named, or its value is shorter than 32 bytes (the
                message names the variable and the length, never the value).
        """
        if not self.key_env:
            raise ValueError("fleet.key_env is not set")
        key = environ.get(self.key_env, "").encode()
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"fleet.key_env: the environment variable {self.key_env} holds "
                             f"{len(key)} bytes; allowed: at least {MIN_KEY_BYTES} (openssl "
                             f"rand -hex 32 makes one)")
        return key

    def nats_sign_in(self, environ: Mapping[str, str]) -> NatsSignIn:
        """How this daemon signs in to NATS, the secret read from the environment now."""
        servers, user = [], None
        for server in (self.nats_url or "").split(","):
            if server.strip():
                parts = urlsplit(server.strip())
                user = parts.username or user
                servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])))
        url = ",".join(servers)
        tls = self.tls_context() if url.startswith("tls://") else None
        creds = None if self.nats_creds_file is None else str(self.nats_creds_file)
        if self.nats_password_env:
            return NatsSignIn(url, user=user, password=environ.get(self.nats_password_env, ""),
                              tls=tls)
        if self.nats_token_env:
            return NatsSignIn(url, token=environ.get(self.nats_token_env, ""), tls=tls)
        return NatsSignIn(url, credentials_file=creds, tls=tls)

    def tls_context(self) -> ssl.SSLContext:
        """The TLS context of ``tls://`` URLs: it verifies the server (by ``nats_ca_file``,
        else the system's CAs) and its name, and shows the client certificate if one is set.

        Raises:
            ValueError: A certificate file cannot be read, is not PEM, or the key does not
                match (the message names the key and the file).
        """
        try:
            context = ssl.create_default_context(
                cafile=None if self.nats_ca_file is None else str(self.nats_ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"fleet.nats_ca_file: cannot use {self.nats_ca_file} ({exc}); "
                             f"allowed: a readable PEM file of CA certificates") from exc
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.nats_cert_file is not None and self.nats_key_file is not None:
            try:
                context.load_cert_chain(str(self.nats_cert_file), str(self.nats_key_file))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"fleet.nats_cert_file, fleet.nats_key_file: cannot use "
                                 f"{self.nats_cert_file} with {self.nats_key_file} ({exc}); "
                                 f"allowed: a readable PEM certificate and its private key, "
                                 f"unencrypted") from exc
        return context

    @field_validator("daemon_id")
    @classmethod
    def _daemon_id(cls, daemon_id: str | None) -> str | None:
        if daemon_id is not None and not _DAEMON_ID.match(daemon_id):
            raise ValueError("must be 1 to 64 letters, digits, '.', '_', ':' or '-', starting "
                             "with a letter or digit")
        return daemon_id

    def resolved_daemon_id(self) -> str:
        """This daemon's id: the configured one, else the host name and process id."""
        return self.daemon_id or default_daemon_id()
