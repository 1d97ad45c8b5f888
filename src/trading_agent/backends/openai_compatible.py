"""A model backend for any OpenAI-compatible chat-completions server.

OpenAI, vLLM, llama.cpp, Ollama, OpenRouter: one wire format, streamed over SSE.

Speed matters here: a long-running desk sends hundreds of messages every round, and the SDK's
``chat.completions.create`` re-validates and re-serializes the whole list each time. So each
:class:`Message` is encoded to its wire JSON **once**, memoized in ``message.cache``, and a
request body is the cached byte strings joined. The bytes go out through
:class:`~trading_agent.backends.sse_transport.SSETransport`, whose connection pool costs the
same per request however many desks have one in flight; the OpenAI SDK still says what is
sent besides the body (its authentication and client headers, kept as they were, so the
requests are what they were when the SDK sent them). Nothing retries here: the loop does.

Prompt caching: the system prompt, the tools and the past messages go first and keep their
bytes from one request to the next, so a server's prefix cache can serve them; the request's
``cache_key`` goes out as OpenAI's ``prompt_cache_key`` unless the config turns it off (then
the body is byte for byte what it was without one), and the ``cached_tokens`` the server
reports are priced at their own price.

Third-party errors stop here (``raise ... from exc``):

- 408, 409, 429, 5xx, timeouts, refused connections, a stream that breaks or ends before a
  finish reason -> :class:`TransientBackendError` (with ``retry_after`` when the server said);
- a refusal that says the prompt is too long -> :class:`ContextOverflowError`;
- anything else (401, 403, 404, other 4xx) -> :class:`BackendError`.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import openai

from trading_agent.agent.backend import ModelReply, ModelRequestSpec, Pricing, Usage
from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ToolUseBlock,
    estimate_tokens,
)
from trading_agent.agent.pacing import pace
from trading_agent.agent.shared_messages import frozen, starts_with
from trading_agent.backends.config import OpenAIBackendConfig, read_api_key
from trading_agent.backends.owned_socket import OwnedUnixSocket
from trading_agent.backends.recent_encodings import RecentEncodings
from trading_agent.backends.sse_transport import (
    TRANSIENT_STATUSES,
    ConnectionFailed,
    EventStream,
    HttpStatusError,
    RequestTimeout,
    SSETransport,
    verified_ssl_context,
)
from trading_agent.errors import (
    BackendError,
    ContextOverflowError,
    TransientBackendError,
)
from trading_agent.jsontext import json_bytes as _dumps

__all__ = ["NO_KEY_PLACEHOLDER", "OpenAICompatibleBackend", "encode_message", "pricing"]

NO_KEY_PLACEHOLDER = "no-key-needed"
"""The API key sent to a server that needs none (the SDK insists on one)."""

_CACHE_KEY = "openai_wire"
_CONTEXT_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context window",
    "context length",
    "context size",
    "exceed_context_size",
    "too many tokens",
    "prompt is too long",
)

_TRANSPORT_ERRORS: tuple[type[Exception], ...] = (HttpStatusError, RequestTimeout,
                                                  ConnectionFailed)
_CUT_ERRORS: tuple[type[Exception], ...] = (RequestTimeout, ConnectionFailed)
_READ_ERRORS: tuple[type[Exception], ...] = (*_CUT_ERRORS, ValueError)
_SILENT_OVERFLOW_SHARE = 0.8
"""An empty answer to a prompt estimated at this share of the window is taken as overflow."""
_JOINED_DESKS = 1024
"""How many desks' last requests are kept joined (the busiest: the most recent). With fewer
desks than this every desk's is kept: 500 desks woken at once each joined their whole history
again when it was 16 (a desk's memo holds a copy of its encoded window, some 200 KB at 1,000
short messages)."""
_JOINED_PIECES = 32
"""How many pieces a desk's joined messages are kept in before they are joined into one
(each request adds one: the messages added since the last)."""
_NO_PIECES: tuple[bytes, ...] = ()
_PREPARE_CHUNK = 100
"""Messages encoded between two yields to the event loop while a request is prepared."""
_STREAM_RUNTIME = "async:asyncio"
"""The SDK's ``X-Stainless-Async`` header for the runtime the daemon runs on."""


# --------------------------------------------------------------------------- encoding


def _arguments(raw: str) -> str:
    """Tool-call arguments as sent back: always the text of a JSON object.

    Some servers (llama.cpp among them) parse past arguments to render their chat template
    and refuse the whole request when they cannot, which would wedge a desk for good. So
    what the model wrote is kept, but wrapped when it is not a JSON object.
    """
    if not raw.strip():
        return "{}"
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return raw
    return json.dumps({"raw_arguments": raw}, ensure_ascii=False)


def _image_part(image: ImageBlock) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": image.data_url()}}


def _user_content(blocks: Sequence[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    if not blocks:
        return ""
    if len(blocks) == 1 and isinstance(blocks[0], TextBlock):
        return blocks[0].text
    return [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image_part(b)
            for b in blocks]


def _wire_messages(message: Message) -> list[dict[str, Any]]:
    """The OpenAI wire messages one internal message becomes (a tool_results one: several).

    A thinking block is left out: it is another provider's, for that provider only.
    """
    if message.role == "assistant":
        text = message.text
        calls = message.tool_uses
        wire: dict[str, Any] = {"role": "assistant"}
        # With tool calls and no text, content is left out: llama-cpp-python's server refuses
        # a null one (tests/fixtures/llama_server/.../assistant_content_null.json).
        if text or not calls:
            wire["content"] = text
        if calls:
            wire["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": _arguments(call.arguments)}}
                for call in calls
            ]
        return [wire]

    results = message.tool_results
    if not results:
        plain = [b for b in message.content if isinstance(b, TextBlock | ImageBlock)]
        return [{"role": "user", "content": _user_content(plain)}]

    # Tool messages carry text only: their pictures follow in one user message, each group
    # introduced by the call it came from, with any other blocks of the message after.
    wires: list[dict[str, Any]] = []
    follow_up: list[dict[str, Any]] = []
    for result in results:
        images = [b for b in result.content if isinstance(b, ImageBlock)]
        text = result.text
        if images:
            noun = "image" if len(images) == 1 else f"{len(images)} images"
            text = f"{text}\n[{noun} attached in the next message]" if text else (
                f"[{noun} attached in the next message]")
            follow_up.append({"type": "text",
                              "text": f"Images from tool call {result.tool_use_id}:"})
            follow_up.extend(_image_part(image) for image in images)
        wires.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": text})
    for block in message.content:
        if isinstance(block, TextBlock):
            follow_up.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            follow_up.append(_image_part(block))
    if follow_up:
        wires.append({"role": "user", "content": follow_up})
    return wires


def encode_message(message: Message) -> bytes:
    """One message as OpenAI wire JSON (comma-joined when it becomes several); memoized.

    The encoding is stored in ``message.cache``, so a message is serialized once in its
    life, however many requests it is sent in.

    Args:
        message: The message to encode.

    Returns:
        The JSON objects, joined by commas, ready to splice into a ``messages`` array.
    """
    cached: bytes | None = message.cache.get(_CACHE_KEY)
    if cached is None:
        cached = b",".join(_dumps(wire) for wire in _wire_messages(message))
        message.cache[_CACHE_KEY] = cached
    return cached


def _tool_definition(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """A definition in OpenAI's ``{"type": "function", "function": ...}`` shape."""
    if "function" in tool:
        return tool
    return {"type": "function", "function": tool}


# --------------------------------------------------------------------------- streaming


@dataclass
class _ToolCallDraft:
    """A tool call being assembled from stream deltas."""

    id: str = ""
    name: str = ""
    arguments: str = ""


def _text_of(value: Any) -> str:
    """Text from a delta field: a string, or a list of text parts (some servers)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _json_text(value: Any) -> str:
    """Arguments as text: servers send a string, a few send the object itself."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False)


class _ReplyBuilder:
    """Collects the chunks of one streamed answer."""

    def __init__(self, on_text: Callable[[str], None] | None,
                 on_thinking: Callable[[str], None] | None = None) -> None:
        self.on_text = on_text
        self.on_thinking = on_thinking
        self.text: list[str] = []
        self.calls: dict[int, _ToolCallDraft] = {}
        self.legacy = _ToolCallDraft()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.chunks = 0

    def feed(self, chunk: Any) -> None:
        """Takes one decoded chunk; ignores whatever it cannot read."""
        self.chunks += 1
        if not isinstance(chunk, dict):
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) not in (0, None):
                continue
            delta: dict[str, Any] = {}
            for field_name in ("delta", "message"):  # "message": a non-streamed shape
                if isinstance(choice.get(field_name), dict):
                    delta = choice[field_name]
                    break
            reasoning = _text_of(delta.get("reasoning_content") or delta.get("reasoning"))
            if reasoning and self.on_thinking is not None:
                self.on_thinking(reasoning)
            text = _text_of(delta.get("content"))
            if text:
                self.text.append(text)
                if self.on_text is not None:
                    self.on_text(text)
            for position, call in enumerate(delta.get("tool_calls") or ()):
                if isinstance(call, dict):
                    self._feed_call(call, position)
            legacy = delta.get("function_call")
            if isinstance(legacy, dict):
                self._merge(self.legacy, legacy)
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason

    def _feed_call(self, call: dict[str, Any], position: int) -> None:
        index = call.get("index")
        if isinstance(index, str) and index.isdigit():
            index = int(index)
        if not isinstance(index, int) or isinstance(index, bool):
            index = self._guess_index(call, position)
        draft = self.calls.setdefault(index, _ToolCallDraft())
        call_id = call.get("id")
        if isinstance(call_id, int) and not isinstance(call_id, bool):
            call_id = str(call_id)
        if not draft.id and isinstance(call_id, str) and call_id.strip():
            draft.id = call_id.strip()
        function = call.get("function")
        if isinstance(function, dict):
            self._merge(draft, function)

    def _guess_index(self, call: dict[str, Any], position: int) -> int:
        """Where an index-less delta belongs: a new call if it starts one, else the last."""
        if not self.calls:
            return position
        last = max(self.calls)
        draft = self.calls[last]
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"),
                                                                   dict) else {}
        new_id = str(call.get("id") or "").strip()
        if new_id and draft.id:
            return last if new_id == draft.id else last + 1
        # Servers that leave out the index send each call whole: a name starts a new one.
        return last + 1 if function.get("name") and draft.name else last

    @staticmethod
    def _merge(draft: _ToolCallDraft, function: dict[str, Any]) -> None:
        name = function.get("name")
        # The name comes once; servers that repeat it in every delta must not double it.
        if not draft.name and isinstance(name, str) and name.strip():
            draft.name = name.strip()
        draft.arguments += _json_text(function.get("arguments"))

    def tool_calls(self, new_id: Callable[[], str]) -> list[ToolUseBlock]:
        """The assembled calls, in index order, each with a usable, unique id."""
        drafts = [self.calls[i] for i in sorted(self.calls) if self.calls[i].name]
        # The legacy field only counts when no tool_calls came and it names a function;
        # some servers send an empty one beside every tool_calls delta.
        if not drafts and self.legacy.name:
            drafts = [self.legacy]
        calls: list[ToolUseBlock] = []
        taken = {draft.id for draft in drafts}
        for draft in drafts:
            call_id = draft.id
            if not call_id or any(call.id == call_id for call in calls):
                call_id = new_id()
                while call_id in taken:  # never the id a server gave another call
                    call_id = new_id()
                taken.add(call_id)
            calls.append(ToolUseBlock(id=call_id, name=draft.name, arguments=draft.arguments))
        return calls


# --------------------------------------------------------------------------- errors


def _error_details(body: object, fallback: str) -> tuple[str, str]:
    """The server's message and code (or type) from an error body, either shape."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            message = inner.get("message") or inner.get("detail") or ""
            code = inner.get("code") or inner.get("type") or ""
            return str(message) or fallback, str(code)
        if isinstance(inner, str):
            return inner, ""
    if isinstance(body, str) and body:
        return body, ""
    return fallback, ""


def _cached_tokens(usage: Mapping[str, Any], prompt_tokens: int) -> int:
    """The prompt tokens served from cache: OpenAI's ``prompt_tokens_details.cached_tokens``
    (vLLM, xAI, DeepSeek-compatible servers and LiteLLM send the same), within the prompt."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool) or cached <= 0:
        return 0
    return min(cached, prompt_tokens)


def _mentions_context(message: str, code: str) -> bool:
    text = f"{code} {message}".lower()
    return any(marker in text for marker in _CONTEXT_MARKERS)


# --------------------------------------------------------------------------- the backend


def pricing(config: OpenAIBackendConfig) -> Pricing | None:
    """The prices a config gives, when both the input and the output price are configured.

    Args:
        config: The backend's config.

    Returns:
        The prices, or None: the cost of a call is then not counted.
    """
    if config.price_input_per_million is None or config.price_output_per_million is None:
        return None
    return Pricing(config.price_input_per_million, config.price_output_per_million,
                   config.price_cached_input_per_million)


class OpenAICompatibleBackend:
    """A :class:`~trading_agent.agent.backend.ModelBackend` for OpenAI-compatible servers.

    Args:
        config: Where the server is, which model, prices, timeouts.
        environ: Where to read the API key from (``os.environ`` by default).

    Raises:
        ConfigError: ``config.api_key_env`` names a variable that is not set.

    Example::

        async with OpenAICompatibleBackend(config) as backend:
            reply = await backend.complete(request, on_text=print)
    """

    def __init__(self, config: OpenAIBackendConfig,
                 environ: Mapping[str, str] | None = None, *,
                 unix_socket: OwnedUnixSocket | None = None) -> None:
        self.config = config
        self.model = config.model
        self.context_window = config.context_window
        self._pricing = pricing(config)
        self._api_key = read_api_key(config.api_key_env, config.model,
                                     os.environ if environ is None else environ
                                     ) or NO_KEY_PLACEHOLDER
        self._client = openai.AsyncOpenAI(
            api_key=self._api_key,
            base_url=config.base_url,
            timeout=config.request_timeout,
            max_retries=0,
            default_headers=config.extra_headers or None,
            organization=None,
            project=None,
            http_client=openai.DefaultAsyncHttpx2Client(verify=verified_ssl_context()),
        )
        self._unix_socket = unix_socket
        self._transport = SSETransport(
            str(self._client.base_url).rstrip("/") + "/chat/completions",
            self._sdk_headers(config), config.request_timeout, unix_socket=unix_socket)
        head: dict[str, Any] = {"model": config.model, **config.extra_body, "stream": True,
                                "stream_options": {"include_usage": True}}
        if config.temperature is not None:
            head["temperature"] = config.temperature
        self._head = _dumps(head)[:-1]  # an open object: per-request fields follow
        self._tools_cache = RecentEncodings()
        self._system_cache = RecentEncodings()
        self._joined: collections.OrderedDict[str | None,
                                              tuple[Sequence[Message], tuple[bytes, ...]]] = (
            collections.OrderedDict())
        """Per desk (the request's cache key), the messages last sent and their wire JSON
        joined: the next request of that desk joins only the messages added since."""
        self._call_numbers = itertools.count(1)
        self._tokenize_route: tuple[str, str] | bool | None = None
        """The server's tokenize route once found; False when it has none (asked once)."""

    def _sdk_headers(self, config: OpenAIBackendConfig) -> dict[str, str]:
        """The headers the SDK sends with a streamed request: its own (client, platform,
        authentication), the configured ones, then the per-request ones it adds."""
        headers = {name: value for name, value in
                   {**self._client.default_headers, **self._client.auth_headers}.items()
                   if isinstance(value, str)}
        headers.update({
            "Accept": "text/event-stream",
            "Accept-Encoding": "gzip, deflate",
            "Connection": "keep-alive",
            "X-Stainless-Async": _STREAM_RUNTIME,
            "x-stainless-retry-count": "0",
            "x-stainless-read-timeout": str(float(config.request_timeout)),
        })
        return headers

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(model={self.model!r}, "
                f"base_url={self.config.base_url!r})")

    async def __aenter__(self) -> OpenAICompatibleBackend:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Closes the HTTP clients and their connections."""
        await self._transport.aclose()
        await self._client.close()

    async def count_tokens(self, text: str) -> int | None:
        """How many tokens the server's own tokenizer makes of ``text``, where the server
        has a tokenize route (llama.cpp's and vLLM's ``/tokenize``, llama-cpp-python's
        ``/extras/tokenize``); None where it has none (OpenAI) or does not answer.

        Args:
            text: The text to measure.
        """
        if self._tokenize_route is False:
            return None  # asked before: the server has no tokenize route
        root = self.config.base_url.rstrip("/").removesuffix("/v1")
        routes = [("/tokenize", "content"), ("/extras/tokenize", "input")]
        if isinstance(self._tokenize_route, tuple):
            routes = [self._tokenize_route]
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        if self._unix_socket is not None:  # the embedded model: its owner alone, checked
            return await self._count_tokens_on_socket(root, routes, text, headers)
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            for route, field in routes:
                try:
                    answer = await client.post(root + route, json={field: text},
                                               headers=headers)
                    tokens = answer.json().get("tokens") if answer.status_code == 200 else None
                except (httpx.HTTPError, ValueError, AttributeError):
                    continue
                if isinstance(tokens, list):
                    self._tokenize_route = (route, field)
                    return len(tokens)
        self._tokenize_route = False
        return None

    async def _count_tokens_on_socket(self, root: str, routes: list[tuple[str, str]],
                                      text: str, headers: Mapping[str, str]) -> int | None:
        """:meth:`count_tokens` over the transport's checked Unix-socket connections."""
        for route, field in routes:
            try:
                status, answer = await self._transport.post_json(root + route, {field: text},
                                                                 headers)
            except (ConnectionFailed, RequestTimeout):
                continue
            tokens = answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
            if isinstance(tokens, list):
                self._tokenize_route = (route, field)
                return len(tokens)
        self._tokenize_route = False
        return None

    # ------------------------------------------------------------------ request body

    def request_body(self, request: ModelRequestSpec) -> bytes:
        """The JSON body one request sends, spliced from cached encodings.

        Args:
            request: What to send.

        Returns:
            The body bytes.
        """
        body = [self._head]
        max_tokens = request.max_output_tokens or self.config.max_output_tokens
        if max_tokens is not None:
            body.append(b',"%s":%d' % (self.config.max_tokens_field.encode(), max_tokens))
        cache_key = self.config.cache_key_for(request.cache_key)
        if cache_key is not None:  # before tools and messages: they stay the body's tail
            body += (b',"prompt_cache_key":', _dumps(cache_key))
        if request.tools:
            body += (b',"tools":', self._tools(request.tools))
        system = self._system_message(request.system_prompt) if request.system_prompt else b""
        messages = self._messages_json(request)
        body += (b',"messages":[', system, b"," if system and messages else b"", *messages,
                 b"]}")
        return b"".join(body)  # the one copy of the history a request makes

    async def prepare(self, request: ModelRequestSpec) -> None:
        """Encodes a request's messages ahead of time (a desk restored with a long history),
        yielding to the event loop every few messages, and keeps them joined for the desk:
        its first request then costs what was added since, not its whole history.

        Args:
            request: What the desk's next request would send.
        """
        for start in range(0, len(request.messages), _PREPARE_CHUNK):
            for message in request.messages[start:start + _PREPARE_CHUNK]:
                encode_message(message)
            await anyio.lowlevel.checkpoint()
        self._messages_json(request)

    def _messages_json(self, request: ModelRequestSpec) -> tuple[bytes, ...]:
        """The messages' wire JSON, comma-joined, in pieces to be joined into the body (each
        piece after the first begins with its comma); for a desk whose last request's
        messages begin this one's (between compactions, the window only grows at its end),
        only the new ones are encoded and joined, into one more piece.

        The history is not copied here: the body's join is its one copy per request (a
        request at 1,000 messages is some 200 KB). Past :data:`_JOINED_PIECES` pieces they
        are joined into one, so a desk's memo stays a few pieces, however long it runs
        between compactions."""
        messages = frozen(request.messages)  # the window's list is shared, not copied
        key = request.cache_key
        memo = self._joined.get(key)
        start, pieces = 0, _NO_PIECES
        if memo is not None and starts_with(messages, memo[0]):
            start, pieces = len(memo[0]), memo[1]
        if start < len(messages):
            tail = b",".join(encode_message(message) for message in messages[start:])
            pieces = (*pieces, b"," + tail) if pieces else (tail,)
            if len(pieces) > _JOINED_PIECES:
                pieces = (b"".join(pieces),)
        self._joined[key] = (messages, pieces)
        self._joined.move_to_end(key)
        if len(self._joined) > _JOINED_DESKS:
            self._joined.popitem(last=False)
        return pieces

    def _system_message(self, prompt: str) -> bytes:
        return self._system_cache.get(
            prompt, lambda: _dumps({"role": "system", "content": prompt}))

    def _tools(self, tools: Sequence[Mapping[str, Any]]) -> bytes:
        return self._tools_cache.for_tools(
            tools, lambda: _dumps([_tool_definition(tool) for tool in tools]))

    # ------------------------------------------------------------------ complete

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Sends one request and streams the answer.

        Args:
            request: What to send.
            on_text: Called with each piece of text as it arrives.
            on_thinking: Called with each piece of reasoning a server streams apart from
                the answer (``reasoning_content``: DeepSeek, vLLM, llama.cpp; ``reasoning``:
                OpenRouter, Ollama); it is never sent back.

        Returns:
            The whole answer, only once the stream completed.

        Raises:
            TransientBackendError: A failure worth retrying (429, 5xx, timeout, a broken or
                unfinished stream).
            ContextOverflowError: The server said the prompt is longer than its window.
            BackendError: Any other failure (401, 403, 404, another 4xx).
        """
        body = self.request_body(request)
        builder = _ReplyBuilder(on_text, on_thinking)
        try:
            stream = await self._transport.post(body)
        except _TRANSPORT_ERRORS as exc:
            raise self._translate(exc) from self._cause(exc)
        with contextlib.closing(stream):
            await pace()  # 500 answers arriving in one poll are read in slices of the loop
            await self._read(stream, builder)
        if builder.finish_reason is None:
            raise self._unfinished(request, builder)
        return self._reply(request, builder)

    async def _read(self, stream: EventStream, builder: _ReplyBuilder) -> None:
        """Feeds the answer's chunks to the builder, up to ``[DONE]`` or the stream's end."""
        while True:
            try:
                event = await stream.next()
                if event is None:
                    return
                if event.data.startswith("[DONE]"):
                    await stream.finish()
                    return
                chunk = json.loads(event.data)
            except _READ_ERRORS as exc:
                if builder.finish_reason is not None and isinstance(exc, _CUT_ERRORS):
                    return  # the answer was whole: only the usage chunk was lost
                raise self._translate(exc) from self._cause(exc)
            if isinstance(chunk, dict) and chunk.get("error"):
                message, code = _error_details(chunk, "An error occurred during streaming")
                raise self._for_status(int(code) if code.isdigit() else None, message, code,
                                       None, in_stream=True)
            builder.feed(chunk)  # outside the try: on_text's own errors are not ours

    def _unfinished(self, request: ModelRequestSpec, builder: _ReplyBuilder) -> BackendError:
        """The error for a stream that ended without a finish reason."""
        estimate = self._estimate_prompt(request)
        if builder.chunks == 0 and estimate >= _SILENT_OVERFLOW_SHARE * self.context_window:
            # llama-cpp-python (chatml-function-calling) answers a too-long streamed prompt
            # with an empty 200 (tests/fixtures/llama_server/chatml_function_calling).
            return ContextOverflowError(
                f"the server sent an empty answer to a prompt of about {estimate} tokens, "
                f"near the {self.context_window}-token window; taken as too long",
                model=self.model)
        return TransientBackendError("the answer stream ended before the model finished",
                                     model=self.model)

    def _estimate_prompt(self, request: ModelRequestSpec) -> int:
        return (sum(estimate_tokens(m) for m in request.messages)
                + len(request.system_prompt) // 4
                + (len(self._tools(request.tools)) // 4 if request.tools else 0))

    def _reply(self, request: ModelRequestSpec, builder: _ReplyBuilder) -> ModelReply:
        calls = builder.tool_calls(lambda: f"call_{next(self._call_numbers)}")
        text = "".join(builder.text)
        content: list[ContentBlock] = []
        if text and (text.strip() or not calls):
            content.append(TextBlock(text))
        content.extend(calls)
        reason = builder.finish_reason or "stop"
        if reason == "function_call" or (calls and reason != "length"):
            reason = "tool_calls"
        return ModelReply(content=tuple(content), usage=self._usage(request, builder, calls),
                          stop_reason=reason)

    def _usage(self, request: ModelRequestSpec, builder: _ReplyBuilder,
               calls: list[ToolUseBlock]) -> Usage:
        reported = builder.usage or {}
        prompt = reported.get("prompt_tokens")
        completion = reported.get("completion_tokens")
        estimated = False
        cached = 0
        if not isinstance(prompt, int) or isinstance(prompt, bool):
            estimated = True
            prompt = self._estimate_prompt(request)
        else:
            cached = _cached_tokens(reported, prompt)
        if not isinstance(completion, int) or isinstance(completion, bool):
            estimated = True
            chars = sum(len(t) for t in builder.text) + sum(
                len(c.name) + len(c.arguments) for c in calls)
            completion = max(1, chars // 4) if chars else 0
        cost = self._pricing.cost(prompt, completion, cached) if self._pricing else None
        return Usage(input_tokens=prompt, output_tokens=completion, estimated=estimated,
                     cost=cost, cached_input_tokens=cached)

    # ------------------------------------------------------------------ errors

    def _redact(self, text: str) -> str:
        if self._api_key != NO_KEY_PLACEHOLDER and self._api_key in text:
            return text.replace(self._api_key, "[redacted]")
        return text

    def _cause(self, exc: BaseException) -> BaseException | None:
        """The exception to chain, unless its text would carry the key into a traceback."""
        if self._api_key != NO_KEY_PLACEHOLDER and self._api_key in str(exc):
            return None
        return exc

    def _translate(self, exc: BaseException) -> BackendError:
        """The project's error for a failure of the network, the server or the stream."""
        model = self.model
        if isinstance(exc, RequestTimeout):
            return TransientBackendError(
                f"the server did not answer within {self.config.request_timeout:g} s",
                model=model)
        if isinstance(exc, ConnectionFailed):
            return TransientBackendError(
                self._redact(f"the connection to the server failed: {exc}"), model=model)
        if isinstance(exc, HttpStatusError):
            text = exc.text
            try:
                body: object = json.loads(text)
            except ValueError:
                body = text.strip()
            message, code = _error_details(body, text[:500] or f"HTTP {exc.status}")
            return self._for_status(exc.status, message, code, exc.retry_after)
        if isinstance(exc, ValueError):
            return TransientBackendError(
                self._redact(f"the server sent an unreadable stream chunk: {exc}"), model=model)
        return BackendError(self._redact(f"the model request failed: {exc}"), model=model)

    def _for_status(self, status: int | None, message: str, code: str,
                    retry_after: float | None, *, in_stream: bool = False) -> BackendError:
        message = self._redact(message.strip() or "no message")
        if status != 429 and _mentions_context(message, code):
            return ContextOverflowError(f"the prompt is too long for the model: {message}",
                                        status_code=status, model=self.model)
        if status is None or status in TRANSIENT_STATUSES:
            where = "in the answer stream" if in_stream else "the server refused the request"
            return TransientBackendError(f"{where}: {message}", status_code=status,
                                         model=self.model, retry_after=retry_after)
        return BackendError(f"the server refused the request: {message}", status_code=status,
                            model=self.model)
