"""The embedded model's socket is spoken to only when the expected process listens on it.

A process of the daemon's user can remove the socket file and listen in its place, after the
server was found ready. Each new connection is checked (``SO_PEERCRED``): one whose listener
is not the expected process is refused before a byte is sent.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.waiting import wait_until
from trading_agent.backends.owned_socket import OwnedUnixSocket
from trading_agent.backends.sse_transport import ConnectionFailed, SSETransport

pytestmark = pytest.mark.skipif(not hasattr(__import__("socket"), "SO_PEERCRED"),
                                reason="SO_PEERCRED is Linux's")


class _JsonServer:
    """A Unix-socket server in this process answering every request with ``{"tokens": [1,
    2, 3]}``, keeping what it received."""

    def __init__(self) -> None:
        self.received = b""
        self.closed = 0

    async def answer(self, stream: Any) -> None:
        async with stream:
            try:
                self.received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                self.closed += 1  # the client went without sending anything
                return
            body = b'{"tokens": [1, 2, 3]}'
            await stream.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(body), body))


async def test_only_the_owner_of_the_socket_is_sent_anything(tmp_path: Path) -> None:
    path = str(tmp_path / "model.sock")
    server = _JsonServer()
    listener = await anyio.create_unix_listener(path)  # listened on by this process
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, server.answer)

        owned = SSETransport("http://local-model/v1/chat/completions", {}, 5.0,
                             unix_socket=OwnedUnixSocket(path, owner_pid=os.getpid()))
        try:
            status, body = await owned.post_json("http://local-model/extras/tokenize",
                                                 {"input": "hello"}, {})
        finally:
            await owned.aclose()
        assert (status, body) == (200, {"tokens": [1, 2, 3]})
        assert b"POST /extras/tokenize" in server.received

        # The same socket, expected to be another process's (the model server's).
        server.received = b""
        other = SSETransport("http://local-model/v1/chat/completions", {}, 5.0,
                             unix_socket=OwnedUnixSocket(path, owner_pid=os.getppid()))
        try:
            with pytest.raises(ConnectionFailed) as raised:
                await other.post(b'{"messages": [{"role": "user", "content": "positions"}]}')
        finally:
            await other.aclose()
        assert f"served by process {os.getpid()}" in str(raised.value)
        assert f"this daemon started (process {os.getppid()})" in str(raised.value)
        await wait_until(lambda: server.closed == 1, "the refused connection to end")
        assert server.received == b""
        group.cancel_scope.cancel()
