"""The settings of a fleet: where the shared state lives and how the daemons meet.

Two tables of the config file, embedded by :class:`~trading_agent.settings.Settings`::

    [store]
    url = "postgresql://trading@db.internal:5432/trading"   # none: SQLite in the state dir
    password_env = "TRADING_AGENT_DB_PASSWORD"

    [fleet]
    nats_url = "nats://trading@nats.internal:4222"   # the user, if NATS asks for one
    nats_password_env = "TRADING_AGENT_NATS_PASSWORD"   # or nats_token_env, or neither
    daemon_id = "host-a"            # default: the host name and the process id
    lease_seconds = 15              # a dead daemon's desks move within about this

Every daemon of a fleet reads the same file. A store on PostgreSQL makes the daemon one of a
fleet: each desk is run by the one daemon that holds its lease, and the daemons reach each
other's desks through NATS, so ``fleet.nats_url`` is required with ``store.url``. Without
``[store] url`` the daemon is alone: SQLite in its state directory, and ``[fleet]`` is an
error (the desks' state could not be shared).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["FleetSettings", "NatsSignIn", "StoreSettings", "default_daemon_id"]

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
    """

    url: str
    user: str | None = None
    password: str | None = None
    token: str | None = None


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
    """

    model_config = ConfigDict(extra="forbid")

    nats_url: str | None = None
    daemon_id: str | None = None
    lease_seconds: float = Field(default=15.0, ge=1.0, le=600.0)
    nats_prefix: str = Field(default="trading_agent", pattern=r"^[A-Za-z0-9_-]{1,32}$")
    nats_password_env: str | None = Field(default=None, min_length=1)
    nats_token_env: str | None = Field(default=None, min_length=1)

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
        return self

    def nats_sign_in(self, environ: Mapping[str, str]) -> NatsSignIn:
        """How this daemon signs in to NATS, the secret read from the environment now."""
        servers, user = [], None
        for server in (self.nats_url or "").split(","):
            if server.strip():
                parts = urlsplit(server.strip())
                user = parts.username or user
                servers.append(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])))
        url = ",".join(servers)
        if self.nats_password_env:
            return NatsSignIn(url, user=user, password=environ.get(self.nats_password_env, ""))
        if self.nats_token_env:
            return NatsSignIn(url, token=environ.get(self.nats_token_env, ""))
        return NatsSignIn(url)

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
