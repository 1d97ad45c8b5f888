"""A Unix socket that only one known process may serve: the embedded model's.

The daemon talks to the local model server it started over a Unix socket in a fresh 0700
directory. The directory keeps other users out; a process of the daemon's own user (an MCP
server it started, say) could still remove the socket file and listen in its place, and
then receive every prompt and answer with the tool calls a desk makes. So every connection
is checked before a byte is sent: on Linux the kernel reports, for a connected Unix socket,
the process that listens on it (``SO_PEERCRED``, recorded at ``listen()``), and a connection
whose listener is not the expected process is closed and fails as a refused connection.

:class:`OwnedUnixConnector` is aiohttp's Unix connector with that check; :func:`listener_pid`
is the check itself, for a plain socket.
"""

from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp.client_exceptions import UnixClientConnectorError

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler

__all__ = ["ImpostorError", "OwnedUnixConnector", "OwnedUnixSocket", "impostor_message",
           "listener_pid"]

_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class OwnedUnixSocket:
    """Where a server listens, and which process must be the one listening.

    Attributes:
        path: The socket's path.
        owner_pid: The process that must listen on it (the server the daemon started).
    """

    path: str
    owner_pid: int


def listener_pid(sock: socket.socket) -> int | None:
    """The process listening at the far end of a connected Unix socket, or None where the
    kernel does not say (off Linux)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    credentials = sock.getsockopt(socket.SOL_SOCKET, option, _CREDENTIALS.size)
    return int(_CREDENTIALS.unpack(credentials)[0])


def impostor_message(path: str, found: int | None, owner_pid: int) -> str:
    """Why a connection was refused, in a sentence."""
    return (f"the socket {path} is served by process {found}, not by the local model "
            f"server this daemon started (process {owner_pid}); nothing was sent to it")


class ImpostorError(UnixClientConnectorError):
    """Another process than the expected one listens on the socket (nothing was sent)."""


class OwnedUnixConnector(aiohttp.UnixConnector):
    """aiohttp's Unix-socket connector, refusing any connection whose listener is not
    ``endpoint.owner_pid``.

    Args:
        endpoint: The socket and its owner.
        **kwargs: As for :class:`aiohttp.UnixConnector` (limit, keepalive_timeout...).
    """

    def __init__(self, endpoint: OwnedUnixSocket, **kwargs: Any) -> None:
        super().__init__(endpoint.path, **kwargs)
        self._owner_pid = endpoint.owner_pid

    async def _create_connection(self, req: Any, traces: Any, timeout: Any  # noqa: ASYNC109
                                 ) -> ResponseHandler:
        protocol = await super()._create_connection(req, traces, timeout)
        transport = protocol.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        found = listener_pid(sock) if sock is not None else None
        if sock is None or (found is not None and found != self._owner_pid):
            if transport is not None:
                transport.abort()
            raise ImpostorError(self.path, req.connection_key, PermissionError(
                errno.EPERM, impostor_message(self.path, found, self._owner_pid)))
        return protocol
