"""Serving the operator API inside the daemon: a Unix socket, and TCP when configured.

:func:`serve_operator_api` runs in the daemon's task group until cancelled. It binds the
sockets itself (the Unix socket gets mode 0600 before anyone can connect), serves them with
uvicorn without uvicorn's signal handlers (the daemon owns SIGTERM), and on cancellation ends
every open event stream, lets uvicorn close its connections, and removes the socket file.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog
import uvicorn
from anyio.abc import TaskStatus

from trading_agent.daemon.control import DeskControl
from trading_agent.errors import ConfigError
from trading_agent.operator.api import OperatorService, create_app
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig, parse_tcp_address

__all__ = ["MIN_TOKEN_CHARS", "OperatorEndpoints", "read_token", "serve_operator_api"]

_log = structlog.get_logger(__name__)

MIN_TOKEN_CHARS = 16
"""The shortest bearer token accepted for the TCP listener."""

_UNIX_PATH_MAX = 107
"""sun_path holds 108 bytes on Linux, the last for the terminating NUL."""


@dataclass(frozen=True)
class OperatorEndpoints:
    """Where the API listens, as reported to the daemon once it is up.

    Attributes:
        socket_path: The Unix socket.
        tcp: ``(host, port)`` of the TCP listener (the real port when 0 was asked), or None.
    """

    socket_path: Path
    tcp: tuple[str, int] | None = None

    @property
    def url(self) -> str | None:
        """The web page's base URL on TCP, or None."""
        if self.tcp is None:
            return None
        host, port = self.tcp
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def read_token(config: OperatorConfig, environ: Mapping[str, str] | None = None) -> str:
    """The TCP listener's bearer token, from the environment.

    Args:
        config: The operator settings (``token_env`` names the variable).
        environ: Where to read it (``os.environ`` by default).

    Returns:
        The token.

    Raises:
        ConfigError: It is unset, empty or shorter than :data:`MIN_TOKEN_CHARS`.
    """
    env = os.environ if environ is None else environ
    token = env.get(config.token_env, "").strip()
    if len(token) < MIN_TOKEN_CHARS:
        what = "is not set" if not token else f"is shorter than {MIN_TOKEN_CHARS} characters"
        raise ConfigError(
            f"operator.tcp_address is {config.tcp_address}, but the environment variable "
            f"{config.token_env} (operator.token_env), which must hold its bearer token, {what}. "
            "Refusing to open a TCP listener without a token. Make one with: python -c "
            "'import secrets; print(secrets.token_urlsafe(32))'")
    return token


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


def _uvicorn_server(app: object) -> _EmbeddedServer:
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        lifespan="off",
        http="h11",
        ws="none",
        log_config=None,
        access_log=False,  # URLs may carry ?token=
        proxy_headers=False,
        server_header=False,
        timeout_graceful_shutdown=3,
    )
    return _EmbeddedServer(config)


async def serve_operator_api(
    control: DeskControl,
    approvals: ApprovalBook,
    config: OperatorConfig,
    *,
    state_dir: Path,
    environ: Mapping[str, str] | None = None,
    task_status: TaskStatus[OperatorEndpoints] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serves the operator API until cancelled.

    Start it with ``endpoints = await task_group.start(serve_operator_api, control, book,
    config, state_dir=...)``, before the desks start, so the live stream holds their first
    events (earlier ones come from the store anyway).

    Args:
        control: The running daemon.
        approvals: The approval book the desks' executors use as their gate.
        config: The operator settings.
        state_dir: The daemon's state directory (the default socket lives there).
        environ: Where the TCP token is read from (``os.environ`` by default).
        task_status: Receives the :class:`OperatorEndpoints` once every listener is up.

    Raises:
        ConfigError: The TCP listener is configured without a token, the address cannot be
            bound, or another daemon holds the socket.
    """
    socket_path = config.socket_in(state_dir)
    token = read_token(config, environ) if config.tcp_address else None
    service = OperatorService(control, approvals, config)
    listeners: list[tuple[_EmbeddedServer, socket.socket]] = []
    unix_socket = _bind_unix(socket_path)
    try:
        listeners.append((_uvicorn_server(create_app(service)), unix_socket))
        tcp: tuple[str, int] | None = None
        if config.tcp_address is not None:
            assert token is not None
            tcp_socket = _bind_tcp(config.tcp_address)
            listeners.append((_uvicorn_server(create_app(service, token=token)), tcp_socket))
            host, port = tcp_socket.getsockname()[:2]
            tcp = (str(host), int(port))
    except BaseException:
        for _, sock in listeners:
            sock.close()
        unix_socket.close()
        socket_path.unlink(missing_ok=True)
        raise
    endpoints = OperatorEndpoints(socket_path, tcp)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(service.hub.run)
            group.start_soon(service.equity.run)
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
