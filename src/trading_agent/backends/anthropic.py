"""A model backend that speaks Anthropic's Messages API natively.

The conversation's content blocks are already Anthropic's (text, image, tool_use,
tool_result), so they go out nearly as they are; the answer streams back over SSE.

Why not the ``anthropic`` package: a second vendor SDK would bring a second set of
dependencies, retries and error classes for what is one POST and one SSE stream. The speed
trick of the OpenAI backend needs the body as bytes anyway: each :class:`Message` is encoded
to wire JSON **once**, memoized in ``message.cache``, and a request body is the cached byte
strings joined, which an SDK that validates and re-serializes its arguments on every call
would undo. The bytes go out through the project's own
:class:`~trading_agent.backends.sse_transport.SSETransport` (aiohttp), as the OpenAI
backend's do: a send costs the same however many desks have one in flight, and timeouts,
cancellation and a cut stream are handled alike, with nothing retried behind the loop's back.

Prompt caching: ``cache_control`` breakpoints on the last tool definition, on the system
prompt and on the last block of the newest message: three, under the API's four. The newest
message moves with every request, so its breakpoint is never part of a message's cached
bytes: it is spliced into the body (the closing brace of the last block is replaced), and a
user's message's bytes stay the same whether it is the newest or not. An answer of text
alone goes in the API's short form, a string (a request ends with a user's message, so an
answer is never the newest and always sent in that one form). Cache reads and writes are
priced at their own prices.

A request is joined onto what the desk's previous request joined (the window only grows at
its end between compactions); when it cannot be (a compaction, a pruned picture, more desks
than are remembered), a window whose roles alternate, the common case, is joined whole at
the speed of ``bytes.join``.

Extended thinking (``thinking_budget_tokens``): the API wants the thinking blocks of an
assistant message that called tools sent back, signed and unchanged, while the tool loop
goes on. An answer that called tools carries its thinking as
:class:`~trading_agent.agent.conversation.ThinkingBlock` s (``source`` ``"anthropic"``),
first in its content, so the conversation and the store keep them: a desk restarted in the
middle of a tool loop sends them back. Only this backend's own thinking is sent, first in
the assistant message holding those calls; an answer whose thinking is missing (made by
another provider, or before thinking was kept) makes the request go without thinking
rather than be refused by the API. Thinking text also goes, delta by delta, to the
request's ``on_thinking``.

Third-party errors stop here (``raise ... from exc``):

- 408, 409, 429, 5xx, 529 (overloaded), timeouts, refused connections, a stream that breaks
  or ends before ``message_stop``, an ``error`` event (overloaded, api error) ->
  :class:`TransientBackendError` (with ``retry_after`` when the server said);
- "prompt is too long" (or the input and ``max_tokens`` beyond the window), and 413 (the
  request is larger than the API takes) -> :class:`ContextOverflowError`;
- 401 and 403 -> :class:`BackendError` naming the key's environment variable, never the key;
  anything else -> :class:`BackendError`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from types import TracebackType
from typing import Any, NamedTuple

import anyio.lowlevel

from trading_agent.agent.backend import ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.pacing import pace
from trading_agent.agent.shared_messages import frozen, starts_with
from trading_agent.backends.config import AnthropicBackendConfig, read_api_key
from trading_agent.backends.recent_encodings import RecentEncodings
from trading_agent.backends.sse_transport import (
    TRANSIENT_STATUSES,
    ConnectionFailed,
    EventStream,
    HttpStatusError,
    RequestTimeout,
    SSETransport,
)
from trading_agent.errors import (
    BackendError,
    ContextOverflowError,
    TransientBackendError,
)
from trading_agent.jsontext import json_bytes as _dumps

__all__ = ["THINKING_SOURCE", "AnthropicBackend", "AnthropicBackendConfig", "WireMessage",
           "encode_message"]

# --------------------------------------------------------------------------- encoding

THINKING_SOURCE = "anthropic"
"""The ``source`` of the thinking blocks this backend makes, and the only ones it sends."""

_CACHE_KEY = "anthropic_wire"
_THINKING_CACHE_KEY = "anthropic_wire_thinking"
_BREAKPOINT = b',"cache_control":{"type":"ephemeral"}}'
"""Spliced over a block's closing brace: the block becomes a cache breakpoint."""
_OPENING = b'{"role":"user","content":[{"type":"text","text":"(earlier messages omitted)"}]}'
"""The first message when the window would start with the model's (the API wants a user's)."""
_WHOLE_END = b"]}"
"""How a message with a ``content`` array ends, after its last block's closing brace."""
_UNREAD_EVENTS = frozenset({"ping", "content_block_stop"})
"""Events whose data says nothing the answer needs: named by their ``event:`` line, they
are not decoded."""
_ID_CHARACTERS = re.compile(r"[^A-Za-z0-9_-]")


def _wire_id(call_id: str) -> str:
    """A tool call id the API takes (letters, digits, ``_`` and ``-``): ids made by other
    servers (a conversation that changed provider) are mapped the same way on both sides."""
    return _ID_CHARACTERS.sub("_", call_id) or "call"


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's ``input``: the arguments the model wrote, wrapped when not an object."""
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"raw_arguments": arguments}


def _image(image: ImageBlock) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": image.media_type,
                                        "data": base64.b64encode(image.data).decode("ascii")}}


def _part(block: TextBlock | ImageBlock) -> dict[str, Any] | None:
    if isinstance(block, ImageBlock):
        return _image(block)
    # The API refuses empty and blank text blocks.
    return {"type": "text", "text": block.text} if block.text.strip() else None


def _wire_block(block: ContentBlock) -> dict[str, Any] | None:
    """One internal block as the API's, or None for one it would refuse (blank text) or
    that goes in only with thinking on (see :meth:`AnthropicBackend._with_thinking`)."""
    if isinstance(block, TextBlock | ImageBlock):
        return _part(block)
    if isinstance(block, ThinkingBlock):
        return None
    if isinstance(block, ToolUseBlock):
        return {"type": "tool_use", "id": _wire_id(block.id), "name": block.name,
                "input": _input(block.arguments)}
    wire: dict[str, Any] = {"type": "tool_result", "tool_use_id": _wire_id(block.tool_use_id)}
    parts = [p for p in map(_part, block.content) if p is not None]
    if len(parts) == 1 and parts[0]["type"] == "text":
        # The API's short form, a string: long histories of tool results are a tenth
        # smaller. A block keeps its form wherever it sits, so the prefix a cache
        # breakpoint marked is sent byte for byte the same the next time.
        wire["content"] = parts[0]["text"]
    elif parts:
        wire["content"] = parts
    if block.is_error:
        wire["is_error"] = True
    return wire


def _thinking_wire(block: ThinkingBlock) -> bytes:
    """A thinking block as the API gave it, to send back unchanged."""
    if block.redacted:
        return _dumps({"type": "redacted_thinking", "data": block.redacted})
    return _dumps({"type": "thinking", "thinking": block.text, "signature": block.signature})


class WireMessage(NamedTuple):
    """One message in Anthropic's wire JSON.

    Attributes:
        role: ``user`` or ``assistant``.
        blocks: The content blocks' JSON objects joined by commas, ready to splice into a
            ``content`` array (empty when the message has nothing the API takes).
        whole: The message object itself, for when it is not merged with a neighbour. An
            answer of text alone has the API's short form, a string: a request always ends
            with a user's message, so an answer sits before every breakpoint it is ever
            sent under, always in this one form, and long histories are a tenth smaller.
    """

    role: str
    blocks: bytes
    whole: bytes


_Encoded = tuple[bytes, bytes]
"""A message's ``(blocks, whole)``, as kept in its cache: a plain tuple of bytes, which the
garbage collector stops tracking (and the message's cache with it), so a long history is not
walked twice more at every collection."""


def _listed(role: str, blocks: bytes) -> bytes:
    """A message with ``blocks`` as a ``content`` array (the form a breakpoint needs)."""
    return b'{"role":"%s","content":[%s]}' % (role.encode(), blocks)


def _wire_message(message: Message) -> _Encoded:
    """A message's ``(blocks, whole)``."""
    blocks = [wire for wire in map(_wire_block, message.content) if wire is not None]
    joined = b",".join(map(_dumps, blocks))
    if message.role == "assistant" and len(blocks) == 1 and blocks[0]["type"] == "text":
        return joined, b'{"role":"assistant","content":%s}' % _dumps(blocks[0]["text"])
    return joined, _listed(message.role, joined)


def _encode(message: Message) -> _Encoded:
    """A message's ``(blocks, whole)``; memoized in ``message.cache``."""
    cached: _Encoded | None = message.cache.get(_CACHE_KEY)
    if cached is None:
        cached = message.cache[_CACHE_KEY] = _wire_message(message)
    return cached


def encode_message(message: Message) -> WireMessage:
    """One message as Anthropic wire JSON; memoized.

    The encoding is stored in ``message.cache``, so a message is serialized once in its life.
    It holds no cache breakpoint and no thinking (see :meth:`AnthropicBackend.request_body`).

    Args:
        message: The message to encode.

    Returns:
        Its role, its blocks and the whole message, as bytes.
    """
    return WireMessage(message.role, *_encode(message))


def _joined(role: str, run: Sequence[_Encoded]) -> bytes:
    """Consecutive messages of one role as one wire message (the API wants roles to
    alternate)."""
    if len(run) == 1:
        return run[0][1]
    return _listed(role, b",".join(blocks for blocks, _ in run))


def _newest(role: str, run: Sequence[_Encoded]) -> bytes:
    """The newest run of one role as one wire message whose last block is a breakpoint
    (spliced over its closing brace), in the body being built only."""
    listed = _listed(role, b",".join(blocks for blocks, _ in run))
    return listed[:-len(_WHOLE_END) - 1] + _BREAKPOINT + _WHOLE_END


def _alternate(roles: list[str], encoded: list[_Encoded], last_role: str | None) -> bool:
    """Whether every message has blocks and the roles alternate, the first differing from
    ``last_role`` (then each message is a wire message of its own). In C, mostly: this is
    the common case, and the window may be a whole history."""
    first = roles[0]
    second = "assistant" if first == "user" else "user"
    evens, odds = roles[0::2], roles[1::2]
    return (first != last_role and evens.count(first) == len(evens)
            and odds.count(second) == len(odds) and all(map(itemgetter(0), encoded)))


class _Joined(NamedTuple):
    """What a desk's last request joined, up to its last run of one role.

    Attributes:
        messages: The messages joined (the window's start, as sent).
        wire: Their wire messages, comma-joined (the opening user message included).
        continued_without_thinking: Whether the newest tool-calling answer among them lost
            its thinking.
        last_role: The role of their last wire message.
    """

    messages: Sequence[Message]
    wire: bytes
    continued_without_thinking: bool
    last_role: str | None


_NOTHING_JOINED = _Joined([], b"", False, None)
_JOINED_DESKS = 1024
"""How many desks' last requests are kept joined (the most recent): every desk's, in a daemon
of fewer desks (with 16, 500 desks woken at once each joined its whole history again)."""
_PREPARE_CHUNK = 100
"""Messages encoded between two yields to the event loop while a request is prepared."""


def _tool_definition(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A definition in Anthropic's shape, from OpenAI's (what the tool registry makes)."""
    function = tool.get("function")
    if not isinstance(function, Mapping):
        return dict(tool)  # already Anthropic's
    definition: dict[str, Any] = {"name": function.get("name", "")}
    if function.get("description"):
        definition["description"] = function["description"]
    definition["input_schema"] = function.get("parameters") or {"type": "object",
                                                                "properties": {}}
    return definition


# --------------------------------------------------------------------------- streaming


@dataclass
class _Draft:
    """One content block being assembled from stream events."""

    type: str
    text: list[str] = field(default_factory=list)
    signature: str = ""
    data: str = ""
    id: str = ""
    name: str = ""
    input: Any = None


class _ReplyBuilder:
    """Collects the events of one streamed answer."""

    def __init__(self, on_text: Callable[[str], None] | None,
                 on_thinking: Callable[[str], None] | None) -> None:
        self.on_text = on_text
        self.on_thinking = on_thinking
        self.blocks: dict[int, _Draft] = {}
        self.stop_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.finished = False
        self.error: dict[str, Any] | None = None

    def feed(self, event: Mapping[str, Any]) -> None:
        """Takes one decoded event; ignores what it does not know (``ping``, new types)."""
        kind = event.get("type")
        if kind == "message_start":
            message = event.get("message")
            if isinstance(message, dict):
                self._usage(message.get("usage"))
        elif kind == "content_block_start":
            block = event.get("content_block")
            if isinstance(block, dict):
                self._start(_index(event), block)
        elif kind == "content_block_delta":
            delta = event.get("delta")
            if isinstance(delta, dict):
                self._delta(_index(event), delta)
        elif kind == "message_delta":
            delta = event.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            if isinstance(reason, str) and reason:
                self.stop_reason = reason
            self._usage(event.get("usage"))
        elif kind == "message_stop":
            self.finished = True
        elif kind == "error":
            error = event.get("error")
            self.error = error if isinstance(error, dict) else {"message": str(error)}

    def _usage(self, usage: object) -> None:
        if isinstance(usage, dict):
            # message_delta's figures are cumulative: later ones win, absent ones stay.
            self.usage.update({k: v for k, v in usage.items() if v is not None})

    def _start(self, index: int, block: dict[str, Any]) -> None:
        draft = _Draft(type=str(block.get("type", "")))
        if draft.type == "text" and isinstance(block.get("text"), str) and block["text"]:
            self._text(draft, block["text"])
        elif draft.type == "thinking":
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                self._thinking(draft, block["thinking"])
            draft.signature = str(block.get("signature") or "")
        elif draft.type == "redacted_thinking":
            draft.data = str(block.get("data") or "")
        elif draft.type == "tool_use":
            draft.id = str(block.get("id") or "")
            draft.name = str(block.get("name") or "")
            draft.input = block.get("input")
        self.blocks[index] = draft

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        draft = self.blocks.get(index)
        if draft is None:  # a delta with no start: take it for what it says it is
            draft = self.blocks[index] = _Draft(type=_DELTA_BLOCKS.get(str(delta.get("type")), ""))
        kind = delta.get("type")
        if kind == "text_delta" and isinstance(delta.get("text"), str):
            self._text(draft, delta["text"])
        elif kind == "thinking_delta" and isinstance(delta.get("thinking"), str):
            self._thinking(draft, delta["thinking"])
        elif kind == "signature_delta" and isinstance(delta.get("signature"), str):
            draft.signature += delta["signature"]
        elif kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            draft.text.append(delta["partial_json"])

    def _text(self, draft: _Draft, text: str) -> None:
        draft.text.append(text)
        if self.on_text is not None and text:
            self.on_text(text)

    def _thinking(self, draft: _Draft, text: str) -> None:
        draft.text.append(text)
        if self.on_thinking is not None and text:
            self.on_thinking(text)

    def content(self) -> list[ContentBlock]:
        """The text and tool_use blocks, in order (blank text left out)."""
        content: list[ContentBlock] = []
        for index in sorted(self.blocks):
            draft = self.blocks[index]
            if draft.type == "text":
                text = "".join(draft.text)
                if text.strip():
                    content.append(TextBlock(text))
            elif draft.type in ("tool_use", "server_tool_use") and draft.name:
                content.append(ToolUseBlock(draft.id or f"toolu_{uuid.uuid4().hex}",
                                            draft.name, _arguments_text(draft)))
        return content

    def thinking(self) -> list[ThinkingBlock]:
        """The thinking blocks, in order, with what the API must get back unchanged."""
        blocks: list[ThinkingBlock] = []
        for index in sorted(self.blocks):
            draft = self.blocks[index]
            if draft.type == "thinking":
                blocks.append(ThinkingBlock("".join(draft.text), draft.signature,
                                            THINKING_SOURCE))
            elif draft.type == "redacted_thinking":
                blocks.append(ThinkingBlock("", source=THINKING_SOURCE, redacted=draft.data))
        return blocks

    def output_chars(self) -> int:
        """Characters of output, for an estimate when the server reports no usage."""
        return sum(len(draft.name) + sum(map(len, draft.text)) for draft in self.blocks.values())


_DELTA_BLOCKS = {"text_delta": "text", "thinking_delta": "thinking",
                 "signature_delta": "thinking", "input_json_delta": "tool_use"}
"""The block a delta belongs to, for a delta that came with no block start."""


def _index(event: Mapping[str, Any]) -> int:
    index = event.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0


def _arguments_text(draft: _Draft) -> str:
    """A tool call's arguments as JSON text: the streamed pieces, else the start's input."""
    streamed = "".join(draft.text)
    if streamed:
        return streamed
    if isinstance(draft.input, dict) and draft.input:
        return json.dumps(draft.input, ensure_ascii=False)
    return "{}"


def _decode(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"an event that is not a JSON object: {text[:200]}")
    return value


# --------------------------------------------------------------------------- errors

_TRANSIENT_TYPES = frozenset({"overloaded_error", "api_error", "rate_limit_error",
                              "timeout_error"})
_OVERFLOW_MARKERS = ("prompt is too long", "exceed context limit", "context window",
                     "context length")
_STATUS_OF_TYPE = {"invalid_request_error": 400, "authentication_error": 401,
                   "permission_error": 403, "not_found_error": 404,
                   "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
                   "overloaded_error": 529}


def _error_details(body: bytes) -> tuple[str, str]:
    """The message and type of an error body: ``{"type": "error", "error": {...}}``."""
    text = body.decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        return text.strip()[:500], ""
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(inner, dict):
        return str(inner.get("message") or "")[:2000], str(inner.get("type") or "")
    if isinstance(inner, str):
        return inner[:2000], ""
    return text.strip()[:500], ""


# --------------------------------------------------------------------------- the backend


class AnthropicBackend:
    """A :class:`~trading_agent.agent.backend.ModelBackend` for Anthropic's Messages API.

    Args:
        config: Where the API is, which model, prices, timeouts, thinking.
        environ: Where to read the API key from (``os.environ`` by default).

    Raises:
        ConfigError: ``config.api_key_env`` names a variable that is not set.

    Example::

        async with AnthropicBackend(config) as backend:
            reply = await backend.complete(request, on_text=print)
    """

    def __init__(self, config: AnthropicBackendConfig,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.model = config.model
        self.context_window = config.context_window
        self._api_key = read_api_key(config.api_key_env, config.model,
                                     os.environ if environ is None else environ)
        root = config.base_url.rstrip("/").removesuffix("/v1")
        self._url = f"{root}/v1/messages"
        headers = {**config.extra_headers, "anthropic-version": config.anthropic_version,
                   "content-type": "application/json", "accept": "text/event-stream"}
        if self._api_key is not None:
            headers["x-api-key"] = self._api_key
        self._transport = SSETransport(self._url, headers, config.request_timeout)
        head: dict[str, Any] = {"model": config.model, "stream": True}
        if config.temperature is not None:
            head["temperature"] = config.temperature
        self._head = _dumps(head)[:-1]  # an open object: per-request fields follow
        self._thinking_field = b""
        if config.thinking_budget_tokens is not None:
            self._thinking_field = b',"thinking":' + _dumps(
                {"type": "enabled", "budget_tokens": config.thinking_budget_tokens})
        self._tools_cache = RecentEncodings()
        self._system_cache = RecentEncodings()
        self._joined: OrderedDict[str | None, _Joined] = OrderedDict()
        """Per desk (the request's cache key), the wire messages of its last request up to
        the last run of one role: the next request of that desk starts there."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={self.model!r}, "
                f"base_url={self.config.base_url!r})")

    async def __aenter__(self) -> AnthropicBackend:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the HTTP client and its connections."""
        await self._transport.aclose()

    # ------------------------------------------------------------------ request body

    async def prepare(self, request: ModelRequestSpec) -> None:
        """Encodes a request's messages ahead of time (a desk restored with a long history),
        yielding to the event loop every few messages, and keeps them joined for the desk:
        its first request then costs what was added since, not its whole history.

        Args:
            request: What the desk's next request would send.
        """
        for start in range(0, len(request.messages), _PREPARE_CHUNK):
            for message in request.messages[start:start + _PREPARE_CHUNK]:
                _encode(message)
            await anyio.lowlevel.checkpoint()
        self.request_body(request)

    def request_body(self, request: ModelRequestSpec) -> bytes:
        """The JSON body one request sends, spliced from cached encodings.

        Consecutive messages of one role become one wire message (the API wants the roles
        to alternate); the last block of the newest becomes a cache breakpoint.

        Args:
            request: What to send.

        Returns:
            The body bytes.
        """
        messages, joined = self._resume(request)
        window = self._window(request.cache_key, messages, joined)
        if window is None:  # the window must be joined again from its start
            self._joined.pop(request.cache_key, None)
            window = self._window(request.cache_key, messages, _NOTHING_JOINED)
            assert window is not None
        parts, continued_without_thinking = window
        max_tokens = self.config.max_output_tokens
        if request.max_output_tokens is not None:
            max_tokens = request.max_output_tokens + (self.config.thinking_budget_tokens or 0)
        body = [self._head, b',"max_tokens":%d' % max_tokens]
        if self._thinking_field and not continued_without_thinking:
            body.append(self._thinking_field)
        if request.system_prompt:
            body += (b',"system":', self._system(request.system_prompt))
        if request.tools:
            body += (b',"tools":', self._tools(request.tools))
        body.append(b',"messages":[')
        for position, part in enumerate(parts):  # one copy of the history, not two
            if position:
                body.append(b",")
            body.append(part)
        body.append(b"]}")
        return b"".join(body)

    def _window(self, key: str | None, messages: Sequence[Message],
                joined: _Joined) -> tuple[list[bytes], bool] | None:
        """The wire messages to send (the newest with its breakpoint), and whether the
        newest tool-calling answer lost its thinking; None when what was joined must be
        joined again (a message after it continues its last run). Remembers, for the desk's
        next request, what was joined up to the start of the last run."""
        start = len(joined.messages)
        new = messages[start:]
        encoded = list(map(_encode, new))
        roles: list[str] = [message.role for message in new]
        if not roles:  # the window is what was joined (an answer taken back): the newest
            return None if joined.wire else ([], False)  # message needs its breakpoint
        if not self._thinking_field and _alternate(roles, encoded, joined.last_role):
            # Each message is a wire message of its own: joined at C speed.
            parts = [joined.wire] if joined.wire else []
            if not joined.wire and roles[0] == "assistant":
                parts.append(_OPENING)
            parts += map(itemgetter(1), encoded[:-1])
            if len(new) > 1:
                wire = b",".join(parts)
                self._remember(key, _Joined(messages[:-1], wire, False, roles[-2]))
                parts = [wire]
            parts.append(_newest(roles[-1], encoded[-1:]))
            return parts, False
        return self._merged_window(key, messages, joined, encoded)

    def _merged_window(self, key: str | None, messages: Sequence[Message], joined: _Joined,
                       encoded: list[_Encoded]) -> tuple[list[bytes], bool] | None:
        """:meth:`_window` when messages must be merged or left out, or thinking put back."""
        start = len(joined.messages)
        parts: list[bytes] = [joined.wire] if joined.wire else []
        run: list[_Encoded] = []  # consecutive messages of one role: one wire message
        run_role = ""
        # Whether the newest tool-calling answer lost its thinking (then the request goes
        # without: the API refuses a tool loop that starts thinking halfway); as of the
        # start of the last run, for the next request of the desk.
        lost = lost_at_run = joined.continued_without_thinking
        run_start, last_role = start, joined.last_role
        thinking = bool(self._thinking_field)
        for position, wire in enumerate(encoded, start):
            message = messages[position]
            before = lost
            if thinking and message.role == "assistant":
                wire, lost = self._with_thinking(message, wire)
            if not wire[0]:
                continue
            if not run and message.role == joined.last_role:
                return None  # continues the last run of what was joined
            if run and run_role != message.role:
                parts.append(_joined(run_role, run))
                last_role = run_role
                run, run_start, lost_at_run = [], position, before
            run.append(wire)
            run_role = message.role
        if not joined.wire and parts and parts[0].startswith(b'{"role":"assistant"'):
            parts.insert(0, _OPENING)
        if run_start > start:
            self._remember(key, _Joined(messages[:run_start], b",".join(parts), lost_at_run,
                                        last_role))
        if not run:
            # Nothing since what was joined has blocks: the newest message is in there,
            # maybe in its short form; join the whole window again (from the start, ``run``
            # is empty only when nothing at all has blocks).
            return None if parts else ([], lost)
        parts.append(_newest(run_role, run))
        if parts[0].startswith(b'{"role":"assistant"'):
            parts.insert(0, _OPENING)
        return parts, lost

    def _resume(self, request: ModelRequestSpec) -> tuple[Sequence[Message], _Joined]:
        """The request's messages, and what of them the desk's last request already joined
        (nothing when they no longer begin this one's: a compaction, a pruned picture)."""
        messages = frozen(request.messages)  # the window's list is shared, not copied
        joined = self._joined.get(request.cache_key)
        if joined is None or not starts_with(messages, joined.messages):
            joined = _NOTHING_JOINED
        return messages, joined

    def _remember(self, key: str | None, joined: _Joined) -> None:
        self._joined[key] = joined
        self._joined.move_to_end(key)
        if len(self._joined) > _JOINED_DESKS:
            self._joined.popitem(last=False)

    def _with_thinking(self, message: Message, wire: _Encoded) -> tuple[_Encoded, bool]:
        """An assistant message with its thinking first; and whether it is a tool-calling
        message without thinking of this backend's (then a request continuing it must go
        without thinking: the API refuses a tool loop that starts thinking halfway)."""
        kept: _Encoded | None = message.cache.get(_THINKING_CACHE_KEY)
        if kept is not None:
            return kept, False
        if not message.tool_uses:
            return wire, False
        thinking = [_thinking_wire(block) for block in message.content
                    if isinstance(block, ThinkingBlock) and block.source == THINKING_SOURCE]
        if not thinking:
            return wire, True
        blocks = b",".join((*thinking, wire[0]))
        kept = message.cache[_THINKING_CACHE_KEY] = (blocks, _listed(message.role, blocks))
        return kept, False

    def _system(self, prompt: str) -> bytes:
        return self._system_cache.get(prompt, lambda: (
            b"[" + _dumps({"type": "text", "text": prompt})[:-1] + _BREAKPOINT + b"]"))

    def _tools(self, tools: Sequence[Mapping[str, Any]]) -> bytes:
        def encode() -> bytes:
            encoded = [_dumps(_tool_definition(tool)) for tool in tools]
            encoded[-1] = encoded[-1][:-1] + _BREAKPOINT
            return b"[" + b",".join(encoded) + b"]"

        return self._tools_cache.for_tools(tools, encode)

    # ------------------------------------------------------------------ complete

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Sends one request and streams the answer.

        Args:
            request: What to send.
            on_text: Called with each piece of text as it arrives.
            on_thinking: Called with each piece of thinking text as it arrives.

        Returns:
            The whole answer, only once the stream completed.

        Raises:
            TransientBackendError: A failure worth retrying (429, 529, 5xx, timeout, a
                broken or unfinished stream, an overloaded error event).
            ContextOverflowError: The server said the prompt is longer than its window.
            BackendError: Any other failure (401, 403, 404, another 4xx).
        """
        body = self.request_body(request)
        builder = _ReplyBuilder(on_text, on_thinking)
        try:
            stream = await self._transport.post(body)
        except HttpStatusError as exc:
            raise self._refusal(exc) from self._cause(exc)
        except (RequestTimeout, ConnectionFailed) as exc:
            raise self._translate(exc) from self._cause(exc)
        with contextlib.closing(stream):
            await pace()  # 500 answers arriving in one poll are read in slices of the loop
            await self._read(stream, builder)
        if builder.error is not None:
            raise self._stream_error(builder.error)
        if not builder.finished:
            raise TransientBackendError("the answer stream ended before the model finished",
                                        model=self.model)
        return self._reply(request, builder)

    async def _read(self, stream: EventStream, builder: _ReplyBuilder) -> None:
        """Feeds the answer's events to the builder, up to ``message_stop``, an error event
        or the stream's end (the ``event:`` line repeats the data's own ``type``)."""
        while not builder.finished and builder.error is None:
            try:
                event = await stream.next()
                if event is None:
                    return
                if not event.data or event.event in _UNREAD_EVENTS:
                    continue
                data = _decode(event.data)
            except (RequestTimeout, ConnectionFailed, ValueError) as exc:
                raise self._translate(exc) from self._cause(exc)
            builder.feed(data)  # outside the try: on_text's own errors are not ours
        if builder.finished:
            await stream.finish()  # read to the end: the connection serves the next request

    def _reply(self, request: ModelRequestSpec, builder: _ReplyBuilder) -> ModelReply:
        content = builder.content()
        if any(isinstance(block, ToolUseBlock) for block in content):
            # Kept with the answer (and stored with it) for the tool loop that follows.
            content[:0] = builder.thinking()
        reason = builder.stop_reason or "stop"
        reason = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}.get(
            reason, reason)
        return ModelReply(content=tuple(content), usage=self._usage(request, builder),
                          stop_reason=reason)

    def _usage(self, request: ModelRequestSpec, builder: _ReplyBuilder) -> Usage:
        reported = builder.usage

        def count(name: str) -> int | None:
            value = reported.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        fresh, output = count("input_tokens"), count("output_tokens")
        read = max(0, count("cache_read_input_tokens") or 0)
        written = max(0, count("cache_creation_input_tokens") or 0)
        estimated = fresh is None or output is None
        if fresh is None:
            fresh, read, written = self._estimate_prompt(request), 0, 0
        if output is None:
            chars = builder.output_chars()
            output = max(1, chars // 4) if chars else 0
        return Usage(input_tokens=fresh + read + written, output_tokens=output,
                     estimated=estimated, cost=self._cost(fresh, read, written, output),
                     cached_input_tokens=read)

    def _cost(self, fresh: int, read: int, written: int, output: int) -> float | None:
        config = self.config
        if config.price_input_per_million is None or config.price_output_per_million is None:
            return None
        price_in = config.price_input_per_million
        read_price = (price_in if config.price_cache_read_per_million is None
                      else config.price_cache_read_per_million)
        write_price = (price_in if config.price_cache_write_per_million is None
                       else config.price_cache_write_per_million)
        return (fresh * price_in + read * read_price + written * write_price
                + output * config.price_output_per_million) / 1_000_000

    def _estimate_prompt(self, request: ModelRequestSpec) -> int:
        return (sum(estimate_tokens(m) for m in request.messages)
                + len(request.system_prompt) // 4
                + (len(self._tools(request.tools)) // 4 if request.tools else 0))

    # ------------------------------------------------------------------ errors

    def _redact(self, text: str) -> str:
        if self._api_key and self._api_key in text:
            return text.replace(self._api_key, "[redacted]")
        return text

    def _cause(self, exc: BaseException) -> BaseException | None:
        """The exception to chain, unless its text would carry the key into a traceback."""
        if self._api_key and self._api_key in str(exc):
            return None
        return exc

    def _translate(self, exc: BaseException) -> BackendError:
        """The project's error for a failure of the network or the stream."""
        if isinstance(exc, RequestTimeout):
            return TransientBackendError(
                f"the server did not answer within {self.config.request_timeout:g} s",
                model=self.model)
        if isinstance(exc, ValueError):
            return TransientBackendError(
                self._redact(f"the server sent an unreadable stream event: {exc}"),
                model=self.model)
        return TransientBackendError(
            self._redact(f"the connection to the server failed: {exc}"), model=self.model)

    def _refusal(self, error: HttpStatusError) -> BackendError:
        """The error for an answer with an error status."""
        message, kind = _error_details(error.body)
        request_id = error.headers.get("request-id")
        if request_id:
            message = f"{message} (request {request_id})"
        return self._for_status(error.status, message, kind, error.retry_after)

    def _stream_error(self, error: Mapping[str, Any]) -> BackendError:
        kind = str(error.get("type") or "")
        message = str(error.get("message") or kind or "an error event")
        return self._for_status(None, message, kind, None)

    def _for_status(self, status: int | None, message: str, kind: str,
                    retry_after: float | None) -> BackendError:
        message = self._redact(message.strip() or "no message")
        effective = status if status is not None else _STATUS_OF_TYPE.get(kind)
        where = "the server refused the request" if status is not None else (
            "an error in the answer stream")
        detail = f"{where}: {kind + ': ' if kind else ''}{message}"
        if effective == 413 or (effective != 429 and any(
                marker in message.lower() for marker in _OVERFLOW_MARKERS)):
            return ContextOverflowError(f"the prompt is too long for the model: {message}",
                                        status_code=status, model=self.model)
        if effective in (401, 403):
            variable = self.config.api_key_env
            advice = (f"check the API key in the environment variable {variable} (api_key_env)"
                      if variable is not None else
                      "no key was sent: name its environment variable in api_key_env")
            return BackendError(f"{detail}; {advice}", status_code=status, model=self.model)
        if kind in _TRANSIENT_TYPES or effective is None or effective in TRANSIENT_STATUSES:
            return TransientBackendError(detail, status_code=status, model=self.model,
                                         retry_after=retry_after)
        return BackendError(detail, status_code=status, model=self.model)
