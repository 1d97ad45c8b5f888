"""The response cache: a model backend wrapper that makes a backtest deterministic and free.

:class:`ResponseCache` wraps any :class:`~trading_agent.agent.backend.ModelBackend`, so the
agent loop never knows it is there. Each request is keyed by a SHA-256 of everything that is
sent and shapes the answer: the model, the sampling settings the caller names, the answer's
token cap, the system prompt, the tool definitions, and each message's role and content
blocks (an image by its media type and a hash of its bytes). Message ids, creation times and
other bookkeeping never sent are left out, so a re-run with fresh ids still hits, and editing
a prompt invalidates only the requests from the first one that changed.

Modes:

- ``record`` (the default): a hit replays the recorded answer; a miss asks the wrapped
  backend and appends the answer to the file.
- ``strict``: a miss raises :class:`CacheMissError`, naming the first message that differs
  from the closest recorded request.
- ``off``: never reads nor writes; only counts the calls.

The same request asked several times in a run gets the recorded answers in the order they
were recorded (the n-th asking replays the n-th answer), never the last one written. A
context overflow is an answer too (the loop compacts on it), so it is recorded and replayed
as :class:`~trading_agent.errors.ContextOverflowError`; transient failures are not.

The file is JSON lines, append-only, one ``write`` per answer, so a crash loses at most the
answer being written (a last line without its newline is dropped and cut off before the next
append). Each distinct message body, system prompt and tool list is written once, under its
hash; an answer's line names them by hash and shares its leading messages with an earlier
answer (``base``, ``keep``), so the file grows with what is new, not with the history. Every
line carries the format version (``"v": 1``)::

    {"v":1,"kind":"message","hash":"9f2c…","body":{"role":"user","content":[…]}}
    {"v":1,"kind":"system","hash":"41d8…","text":"You are the desk alpha…"}
    {"v":1,"kind":"tools","hash":"c0ff…","tools":[…]}
    {"v":1,"kind":"answer","key":"e3b0…","model":"m","sampling":{},"max_output_tokens":null,
     "system":"41d8…","tools":"c0ff…","base":11,"keep":30,"messages":["9f2c…"],
     "reply":{"content":[…],"usage":{…},"stop_reason":"stop"}}

Errors (in :mod:`trading_agent.errors`' tree)::

    BackendError
    └── CacheMissError      strict mode: no recorded answer (never retried by the loop)
    ConfigError
    └── CacheFileError      the cache file cannot be read, or a line of it is unreadable
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, get_args

import anyio

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.errors import BackendError, ConfigError, ContextOverflowError

__all__ = ["FORMAT_VERSION", "CacheFileError", "CacheMissError", "CacheMode", "ResponseCache"]

CacheMode = Literal["record", "strict", "off"]
"""``record`` asks the model on a miss, ``strict`` fails on one, ``off`` never caches."""

FORMAT_VERSION = 1
"""The version of the file format and of the request key; a line of another version is
refused, and a key never matches one made under another version."""

_MODES: tuple[str, ...] = get_args(CacheMode)
_MEMO = "response_cache"
"""The key of a message's hash in ``Message.cache`` (the per-message memo of derived values)."""
_RECENT_BASES = 4
"""How many recent answers a new one may share its leading messages with."""
_EXCERPT = 80
"""Characters of each text a miss message shows."""


class CacheMissError(BackendError):
    """Strict mode: the request has no recorded answer.

    A :class:`~trading_agent.errors.BackendError` that is not transient, so the loop fails
    the turn at once instead of retrying. The message names the request and the first message
    that differs from the closest recorded request.
    """


class CacheFileError(ConfigError):
    """The response cache file cannot be read, or one of its lines is unreadable."""


# --------------------------------------------------------------------------- keys


def _canonical(value: Any) -> str:
    """JSON that is the same for the same data in any process: sorted keys, ASCII (so a lone
    surrogate in a broken model stream still encodes), no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _request_block(block: ContentBlock) -> dict[str, Any]:
    """A block as the key sees it: what is sent, with an image by its bytes' hash."""
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    if isinstance(block, ImageBlock):
        return {"type": "image", "media_type": block.media_type,
                "sha256": hashlib.sha256(block.data).hexdigest()}
    if isinstance(block, ToolUseBlock):
        return {"type": "tool_use", "id": block.id, "name": block.name,
                "input": block.arguments}
    return {"type": "tool_result", "tool_use_id": block.tool_use_id,
            "content": [_request_block(inner) for inner in block.content],
            "is_error": block.is_error}


def _message_body(message: Message) -> dict[str, Any]:
    return {"role": message.role, "content": [_request_block(b) for b in message.content]}


def _message_hash(message: Message) -> str:
    """A message's hash, computed once in its life: messages are immutable, and every request
    of a turn sends the same objects again (the conversation, repair, the image preparer and
    the compressor all reuse them), so a replayed request hashes only its new messages."""
    cached = message.cache.get(_MEMO)
    if cached is None:
        cached = _digest(_canonical(_message_body(message)))
        message.cache[_MEMO] = cached
    return str(cached)


@dataclass(frozen=True)
class _Parts:
    """A request's key and the hashes it is made of."""

    key: str
    head: str
    system: str
    tools: str
    messages: list[str]


# --------------------------------------------------------------------------- replies


def _reply_block(block: ContentBlock) -> dict[str, Any]:
    """A block of an answer, whole (an image with its bytes), to be rebuilt on replay."""
    if isinstance(block, ImageBlock):
        return {"type": "image", "media_type": block.media_type,
                "description": block.description,
                "data": base64.b64encode(block.data).decode("ascii")}
    if isinstance(block, ToolResultBlock):
        return {"type": "tool_result", "tool_use_id": block.tool_use_id,
                "content": [_reply_block(inner) for inner in block.content],
                "is_error": block.is_error}
    return _request_block(block)


def _reply_json(reply: ModelReply) -> dict[str, Any]:
    usage = reply.usage
    return {"content": [_reply_block(b) for b in reply.content],
            "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
                      "estimated": usage.estimated, "cost": usage.cost,
                      "cached_input_tokens": usage.cached_input_tokens},
            "stop_reason": reply.stop_reason}


@dataclass(frozen=True)
class _Overflow:
    """A recorded context overflow: the server refused the prompt as too long."""

    message: str
    status_code: int | None


_Outcome = ModelReply | _Overflow


class _BadLine(Exception):
    """A line of the cache file that cannot be read; the text says why."""


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
           *, optional: bool = False) -> Any:
    value = data.get(name)
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int: a flag where a number belongs (or the reverse) is a wrong shape.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise _BadLine(f'"{name}" is missing or not of the right type')
    return value


def _read_block(data: Any, *, nested: bool = False) -> ContentBlock:
    if not isinstance(data, dict):
        raise _BadLine("a content block is not an object")
    kind = data.get("type")
    if kind == "text":
        return TextBlock(_field(data, "text", str))
    if kind == "tool_use" and not nested:
        return ToolUseBlock(_field(data, "id", str), _field(data, "name", str),
                            _field(data, "input", str))
    if kind == "image":
        try:
            raw = base64.b64decode(_field(data, "data", str), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _BadLine("an image's data is not base64") from exc
        return ImageBlock(raw, _field(data, "media_type", str),
                          _field(data, "description", str))
    if kind == "tool_result" and not nested:
        inner = tuple(_read_block(b, nested=True) for b in _field(data, "content", list))
        return ToolResultBlock(_field(data, "tool_use_id", str),
                               tuple(b for b in inner if isinstance(b, TextBlock | ImageBlock)),
                               _field(data, "is_error", bool))
    raise _BadLine(f"unknown content block type {kind!r}")


def _read_outcome(line: Mapping[str, Any]) -> _Outcome:
    if ("reply" in line) == ("error" in line):
        raise _BadLine('an answer needs exactly one of "reply" and "error"')
    if "error" in line:
        error = _field(line, "error", dict)
        if error.get("kind") != "context_overflow":
            raise _BadLine(f"unknown error kind {error.get('kind')!r}")
        return _Overflow(_field(error, "message", str),
                         _field(error, "status_code", int, optional=True))
    reply = _field(line, "reply", dict)
    usage = _field(reply, "usage", dict)
    cost = _field(usage, "cost", (int, float), optional=True)
    cached = _field(usage, "cached_input_tokens", int, optional=True)
    return ModelReply(
        content=tuple(_read_block(b) for b in _field(reply, "content", list)),
        usage=Usage(_field(usage, "input_tokens", int), _field(usage, "output_tokens", int),
                    _field(usage, "estimated", bool), None if cost is None else float(cost),
                    cached or 0),
        stop_reason=_field(reply, "stop_reason", str))


# --------------------------------------------------------------------------- the recording


@dataclass(frozen=True)
class _Entry:
    """One recorded answer's request, its messages shared with an earlier entry's.

    The messages are ``entries[base]``'s first ``keep``, then ``added``.
    """

    key: str
    head: str
    system: str
    tools: str
    base: int | None
    keep: int
    added: tuple[str, ...]

    @property
    def length(self) -> int:
        return self.keep + len(self.added)


@dataclass
class _Recording:
    """What the cache file holds, as loaded (and as appended since)."""

    messages: dict[str, dict[str, Any]] = field(default_factory=dict)
    systems: dict[str, str] = field(default_factory=dict)
    tools: dict[str, list[Any]] = field(default_factory=dict)
    entries: list[_Entry] = field(default_factory=list)
    answers: dict[str, list[tuple[int, _Outcome]]] = field(default_factory=dict)
    torn_at: int | None = None
    """The offset of a last line without its newline (a torn write), to cut off."""

    def add_entry(self, entry: _Entry, outcome: _Outcome) -> int:
        index = len(self.entries)
        self.entries.append(entry)
        self.answers.setdefault(entry.key, []).append((index, outcome))
        return index

    def take(self, raw: bytes) -> None:
        """Reads one line of the file into the recording."""
        try:
            line = json.loads(raw)
        except ValueError as exc:
            raise _BadLine(f"not JSON ({exc})") from None
        if not isinstance(line, dict):
            raise _BadLine("not a JSON object")
        version = line.get("v")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise _BadLine(f"format version {version!r}; this program reads version "
                           f"{FORMAT_VERSION}")
        kind = line.get("kind")
        if kind == "message":
            body = _field(line, "body", dict)
            if _field(body, "role", str) not in ("user", "assistant"):
                raise _BadLine(f"unknown role {body['role']!r}")
            if not all(isinstance(b, dict) for b in _field(body, "content", list)):
                raise _BadLine("a content block is not an object")
            self.messages[_field(line, "hash", str)] = body
        elif kind == "system":
            self.systems[_field(line, "hash", str)] = _field(line, "text", str)
        elif kind == "tools":
            self.tools[_field(line, "hash", str)] = _field(line, "tools", list)
        elif kind == "answer":
            self.add_entry(self._entry(line), _read_outcome(line))
        else:
            raise _BadLine(f"unknown line kind {kind!r}")

    def _entry(self, line: Mapping[str, Any]) -> _Entry:
        system = _field(line, "system", str)
        tools = _field(line, "tools", str)
        if system not in self.systems or tools not in self.tools:
            raise _BadLine("names a system prompt or tool list written nowhere before it")
        added = _field(line, "messages", list)
        if not all(isinstance(h, str) and h in self.messages for h in added):
            raise _BadLine("names a message written nowhere before it")
        base = _field(line, "base", int, optional=True)
        keep = _field(line, "keep", int)
        limit = 0 if base is None else (
            self.entries[base].length if 0 <= base < len(self.entries) else -1)
        if limit < 0:
            raise _BadLine(f'"base" {base} is not an earlier answer')
        if not 0 <= keep <= limit:
            raise _BadLine(f'"keep" {keep} is outside 0..{limit}')
        head = _canonical({"format": FORMAT_VERSION, "model": _field(line, "model", str),
                           "sampling": _field(line, "sampling", dict),
                           "max_output_tokens": _field(line, "max_output_tokens", int,
                                                       optional=True)})
        return _Entry(_field(line, "key", str), head, system, tools, base, keep,
                      tuple(added))

    def message_at(self, index: int, position: int) -> str:
        """The hash of message ``position`` of entry ``index``, following the bases."""
        entry = self.entries[index]
        while position < entry.keep:
            assert entry.base is not None  # keep is 0 without a base (checked on load)
            entry = self.entries[entry.base]
        return entry.added[position - entry.keep]

    def prefix_lengths(self, now: Sequence[str]) -> list[int]:
        """For each entry, how many leading messages it shares with ``now``.

        Linear in the file: an entry starts as its base's prefix, so only its own messages
        are compared.
        """
        lengths: list[int] = []
        for entry in self.entries:
            inherited = lengths[entry.base] if entry.base is not None else 0
            if inherited < entry.keep:
                lengths.append(inherited)
                continue
            common = entry.keep
            for recorded, asked in zip(entry.added, now[entry.keep:], strict=False):
                if recorded != asked:
                    break
                common += 1
            lengths.append(common)
        return lengths


def _load(path: Path) -> _Recording:
    """Reads the whole cache file (run in a thread)."""
    recording = _Recording()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return recording
    except OSError as exc:
        raise CacheFileError(f"{path}: the response cache cannot be read ({exc}); fix it, "
                             "delete the file, or run with `--cache off`") from None
    lines = data.split(b"\n")
    tail = lines.pop()
    if tail:
        recording.torn_at = len(data) - len(tail)
    for number, raw in enumerate(lines, 1):
        try:
            recording.take(raw)
        except _BadLine as exc:
            raise CacheFileError(
                f"{path}, line {number}: unreadable response cache line: {exc}. Delete the "
                "file to record afresh, or run with `--cache off`") from None
    return recording


# --------------------------------------------------------------------------- misses


def _render_block(block: Any) -> str:
    if not isinstance(block, Mapping):
        return str(block)
    kind = block.get("type")
    if kind == "text":
        return str(block.get("text"))
    if kind == "image":
        return f"[image {block.get('media_type')} {str(block.get('sha256'))[:12]}]"
    if kind == "tool_use":
        return f"[tool_use {block.get('id')}: {block.get('name')} {block.get('input')}]"
    error = " error" if block.get("is_error") else ""
    inner = " ".join(_render_block(b) for b in block.get("content") or ())
    return f"[tool_result {block.get('tool_use_id')}{error}] {inner}"


def _render(body: Mapping[str, Any]) -> str:
    return "\n".join(_render_block(b) for b in body.get("content") or ())


def _describe(body: Mapping[str, Any]) -> str:
    """``user, tool_result``: the role and the kinds of blocks, in order, once each."""
    kinds = dict.fromkeys(str(b.get("type")) for b in body.get("content") or ())
    return ", ".join([str(body.get("role")), *kinds])


def _excerpts(recorded: str, now: str) -> tuple[str, str]:
    """Both texts, quoted, from a little before the first character that differs."""
    same = 0
    for a, b in zip(recorded, now, strict=False):
        if a != b:
            break
        same += 1
    # From the start when the difference shows there with some of what follows it.
    start = 0 if same + 20 <= _EXCERPT else same - 20

    def cut(text: str) -> str:
        piece = text[start:start + _EXCERPT].replace("\n", "\\n")
        return ('"' + ("…" if start else "") + piece
                + ("…" if start + _EXCERPT < len(text) else "") + '"')

    return cut(recorded), cut(now)


def _tool_names(tools: Sequence[Any]) -> dict[str, str]:
    named: dict[str, str] = {}
    for tool in tools:
        inner = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = inner.get("name") if isinstance(inner, dict) else None
        named[str(name)] = _canonical(tool)
    return named


def _tools_change(recorded: Sequence[Any], now: Sequence[Any]) -> str:
    before, after = _tool_names(recorded), _tool_names(now)
    changes = [f"added {', '.join(sorted(after.keys() - before.keys()))}",
               f"removed {', '.join(sorted(before.keys() - after.keys()))}",
               "changed " + ", ".join(sorted(n for n in before.keys() & after.keys()
                                             if before[n] != after[n]))]
    said = [c for c in changes if not c.endswith(" ")]
    return "; ".join(said) if said else "their order changed"


# --------------------------------------------------------------------------- the cache


class ResponseCache:
    """A :class:`~trading_agent.agent.backend.ModelBackend` that replays recorded answers.

    Args:
        backend: The model to ask on a miss (in ``record`` mode) and in ``off`` mode.
        path: The cache file (JSON lines); its folder is made on the first write.
        mode: ``record``, ``strict`` or ``off`` (see the module docstring).
        sampling: The settings that shape answers but are not in the request (temperature,
            the backend's default token cap, extra body fields): part of every key, so
            changing them re-asks the model. Values must be JSON.

    Attributes:
        backend: The wrapped backend.
        path: The cache file.
        mode: The mode.
        model: The wrapped backend's model.
        context_window: The wrapped backend's window.
        requests: Requests asked of the cache so far.
        model_calls: Requests that reached the wrapped backend (failed attempts included).
        cache_hits: Requests answered from the file.

    Raises:
        ConfigError: An unknown mode, or sampling settings that are not JSON.

    Example::

        async with ResponseCache(backend, out / "responses.jsonl", "strict") as cached:
            loop = AgentLoop("alpha", cached, executor, bus, maximum_rounds=8)
    """

    def __init__(self, backend: ModelBackend, path: Path, mode: CacheMode = "record", *,
                 sampling: Mapping[str, Any] | None = None) -> None:
        if mode not in _MODES:
            raise ConfigError(f"cache mode {mode!r}: allowed are {', '.join(_MODES)}")
        try:
            sampling_json: dict[str, Any] = json.loads(_canonical(dict(sampling or {})))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"the response cache's sampling settings must be JSON values: "
                              f"{exc}") from None
        self.backend = backend
        self.path = Path(path)
        self.mode: CacheMode = mode
        self.model: str = backend.model
        self.context_window: int = backend.context_window
        self.requests = 0
        self.model_calls = 0
        self.cache_hits = 0
        self._sampling = sampling_json
        self._heads: dict[int | None, str] = {}
        self._system_memo: tuple[str, str] | None = None
        self._tools_memo: tuple[tuple[Mapping[str, Any], ...], str] | None = None
        self._recording: _Recording | None = None
        self._used: dict[str, int] = {}
        self._recent: deque[tuple[int, list[str]]] = deque(maxlen=_RECENT_BASES)
        self._file: io.FileIO | None = None
        self._write_lock: anyio.Lock | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r}, path={str(self.path)!r}, {self.mode})"

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        """Loads the cache file (in a thread); nothing is read in ``off`` mode.

        Raises:
            CacheFileError: The file cannot be read, or a line of it is unreadable.
        """
        if self._recording is None and self.mode != "off":
            self._write_lock = anyio.Lock()
            self._recording = await anyio.to_thread.run_sync(_load, self.path)

    async def aclose(self) -> None:
        """Closes the file (the wrapped backend is the caller's to close)."""
        if self._file is not None:
            file, self._file = self._file, None
            await anyio.to_thread.run_sync(file.close)

    async def __aenter__(self) -> ResponseCache:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ keys

    def key_of(self, request: ModelRequestSpec) -> str:
        """The key a request is recorded under.

        Args:
            request: The request.

        Returns:
            A SHA-256, in hex.
        """
        return self._parts(request).key

    def _parts(self, request: ModelRequestSpec) -> _Parts:
        head = self._heads.get(request.max_output_tokens)
        if head is None:
            head = _canonical({"format": FORMAT_VERSION, "model": self.model,
                               "sampling": self._sampling,
                               "max_output_tokens": request.max_output_tokens})
            self._heads[request.max_output_tokens] = head
        system = self._system_hash(request.system_prompt)
        tools = self._tools_hash(request.tools)
        messages = [_message_hash(m) for m in request.messages]
        digest = hashlib.sha256(f"{head}\n{system}\n{tools}\n{len(messages)}\n".encode("ascii"))
        digest.update("".join(messages).encode("ascii"))
        return _Parts(digest.hexdigest(), head, system, tools, messages)

    def _system_hash(self, prompt: str) -> str:
        memo = self._system_memo
        if memo is None or memo[0] != prompt:
            memo = (prompt, _digest(_canonical(prompt)))
            self._system_memo = memo
        return memo[1]

    def _tools_hash(self, tools: Sequence[Mapping[str, Any]]) -> str:
        # Keyed by the identity of each definition, as the registry builds them once; the
        # memo holds them, so an id cannot be reused while it is compared.
        key = tuple(tools)
        memo = self._tools_memo
        if memo is None or len(memo[0]) != len(key) or any(
                a is not b for a, b in zip(memo[0], key, strict=True)):
            memo = (key, _digest(_canonical([dict(t) for t in key])))
            self._tools_memo = memo
        return memo[1]

    # ------------------------------------------------------------------ complete

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None) -> ModelReply:
        """Replays the recorded answer, or asks the wrapped backend (``record``, ``off``).

        A replayed answer is what was recorded: the same content and tool-call ids, usage
        and stop reason; its text goes to ``on_text`` in one piece.

        Args:
            request: What to send.
            on_text: Called with the answer's text.

        Returns:
            The answer.

        Raises:
            CacheMissError: Strict mode, and no recorded answer is left for this request.
            ContextOverflowError: The server refused the prompt as too long (live or
                recorded).
            TransientBackendError: From the wrapped backend, on a miss.
            BackendError: From the wrapped backend, on a miss.
            CacheFileError: The answer could not be appended to the file.
            RuntimeError: The cache was not opened.
        """
        self.requests += 1
        if self.mode == "off":
            self.model_calls += 1
            return await self.backend.complete(request, on_text)
        recording = self._recording
        if recording is None:
            raise RuntimeError("open the ResponseCache before use (async with, or open())")
        parts = self._parts(request)
        used = self._used.get(parts.key, 0)
        answers = recording.answers.get(parts.key)
        if answers is not None and used < len(answers):
            self._used[parts.key] = used + 1
            self.cache_hits += 1
            index, outcome = answers[used]
            self._recent.append((index, parts.messages))
            return self._replay(outcome, on_text)
        if self.mode == "strict":
            raise CacheMissError(self._explain_miss(request, parts), model=self.model)
        self.model_calls += 1
        try:
            reply = await self.backend.complete(request, on_text)
        except ContextOverflowError as exc:
            with anyio.CancelScope(shield=True):
                await self._record(request, parts, _Overflow(exc.message, exc.status_code))
            raise
        # Paid for: keep it even when the turn is being cancelled.
        with anyio.CancelScope(shield=True):
            await self._record(request, parts, reply)
        return reply

    def _replay(self, outcome: _Outcome, on_text: Callable[[str], None] | None) -> ModelReply:
        if isinstance(outcome, _Overflow):
            raise ContextOverflowError(outcome.message, status_code=outcome.status_code,
                                       model=self.model)
        if on_text is not None and outcome.text:
            on_text(outcome.text)
        return outcome

    # ------------------------------------------------------------------ recording

    async def _record(self, request: ModelRequestSpec, parts: _Parts,
                      outcome: _Outcome) -> None:
        """Appends one answer, and the bodies it names that are new, in one write.

        The recording changes only once the write succeeded, so a failed write never leaves
        a later line naming a body the file lacks.
        """
        recording = self._recording
        assert recording is not None and self._write_lock is not None
        async with self._write_lock:  # lines in order: a body before the answer naming it
            lines: list[dict[str, Any]] = []
            system = (None if parts.system in recording.systems else request.system_prompt)
            if system is not None:
                lines.append({"v": FORMAT_VERSION, "kind": "system", "hash": parts.system,
                              "text": system})
            tools: list[Any] | None = None
            if parts.tools not in recording.tools:
                tools = json.loads(_canonical([dict(t) for t in request.tools]))
                lines.append({"v": FORMAT_VERSION, "kind": "tools", "hash": parts.tools,
                              "tools": tools})
            base, keep = self._base_for(parts.messages)
            added = parts.messages[keep:]
            bodies: dict[str, dict[str, Any]] = {}
            for message, digest in zip(request.messages[keep:], added, strict=True):
                if digest not in recording.messages and digest not in bodies:
                    bodies[digest] = _message_body(message)
                    lines.append({"v": FORMAT_VERSION, "kind": "message", "hash": digest,
                                  "body": bodies[digest]})
            answer: dict[str, Any] = {
                "v": FORMAT_VERSION, "kind": "answer", "key": parts.key, "model": self.model,
                "sampling": self._sampling, "max_output_tokens": request.max_output_tokens,
                "system": parts.system, "tools": parts.tools, "base": base, "keep": keep,
                "messages": added}
            if isinstance(outcome, _Overflow):
                answer["error"] = {"kind": "context_overflow", "message": outcome.message,
                                   "status_code": outcome.status_code}
            else:
                answer["reply"] = _reply_json(outcome)
            lines.append(answer)
            data = "".join(_canonical(line) + "\n" for line in lines).encode("ascii")
            await anyio.to_thread.run_sync(self._append, data)

            if system is not None:
                recording.systems[parts.system] = system
            if tools is not None:
                recording.tools[parts.tools] = tools
            recording.messages.update(bodies)
            index = recording.add_entry(_Entry(parts.key, parts.head, parts.system,
                                               parts.tools, base, keep, tuple(added)), outcome)
            self._used[parts.key] = self._used.get(parts.key, 0) + 1
            self._recent.append((index, parts.messages))

    def _base_for(self, messages: list[str]) -> tuple[int | None, int]:
        """The recent answer sharing the most leading messages, and how many it shares."""
        best: tuple[int | None, int] = (None, 0)
        for index, recorded in self._recent:
            common = 0
            for a, b in zip(recorded, messages, strict=False):
                if a != b:
                    break
                common += 1
            if common > best[1]:
                best = (index, common)
        return best

    def _append(self, data: bytes) -> None:
        """Writes whole lines at the end of the file (in a thread)."""
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                recording = self._recording
                if recording is not None and recording.torn_at is not None:
                    os.truncate(self.path, recording.torn_at)  # a torn last line: cut it off
                    recording.torn_at = None
                # Kept open for the run, closed by aclose.
                self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115
            view = memoryview(data)
            while view:  # unbuffered: each write goes to the OS, so a crash keeps it
                view = view[self._file.write(view) or 0:]
        except OSError as exc:
            raise CacheFileError(f"{self.path}: cannot append to the response cache ({exc}); "
                                 "fix it, or run with `--cache off`") from None

    # ------------------------------------------------------------------ misses

    def _explain_miss(self, request: ModelRequestSpec, parts: _Parts) -> str:
        """Why a strict request has no answer, against the closest recorded request."""
        recording = self._recording
        assert recording is not None
        start = f"no recorded answer for request {self.requests} (strict cache)"
        if not recording.entries:
            return (f"{start}: the cache file {self.path} is empty or missing; run with "
                    "`--cache record` first to record the model's answers")
        recorded_times = len(recording.answers.get(parts.key, ()))
        if recorded_times:
            return (f"{start}: this exact request was recorded {recorded_times} time(s) and "
                    f"this run asks it once more; the recording stops here")
        lengths = recording.prefix_lengths(parts.messages)
        best = max(range(len(recording.entries)), key=lambda i: (
            recording.entries[i].system == parts.system, recording.entries[i].tools ==
            parts.tools, recording.entries[i].head == parts.head, lengths[i], i))
        entry = recording.entries[best]
        if entry.system != parts.system:
            before, after = _excerpts(recording.systems[entry.system], request.system_prompt)
            return f"{start}: the system prompt changed: recorded {before}, now {after}"
        if entry.tools != parts.tools:
            change = _tools_change(recording.tools[entry.tools],
                                   [dict(t) for t in request.tools])
            return f"{start}: the tools changed ({change})"
        if entry.head != parts.head:
            return (f"{start}: the model or sampling settings changed: recorded "
                    f"{entry.head}, now {parts.head}")
        common = lengths[best]
        count = len(parts.messages)
        now = _message_body(request.messages[common]) if common < count else None
        then = (recording.messages[recording.message_at(best, common)]
                if common < entry.length else None)
        if now is not None and then is not None:
            before, after = _excerpts(_render(then), _render(now))
            was = "" if _describe(then) == _describe(now) else f"({_describe(then)}) "
            return (f"{start}: message {common + 1} of {count} ({_describe(now)}) differs from "
                    f"the recording: recorded {was}{before}, now {after}")
        if now is not None:
            _, after = _excerpts("", _render(now))
            return (f"{start}: message {common + 1} of {count} ({_describe(now)}) is new: the "
                    f"closest recorded request ends after message {common}; now {after}")
        if then is not None:
            before, _ = _excerpts(_render(then), "")
            return (f"{start}: the request ends after message {count}, where the closest "
                    f"recorded request goes on with message {common + 1} ({_describe(then)}): "
                    f"recorded {before}")
        return f"{start}: it differs from every recorded request"
