"""Telling systemd how the daemon is doing, over ``$NOTIFY_SOCKET`` (no libsystemd needed).

The protocol is one datagram per message, ``KEY=value`` lines, to the Unix socket named by
``$NOTIFY_SOCKET`` (a name starting with ``@`` is in the abstract namespace). The unit's
``Type=notify`` waits for ``READY=1``; ``WatchdogSec=`` expects ``WATCHDOG=1`` at least that
often (systemd passes the period as ``$WATCHDOG_USEC``); ``STATUS=`` shows in
``systemctl status``; ``STOPPING=1`` says a shutdown has begun.

Outside systemd there is no ``$NOTIFY_SOCKET`` and every call does nothing. A message that
cannot be sent is logged, never raised: systemd's opinion must not crash a desk.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable, Mapping

import anyio
import structlog

__all__ = ["SystemdNotifier"]

_log = structlog.get_logger(__name__)


def _address(name: str) -> str | bytes:
    """The socket address: ``@name`` is the abstract namespace (a leading NUL byte)."""
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class SystemdNotifier:
    """Sends readiness, watchdog pings, status and stopping to systemd.

    Args:
        environ: The environment to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
            ``WATCHDOG_PID`` from (``os.environ`` by default).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        name = environ.get("NOTIFY_SOCKET", "")
        self.socket_name: str | None = name or None
        self.watchdog_interval: float | None = None
        """Seconds between watchdog pings (half of ``WatchdogSec=``), or None when the unit
        asks for none."""
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        # The watchdog is for the process systemd named, if it named one.
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1_000_000 / 2
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Whether systemd is listening."""
        return self.socket_name is not None

    def notify(self, **fields: str | int) -> bool:
        """Sends one message of ``KEY=value`` fields (``notify(READY=1, STATUS="...")``).

        Args:
            **fields: The fields, in the order given.

        Returns:
            True when it was sent; False without ``$NOTIFY_SOCKET`` or when sending failed.
        """
        if self.socket_name is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._socket.setblocking(False)
            self._socket.sendto(payload, _address(self.socket_name))
        except OSError as exc:
            _log.warning("systemd_notify_failed", socket=self.socket_name, error=str(exc),
                         message=payload.decode(errors="replace"))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: the desks are running (with a status line, if given)."""
        return self.notify(READY=1, **({"STATUS": status} if status is not None else {}))

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the main loop is alive."""
        return self.notify(WATCHDOG=1)

    def status(self, text: str) -> bool:
        """``STATUS=``: one line for ``systemctl status``."""
        return self.notify(STATUS=text.replace("\n", " "))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: a shutdown has begun."""
        return self.notify(STOPPING=1, **({"STATUS": status} if status is not None else {}))

    async def run_watchdog(self, status: Callable[[], str] | None = None, *,
                           sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        """Pings the watchdog (and refreshes the status) every interval, until cancelled.

        Run it in the daemon's main task group: when the event loop is stuck, the pings stop
        and systemd restarts the daemon. Returns at once when the unit asks for no watchdog.

        Args:
            status: Gives the status line to send with each ping.
            sleep: The sleep (injectable for tests).
        """
        interval = self.watchdog_interval
        if interval is None or not self.enabled:
            return
        while True:
            if status is not None:
                self.notify(WATCHDOG=1, STATUS=status().replace("\n", " "))
            else:
                self.watchdog()
            await sleep(interval)

    def close(self) -> None:
        """Closes the socket (idempotent)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
