"""``trading-agent run``: the daemon's process from start to exit.

:func:`run_daemon` opens every service (:func:`~trading_agent.app.services.open_daemon`),
serves the operator API, runs the desks' supervisor, tells systemd (``READY=1`` once the
desks run, ``WATCHDOG=1`` and ``STATUS=`` from the main loop, ``STOPPING=1`` on shutdown),
prints on stderr how to watch and steer the desks (the socket, ``trading-agent
desks``/``chat``/``events``), reads the config again on SIGHUP, and handles signals:

- the first SIGTERM or SIGINT stops new turns; running turns stop at their next safe point
  (after the tool round in flight); after ``shutdown_timeout_seconds`` whatever still runs
  is cancelled (a cancelled tool round still gets its results stored). The events still
  buffered are written (for at most half a second; what is left is counted in the log), the
  local model server gets at most 1 s, the store is closed, and the process exits 0;
- a second signal cancels everything at once. Every write to SQLite is one transaction, so
  the store stays consistent either way.

Before anything else the process makes itself non-dumpable (Linux ``prctl(PR_SET_DUMPABLE,
0)``): its children (stdio MCP servers, the local model server) run as the same user, and
would otherwise read its environment, exchange secret included, from ``/proc/<pid>/environ``
(or its memory through ptrace). The operator API then refuses connections from the daemon's
own descendants (see :mod:`trading_agent.operator.server`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shutil
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

from trading_agent.agent.event_bus import Subscription
from trading_agent.app.event_loop import loop_name
from trading_agent.app.services import open_daemon
from trading_agent.app.stop_budget import StopBudget
from trading_agent.app.systemd import SystemdNotifier
from trading_agent.daemon.heap import HeapKeeper
from trading_agent.daemon.supervisor import Supervisor
from trading_agent.errors import ConfigError
from trading_agent.logging_setup import log_events
from trading_agent.operator.config import SOCKET_NAME
from trading_agent.settings import Settings

__all__ = ["run_daemon"]

_log = structlog.get_logger(__name__)

_STATUS_SECONDS = 30.0
"""How often systemd's status line is refreshed when there is no watchdog."""

_PR_SET_DUMPABLE = 4
"""From ``<linux/prctl.h>``."""

_TOKEN_FILE = "web-token"
"""Where a token made at start is written, beside the operator socket, when stderr is not a
terminal (under systemd it would land in the journal)."""

_DRAIN_SECONDS = 0.5
"""How long a shutdown waits for the event log to be written once the desks stopped. The
SIGTERM budget of 10 s: the desks' ``shutdown_timeout_seconds`` (8 by default), this, the
webhooks and traces together in what is left (see :mod:`trading_agent.app.stop_budget`),
then the local model server's grace (at most 1 s)."""


async def run_daemon(settings: Settings, *, environ: Mapping[str, str] | None = None,
                     config_path: Path | None = None) -> None:
    """Runs the daemon until SIGTERM or SIGINT (``trading-agent run``).

    Args:
        settings: The validated settings.
        environ: The environment (``os.environ`` by default): secrets, ``$NOTIFY_SOCKET``.
        config_path: The file the settings came from, read again on SIGHUP (and by
            ``trading-agent reload``).

    Raises:
        ConfigError: The settings cannot be put to work (a missing secret, a busy socket).
        StoreError: The state directory's store cannot be opened.
    """
    _make_non_dumpable()
    notifier = SystemdNotifier(environ)
    try:
        with _single_error():
            async with anyio.create_task_group() as outer:
                shutdown = _Shutdown(outer.cancel_scope, notifier)
                outer.start_soon(shutdown.watch_signals)
                await _run(settings, environ, notifier, shutdown, config_path)
                outer.cancel_scope.cancel()
    finally:
        notifier.close()
    _log.info("daemon_stopped")


async def _run(settings: Settings, environ: Mapping[str, str] | None,
               notifier: SystemdNotifier, shutdown: _Shutdown,
               config_path: Path | None) -> None:
    async with open_daemon(settings, environ=environ, config_path=config_path,
                           heap_keeper=HeapKeeper()) as daemon:
        supervisor = daemon.supervisor
        async with anyio.create_task_group() as recorders:
            # These end once their subscriptions close and what they hold is written.
            recorders.start_soon(daemon.store.events.persist_events, daemon.store_subscription)
            recorders.start_soon(log_events, daemon.log_subscription)
            try:
                async with anyio.create_task_group() as group:
                    endpoints = None
                    if daemon.serve_api is not None:
                        endpoints = await group.start(functools.partial(
                            daemon.serve_api, refuse_descendants=True))
                    shutdown.supervisor = supervisor
                    shutdown.budget = daemon.stop_budget
                    await group.start(supervisor.run)
                    notifier.ready(supervisor.status_line())
                    _log.info("daemon_ready", desks=list(supervisor.desk_names()),
                              event_loop=loop_name())
                    _print_banner(supervisor.desk_names(), endpoints, environ)
                    group.start_soon(_inform_systemd, notifier, supervisor,
                                     settings.daemon.watchdog)
                    group.start_soon(_reload_on_sighup, supervisor, notifier)
                    await supervisor.stopped.wait()
                    group.cancel_scope.cancel()
                if daemon.fleet is not None:  # the others take its desks now
                    await daemon.fleet.leave()
            finally:
                daemon.store_subscription.close()
                daemon.log_subscription.close()
                # Writing what is buffered must not break the 10 s SIGTERM promise.
                recorders.cancel_scope.deadline = anyio.current_time() + _DRAIN_SECONDS
        if recorders.cancel_scope.cancel_called:
            left = _count_left(daemon.store_subscription)
            _log.warning("events_not_stored", count=left,
                         reason=f"the store did not write them within {_DRAIN_SECONDS:g} s "
                                "of the shutdown")


def _count_left(subscription: Subscription) -> int:
    """Empties a closed subscription, counting what it still held."""
    left = 0
    while (event := subscription.get_nowait()) is not None:
        left += int(getattr(event, "count", 1)) if event.id <= 0 else 1
    return left


def _print_banner(desks: Sequence[str], endpoints: Any,
                  environ: Mapping[str, str] | None) -> None:
    """Tells the person who started the daemon (``make run``) how to watch and steer it.

    On stderr, apart from the log lines on stdout; under systemd it lands in the journal once.
    With a TCP listener it leads with the web page's address to open: with its token when
    the token was made at start (``generate_token``) and stderr is a terminal (this is the
    one place it is shown); when stderr is not a terminal (systemd's journal, a log file) the
    token goes to a file readable by the owner alone, beside the socket, and the banner
    names the file; a token from the environment is named by its variable, never shown.
    """
    command = _operator_command()
    where = ""
    if endpoints is not None:
        env = os.environ if environ is None else environ
        # Where ``trading-agent chat`` looks when given no --socket.
        default = Path(env.get("STATE_DIRECTORY", "").split(":")[0] or "state") / SOCKET_NAME
        if Path(endpoints.socket_path).resolve() != default.resolve():
            where = f" --socket {endpoints.socket_path}"
    first = desks[0] if desks else "DESK"
    lines = [f"trading-agent is running {len(desks)} desk{'s' if len(desks) != 1 else ''}: "
             f"{', '.join(desks)}"]
    if endpoints is not None and endpoints.url:
        if endpoints.generated_token and _on_terminal(sys.stderr):
            lines += [f"  web page: {endpoints.url}#token={endpoints.generated_token}",
                      "    (open it in a browser; the token was made for this run and is shown "
                      "only here)"]
        elif endpoints.generated_token:
            token_file = _write_token(Path(endpoints.socket_path).parent / _TOKEN_FILE,
                                      endpoints.generated_token)
            lines += [f"  web page: {endpoints.url}#token=<the token in {token_file}>",
                      "    (the token was made for this run; it is not printed where logs "
                      "are kept)"]
        else:
            lines += [f"  web page: {endpoints.url}#token=${endpoints.token_env}",
                      f"    (with the token from ${endpoints.token_env} after #token=)"]
    if endpoints is not None:
        lines.append(f"  operator API: {endpoints.socket_path}"
                     + (f" and {endpoints.url}" if endpoints.url else ""))
        lines += ["  watch and steer them from another terminal:",
                  f"    {command} desks{where}",
                  f"    {command} chat {first}{where}      # type to steer the desk",
                  f"    {command} events --follow{where}"]
    lines.append("  stop: Ctrl-C (SIGINT) or SIGTERM")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _on_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed
        return False


def _write_token(path: Path, token: str) -> Path:
    """Writes ``token`` to ``path``, readable and writable by the owner alone from its
    creation (a file left by an earlier run is replaced)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(token + "\n")
    return path


def _make_non_dumpable() -> None:
    """Keeps same-user processes (the daemon's own children included) out of its
    ``/proc/<pid>/environ``, memory and ptrace; a no-op off Linux. It also turns core dumps
    off: a core holds the secrets too."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        _log.warning("not_made_non_dumpable", error=os.strerror(ctypes.get_errno()))


def _operator_command() -> str:
    """The ``trading-agent`` console script beside this Python: by its name when it is the
    one on ``$PATH``, relative to the working directory when under it (``.venv/bin/...``)."""
    script = Path(sys.executable).parent / "trading-agent"
    if not script.exists():
        return f"{sys.executable} -m trading_agent.cli"
    found = shutil.which("trading-agent")
    if found is not None and Path(found).resolve() == script.resolve():
        return "trading-agent"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


async def _inform_systemd(notifier: SystemdNotifier, supervisor: Supervisor,
                          watchdog: bool) -> None:
    """``WATCHDOG=1`` with a fresh ``STATUS=`` every watchdog interval, from the main loop;
    without a watchdog, the status alone every half minute."""
    if watchdog and notifier.watchdog_interval is not None:
        await notifier.run_watchdog(supervisor.status_line)
        return
    while notifier.enabled:
        await anyio.sleep(_STATUS_SECONDS)
        notifier.status(supervisor.status_line())


async def _reload_on_sighup(supervisor: Supervisor, notifier: SystemdNotifier) -> None:
    """SIGHUP reads the config again (systemd's ``ExecReload=kill -HUP $MAINPID``)."""
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            notifier.notify(RELOADING=1)
            try:
                await supervisor.reload("SIGHUP")
            except ConfigError as exc:
                _log.error("config_reload_refused", error=str(exc))
            finally:
                notifier.ready(supervisor.status_line())


@contextlib.contextmanager
def _single_error() -> Iterator[None]:
    """Lets a lone error out of the task groups as itself (the CLI reports ConfigError)."""
    try:
        yield
    except BaseExceptionGroup as group:
        errors = _leaves(group)
        if len(errors) == 1:
            raise errors[0] from None
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    found: list[BaseException] = []
    for error in group.exceptions:
        found.extend(_leaves(error) if isinstance(error, BaseExceptionGroup) else [error])
    return found


class _Shutdown:
    """The signals: the first drains the desks, the second cancels everything."""

    def __init__(self, scope: anyio.CancelScope, notifier: SystemdNotifier) -> None:
        self._scope = scope
        self._notifier = notifier
        self.supervisor: Supervisor | None = None
        self.budget: StopBudget | None = None
        self.requested = False

    async def watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for received in signals:
                if self.requested:
                    _log.warning("shutdown_forced", signal=signal.Signals(received).name)
                    self._scope.cancel()
                    return
                self.requested = True
                if self.budget is not None:
                    self.budget.begin()
                _log.info("shutdown_started", signal=signal.Signals(received).name)
                self._notifier.stopping("stopping: desks finish their tool round")
                if self.supervisor is not None:
                    self.supervisor.shutdown()
                else:
                    self._scope.cancel()  # still starting: no turn to drain yet
