"""Serving the operator API inside the daemon: a Unix socket, and TCP when configured.

:func:`serve_operator_api` runs in the daemon's task group until cancelled. It binds the
sockets itself (the Unix socket gets mode 0600 before anyone can connect), serves them with
uvicorn without uvicorn's signal handlers (the daemon owns SIGTERM), and on cancellation ends
every open event stream, lets uvicorn close its connections, and removes the socket file.

Every connection goes through :class:`_GuardedH11Protocol`, uvicorn's h11 protocol with
three guards, because a listener anyone on the network can reach must not be able to starve
the daemon:

- a connection that has not sent a request's complete headers within
  :data:`HEADER_TIMEOUT_SECONDS` (of opening, or of its previous answer) gets a 408 and is
  closed: idle half-requests hold no descriptor for long;
- the TCP listener serves at most :func:`tcp_connection_limit` connections at once (a quarter
  of the descriptor limit, at most :data:`MAX_TCP_CONNECTIONS`), accepts in small batches,
  and answers any beyond with a 503: the Unix socket, the store and the exchange keep the
  rest of the descriptors, so a flood of TCP connections cannot take the daemon down;
- ``TCP_NODELAY`` on accepted TCP sockets: without it Nagle's algorithm and delayed ACKs
  held every answer on a reused connection for about 40 ms.

Who may use the Unix socket: its mode (0600) lets in the daemon's user alone, each connection
acts as the OS user its peer credentials name (the name every record of its actions carries,
:func:`~trading_agent.operator.identity.peer_operator`), and with
``refuse_descendants`` (``trading-agent run`` sets it) the peer's process (``SO_PEERCRED``)
is refused with a 403 when the daemon is among its ancestors (its parent chain in
``/proc``): a stdio MCP server, or anything it starts, runs as the same user but must not
act as the operator.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import socket
import stat
import struct
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
import uvicorn
from anyio.abc import TaskStatus
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from trading_agent.daemon.control import DeskControl
from trading_agent.errors import ConfigError
from trading_agent.jsontext import json_bytes
from trading_agent.operator.api import SOCKET_PEER_KEY, OperatorService, create_app
from trading_agent.operator.approvals import Approvals
from trading_agent.operator.audit import AuditLog
from trading_agent.operator.config import OperatorConfig, format_tcp_address, parse_tcp_address
from trading_agent.operator.equity import EquitySamples
from trading_agent.operator.identity import (
    MIN_TOKEN_CHARS,
    Operator,
    load_credentials,
    peer_operator,
)
from trading_agent.operator.metrics import DaemonMetrics
from trading_agent.operator.tickets import TICKET_SECONDS

__all__ = [
    "HEADER_TIMEOUT_SECONDS",
    "MAX_TCP_CONNECTIONS",
    "MIN_TOKEN_CHARS",
    "OperatorEndpoints",
    "read_token",
    "serve_operator_api",
    "tcp_connection_limit",
]

_log = structlog.get_logger(__name__)

_UNIX_PATH_MAX = 107
"""sun_path holds 108 bytes on Linux, the last for the terminating NUL."""

HEADER_TIMEOUT_SECONDS = 10.0
"""How long a connection may take to send a request's complete headers."""

MAX_TCP_CONNECTIONS = 128
"""The most connections the TCP listener serves at once, however high the descriptor limit:
a few browsers (each holds an event stream and a handful of requests) and scripts need far
fewer."""

_TCP_BACKLOG = 16
"""The TCP listener's queue, and how many connections asyncio accepts in one go before any
of them is counted: small, so a burst cannot take descriptors past the limit."""

_UNIX_BACKLOG = 128
"""The Unix socket's queue (only its owner can connect)."""

_MAX_REFUSING = 16
"""Refused connections kept open for a moment so the client reads its 503; beyond this
many at once, the rest are closed at once (each holds a descriptor)."""

_MAX_REFUSED_PEERS_LOGGED = 1000
"""How many distinct refused processes are logged (one line each) before the rest are not."""

_REFUSAL_LINGER_SECONDS = 1.0
"""How long a refused connection stays open for its client to read the 503."""


@dataclass(frozen=True)
class OperatorEndpoints:
    """Where the API listens, as reported to the daemon once it is up.

    Attributes:
        socket_path: The Unix socket.
        tcp: ``(host, port)`` of the TCP listener (the real port when 0 was asked), or None.
        generated_token: The TCP listener's token when it was made at start
            (``generate_token``), for the banner alone; None when it came from the
            environment. Left out of ``repr``.
        token_env: The variable the TCP listener's token is read from (None without TCP).
        tls: Whether the TCP listener speaks HTTPS.
    """

    socket_path: Path
    tcp: tuple[str, int] | None = None
    generated_token: str | None = field(default=None, repr=False)
    token_env: str | None = None
    tls: bool = False

    @property
    def url(self) -> str | None:
        """The web page's base URL on TCP, or None."""
        if self.tcp is None:
            return None
        host, port = self.tcp
        scheme = "https" if self.tls else "http"
        return f"{scheme}://[{host}]:{port}/" if ":" in host else f"{scheme}://{host}:{port}/"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def tcp_connection_limit() -> int:
    """How many connections the TCP listener serves at once.

    Returns:
        A quarter of the process's descriptor limit (``RLIMIT_NOFILE``, ``LimitNOFILE=``
        under systemd), at most :data:`MAX_TCP_CONNECTIONS` and at least 8.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_TCP_CONNECTIONS
    return max(8, min(MAX_TCP_CONNECTIONS, soft // 4))


@dataclass
class _ConnectionLimits:
    """One listener's guards, shared by its connections.

    Attributes:
        header_timeout: Seconds a connection has to send a request's complete headers.
        max_connections: The most connections served at once; None for no limit.
        refusing: Refused connections still open (reading their 503).
        at_limit: Whether the limit was reached (logged once each time it is).
        refuse_descendants: Refuse Unix-socket peers that descend from this process.
        refused_peers: The processes refused so far (each is logged once: a child that
            tries in a loop must not flood the journal).
    """

    header_timeout: float
    max_connections: int | None = None
    refusing: int = 0
    at_limit: bool = False
    refuse_descendants: bool = False
    refused_peers: set[int] = field(default_factory=set)


class _ListenerConfig(uvicorn.Config):
    """uvicorn's settings, carrying the listener's :class:`_ConnectionLimits` to its
    connections (uvicorn hands each connection its config)."""

    def __init__(self, app: Any, limits: _ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, http=_GuardedH11Protocol, **kwargs)
        self.limits = limits


def _error_bytes(status: int, reason: str, code: str, message: str,
                 headers: str = "") -> bytes:
    body = json_bytes({"error": {"status": status, "code": code, "message": message}})
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n{headers}\r\n"
            ).encode("latin-1") + body


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header timeout, the connection limit and
    ``TCP_NODELAY`` (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState,
                 app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, _ListenerConfig)
        self._limits = config.limits
        self._header_timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if (self._limits.refuse_descendants and sock is not None
                and sock.family == socket.AF_UNIX
                and (descendant := _descendant_peer(sock)) is not None):
            self._refuse_descendant(transport, descendant)
            return
        limit = self._limits.max_connections
        if limit is not None and len(self.connections) >= limit:
            self._refuse(transport, limit)
            return
        self._limits.at_limit = False
        super().connection_made(transport)
        if sock is not None and sock.family == socket.AF_UNIX:
            self.app = _WithPeer(self.app, peer_operator(sock))
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self._refused:
            if self._lingering:
                self._lingering = False
                self._limits.refusing -= 1
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # a refused connection's request is read and dropped
            super().data_received(data)

    def on_response_complete(self) -> None:
        # Armed for the request just answered, before a pipelined next one can start.
        self._arm_header_timer()
        super().on_response_complete()

    def _refuse(self, transport: asyncio.Transport, limit: int) -> None:
        if not self._limits.at_limit:
            self._limits.at_limit = True
            _log.warning("operator_api_connection_limit", limit=limit,
                         note="new TCP connections get a 503 until some close")
        self._refused = True
        if self._limits.refusing >= _MAX_REFUSING:
            transport.abort()
            return
        # The 503 and our end closed, then a moment for the client to read it: closing
        # at once, with its request unread, would make the kernel reset the connection.
        self._lingering = True
        self._limits.refusing += 1
        transport.write(_error_bytes(
            503, "Service Unavailable", "too_many_connections",
            f"the operator API is serving {limit} connections, its limit; try again shortly",
            "retry-after: 5\r\n"))
        transport.write_eof()
        self.loop.call_later(_REFUSAL_LINGER_SECONDS, transport.abort)

    def _refuse_descendant(self, transport: asyncio.Transport, peer: int) -> None:
        refused = self._limits.refused_peers
        if peer not in refused and len(refused) < _MAX_REFUSED_PEERS_LOGGED:
            refused.add(peer)
            _log.warning("operator_api_peer_refused", pid=peer,
                         reason="a process started by the daemon (an MCP server, the local "
                                "model, or what they started) may not use the operator socket")
        self._refused = True
        transport.write(_error_bytes(
            403, "Forbidden", "forbidden_peer",
            "the operator socket refuses processes the daemon started (its MCP servers and "
            "what they start)"))
        # Our end closed, then a moment for the client to send its request and read this:
        # closing at once would reset the connection under a request still being written.
        transport.write_eof()
        self.loop.call_later(_REFUSAL_LINGER_SECONDS, transport.abort)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(
            self._limits.header_timeout, self._header_timeout, self.cycle)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self, cycle: object) -> None:
        # A new request (its headers complete) replaces the cycle: then nothing is late.
        self._header_timer = None
        if self.cycle is not cycle or self.transport.is_closing():
            return
        self.transport.write(_error_bytes(
            408, "Request Timeout", "request_timeout",
            f"no complete request headers within {self._limits.header_timeout:g} s"))
        self.transport.close()


class _WithPeer:
    """The app, with each request of one Unix-socket connection carrying its peer."""

    def __init__(self, app: ASGIApp, peer: Operator) -> None:
        self._app = app
        self._peer = peer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SOCKET_PEER_KEY] = self._peer
        await self._app(scope, receive, send)


def _descendant_peer(sock: socket.socket) -> int | None:
    """The peer's pid when this process is among its ancestors (or it cannot be told,
    the peer having gone), else None. Off Linux (no ``SO_PEERCRED``): None."""
    peercred = getattr(socket, "SO_PEERCRED", None)
    if peercred is None:
        return None
    try:
        credentials = sock.getsockopt(socket.SOL_SOCKET, peercred, struct.calcsize("3i"))
        pid = int(struct.unpack("3i", credentials)[0])
    except OSError:
        return None
    if pid <= 0:  # outside our pid namespace: above us, never below
        return None
    ours = os.getpid()
    current = pid
    for _ in range(4096):  # a chain longer than the pid space is a loop
        if current == ours:
            return pid
        if current <= 1:
            return None
        parent = _parent_pid(current)
        if parent is None:
            return pid if current == pid else None  # the peer itself gone: refuse
        current = parent
    return pid


def _parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` from ``/proc/<pid>/stat``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            text = stat_file.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so cut at the last ")".
    fields = text[text.rfind(b")") + 2:].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return None


def read_token(config: OperatorConfig, environ: Mapping[str, str] | None = None) -> str:
    """The single token of ``operator.token_env``, from the environment.

    Args:
        config: The operator settings (``token_env`` names the variable).
        environ: Where to read it (``os.environ`` by default).

    Returns:
        The token.

    Raises:
        ConfigError: It is unset, empty or shorter than :data:`MIN_TOKEN_CHARS`.
    """
    credentials = load_credentials(config.model_copy(update={"operators": (),
                                                             "generate_token": False}),
                                   environ)
    return credentials.tokens[0][0].decode()


def _bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from its creation."""
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        raise ConfigError(f"the operator socket path {path} is longer than {_UNIX_PATH_MAX} "
                          "bytes, the Unix limit: set operator.socket_path to a shorter one")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"{path} exists and is not a socket; move it away or set "
                              "operator.socket_path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left by a daemon that died: stale
        else:
            raise ConfigError(f"another process is listening on {path}: is a daemon already "
                              "running with this state directory?")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # The umask makes the file 0600 at bind time: no window where others could connect.
        previous = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(previous)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_tcp(address: str) -> socket.socket:
    host, port = parse_tcp_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128, reuse_port=False)
    except OSError as exc:
        raise ConfigError(f"cannot listen on operator.tcp_address {address}: {exc}") from exc
    sock.setblocking(False)
    return sock


def _bind_tcp_trying(config: OperatorConfig) -> socket.socket:
    """The TCP listener on ``tcp_address``, or on one of the ``tcp_port_tries - 1`` ports
    after it when that one is in use."""
    assert config.tcp_address is not None
    host, port = parse_tcp_address(config.tcp_address)
    last = min(port + config.tcp_port_tries - 1, 65535) if port else port
    for candidate in range(port, last + 1):
        try:
            return _bind_tcp(format_tcp_address(host, candidate))
        except ConfigError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, OSError) and cause.errno == errno.EADDRINUSE):
                raise
            if candidate == last:
                if last == port:
                    raise
                raise ConfigError(f"cannot listen on operator.tcp_address {config.tcp_address} "
                                  f"nor on the ports after it up to {last} "
                                  f"(operator.tcp_port_tries): all are in use") from cause
    raise AssertionError("unreachable")


def _uvicorn_server(app: object, *, tcp: bool = False, refuse_descendants: bool = False,
                    tls: tuple[Path, Path] | None = None) -> _EmbeddedServer:
    limits = _ConnectionLimits(HEADER_TIMEOUT_SECONDS,
                               tcp_connection_limit() if tcp else None,
                               refuse_descendants=refuse_descendants)
    config = _ListenerConfig(
        app,
        limits,
        backlog=_TCP_BACKLOG if tcp else _UNIX_BACKLOG,
        lifespan="off",
        ws="none",
        log_config=None,
        access_log=False,  # URLs may carry a stream ticket
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=3,
        **({"ssl_certfile": str(tls[0]), "ssl_keyfile": str(tls[1])} if tls else {}),
    )
    if tls is not None:
        try:
            config.load()  # reads the certificate and key now, to name them if they fail
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"operator.tls_cert_file {tls[0]} and operator.tls_key_file {tls[1]}: "
                f"cannot be loaded as a PEM certificate and its key ({exc})") from exc
    return _EmbeddedServer(config)


async def serve_operator_api(
    control: DeskControl,
    approvals: Approvals,
    config: OperatorConfig,
    *,
    state_dir: Path,
    environ: Mapping[str, str] | None = None,
    equity_samples: EquitySamples | None = None,
    audit: AuditLog | None = None,
    refuse_descendants: bool = False,
    ticket_seconds: float = TICKET_SECONDS,
    task_status: TaskStatus[OperatorEndpoints] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serves the operator API until cancelled.

    Start it with ``endpoints = await task_group.start(serve_operator_api, control, book,
    config, state_dir=...)``, before the desks start, so the live stream holds their first
    events (earlier ones come from the store anyway).

    Args:
        control: The running daemon.
        approvals: The approval book the desks' executors use as their gate (in a fleet,
            one that reaches every daemon's).
        config: The operator settings.
        state_dir: The daemon's state directory (the default socket lives there).
        environ: Where the TCP token is read from (``os.environ`` by default).
        equity_samples: Where the equity chart's samples are kept (the daemon's store), so
            the history outlives a restart; in memory when None.
        audit: Where operator actions are recorded (the daemon's store); in memory when
            None.
        refuse_descendants: Refuse the Unix socket to processes this one started, and
            their descendants (``trading-agent run``; off where a test process is both the
            daemon and the parent of the CLI it runs).
        ticket_seconds: How long a stream ticket opens the event stream (a minute; a test
            of the page's renewal makes it seconds).
        task_status: Receives the :class:`OperatorEndpoints` once every listener is up.

    Raises:
        ConfigError: The TCP listener is configured without a token, the address cannot be
            bound, or another daemon holds the socket.
    """
    socket_path = config.socket_in(state_dir)
    credentials = load_credentials(config, environ) if config.tcp_address else None
    service = OperatorService(control, approvals, config, equity_samples=equity_samples,
                              audit=audit, ticket_seconds=ticket_seconds)
    listeners: list[tuple[_EmbeddedServer, socket.socket]] = []
    unix_socket = _bind_unix(socket_path)
    metrics = DaemonMetrics(control, approvals, stream=service.hub)
    try:
        listeners.append((_uvicorn_server(create_app(service, metrics=metrics),
                                          refuse_descendants=refuse_descendants),
                          unix_socket))
        tcp: tuple[str, int] | None = None
        if config.tcp_address is not None:
            assert credentials is not None
            tls = ((config.tls_cert_file, config.tls_key_file)
                   if config.tls_cert_file is not None and config.tls_key_file is not None
                   else None)
            server = _uvicorn_server(create_app(service, credentials=credentials,
                                                metrics=metrics), tcp=True, tls=tls)
            tcp_socket = _bind_tcp_trying(config)
            listeners.append((server, tcp_socket))
            host, port = tcp_socket.getsockname()[:2]
            tcp = (str(host), int(port))
    except BaseException:
        for _, sock in listeners:
            sock.close()
        metrics.close()
        unix_socket.close()
        socket_path.unlink(missing_ok=True)
        raise
    endpoints = OperatorEndpoints(
        socket_path, tcp, credentials.generated_token if credentials is not None else None,
        config.token_env if tcp is not None else None, tls=config.tls)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(service.hub.run)
            group.start_soon(service.equity.run)
            group.start_soon(metrics.run)
            for server, sock in listeners:
                group.start_soon(_serve_shielded, server, sock)
            try:
                with anyio.fail_after(10):
                    # uvicorn offers no event for "listening": poll its flag, briefly.
                    while not all(server.started for server, _ in listeners):  # noqa: ASYNC110
                        await anyio.sleep(0.005)
                _log.info("operator_api_listening", socket=str(socket_path),
                          tcp=endpoints.url)
                task_status.started(endpoints)
                await anyio.sleep_forever()
            finally:
                # Streams end first, so uvicorn finds every connection idle and closes it.
                service.close()
                metrics.close()
                for server, _ in listeners:
                    server.should_exit = True
    finally:
        socket_path.unlink(missing_ok=True)


async def _serve_shielded(server: _EmbeddedServer, sock: socket.socket) -> None:
    """Runs uvicorn to its own orderly end (``should_exit``), even when the group is
    cancelled: a cancelled uvicorn would leave its listening socket open."""
    with anyio.CancelScope(shield=True):
        try:
            await server.serve(sockets=[sock])
        finally:
            sock.close()
