"""Headless Chromium driven over the Chrome DevTools Protocol, with nothing to download.

A minimal WebSocket client (RFC 6455: the upgrade, masked client frames, fragments, ping)
over anyio's TCP streams, since no websocket package is installed, and a :class:`Browser`
that starts Debian's ``chromium`` with ``--remote-debugging-port=0`` and talks to its page.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx

__all__ = ["Browser", "CdpError", "WebSocket", "chromium_path", "open_browser"]

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-default-apps", "--hide-scrollbars",
    "--force-color-profile=srgb", "--remote-debugging-port=0",
]


def chromium_path() -> str | None:
    """Debian's chromium, when installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class CdpError(RuntimeError):
    """Chromium answered a command with an error."""


class WebSocket:
    """A client WebSocket on an open TCP stream (text messages only)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self._stream = stream
        self._buffer = b""

    @classmethod
    async def connect(cls, url: str) -> WebSocket:
        """Opens ``ws://host:port/path`` and performs the upgrade."""
        assert url.startswith("ws://"), url
        host_port, _, path = url[5:].partition("/")
        host, _, port = host_port.rpartition(":")
        stream = await anyio.connect_tcp(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        request = (f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   "Sec-WebSocket-Version: 13\r\n\r\n")
        await stream.send(request.encode())
        socket = cls(stream)
        head = await socket._read_until(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 101"):
            await stream.aclose()
            raise CdpError(f"websocket upgrade refused: {head[:200]!r}")
        return socket

    async def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buffer:
            self._buffer += await self._stream.receive()
        head, _, self._buffer = self._buffer.partition(marker)
        return head

    async def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._buffer += await self._stream.receive()
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    async def _send_frame(self, opcode: int, payload: bytes) -> None:
        header = bytes([0x80 | opcode])
        size = len(payload)
        if size < 126:
            header += bytes([0x80 | size])
        elif size < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack("!H", size)
        else:
            header += bytes([0x80 | 127]) + struct.pack("!Q", size)
        mask = os.urandom(4)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        await self._stream.send(header + mask + masked)

    async def send(self, text: str) -> None:
        """Sends a text message."""
        await self._send_frame(0x1, text.encode())

    async def receive(self) -> str:
        """The next text message (pings are answered, fragments joined)."""
        parts: list[bytes] = []
        while True:
            first, second = await self._read_exactly(2)
            opcode, final = first & 0x0F, bool(first & 0x80)
            size = second & 0x7F
            if size == 126:
                (size,) = struct.unpack("!H", await self._read_exactly(2))
            elif size == 127:
                (size,) = struct.unpack("!Q", await self._read_exactly(8))
            mask = await self._read_exactly(4) if second & 0x80 else b""
            payload = await self._read_exactly(size)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 0x9:
                await self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise anyio.EndOfStream
            if opcode in (0x0, 0x1, 0x2):
                parts.append(payload)
                if final:
                    return b"".join(parts).decode()

    async def aclose(self) -> None:
        """Closes the connection."""
        with contextlib.suppress(Exception):
            await self._send_frame(0x8, b"")
        await self._stream.aclose()


class Browser:
    """One page of a headless Chromium, driven over CDP."""

    def __init__(self, socket: WebSocket) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self.console: list[str] = []
        """Console messages and uncaught exceptions of the page."""

    async def command(self, method: str, **params: Any) -> dict[str, Any]:
        """Sends a command and returns its result (events on the way are kept as console
        messages when they are console messages or exceptions)."""
        number = next(self._ids)
        await self._socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(await self._socket.receive())
            if message.get("id") == number:
                if "error" in message:
                    raise CdpError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._note(message)

    def _note(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            texts = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
            self.console.append(f"console.{params.get('type')}: {' '.join(texts)}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            self.console.append(f"exception: {exception.get('description') or details}")

    async def evaluate(self, expression: str) -> Any:
        """Evaluates JavaScript in the page (awaiting promises) and returns its value."""
        result = await self.command("Runtime.evaluate", expression=expression,
                                    returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise CdpError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str) -> Any:
        """Polls a JavaScript condition until it is truthy (10 s at most)."""
        # Until the page has loaded, the expression may throw: that counts as not yet.
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return false; }} }})()"
        try:
            with anyio.fail_after(10):
                while not (value := await self.evaluate(guarded)):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        except TimeoutError:
            text = await self.evaluate("document.body.innerText")
            raise AssertionError(f"the page never showed {what}; console: {self.console}; "
                                 f"text:\n{text}") from None
        return value

    async def screenshot(self, path: Path) -> Path:
        """Saves a PNG of the page."""
        result = await self.command("Page.captureScreenshot", format="png")
        target = anyio.Path(path)
        await target.parent.mkdir(parents=True, exist_ok=True)
        await target.write_bytes(base64.b64decode(result["data"]))
        return path


@contextlib.asynccontextmanager
async def open_browser(width: int = 1360, height: int = 880) -> AsyncIterator[Browser]:
    """Starts headless Chromium in a fresh profile and yields its page; stops it after."""
    executable = chromium_path()
    assert executable is not None
    profile = Path(tempfile.mkdtemp(prefix="ta-chromium-"))
    process = await anyio.open_process(
        [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
         f"--window-size={width},{height}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    socket: WebSocket | None = None
    try:
        port_file = profile / "DevToolsActivePort"
        with anyio.fail_after(20):
            while not port_file.exists() or not port_file.read_text().strip():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            targets = (await http.get("/json/list")).json()
        page = next(t for t in targets if t.get("type") == "page")
        socket = await WebSocket.connect(page["webSocketDebuggerUrl"])
        browser = Browser(socket)
        await browser.command("Runtime.enable")
        await browser.command("Page.enable")
        await browser.command("Emulation.setDeviceMetricsOverride", width=width, height=height,
                              deviceScaleFactor=1, mobile=False)
        yield browser
    finally:
        if socket is not None:
            await socket.aclose()
        process.terminate()
        with anyio.move_on_after(5):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        shutil.rmtree(profile, ignore_errors=True)
