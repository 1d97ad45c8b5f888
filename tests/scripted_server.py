"""A scripted OpenAI-compatible HTTP server on loopback, for tests.

Real HTTP/1.1 on ``127.0.0.1`` (keep-alive, chunked SSE), served by a small asyncio server in a
thread of its own, so it works the same under any test's event loop (or none). A test gives
it a *script*, one step per chat-completions request, and checks afterwards what the model
was sent and that the script ran out::

    server.add(
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})]),
        rate_limited(retry_after=2),
        Reply("BTC is at 64,000.", text_chunks=3),
    )
    ...  # run the code under test against server.base_url
    assert server.requests[0].messages[0]["role"] == "system"
    server.assert_complete()

Steps: :class:`Reply` (text and/or tool calls, usage or none, delays, chunking, a dropped
connection, a hold until the test releases it), :class:`HttpError` (and the helpers
:func:`rate_limited`, :func:`server_error`, :func:`context_overflow`, :func:`unauthorized`),
:func:`dropped_stream`, :func:`slow`, and, to replay captured traffic or untidy servers,
:class:`RawSSE`, :class:`RawJSON` and :class:`SSEChunks`. Instead of (or after) a script, a
*responder* computes each step from the request (benchmarks, long randomized runs).

``GET /v1/models`` lists the server's model and uses no step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from types import TracebackType
from typing import Any

import anyio

__all__ = [
    "HttpError",
    "RawJSON",
    "RawSSE",
    "RecordedRequest",
    "Reply",
    "Responder",
    "SSEChunks",
    "ScriptedServer",
    "Step",
    "ToolCall",
    "calls_then_answer",
    "context_overflow",
    "dropped_stream",
    "rate_limited",
    "server_error",
    "slow",
    "unauthorized",
]

AUTO = "auto"
"""For :attr:`Reply.usage` and :attr:`ToolCall.id`: let the server make one up."""


# --------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class ToolCall:
    """A tool call in a scripted reply.

    Attributes:
        name: The function's name.
        arguments: A dict (sent as JSON) or the raw text (maybe invalid, to test that).
        id: The call id; ``"auto"`` makes up ``call_<n>``; None leaves the id out.
        argument_chunks: How many deltas the arguments are split into.
    """

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)
    id: str | int | None = AUTO
    argument_chunks: int = 1

    @property
    def arguments_text(self) -> str:
        """The arguments as the JSON text sent."""
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(dict(self.arguments))


@dataclass(frozen=True)
class Reply:
    """A model answer, streamed as OpenAI does (or as one JSON when not streamed).

    Attributes:
        text: The answer's text, or its exact deltas as a sequence of pieces.
        tool_calls: Tool calls, sent after the text, with consecutive indexes.
        text_chunks: How many deltas a string ``text`` is split into.
        usage: ``(prompt_tokens, completion_tokens)``; ``"auto"`` makes up figures from the
            request's size; None sends no usage. Streamed usage is only sent when the
            request asked for it (``stream_options.include_usage``), as OpenAI does.
        finish_reason: Defaults to ``tool_calls`` when there are tool calls, else ``stop``.
        delay: Seconds to wait before the response starts (longer than the client's timeout
            makes a slow server).
        chunk_delay: Seconds between chunks.
        drop_after: Close the socket after this many SSE events, without ending the stream.
        hold_until: Wait for this event before answering (set it from the test).
        cached_tokens: With usage, also sent as ``prompt_tokens_details.cached_tokens``
            (the prompt tokens OpenAI served from its prompt cache); None sends no details.
    """

    text: str | Sequence[str] = ""
    tool_calls: Sequence[ToolCall] = ()
    text_chunks: int = 1
    usage: tuple[int, int] | str | None = AUTO
    finish_reason: str | None = None
    delay: float = 0.0
    chunk_delay: float = 0.0
    drop_after: int | None = None
    hold_until: threading.Event | None = None
    cached_tokens: int | None = None

    @property
    def text_pieces(self) -> list[str]:
        """The text deltas, in order."""
        if not isinstance(self.text, str):
            return [piece for piece in self.text if piece]
        if not self.text:
            return []
        return _split(self.text, self.text_chunks)

    @property
    def full_text(self) -> str:
        """The whole text."""
        return "".join(self.text_pieces)


@dataclass(frozen=True)
class HttpError:
    """An error response in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Attributes:
        status: The HTTP status.
        message: The error's message.
        type: The error's type.
        code: The error's code.
        headers: Extra response headers (``Retry-After``...).
        delay: Seconds to wait before answering.
    """

    status: int
    message: str = "scripted error"
    type: str = "server_error"
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass(frozen=True)
class RawSSE:
    """A captured SSE body, replayed verbatim (one event at a time with ``chunk_delay``).

    Attributes:
        text: The body, events separated by blank lines.
        status: The HTTP status.
        headers: Extra response headers.
        chunk_delay: Seconds between events; 0 sends the whole body at once.
        delay: Seconds before the answer starts (a model's latency).
    """

    text: str
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    chunk_delay: float = 0.0
    delay: float = 0.0


@dataclass(frozen=True)
class RawJSON:
    """A JSON (or any text) response, replayed verbatim.

    Attributes:
        status: The HTTP status.
        body: A JSON-able value, or the exact text/bytes to send.
        headers: Extra response headers.
    """

    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SSEChunks:
    """Hand-made stream chunks: each dict is sent as ``data: <json>``, a str as-is.

    Attributes:
        chunks: The events' data.
        done: Whether ``data: [DONE]`` ends the stream.
        drop: Close the socket after the chunks instead of ending the response.
        chunk_delay: Seconds between chunks.
    """

    chunks: Sequence[Mapping[str, Any] | str]
    done: bool = True
    drop: bool = False
    chunk_delay: float = 0.0


Step = Reply | HttpError | RawSSE | RawJSON | SSEChunks
"""One scripted response."""


def rate_limited(retry_after: float | str | None = 1, *,
                 retry_after_ms: float | None = None) -> HttpError:
    """A 429, with ``Retry-After`` (seconds or an HTTP date) and/or ``retry-after-ms``."""
    headers: dict[str, str] = {}
    if retry_after is not None:
        headers["Retry-After"] = (retry_after if isinstance(retry_after, str)
                                  else f"{retry_after:g}")
    if retry_after_ms is not None:
        headers["retry-after-ms"] = f"{retry_after_ms:g}"
    return HttpError(429, "Rate limit reached for requests", "requests", "rate_limit_exceeded",
                     headers)


def server_error(status: int = 500, message: str = "The server had an error") -> HttpError:
    """A 5xx (or 408/409) error."""
    return HttpError(status, message, "server_error")


def context_overflow(
    message: str = ("This model's maximum context length is 8192 tokens. However, your "
                    "messages resulted in 9100 tokens. Please reduce the length of the messages."),
) -> HttpError:
    """OpenAI's 400 ``context_length_exceeded``."""
    return HttpError(400, message, "invalid_request_error", "context_length_exceeded")


def unauthorized(message: str = "Incorrect API key provided.") -> HttpError:
    """A 401 ``invalid_api_key``."""
    return HttpError(401, message, "invalid_request_error", "invalid_api_key")


def dropped_stream(text: str = "This answer will be cut", after_chunks: int = 2) -> Reply:
    """A reply whose connection is closed after ``after_chunks`` events, with no end."""
    return Reply(text, text_chunks=4, drop_after=after_chunks)


def slow(delay: float, reply: Reply | None = None) -> Reply:
    """A reply that starts only after ``delay`` seconds."""
    return dataclasses.replace(reply if reply is not None else Reply("late"), delay=delay)


def _split(text: str, parts: int) -> list[str]:
    parts = max(1, min(parts, len(text)))
    size, extra = divmod(len(text), parts)
    pieces, start = [], 0
    for index in range(parts):
        end = start + size + (1 if index < extra else 0)
        pieces.append(text[start:end])
        start = end
    return pieces


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class RecordedRequest:
    """One request the server received.

    Attributes:
        method: ``GET``, ``POST``...
        path: The request path (``/v1/chat/completions``).
        headers: The headers, names in lower case.
        body: The raw body.
        received_at: ``time.monotonic()`` when the body was read.
    """

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    received_at: float

    @functools.cached_property
    def json(self) -> Any:
        """The body parsed as JSON, once (None when empty)."""
        return json.loads(self.body) if self.body else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The ``messages`` sent."""
        return list(self.json["messages"])

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The ``tools`` sent (empty when none)."""
        return list(self.json.get("tools") or [])

    @property
    def stream(self) -> bool:
        """Whether the client asked for a stream."""
        return bool(self.json.get("stream"))


Responder = Callable[[RecordedRequest], Step]
"""Computes the step for a request (used when the script has run out)."""


def calls_then_answer(tool: str, times: int, answer: str = "Done.",
                      arguments: Mapping[str, Any] | None = None) -> Responder:
    """A responder that calls ``tool`` until ``times`` results are in the request, then answers.

    Counts the ``tool`` messages of each request, so it follows any number of turns:
    a benchmark or a long randomized run can use it as is.
    """
    def respond(request: RecordedRequest) -> Step:
        results = sum(1 for m in request.messages if m.get("role") == "tool")
        if results < times:
            return Reply(tool_calls=[ToolCall(tool, dict(arguments or {}))])
        return Reply(answer)

    return respond


# --------------------------------------------------------------------------- the server


class ScriptedServer:
    """An OpenAI-compatible server that answers from a script, on ``127.0.0.1``.

    Args:
        steps: The script to start with.
        responder: Called for each request once the script has run out.
        model: The model name ``/v1/models`` lists and replies carry.
    """

    def __init__(self, steps: Sequence[Step] = (), *, responder: Responder | None = None,
                 model: str = "scripted-model") -> None:
        self.model = model
        self.responder = responder
        self.tokenizer: Callable[[str], int] | None = None
        """When set, ``POST /tokenize`` answers (as llama.cpp's server does) with this many
        tokens for the ``content`` given; else that route is unknown, as on OpenAI's API."""
        self.requests: list[RecordedRequest] = []
        """The chat-completions requests, in order of arrival."""
        self.answered: list[RecordedRequest] = []
        """The chat-completions requests whose answer was written whole, in that order (a
        held reply joins once its test let it go and it was sent)."""
        self.other_requests: list[RecordedRequest] = []
        """Every other request (``/v1/models``, unknown paths)."""
        self.unexpected: list[RecordedRequest] = []
        """Requests that came when there was no step and no responder."""
        self.errors: list[BaseException] = []
        """Failures inside the server itself (a bug in a step or a responder)."""
        self.connections = 0
        """How many TCP connections were accepted (to check keep-alive)."""
        self._steps: deque[Step] = deque(steps)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._sockets: set[socket.socket] = set()

    # ------------------------------------------------------------------ the script

    def add(self, *steps: Step) -> ScriptedServer:
        """Appends steps to the script.

        Args:
            *steps: The steps, in the order requests will get them.

        Returns:
            The server, for chaining.
        """
        with self._lock:
            self._steps.extend(steps)
        return self

    @property
    def remaining(self) -> int:
        """Steps not used yet."""
        with self._lock:
            return len(self._steps)

    def assert_complete(self) -> None:
        """Checks the script ran out, no request went unanswered and the server never failed.

        Raises:
            AssertionError: Naming what is left or what went wrong.
        """
        with self._lock:
            left = list(self._steps)
        problems = []
        if left:
            problems.append(f"{len(left)} scripted step(s) never requested: {left!r}")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} request(s) came after the script ran out")
        if self.errors:
            problems.append(f"the server failed: {self.errors!r}")
        assert not problems, "; ".join(problems)

    async def wait_for_requests(self, count: int) -> list[RecordedRequest]:
        """Waits, without blocking the event loop, until ``count`` requests have arrived.

        Bound it with ``anyio.fail_after``.

        Args:
            count: How many chat-completions requests to wait for.

        Returns:
            The requests so far.
        """
        # Requests arrive on the server's thread, which cannot set this loop's events.
        while len(self.requests) < count:  # noqa: ASYNC110
            await anyio.sleep(0.002)
        return list(self.requests)

    def _next_step(self, request: RecordedRequest) -> Step | None:
        with self._lock:
            if self._steps:
                return self._steps.popleft()
        if self.responder is not None:
            return self.responder(request)
        return None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        """The API root, ending in ``/v1``."""
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._port

    def start(self) -> ScriptedServer:
        """Starts serving in a background thread; returns once it listens."""
        if self._thread is not None:
            raise RuntimeError("the scripted server is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="scripted-server", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the scripted server did not start")
        if self.errors:
            raise RuntimeError(f"the scripted server could not start: {self.errors[0]!r}")
        return self

    def stop(self) -> None:
        """Stops serving, drops open connections and joins the thread."""
        if self._thread is None or self._loop is None:
            return
        stopping = self._stopping
        if stopping is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(stopping.set)
        self._thread.join(10)
        if self._thread.is_alive():  # pragma: no cover - a stuck handler
            raise RuntimeError("the scripted server did not stop")
        self._loop.close()
        self._thread = None

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _run(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # pragma: no cover - reported by start()/assert_complete
            self.errors.append(exc)
        finally:
            self._started.set()
            asyncio.set_event_loop(None)

    async def _serve(self) -> None:
        # Accepting by hand, not with asyncio.start_server: Python 3.11's server leaks the
        # socket of a connection accepted just as it closes, and never closes connections.
        loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        self._port = listener.getsockname()[1]
        loop.add_reader(listener.fileno(), self._accept, listener)
        self._started.set()
        try:
            await self._stopping.wait()
        finally:
            loop.remove_reader(listener.fileno())
            listener.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for connection in list(self._sockets):  # handlers cancelled before they ran
                connection.close()
            for _ in range(3):  # aborted transports close their sockets in a later callback
                await asyncio.sleep(0)

    def _accept(self, listener: socket.socket) -> None:
        """Accepts every waiting connection (synchronously: none can be lost)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                connection, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            connection.setblocking(False)
            # Small SSE writes must not wait for the client's delayed ACK (Nagle).
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets.add(connection)
            self.connections += 1
            task = loop.create_task(self._connection(connection))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ HTTP

    async def _connection(self, connection: socket.socket) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=connection)
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                keep_open = await self._respond(request, writer)
                if not keep_open or request.headers.get("connection", "").lower() == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as exc:  # a bug in a step or a responder: reported, not hidden
            self.errors.append(exc)
            if writer is not None:
                with contextlib.suppress(Exception):
                    await _send_json(writer, 500, {"error": {
                        "message": f"scripted server: {exc!r}", "type": "server_error"}})
        finally:
            if writer is not None:
                writer.transport.abort()
            else:
                connection.close()
            self._sockets.discard(connection)

    async def _respond(self, request: RecordedRequest, writer: asyncio.StreamWriter) -> bool:
        """Answers one request; returns False when the connection must be closed."""
        path = request.path.split("?", 1)[0].rstrip("/")
        if "://" in path:  # absolute form: the server stands in for a forward proxy too
            path = "/" + path.split("://", 1)[1].partition("/")[2]
        if request.method == "GET" and path in ("/v1/models", "/models"):
            self.other_requests.append(request)
            await _send_json(writer, 200, {"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 0, "owned_by": "scripted"}]})
            return True
        if request.method == "POST" and path == "/tokenize" and self.tokenizer is not None:
            self.other_requests.append(request)
            count = self.tokenizer(str(request.json.get("content", "")))
            await _send_json(writer, 200, {"tokens": list(range(count))})
            return True
        if request.method != "POST" or path not in ("/v1/chat/completions", "/chat/completions"):
            self.other_requests.append(request)
            await _send_json(writer, 404, {"error": {"message": f"no route {request.path}",
                                                     "type": "invalid_request_error"}})
            return True
        self.requests.append(request)
        step = self._next_step(request)
        if step is None:
            self.unexpected.append(request)
            # A 400, not a 5xx, so a retrying client stops at once instead of looping.
            await _send_json(writer, 400, {"error": {
                "message": "scripted server: the script ran out and there is no responder",
                "type": "invalid_request_error", "code": "script_exhausted"}})
            return True
        keep_open = await self._play(step, request, writer)
        self.answered.append(request)
        return keep_open

    async def _play(self, step: Step, request: RecordedRequest,
                    writer: asyncio.StreamWriter) -> bool:
        if isinstance(step, HttpError):
            await asyncio.sleep(step.delay)
            error = {"message": step.message, "type": step.type, "param": None,
                     "code": step.code}
            await _send_json(writer, step.status, {"error": error}, step.headers)
            return True
        if isinstance(step, RawJSON):
            await _send_json(writer, step.status, step.body, step.headers)
            return True
        if isinstance(step, RawSSE):
            await asyncio.sleep(step.delay)
            texts = ([step.text] if step.chunk_delay <= 0
                     else [e + "\n\n" for e in step.text.split("\n\n") if e.strip()])
            await _send_stream(writer, [t.encode() for t in texts], step.chunk_delay,
                               status=step.status, headers=step.headers)
            return True
        if isinstance(step, SSEChunks):
            events = [_event(c if isinstance(c, str) else json.dumps(c)) for c in step.chunks]
            if step.done and not step.drop:
                events.append(_event("[DONE]"))
            await _send_stream(writer, events, step.chunk_delay, drop=step.drop)
            return not step.drop
        if step.hold_until is not None:
            # A threading.Event, set from the test's thread: poll it.
            while not step.hold_until.is_set():  # noqa: ASYNC110
                await asyncio.sleep(0.002)
        await asyncio.sleep(step.delay)
        body = request.json or {}
        if not body.get("stream"):
            await _send_json(writer, 200, self._completion(step, request))
            return True
        events = self._chunks(step, request)
        drop = step.drop_after is not None
        if drop:
            events = events[:step.drop_after]
        await _send_stream(writer, events, step.chunk_delay, drop=drop)
        return not drop

    def _usage(self, step: Reply, request: RecordedRequest) -> dict[str, Any] | None:
        if step.usage is None:
            return None
        if isinstance(step.usage, tuple):
            prompt, completion = step.usage
        else:
            prompt = max(1, len(request.body) // 4)
            chars = len(step.full_text) + sum(len(c.name) + len(c.arguments_text)
                                              for c in step.tool_calls)
            completion = max(1, chars // 4)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if step.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": step.cached_tokens,
                                              "audio_tokens": 0}
        return usage

    def _call_ids(self, step: Reply) -> list[str | int | None]:
        return [f"call_{next(self._ids)}" if call.id == AUTO else call.id
                for call in step.tool_calls]

    def _finish_reason(self, step: Reply) -> str:
        return step.finish_reason or ("tool_calls" if step.tool_calls else "stop")

    def _completion(self, step: Reply, request: RecordedRequest) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": step.full_text or None}
        if step.tool_calls:
            message["tool_calls"] = [
                _without_none({"id": call_id, "type": "function",
                               "function": {"name": call.name,
                                            "arguments": call.arguments_text}})
                for call, call_id in zip(step.tool_calls, self._call_ids(step), strict=True)]
        body: dict[str, Any] = {
            "id": f"chatcmpl-scripted-{next(self._ids)}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": self._finish_reason(step)}]}
        usage = self._usage(step, request)
        if usage is not None:
            body["usage"] = usage
        return body

    def _chunks(self, step: Reply, request: RecordedRequest) -> list[bytes]:
        base = {"id": f"chatcmpl-scripted-{next(self._ids)}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model}

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return _event(json.dumps({**base, "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish_reason}]}))

        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"content": piece}) for piece in step.text_pieces]
        for index, (call, call_id) in enumerate(
                zip(step.tool_calls, self._call_ids(step), strict=True)):
            arguments = _split(call.arguments_text, call.argument_chunks) or [""]
            first = _without_none({"index": index, "id": call_id, "type": "function",
                                   "function": {"name": call.name, "arguments": arguments[0]}})
            events.append(chunk({"tool_calls": [first]}))
            events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                       for piece in arguments[1:]]
        events.append(chunk({}, self._finish_reason(step)))
        usage = self._usage(step, request)
        options = (request.json or {}).get("stream_options") or {}
        if usage is not None and options.get("include_usage"):
            events.append(_event(json.dumps({**base, "choices": [], "usage": usage})))
        events.append(_event("[DONE]"))
        return events


def _without_none(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


async def _read_request(reader: asyncio.StreamReader) -> RecordedRequest | None:
    """Reads one HTTP/1.1 request; None when the client closed the connection."""
    line = await reader.readline()
    while line in (b"\r\n", b"\n"):  # tolerated between keep-alive requests
        line = await reader.readline()
    if not line:
        return None
    method, target, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: dict[str, str] = {}
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts = []
        while True:
            size = int((await reader.readline()).split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    else:
        body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
    return RecordedRequest(method, target, headers, body, time.monotonic())


def _head(status: int, headers: Mapping[str, str]) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = "Status"
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send_json(writer: asyncio.StreamWriter, status: int, body: Any,
                     headers: Mapping[str, str] | None = None) -> None:
    if isinstance(body, bytes):
        data = body
    elif isinstance(body, str):
        data = body.encode()
    else:
        data = json.dumps(body).encode()
    head = {"Content-Type": "application/json", "Content-Length": str(len(data)),
            **(headers or {})}
    writer.write(_head(status, head) + data)
    await writer.drain()


async def _send_stream(writer: asyncio.StreamWriter, events: Sequence[bytes], delay: float,
                       *, status: int = 200, headers: Mapping[str, str] | None = None,
                       drop: bool = False) -> None:
    """Sends events as a chunked SSE body; with ``drop``, closes the socket instead of ending."""
    head = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "Transfer-Encoding": "chunked", **(headers or {})}
    writer.write(_head(status, head))
    await writer.drain()
    for index, event in enumerate(events):
        if delay > 0 and index:
            await asyncio.sleep(delay)
        if not event:
            continue  # a chunk of size 0 would end the body
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
    if drop:
        await asyncio.sleep(0.01)  # let the client read what was sent before the cut
        writer.transport.abort()
        return
    writer.write(b"0\r\n\r\n")
    await writer.drain()


