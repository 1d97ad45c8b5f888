"""A scripted Anthropic-compatible Messages API server on loopback, for tests.

The HTTP side (a thread of its own, keep-alive, chunked SSE, recording, the script and
:meth:`~tests.scripted_server.ScriptedServer.assert_complete`) is the OpenAI scripted
server's: this one subclasses it and only speaks Anthropic's wire format on
``POST /v1/messages``. The OpenAI server's steps mean the same here::

    server.add(
        Answer(thinking="The tick is small.", tool_calls=[ToolCall("get_ticker", {...})]),
        rate_limited(retry_after=2),
        Reply("BTC is at 64,000.", usage=(1200, 40), cached_tokens=9000),
    )
    ...  # run the backend against server.base_url (the API root, no /v1)
    assert server.requests[0].json["system"][0]["cache_control"] == {"type": "ephemeral"}
    server.assert_complete()

- :class:`~tests.scripted_server.Reply`: text and tool calls (``toolu_<n>`` ids when
  ``"auto"``), ``usage`` as ``(input_tokens, output_tokens)`` where the input is Anthropic's
  uncached part, ``cached_tokens`` sent as ``cache_read_input_tokens``, ``finish_reason`` as
  the ``stop_reason`` (``end_turn`` or ``tool_use`` by default); delays, holds and
  ``drop_after`` (counted in SSE events) as there.
- :class:`Answer`: a reply with thinking (deltas and a signature, or a redacted block) and
  ``cache_creation_input_tokens``.
- :class:`~tests.scripted_server.HttpError`, in Anthropic's shape
  (``{"type": "error", "error": {"type", "message"}}``) with a ``request-id`` header; the
  helpers :func:`rate_limited`, :func:`overloaded`, :func:`server_error`,
  :func:`unauthorized`, :func:`forbidden`, :func:`prompt_too_long`.
- :func:`dropped_stream`, :class:`StreamError` (an ``error`` event mid-stream),
  :class:`Events` (hand-made events), and the OpenAI server's ``RawSSE`` and ``RawJSON``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tests.scripted_server import (
    AUTO,
    HttpError,
    RawJSON,
    RawSSE,
    RecordedRequest,
    Reply,
    ScriptedServer,
    SSEChunks,
    ToolCall,
    _send_json,
    _send_stream,
    _split,
)

__all__ = [
    "Answer",
    "AnthropicScriptedServer",
    "AnthropicStep",
    "Events",
    "HttpError",
    "RawJSON",
    "RawSSE",
    "Reply",
    "StreamError",
    "ToolCall",
    "dropped_stream",
    "forbidden",
    "overloaded",
    "prompt_too_long",
    "rate_limited",
    "server_error",
    "unauthorized",
]

MESSAGES_PATH = "/v1/messages"


# --------------------------------------------------------------------------- steps


@dataclass(frozen=True)
class Answer(Reply):
    """A :class:`~tests.scripted_server.Reply` with Anthropic's extras.

    Attributes:
        thinking: The thinking text (or its exact deltas), sent as a thinking block first.
        thinking_chunks: How many deltas a string ``thinking`` is split into.
        signature: The thinking block's signature (sent as a ``signature_delta``).
        redacted_thinking: The data of a ``redacted_thinking`` block, sent after the
            thinking; None for none.
        cache_creation_tokens: With usage, ``cache_creation_input_tokens``.
    """

    thinking: str | Sequence[str] = ""
    thinking_chunks: int = 1
    signature: str = "scripted-signature"
    redacted_thinking: str | None = None
    cache_creation_tokens: int | None = None

    @property
    def thinking_pieces(self) -> list[str]:
        """The thinking deltas, in order."""
        if not isinstance(self.thinking, str):
            return [piece for piece in self.thinking if piece]
        return _split(self.thinking, self.thinking_chunks) if self.thinking else []


@dataclass(frozen=True)
class StreamError:
    """A stream that starts, sends some text, then an ``error`` event (and ends).

    Attributes:
        type: The error's type (``overloaded_error``, ``api_error``...).
        message: The error's message.
        text: Text streamed before the error.
    """

    type: str = "overloaded_error"
    message: str = "Overloaded"
    text: str = "Half an ans"


@dataclass(frozen=True)
class Events:
    """Hand-made stream events: each dict is sent as ``event: <its type>`` and its JSON.

    Attributes:
        events: The events.
        drop: Close the socket after them instead of ending the response.
        chunk_delay: Seconds between events.
    """

    events: Sequence[Mapping[str, Any]]
    drop: bool = False
    chunk_delay: float = 0.0


AnthropicStep = Reply | HttpError | RawSSE | RawJSON | StreamError | Events
"""One scripted response."""


def _error(status: int, message: str, kind: str,
           headers: Mapping[str, str] | None = None) -> HttpError:
    return HttpError(status, message, kind, headers=dict(headers or {}))


def rate_limited(retry_after: float | str | None = 1) -> HttpError:
    """A 429 ``rate_limit_error``, with ``retry-after`` (seconds or an HTTP date)."""
    headers = {} if retry_after is None else {
        "retry-after": retry_after if isinstance(retry_after, str) else f"{retry_after:g}"}
    return _error(429, "Number of request tokens has exceeded your per-minute rate limit",
                  "rate_limit_error", headers)


def overloaded(retry_after: float | None = None) -> HttpError:
    """A 529 ``overloaded_error``."""
    headers = {} if retry_after is None else {"retry-after": f"{retry_after:g}"}
    return _error(529, "Overloaded", "overloaded_error", headers)


def server_error(status: int = 500, message: str = "Internal server error") -> HttpError:
    """A 5xx ``api_error`` (or another status)."""
    return _error(status, message, "api_error")


def unauthorized(message: str = "invalid x-api-key") -> HttpError:
    """A 401 ``authentication_error``."""
    return _error(401, message, "authentication_error")


def forbidden(message: str = "Your API key does not have permission to use this model"
              ) -> HttpError:
    """A 403 ``permission_error``."""
    return _error(403, message, "permission_error")


def prompt_too_long(tokens: int = 210_345, maximum: int = 200_000) -> HttpError:
    """The 400 ``invalid_request_error`` Anthropic sends for a prompt over the window."""
    return _error(400, f"prompt is too long: {tokens} tokens > {maximum} maximum",
                  "invalid_request_error")


def dropped_stream(text: str = "This answer will be cut", after_events: int = 4) -> Reply:
    """A reply whose connection is closed after ``after_events`` SSE events, with no end
    (the default: the message start, the text block's start and two of its deltas)."""
    return Reply(text, text_chunks=4, drop_after=after_events)


# --------------------------------------------------------------------------- the server


def _event(data: Mapping[str, Any]) -> bytes:
    return f"event: {data.get('type', 'message')}\ndata: {json.dumps(data)}\n\n".encode()


class AnthropicScriptedServer(ScriptedServer):
    """An Anthropic-compatible server that answers from a script, on ``127.0.0.1``.

    Args:
        steps: The script to start with.
        model: The model name replies carry.
    """

    def __init__(self, steps: Sequence[AnthropicStep] = (), *,
                 model: str = "scripted-claude") -> None:
        super().__init__(model=model)
        self.add(*steps)
        self._message_ids = itertools.count(1)

    def add(self, *steps: AnthropicStep) -> AnthropicScriptedServer:  # type: ignore[override]
        """Appends steps to the script.

        Args:
            *steps: The steps, in the order requests will get them.

        Returns:
            The server, for chaining.
        """
        super().add(*steps)  # type: ignore[arg-type]
        return self

    @property
    def base_url(self) -> str:
        """The API root, as Anthropic's (``https://api.anthropic.com``): no ``/v1``."""
        return f"http://127.0.0.1:{self.port}"

    async def _respond(self, request: RecordedRequest, writer: asyncio.StreamWriter) -> bool:
        path = request.path.split("?", 1)[0].rstrip("/")
        if request.method != "POST" or path != MESSAGES_PATH:
            self.other_requests.append(request)
            await _send_json(writer, 404, {"type": "error", "error": {
                "type": "not_found_error", "message": f"no route {request.path}"}})
            return True
        self.requests.append(request)
        step = self._next_step(request)
        if step is None:
            self.unexpected.append(request)
            await _send_json(writer, 400, {"type": "error", "error": {
                "type": "invalid_request_error",
                "message": "scripted server: the script ran out and there is no responder"}})
            return True
        return await self._play(step, request, writer)

    async def _play(self, step: Any, request: RecordedRequest,
                    writer: asyncio.StreamWriter) -> bool:
        if isinstance(step, HttpError):
            await asyncio.sleep(step.delay)
            headers = {"request-id": f"req_scripted_{next(self._message_ids)}", **step.headers}
            await _send_json(writer, step.status, {"type": "error", "error": {
                "type": step.type, "message": step.message}}, headers)
            return True
        if isinstance(step, StreamError):
            events = self._events(Reply(step.text), request)[:4]
            events.append(_event({"type": "error", "error": {"type": step.type,
                                                              "message": step.message}}))
            await _send_stream(writer, events, 0.0)
            return True
        if isinstance(step, Events):
            await _send_stream(writer, [_event(e) for e in step.events], step.chunk_delay,
                               drop=step.drop)
            return not step.drop
        if isinstance(step, RawSSE | RawJSON):
            return await super()._play(step, request, writer)
        if isinstance(step, SSEChunks):
            raise TypeError("SSEChunks is OpenAI's stream shape; use Events here")
        assert isinstance(step, Reply)
        if step.hold_until is not None:
            while not step.hold_until.is_set():  # noqa: ASYNC110 - a thread's event
                await asyncio.sleep(0.002)
        await asyncio.sleep(step.delay)
        if not (request.json or {}).get("stream"):
            await _send_json(writer, 200, self._message(step, request))
            return True
        events = self._events(step, request)
        drop = step.drop_after is not None
        if step.drop_after is not None:
            events = events[:step.drop_after]
        await _send_stream(writer, events, step.chunk_delay, drop=drop)
        return not drop

    # ------------------------------------------------------------------ replies

    def _call_ids(self, step: Reply) -> list[str | int | None]:
        return [f"toolu_{next(self._ids)}" if call.id == AUTO else call.id
                for call in step.tool_calls]

    def _stop_reason(self, step: Reply) -> str:
        return step.finish_reason or ("tool_use" if step.tool_calls else "end_turn")

    def _figures(self, step: Reply, request: RecordedRequest) -> dict[str, int] | None:
        """The usage the reply reports, or None."""
        if step.usage is None:
            return None
        if isinstance(step.usage, tuple):
            fresh, output = step.usage
        else:
            fresh = max(1, len(request.body) // 4)
            chars = len(step.full_text) + sum(len(c.name) + len(c.arguments_text)
                                              for c in step.tool_calls)
            output = max(1, chars // 4)
        written = step.cache_creation_tokens if isinstance(step, Answer) else None
        return {"input_tokens": fresh, "cache_creation_input_tokens": written or 0,
                "cache_read_input_tokens": step.cached_tokens or 0, "output_tokens": output}

    def _blocks(self, step: Reply) -> list[dict[str, Any]]:
        """The reply's content blocks, whole."""
        blocks: list[dict[str, Any]] = []
        if isinstance(step, Answer):
            if step.thinking_pieces:
                blocks.append({"type": "thinking", "thinking": "".join(step.thinking_pieces),
                               "signature": step.signature})
            if step.redacted_thinking is not None:
                blocks.append({"type": "redacted_thinking", "data": step.redacted_thinking})
        if step.text_pieces:
            blocks.append({"type": "text", "text": step.full_text})
        for call, call_id in zip(step.tool_calls, self._call_ids(step), strict=True):
            try:
                arguments = json.loads(call.arguments_text)
            except ValueError:
                arguments = {"unparsed": call.arguments_text}
            blocks.append({"type": "tool_use", "id": call_id, "name": call.name,
                           "input": arguments})
        return blocks

    def _message(self, step: Reply, request: RecordedRequest) -> dict[str, Any]:
        """The whole message, as a non-streamed request gets it."""
        message: dict[str, Any] = {
            "id": f"msg_scripted_{next(self._message_ids)}", "type": "message",
            "role": "assistant", "model": self.model, "content": self._blocks(step),
            "stop_reason": self._stop_reason(step), "stop_sequence": None}
        usage = self._figures(step, request)
        if usage is not None:
            message["usage"] = usage
        return message

    def _events(self, step: Reply, request: RecordedRequest) -> list[bytes]:
        """The reply as Anthropic streams it."""
        usage = self._figures(step, request)
        start: dict[str, Any] = {
            "id": f"msg_scripted_{next(self._message_ids)}", "type": "message",
            "role": "assistant", "model": self.model, "content": [], "stop_reason": None,
            "stop_sequence": None}
        if usage is not None:
            start["usage"] = {**usage, "output_tokens": 1}
        events = [_event({"type": "message_start", "message": start})]
        index = 0

        def block(opening: dict[str, Any], deltas: list[dict[str, Any]]) -> None:
            nonlocal index
            events.append(_event({"type": "content_block_start", "index": index,
                                  "content_block": opening}))
            events.extend(_event({"type": "content_block_delta", "index": index,
                                  "delta": delta}) for delta in deltas)
            events.append(_event({"type": "content_block_stop", "index": index}))
            index += 1

        if isinstance(step, Answer):
            if step.thinking_pieces:
                block({"type": "thinking", "thinking": "", "signature": ""},
                      [{"type": "thinking_delta", "thinking": piece}
                       for piece in step.thinking_pieces]
                      + [{"type": "signature_delta", "signature": step.signature}])
            if step.redacted_thinking is not None:
                block({"type": "redacted_thinking", "data": step.redacted_thinking}, [])
        if step.text_pieces:
            block({"type": "text", "text": ""},
                  [{"type": "text_delta", "text": piece} for piece in step.text_pieces])
        events.append(_event({"type": "ping"}))
        for call, call_id in zip(step.tool_calls, self._call_ids(step), strict=True):
            pieces = _split(call.arguments_text, call.argument_chunks)
            block({"type": "tool_use", "id": call_id, "name": call.name, "input": {}},
                  [{"type": "input_json_delta", "partial_json": piece} for piece in pieces])
        delta: dict[str, Any] = {"type": "message_delta", "delta": {
            "stop_reason": self._stop_reason(step), "stop_sequence": None}}
        if usage is not None:
            delta["usage"] = {"output_tokens": usage["output_tokens"]}
        events += [_event(delta), _event({"type": "message_stop"})]
        return events

