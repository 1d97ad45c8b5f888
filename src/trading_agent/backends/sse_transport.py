"""The hot path of a model call: POST pre-encoded bytes, read back server-sent events.

A desk's request body is already bytes (spliced from each message's memoized encoding), so
all the transport does is send them and split the answer into events. The OpenAI SDK's
client did that through a connection pool that walks every connection on each request it
adds or removes: with 500 desks waking together, the cost of one send grew with the
requests in flight. This module uses aiohttp instead (a well-kept client, already in the
tree for ccxt), whose connector hands out an idle connection from a per-host queue and keeps
the count of those in use, so a send costs the same with one request in flight or a
thousand; its HTTP parser is in C. The events are split here, incrementally and with no
limit on a line's length, as the SDK's decoder splits them.

What goes out is decided by the caller (URL, headers, body); failures come back as three
exceptions of this module, which the backend translates to its own errors:
:class:`HttpStatusError` (an answer that is not 2xx, its body read), :class:`RequestTimeout`
(no connection or no bytes within the timeout) and :class:`ConnectionFailed` (refused, reset,
cut mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from types import TracebackType

import aiohttp
import httpx

from trading_agent.backends.owned_socket import OwnedUnixConnector, OwnedUnixSocket

__all__ = [
    "TRANSIENT_STATUSES",
    "ConnectionFailed",
    "EventStream",
    "HttpStatusError",
    "RequestTimeout",
    "SSETransport",
    "ServerSentEvent",
    "verified_ssl_context",
]

_MAX_CONNECTIONS = 1000
"""Connections open at once to one server (the OpenAI SDK's limit): a desk has at most one
request in flight, and a daemon runs up to about a thousand desks."""
_KEEPALIVE_SECONDS = 15.0
"""How long an idle connection is kept for the next request."""
_ERROR_BODY_LIMIT = 64 * 1024
"""The most bytes of an error answer that are read (its message is near the start)."""
_LINE_END = re.compile(rb"\r\n|\r|\n")

TRANSIENT_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})
"""Answers worth trying again: a timeout, a conflict, too early, rate limited, a server
error, overloaded."""


@functools.cache
def verified_ssl_context() -> ssl.SSLContext:
    """One verifying TLS context for every transport (loading the CA store costs ~75 ms)."""
    return httpx.create_ssl_context()


class HttpStatusError(Exception):
    """The server answered with a status that is not 2xx.

    Attributes:
        status: The HTTP status.
        headers: The answer's headers (case-insensitive).
        body: The start of the answer's body.
    """

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self) -> str:
        """The body as text."""
        return self.body.decode("utf-8", "replace")

    @property
    def retry_after(self) -> float | None:
        """Seconds the server asked to wait (``retry-after-ms``, or ``Retry-After`` in
        seconds or as an HTTP date), or None."""
        return _retry_after(self.headers)


class RequestTimeout(Exception):
    """No connection, or no bytes of the answer, within the timeout."""


class ConnectionFailed(Exception):
    """The connection was refused, reset, or cut before the answer ended."""


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One event of the stream.

    Attributes:
        event: Its ``event:`` field, or None.
        data: Its ``data:`` lines, joined by newlines.
    """

    event: str | None
    data: str


class _EventDecoder:
    """Splits bytes into events as they arrive (CR, LF or CRLF line ends; no size limit)."""

    def __init__(self) -> None:
        self._partial: list[bytes] = []
        self._skip_newline = False
        self._event: str | None = None
        self._data: list[str] = []
        self._fields = False

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        if self._skip_newline and chunk[:1] == b"\n":
            chunk = chunk[1:]
        self._skip_newline = False
        if not _LINE_END.search(chunk):
            if chunk:
                self._partial.append(chunk)  # a long line, arriving in pieces
            return []
        if self._partial:
            chunk = b"".join((*self._partial, chunk))
            self._partial = []
        lines = _LINE_END.split(chunk)
        rest = lines.pop()
        if rest:
            self._partial.append(rest)
        elif chunk.endswith(b"\r"):
            self._skip_newline = True  # a CRLF split between two chunks
        events: list[ServerSentEvent] = []
        for line in lines:
            event = self._line(line.decode("utf-8"))
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> ServerSentEvent | None:
        if not line:
            if not self._fields:
                return None
            event = ServerSentEvent(self._event, "\n".join(self._data))
            self._event, self._data, self._fields = None, [], False
            return event
        if line.startswith(":"):
            return None  # a comment (a keep-alive ping)
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value or None
        elif name not in ("id", "retry"):
            return None
        self._fields = True
        return None


class EventStream:
    """The events of one answer, read as they arrive; close it when done (``async with``).

    Ending early (a cancelled turn, an error) closes the connection; reading to the end
    gives it back to the pool for the next request.
    """

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self._decoder = _EventDecoder()
        self._ready: list[ServerSentEvent] = []
        self._position = 0
        self._ended = False

    async def next(self) -> ServerSentEvent | None:
        """The next event; None at the end of the answer.

        Raises:
            RequestTimeout: No bytes came within the timeout.
            ConnectionFailed: The connection broke before the answer ended.
        """
        while self._position >= len(self._ready):
            if self._ended:
                return None
            try:
                chunk = await self._response.content.readany()
            except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
                raise RequestTimeout("no bytes of the answer within the timeout") from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise ConnectionFailed(_describe(exc)) from exc
            if not chunk:
                self._ended = True
                return None
            self._ready = self._decoder.feed(chunk)
            self._position = 0
        event = self._ready[self._position]
        self._position += 1
        return event

    async def finish(self) -> None:
        """Reads what is left of the answer (after ``[DONE]``) so the connection is reused."""
        with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
            while await self._response.content.readany():
                pass
        self._ended = True

    def close(self) -> None:
        """Gives the connection back when the answer was read whole, else closes it."""
        if self._ended and self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class SSETransport:
    """Posts bodies to one URL and streams the answers; one connection pool per event loop.

    Args:
        url: Where every request goes.
        headers: Sent with every request (``Content-Length`` and ``Host`` are added).
        timeout: Seconds to wait for a connection, or for the next bytes of an answer.
        ssl_context: How HTTPS servers are verified; :func:`verified_ssl_context` when None.
        unix_socket: Connect through this Unix socket, to its owner alone, instead of to the
            URL's host (the embedded model); the URL's host is then only a name.
    """

    def __init__(self, url: str, headers: Mapping[str, str], timeout: float,
                 ssl_context: ssl.SSLContext | None = None, *,
                 unix_socket: OwnedUnixSocket | None = None) -> None:
        self.url = url
        self._unix_socket = unix_socket
        self._headers = dict(headers)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout,
                                              sock_read=timeout, connect=timeout)
        self._ssl_context = ssl_context or verified_ssl_context()
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Never a proxy in front of a Unix socket: prompts go to the socket's owner alone.
        self._proxy = None if unix_socket is not None else _environment_proxy(url)

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            # Made in the loop that uses it (aiohttp binds a session to one); a backend
            # moved to another loop (a second anyio.run) starts a pool of its own there.
            self._loop = loop
            connector: aiohttp.BaseConnector = aiohttp.TCPConnector(
                limit=_MAX_CONNECTIONS, ssl=self._ssl_context,
                keepalive_timeout=_KEEPALIVE_SECONDS)
            if self._unix_socket is not None:
                connector = OwnedUnixConnector(self._unix_socket, limit=_MAX_CONNECTIONS,
                                               keepalive_timeout=_KEEPALIVE_SECONDS)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout, headers=self._headers, auto_decompress=True,
                skip_auto_headers=("User-Agent",), cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False)  # the proxy is read once, not looked up in a thread per call
        return self._session

    async def post(self, body: bytes) -> EventStream:
        """Sends one request; its answer's events are read from what this returns.

        Args:
            body: The request body, ready to send.

        Returns:
            The answer's events (the status was 2xx).

        Raises:
            HttpStatusError: Any other status (a redirect is not followed: a model server
                that moved is a configuration to fix, not a POST to repeat elsewhere).
            RequestTimeout: No connection, or no answer, within the timeout.
            ConnectionFailed: The connection was refused or broke.
        """
        try:
            response = await self._client().post(self.url, data=body, proxy=self._proxy,
                                                 allow_redirects=False)
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise RequestTimeout("no answer within the timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ConnectionFailed(_describe(exc)) from exc
        if 200 <= response.status < 300:
            return EventStream(response)
        try:
            body_start = await response.content.read(_ERROR_BODY_LIMIT)
        except (TimeoutError, aiohttp.ClientError, OSError):
            body_start = b""
        finally:
            response.close()
        raise HttpStatusError(response.status, response.headers, body_start)

    async def post_json(self, url: str, payload: Mapping[str, object],
                        headers: Mapping[str, str]) -> tuple[int, object]:
        """One plain JSON request on this transport's connections (a side route of the
        same server, such as its tokenizer); returns the status and the decoded body (None
        when it is not JSON).

        Raises:
            RequestTimeout: No answer within the timeout.
            ConnectionFailed: The connection was refused or broke.
        """
        try:
            async with self._client().post(url, json=payload, headers=dict(headers),
                                           proxy=self._proxy, allow_redirects=False) as answer:
                try:
                    body: object = await answer.json(content_type=None)
                except ValueError:
                    body = None
                return answer.status, body
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise RequestTimeout("no answer within the timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise ConnectionFailed(_describe(exc)) from exc

    async def aclose(self) -> None:
        """Closes the pool's connections."""
        session, self._session = self._session, None
        if session is not None and self._loop is asyncio.get_running_loop():
            await session.close()
        elif session is not None:
            session.detach()  # its loop is gone, and its connections with it


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or HTTP date)."""
    milliseconds = headers.get("retry-after-ms")
    if milliseconds:
        try:
            value = float(milliseconds) / 1000
        except ValueError:
            pass
        else:
            if math.isfinite(value) and value >= 0:
                return value
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            moment = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if moment.tzinfo is None:
            return None
        return max(0.0, moment.timestamp() - time.time())
    return value if math.isfinite(value) and value >= 0 else None


def _environment_proxy(url: str) -> str | None:
    """The proxy the environment names for ``url`` (``HTTPS_PROXY``, ``HTTP_PROXY``,
    ``ALL_PROXY``, unless ``NO_PROXY`` exempts its host), as the SDK's client honoured them."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None or urllib.request.proxy_bypass(parts.hostname):
        return None
    proxies = urllib.request.getproxies_environment()
    return proxies.get(parts.scheme) or proxies.get("all")


def _describe(exc: BaseException) -> str:
    """``Type: message`` of a network failure, with its cause when it has one."""
    text = str(exc) or (str(exc.__cause__) if exc.__cause__ is not None else "")
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
