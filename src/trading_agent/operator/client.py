"""A client of the operator API, over the daemon's Unix socket or TCP with a token.

The CLI uses it; so do the tests and the benchmark. Errors are the project's: a daemon that
is not running, a socket this user may not open, and refusals from the API each raise an
:class:`OperatorClientError` whose message says what to do.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import anyio
import httpx

from trading_agent.errors import TradingAgentError
from trading_agent.operator.event_stream import STREAM_CURSOR_HEADER

__all__ = [
    "DaemonNotRunningError",
    "ImageAttachment",
    "OperatorClient",
    "OperatorClientError",
    "OperatorRequestError",
    "StreamEvent",
    "parse_sse",
]


class OperatorClientError(TradingAgentError):
    """The operator API could not be used; the message says why and what to do."""


class DaemonNotRunningError(OperatorClientError):
    """Nothing listens where the daemon should."""


class OperatorRequestError(OperatorClientError):
    """The API refused a request.

    Args:
        status: The HTTP status.
        code: The API's error code (``unknown_desk``).
        message: The API's message.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} (HTTP {status})")
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ImageAttachment:
    """A picture sent with a message.

    Attributes:
        data: The file's bytes (a PNG, JPEG, GIF or WebP; the daemon checks).
        media_type: Its media type (``image/png``).
        name: Its file name, which the desk sees.
    """

    data: bytes
    media_type: str
    name: str = ""


@dataclass(frozen=True)
class StreamEvent:
    """One event from the stream.

    Attributes:
        id: The event's id (None for the client's own notices).
        data: The event, with its ``type`` and ``desk``.
    """

    id: int | None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def type(self) -> str:
        """The event's type (``text_delta``, ``tool_call``...)."""
        return str(self.data.get("type", ""))


async def parse_sse(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str | None, str]]:
    """Server-sent events from lines: ``(id, data)`` per event; comments are skipped.

    Args:
        lines: The response's lines, without line ends.

    Yields:
        The event's id field (None when it had none) and its data.
    """
    event_id: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "id":
            event_id = value


class OperatorClient:
    """Talks to a running daemon's operator API.

    Args:
        socket_path: The daemon's Unix socket.
        url: Or the API's TCP base URL (``http://127.0.0.1:8765``).
        token: The bearer token (TCP).
        timeout: Seconds to wait for an answer (a stream waits indefinitely, and the server
            sends a keep-alive every 15 s).

    Example::

        async with OperatorClient(socket_path=Path("state/operator.sock")) as client:
            for desk in await client.desks():
                print(desk["name"], desk["state"])
    """

    def __init__(self, *, socket_path: Path | None = None, url: str | None = None,
                 token: str | None = None, timeout: float = 120.0,
                 surface: str = "cli") -> None:
        if (socket_path is None) == (url is None):
            raise ValueError("give exactly one of socket_path and url")
        self.socket_path = socket_path
        self.url = url
        # What the audit records this client as (cli, chat).
        headers = {"X-Operator-Surface": surface}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if socket_path is not None:
            transport = httpx.AsyncHTTPTransport(uds=str(socket_path))
            base_url = "http://operator"
        else:
            assert url is not None
            transport = httpx.AsyncHTTPTransport()
            base_url = url.rstrip("/")
        self._client = httpx.AsyncClient(transport=transport, base_url=base_url,
                                         headers=headers, timeout=timeout)

    @property
    def where(self) -> str:
        """The socket or URL, for messages."""
        return str(self.socket_path) if self.socket_path is not None else str(self.url)

    async def __aenter__(self) -> OperatorClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the connections."""
        await self._client.aclose()

    # ------------------------------------------------------------------ errors

    def _unreachable(self, exc: BaseException) -> OperatorClientError:
        """The clearest error for a failed connection."""
        if self.socket_path is not None:
            path = self.socket_path
            start = "start it with `trading-agent run --config <your config>`"
            if not path.exists():
                return DaemonNotRunningError(
                    f"No daemon is listening on {path}: the socket does not exist; {start}.")
            if not os.access(path, os.R_OK | os.W_OK) or _caused_by(exc, PermissionError):
                return OperatorClientError(
                    f"Permission denied on {path}: the socket is readable only by the user "
                    "the daemon runs as (mode 0600); run this command as that user.")
            return DaemonNotRunningError(f"No daemon is listening on {path}: {start}.")
        return DaemonNotRunningError(f"No daemon answers at {self.url}: {exc}. Is it running, "
                                     "with operator.tcp_address set?")

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self._client.request(method, path, **kwargs)
        except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
            raise self._unreachable(exc) from exc
        except httpx.TimeoutException as exc:
            raise OperatorClientError(f"The daemon at {self.where} did not answer in time: "
                                      f"{exc!r}") from exc
        except httpx.HTTPError as exc:
            raise OperatorClientError(f"Talking to the daemon at {self.where} failed: "
                                      f"{exc!r}") from exc
        return _json_or_raise(response)

    # ------------------------------------------------------------------ requests

    async def health(self) -> dict[str, Any]:
        """The daemon's health: desks, newest event id."""
        result: dict[str, Any] = await self._request("GET", "/api/health")
        return result

    async def desks(self) -> list[dict[str, Any]]:
        """Every desk's status."""
        return list((await self._request("GET", "/api/desks"))["desks"])

    async def desk(self, desk: str) -> dict[str, Any]:
        """One desk's status."""
        result: dict[str, Any] = await self._request("GET", f"/api/desks/{_part(desk)}")
        return result

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: Sequence[ImageAttachment] = (), *,
                           idempotency_key: str | None = None) -> dict[str, Any]:
        """Sends a message: it steers a running turn or starts one.

        The message goes with an idempotency key (a new one unless given): when the daemon
        answers that it was not kept, or could not confirm it (its fleet's NATS down for a
        moment), it is sent again with the same key, so it is read once, a few times over
        a few seconds; then the daemon's answer is raised.

        Args:
            desk: The desk.
            text: The message (may be empty when it carries a picture).
            source: Who sends it.
            images: Pictures sent with it (at most four).
            idempotency_key: The key; a new one when None.

        Returns:
            ``{"id", "desk", "delivery"}``; delivery is ``steering`` or ``turn``.

        Raises:
            OperatorRequestError: Refused: a picture that is not one, of another format, or
                over the daemon's limit (HTTP 400 or 413, the limit named).
        """
        body: dict[str, Any] = {"text": text, "source": source}
        if images:
            body["images"] = [{"media_type": image.media_type, "name": image.name,
                               "data": base64.b64encode(image.data).decode("ascii")}
                              for image in images]
        return await self._post_message(desk, body, idempotency_key)

    async def send_and_wait(self, desk: str, text: str, source: str = "operator", *,
                            wait_seconds: float = 900.0) -> dict[str, Any]:
        """Sends a message and waits for the end of the turn that reads it.

        Args:
            desk: The desk.
            text: The message.
            source: Who sends it.
            wait_seconds: How long the daemon waits for the answer.

        Returns:
            ``{"id", "desk", "delivery", "reply": {"ok", "text", "error"}}``.

        Raises:
            OperatorRequestError: No answer within ``wait_seconds`` (``no_reply``).
        """
        body = {"text": text, "source": source, "wait": True, "timeout": wait_seconds}
        return await self._post_message(desk, body, None, timeout=wait_seconds + 30)

    async def _post_message(self, desk: str, body: dict[str, Any], key: str | None,
                            **options: Any) -> dict[str, Any]:
        """Posts a message under one idempotency key, again while the daemon says it was not
        kept or not confirmed (each attempt is read once at most)."""
        body = {**body, "idempotency_key": key or uuid.uuid4().hex}
        for wait in (*_MESSAGE_RETRY_SECONDS, None):
            try:
                result: dict[str, Any] = await self._request(
                    "POST", f"/api/desks/{_part(desk)}/messages", json=body, **options)
                return result
            except OperatorRequestError as exc:
                if wait is None or exc.code not in _NOT_KEPT:
                    raise
            await anyio.sleep(wait)
        raise AssertionError("unreachable")

    async def pause(self, desk: str, operator: str, reason: str) -> dict[str, Any]:
        """Holds a desk: no turns until it is resumed. Returns ``changed`` and the status."""
        result: dict[str, Any] = await self._request(
            "POST", f"/api/desks/{_part(desk)}/pause",
            json={"operator": operator, "reason": reason})
        return result

    async def resume(self, desk: str, operator: str) -> dict[str, Any]:
        """Lets a held desk take turns again. Returns ``changed``, ``waiting`` (the triggers
        that waited) and the status."""
        result: dict[str, Any] = await self._request(
            "POST", f"/api/desks/{_part(desk)}/resume", json={"operator": operator})
        return result

    async def reduce_only(self, desk: str, on: bool, operator: str,
                          reason: str = "") -> dict[str, Any]:
        """Puts a desk in reduce-only, or lifts it. Returns ``on``, ``state`` (or ``was``)
        and the status."""
        result: dict[str, Any] = await self._request(
            "POST", f"/api/desks/{_part(desk)}/reduce_only",
            json={"on": on, "operator": operator, "reason": reason})
        return result

    async def cancel(self, desk: str, operator: str, *, now: bool = False) -> bool:
        """Ends the desk's running turn (at its next safe point, or at once); False when
        none was running."""
        result = await self._request("POST", f"/api/desks/{_part(desk)}/cancel",
                                     json={"operator": operator, "now": now})
        return bool(result["cancelled"])

    async def retry(self, desk: str, operator: str) -> int:
        """Runs the desk's last turn again from its trigger; how many messages left what the
        desk is sent. A refusal (a turn running, nothing to retry) raises
        :class:`OperatorRequestError` saying why."""
        result = await self._request("POST", f"/api/desks/{_part(desk)}/retry",
                                     json={"operator": operator})
        return int(result["dropped"])

    async def kill_switch(self, on: bool, *, desk: str | None, operator: str, reason: str = "",
                          cancel_orders: bool = False, flatten: bool = False) -> dict[str, Any]:
        """Switches a desk's kill switch, or every desk's, on or off.

        Returns:
            The daemon's answer: ``halt`` (or ``was``), ``cancelled``, ``flattened``,
            ``failed``.
        """
        body: dict[str, Any] = {"on": on, "desk": desk, "operator": operator,
                                "reason": reason, "cancel_orders": cancel_orders,
                                "flatten": flatten}
        result: dict[str, Any] = await self._request("POST", "/api/kill-switch", json=body)
        return result

    async def reload(self, operator: str) -> dict[str, Any]:
        """Reads the daemon's config file again. Returns ``ok`` and ``changes`` (what
        changed, or why nothing did)."""
        result: dict[str, Any] = await self._request("POST", "/api/reload",
                                                     json={"operator": operator})
        return result

    async def pins(self, desk: str) -> dict[str, Any]:
        """A desk's standing instructions: ``pins`` (id, text, by, at) and ``configured``."""
        result: dict[str, Any] = await self._request("GET", f"/api/desks/{_part(desk)}/pins")
        return result

    async def pin(self, desk: str, text: str, operator: str) -> dict[str, Any]:
        """Pins an instruction to a desk. Returns ``pin`` and the desk's pins."""
        result: dict[str, Any] = await self._request(
            "POST", f"/api/desks/{_part(desk)}/pins", json={"text": text, "operator": operator})
        return result

    async def unpin(self, desk: str, pin_id: int, operator: str) -> dict[str, Any]:
        """Takes a pin off a desk. Returns ``unpinned`` and the desk's pins left."""
        result: dict[str, Any] = await self._request(
            "DELETE", f"/api/desks/{_part(desk)}/pins/{pin_id}", json={"operator": operator})
        return result

    async def kill_switches(self) -> list[dict[str, Any]]:
        """The kill switches that are on."""
        result = await self._request("GET", "/api/kill-switch")
        return list(result["halts"])

    async def compact(self, desk: str) -> bool:
        """Compacts a desk's conversation now; True when something was compacted."""
        result = await self._request("POST", f"/api/desks/{_part(desk)}/compact")
        return bool(result["compacted"])

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        """A page of a desk's stored messages, newest last."""
        params: dict[str, Any] = {"limit": limit}
        if before is not None:
            params["before"] = before
        result = await self._request("GET", f"/api/desks/{_part(desk)}/transcript",
                                     params=params)
        return list(result["messages"])

    async def positions(self, desk: str) -> dict[str, Any]:
        """The desk's own open positions at the marks: ``desk``, ``books`` (whether it keeps
        any), ``positions`` and ``markets`` (shapes in :mod:`trading_agent.operator.api`)."""
        result: dict[str, Any] = await self._request(
            "GET", f"/api/desks/{_part(desk)}/positions")
        return result

    async def orders(self, desk: str, *, every: bool = False) -> dict[str, Any]:
        """The desk's open orders (``every``: all of them): ``desk``, ``books``, ``orders``."""
        params = {"all": "1"} if every else {}
        result: dict[str, Any] = await self._request(
            "GET", f"/api/desks/{_part(desk)}/orders", params=params)
        return result

    async def trades(self, desk: str, *, since: str | None = None,
                     open_only: bool = False) -> dict[str, Any]:
        """The desk's round trips: ``desk``, ``books``, ``trades``; ``since`` a UTC day as
        YYYY-MM-DD (the daemon refuses anything else, saying so)."""
        params: dict[str, Any] = {}
        if since:
            params["since"] = since
        if open_only:
            params["open"] = "1"
        result: dict[str, Any] = await self._request(
            "GET", f"/api/desks/{_part(desk)}/trades", params=params)
        return result

    async def profit(self, desk: str, *, period: str = "daily",
                     since: str | None = None) -> dict[str, Any]:
        """The desk's profit: ``desk``, ``books``, ``period``, ``summary`` and ``rows``."""
        params: dict[str, Any] = {"period": period}
        if since:
            params["since"] = since
        result: dict[str, Any] = await self._request(
            "GET", f"/api/desks/{_part(desk)}/profit", params=params)
        return result

    async def cancel_order(self, desk: str, order_id: str,
                           operator: str = "operator") -> dict[str, Any]:
        """Cancels one open order of the desk's books: ``desk`` and ``order`` (the
        exchange's answer)."""
        result: dict[str, Any] = await self._request(
            "POST", f"/api/desks/{_part(desk)}/orders/{_part(order_id)}/cancel",
            json={"operator": operator})
        return result

    def set_surface(self, surface: str) -> None:
        """Names what the audit records this client's actions as (``cli``, ``chat``)."""
        self._client.headers["X-Operator-Surface"] = surface

    async def me(self) -> dict[str, Any]:
        """Who the daemon takes this client for: ``name``, ``role``, ``surface``."""
        result: dict[str, Any] = await self._request("GET", "/api/me")
        return result

    async def audit(self, *, desk: str | None = None, since: str | None = None,
                    limit: int = 200) -> list[dict[str, Any]]:
        """The newest operator actions (at most ``limit``), oldest first."""
        params: dict[str, Any] = {"limit": limit}
        if desk:
            params["desk"] = desk
        if since:
            params["since"] = since
        return list((await self._request("GET", "/api/audit", params=params))["actions"])

    async def approvals(self, desk: str | None = None) -> list[dict[str, Any]]:
        """Pending approvals."""
        params = {"desk": desk} if desk else {}
        return list((await self._request("GET", "/api/approvals", params=params))["approvals"])

    async def approve(self, approval_id: str, operator: str = "operator",
                      reason: str = "") -> dict[str, Any]:
        """Approves a held tool call."""
        result = await self._request("POST", f"/api/approvals/{_part(approval_id)}/approve",
                                     json={"operator": operator, "reason": reason})
        return dict(result["approval"])

    async def deny(self, approval_id: str, operator: str = "operator",
                   reason: str = "") -> dict[str, Any]:
        """Denies a held tool call; the desk's model reads the reason."""
        result = await self._request("POST", f"/api/approvals/{_part(approval_id)}/deny",
                                     json={"operator": operator, "reason": reason})
        return dict(result["approval"])

    async def events(self, *, desk: str | None = None, after: int | None = None,
                     tail: int | None = None, follow: bool = True,
                     reconnect: bool = True) -> AsyncIterator[StreamEvent]:
        """The event stream; it reconnects after a dropped connection, resuming after the
        last event seen, so nothing is missed or repeated.

        Args:
            desk: Only this desk's events.
            after: Start after this event id.
            tail: Start with the last ``tail`` events the daemon holds in memory.
            follow: Keep streaming; False ends once caught up.
            reconnect: Reconnect when the connection drops (following streams only).

        Yields:
            Events; a notice of type ``stream_open`` each time the stream is open (from
            then on nothing is missed), and while reconnecting one of type
            ``stream_reconnecting``.
        """
        last_id = after
        delay = 0.5
        while True:
            params: dict[str, Any] = {"follow": "1" if follow else "0"}
            if desk:
                params["desk"] = desk
            if last_id is not None:
                params["after"] = last_id
            elif tail:
                params["tail"] = tail
            try:
                async with self._client.stream(
                        "GET", "/api/events", params=params,
                        timeout=httpx.Timeout(self._client.timeout.connect, read=None)) as response:
                    if response.status_code != 200:
                        await response.aread()
                        _json_or_raise(response)
                    delay = 0.5
                    if last_id is None and STREAM_CURSOR_HEADER in response.headers:
                        # Asked "from now": resume from where that was, should we drop.
                        last_id = int(response.headers[STREAM_CURSOR_HEADER])
                    yield StreamEvent(None, {"type": "stream_open", "after": last_id})
                    async for event_id, data in parse_sse(response.aiter_lines()):
                        event = StreamEvent(int(event_id) if event_id else None, json.loads(data))
                        if event.id is not None:
                            last_id = event.id
                        yield event
                if not follow:
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if not (follow and reconnect):
                    raise self._unreachable(exc) from exc
                yield StreamEvent(None, {"type": "stream_reconnecting", "error": str(exc)
                                         or type(exc).__name__, "retry_in": delay})
            if not reconnect:
                return
            await anyio.sleep(delay)
            delay = min(delay * 2, 5.0)


_MESSAGE_RETRY_SECONDS = (0.5, 1.0, 2.0)
"""The waits before a message the daemon did not keep is sent again (same key)."""

_NOT_KEPT = frozenset({"message_not_kept", "message_not_confirmed"})


def _json_or_raise(response: httpx.Response) -> Any:
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.is_success:
        return data
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        raise OperatorRequestError(response.status_code, str(error.get("code", "")),
                                   str(error.get("message", "")))
    raise OperatorRequestError(response.status_code, "http_error",
                               response.text[:200] or response.reason_phrase)


def _part(text: str) -> str:
    """A path segment, escaped."""
    return quote(text, safe="")


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False
