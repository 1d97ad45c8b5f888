"""The response cache: a model backend wrapper that makes a backtest deterministic and free.

:class:`ResponseCache` wraps any :class:`~trading_agent.agent.backend.ModelBackend`, so the
agent loop never knows it is there. Each request is keyed by a SHA-256 of everything that is
sent and shapes the answer: the model, the sampling settings the caller names, the answer's
token cap, the system prompt, the tool definitions, and each message's role and content
blocks (an image by its media type and a hash of its bytes). Message ids, creation times and
other bookkeeping never sent are left out, so a re-run with fresh ids still hits, and editing
a prompt invalidates only the requests from the first one that changed.

The messages enter the key as a hash chain: each link hashes the link before it with the next
message's body hash, so the last link stands for the whole list. A request that repeats the
previous one's messages (the same objects, as every request of a turn does) and adds two
costs two links: the cache keeps its last few requests with their chains, finds how many
leading messages are the same objects (a C-speed list comparison), and hashes only the rest.
The links depend on content alone, so any process computes the same key for the same request.

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
line carries the format version (``"v": 2``); a file of another version, such as one written
before the keys were chained (version 1), is refused::

    {"v":2,"kind":"message","hash":"9f2c…","body":{"role":"user","content":[…]}}
    {"v":2,"kind":"system","hash":"41d8…","text":"You are the desk alpha…"}
    {"v":2,"kind":"tools","hash":"c0ff…","tools":[…]}
    {"v":2,"kind":"answer","key":"e3b0…","model":"m","sampling":{},"max_output_tokens":null,
     "system":"41d8…","tools":"c0ff…","base":11,"keep":30,"messages":["9f2c…"],
     "reply":{"content":[…],"usage":{…},"stop_reason":"stop"}}

Memory stays flat over a long run: the cache holds the hashes of what the file holds, each
recorded answer's place in the file, and its last few requests, never a body. An answer is
read back from the file when it is replayed, and the bodies of the closest recorded request
only when a strict miss is explained.

Errors (in :mod:`trading_agent.errors`' tree)::

    BackendError
    └── CacheMissError      strict mode: no recorded answer (never retried by the loop)
    ConfigError
    └── CacheFileError      the cache file cannot be read, or a line of it is unreadable
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import hashlib
import json
import os
from array import array
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, get_args

import anyio
import structlog

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.conversation import (
    ContentBlock,
    ImageBlock,
    Message,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.backtest.files import append_private, private_folder
from trading_agent.errors import BackendError, ConfigError, ContextOverflowError

__all__ = ["FORMAT_VERSION", "CacheFileError", "CacheMissError", "CacheMode", "ResponseCache",
           "sampling_of"]

CacheMode = Literal["record", "strict", "off"]
"""``record`` asks the model on a miss, ``strict`` fails on one, ``off`` never caches."""

FORMAT_VERSION = 2
"""The version of the file format and of the request key; a line of another version is
refused, and a key never matches one made under another version (version 1 hashed the
messages' hashes side by side, not as a chain)."""

_MODES: tuple[str, ...] = get_args(CacheMode)
_log = structlog.get_logger(__name__)
_DIGEST = "response_cache.digest"
"""The key of a message's body hash in ``Message.cache`` (the per-message memo of derived
values): messages are immutable, so each is hashed once in its life."""
_LINK = "response_cache.link"
"""The key of a message's last chain link in ``Message.cache``: (the link before it, its
link). It spares the hashing when the same objects follow a message that differs only in
being a new object (a repair made afresh for each request)."""
_RECENT = 4
"""How many recent requests a new one may share its leading messages with."""
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


def sampling_of(backend: ModelBackend) -> dict[str, Any]:
    """What besides the request shapes the answer: the backend's sampling settings (part of
    every key; the backtest and a paper desk's recorder read them the same way)."""
    config = getattr(backend, "config", None)
    if config is None:
        return {}
    return {key: getattr(config, key, None)
            for key in ("temperature", "max_output_tokens", "max_tokens_field", "extra_body",
                        "thinking_budget_tokens")}


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
    if isinstance(block, ThinkingBlock):
        return {"type": "thinking", "text": block.text, "signature": block.signature,
                "source": block.source, "redacted": block.redacted}
    return {"type": "tool_result", "tool_use_id": block.tool_use_id,
            "content": [_request_block(inner) for inner in block.content],
            "is_error": block.is_error}


def _message_body(message: Message) -> dict[str, Any]:
    return {"role": message.role, "content": [_request_block(b) for b in message.content]}


def _message_digest(message: Message) -> bytes:
    """A message's body hash (32 bytes), computed once in its life."""
    cached = message.cache.get(_DIGEST)
    if cached is None:
        cached = hashlib.sha256(_canonical(_message_body(message)).encode("ascii")).digest()
        message.cache[_DIGEST] = cached
    return bytes(cached)


def _link(previous: bytes, message: Message) -> bytes:
    """The chain link after ``previous``: the hash of the messages up to ``message``."""
    memo = message.cache.get(_LINK)
    if memo is not None and memo[0] == previous:
        return bytes(memo[1])
    link = hashlib.sha256(previous + _message_digest(message)).digest()
    message.cache[_LINK] = (previous, link)
    return link


def _same_objects(recent: list[Message], now: list[Message]) -> int:
    """How many leading messages two requests share as the same objects.

    List equality runs in C and tests identity before ``__eq__`` (and a message compares by
    identity), so the common case, the whole of ``recent`` at the start of ``now``, costs one
    comparison of pointers; otherwise a binary search over slices finds the first difference.
    """
    low, high = 0, min(len(recent), len(now))
    if (recent if high == len(recent) else recent[:high]) == (
            now if high == len(now) else now[:high]):
        return high
    while high - low > 1:  # the first `low` are the same; a difference lies before `high`
        middle = (low + high) // 2
        if recent[low:middle] == now[low:middle]:
            low = middle
        else:
            high = middle
    return low


def _same_content(recent: list[bytes], now: list[bytes]) -> int:
    """How many leading messages two chains share: the largest n whose n-th links are equal
    (a link stands for every message up to it, so a binary search finds it)."""
    low, high = 0, min(len(recent), len(now))
    while low < high:
        middle = (low + high + 1) // 2
        if recent[middle - 1] == now[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


@dataclass(eq=False)
class _Sent:
    """A recent request as the key saw it.

    Attributes:
        messages: Its messages (a copy of the list; the same objects).
        chain: ``chain[i]`` is the link of ``messages[i]``: the hash of the first ``i + 1``.
        entry: The recorded answer it was given or recorded as (a base for the next answer).
    """

    messages: list[Message]
    chain: list[bytes]
    entry: int | None = None


@dataclass(frozen=True)
class _Parts:
    """A request's key and the hashes it is made of."""

    key: bytes
    head: str
    system: str
    tools: str
    sent: _Sent


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
    if kind == "thinking" and not nested:
        return ThinkingBlock(_field(data, "text", str), _field(data, "signature", str),
                             _field(data, "source", str), _field(data, "redacted", str))
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


def _place(entry: int, offset: int, length: int) -> int:
    """An answer's entry number and line (offset and length in the file) packed in one int:
    one small object per recorded answer, as a long run holds hundreds of thousands. An entry
    number and a line length each fit in 32 bits (a line of 4 GiB is not an answer)."""
    return (offset << 64) | (entry << 32) | length


def _unplace(place: int) -> tuple[int, int, int]:
    """``(entry, offset, length)`` of :func:`_place`."""
    return (place >> 32) & 0xFFFFFFFF, place >> 64, place & 0xFFFFFFFF


def _hex_digest(value: Any) -> bytes | None:
    """A SHA-256 in hex as its 32 bytes, or None for anything else."""
    if not isinstance(value, str) or len(value) != 64:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None


def _parse(raw: bytes) -> dict[str, Any]:
    """One line of the file, as an object of this format version."""
    try:
        line = json.loads(raw)
    except ValueError as exc:
        raise _BadLine(f"not JSON ({exc})") from None
    if not isinstance(line, dict):
        raise _BadLine("not a JSON object")
    version = line.get("v")
    if version != FORMAT_VERSION or isinstance(version, bool):
        older = (" (written by an older trading-agent, whose request keys differ)"
                 if type(version) is int and 0 < version < FORMAT_VERSION else "")
        raise _BadLine(f"format version {version!r}{older}; this program reads version "
                       f"{FORMAT_VERSION}")
    return line


def _head(line: Mapping[str, Any]) -> str:
    """What an answer's line says of the model and the sampling, as the key spells it."""
    return _canonical({"format": FORMAT_VERSION, "model": _field(line, "model", str),
                       "sampling": _field(line, "sampling", dict),
                       "max_output_tokens": _field(line, "max_output_tokens", int,
                                                   optional=True)})


@dataclass
class _Recording:
    """What replay and recording need of the cache file: hashes and places, never a body.

    Attributes:
        messages: The hashes of the message bodies the file holds (so each is written once).
        systems: The hashes of its system prompts.
        tools: The hashes of its tool lists.
        lengths: Each answer's message count, in the file's order (to check a ``base``).
        answers: For each key, the places (:func:`_place`) of its answers as loaded, in order.
        size: The length of the file's whole lines.
        torn_at: The offset of a last line without its newline (a torn write), to cut off.
    """

    messages: set[bytes] = field(default_factory=set)
    systems: set[str] = field(default_factory=set)
    tools: set[str] = field(default_factory=set)
    lengths: array[int] = field(default_factory=lambda: array("q"))
    answers: dict[bytes, tuple[int, ...]] = field(default_factory=dict)
    size: int = 0
    torn_at: int | None = None

    def take(self, raw: bytes, offset: int) -> None:
        """Reads one line of the file, found at ``offset``, into the recording."""
        line = _parse(raw)
        kind = line.get("kind")
        if kind == "message":
            body = _field(line, "body", dict)
            if _field(body, "role", str) not in ("user", "assistant"):
                raise _BadLine(f"unknown role {body['role']!r}")
            if not all(isinstance(b, dict) for b in _field(body, "content", list)):
                raise _BadLine("a content block is not an object")
            digest = _hex_digest(_field(line, "hash", str))
            if digest is None:
                raise _BadLine('"hash" is not a SHA-256 in hex')
            self.messages.add(digest)
        elif kind == "system":
            _field(line, "text", str)
            self.systems.add(_field(line, "hash", str))
        elif kind == "tools":
            _field(line, "tools", list)
            self.tools.add(_field(line, "hash", str))
        elif kind == "answer":
            self._answer(line, offset, len(raw))
        else:
            raise _BadLine(f"unknown line kind {kind!r}")

    def _answer(self, line: Mapping[str, Any], offset: int, length: int) -> None:
        system = _field(line, "system", str)
        tools = _field(line, "tools", str)
        if system not in self.systems or tools not in self.tools:
            raise _BadLine("names a system prompt or tool list written nowhere before it")
        added = _field(line, "messages", list)
        if not all(_hex_digest(h) in self.messages for h in added):
            raise _BadLine("names a message written nowhere before it")
        base = _field(line, "base", int, optional=True)
        keep = _field(line, "keep", int)
        limit = 0 if base is None else (
            self.lengths[base] if 0 <= base < len(self.lengths) else -1)
        if limit < 0:
            raise _BadLine(f'"base" {base} is not an earlier answer')
        if not 0 <= keep <= limit:
            raise _BadLine(f'"keep" {keep} is outside 0..{limit}')
        _head(line)
        key = _hex_digest(_field(line, "key", str))
        if key is None:
            raise _BadLine('"key" is not a SHA-256 in hex')
        _read_outcome(line)  # checked now, read again when replayed
        entry = len(self.lengths)
        self.lengths.append(keep + len(added))
        self.answers[key] = (*self.answers.get(key, ()), _place(entry, offset, length))


def _load(path: Path) -> tuple[_Recording, IO[bytes] | None]:
    """Reads the cache file line by line (run in a thread).

    Returns:
        The recording, and the file left open to read answers back when it holds any.
    """
    recording = _Recording()
    try:
        file = open(path, "rb")  # noqa: SIM115  (kept open for replays, closed by aclose)
    except FileNotFoundError:
        return recording, None
    except OSError as exc:
        raise CacheFileError(f"{path}: the response cache cannot be read ({exc}); fix it, "
                             "delete the file, or run with `--cache off`") from None
    try:
        offset = 0
        for number, raw in enumerate(file, 1):
            if not raw.endswith(b"\n"):
                recording.torn_at = offset
                break
            try:
                recording.take(raw, offset)
            except _BadLine as exc:
                raise CacheFileError(
                    f"{path}, line {number}: unreadable response cache line: {exc}. Delete "
                    "the file to record afresh, or run with `--cache off`") from None
            offset += len(raw)
        recording.size = offset
    except OSError as exc:
        file.close()
        raise CacheFileError(f"{path}: the response cache cannot be read ({exc}); fix it, "
                             "delete the file, or run with `--cache off`") from None
    except BaseException:
        file.close()
        raise
    if not recording.answers:
        file.close()
        return recording, None
    return recording, file


# --------------------------------------------------------------------------- misses


@dataclass
class _Closest:
    """The recorded request closest to a missed one, with the bodies a miss message shows.

    Attributes:
        system: The hash of its system prompt, and the prompt.
        tools: The hash of its tool list, and the list.
        head: Its model and sampling settings, as the key spells them.
        common: How many leading messages it shares with the missed request.
        length: How many messages it has.
        message: Its message after the common ones (its body), if it goes on.
    """

    system: tuple[str, str]
    tools: tuple[str, list[Any]]
    head: str
    common: int
    length: int
    message: dict[str, Any] | None


def _closest(path: Path, size: int, now: Sequence[str], system: str, tools: str,
             head: str) -> _Closest:
    """Finds the recorded request closest to ``now`` (message hashes in hex) in the file.

    The closest has the same system prompt, tools and settings if any has, then the most
    leading messages in common, then is the latest. One pass over the file (run in a thread),
    linear in it: an answer's common prefix starts as its base's, so only its own messages are
    compared. The bodies the miss message shows are then read back by their place.

    Raises:
        _BadLine: The file no longer holds what was loaded.
        OSError: The file cannot be read.
    """
    places: dict[tuple[str, str], tuple[int, int]] = {}
    commons: list[int] = []
    nexts: list[str | None] = []  # each answer's message after its common ones (a hash)
    best: tuple[tuple[bool, bool, bool, int], int, int, str, str, str] | None = None
    with open(path, "rb") as file:
        offset = 0
        for raw in file:
            if offset + len(raw) > size:
                break  # appended since it was loaded (strict never writes, but someone may)
            line = _parse(raw)
            kind = _field(line, "kind", str)
            if kind != "answer":
                places[kind, _field(line, "hash", str)] = (offset, len(raw))
                offset += len(raw)
                continue
            offset += len(raw)
            base = _field(line, "base", int, optional=True)
            keep = _field(line, "keep", int)
            added: list[str] = _field(line, "messages", list)
            if base is not None and commons[base] < keep:
                # It parts from the missed request inside the part it shares with its base.
                common, following = commons[base], nexts[base]
            else:
                common = keep
                for recorded in added:
                    if common >= len(now) or recorded != now[common]:
                        break
                    common += 1
                following = added[common - keep] if common - keep < len(added) else None
            commons.append(common)
            nexts.append(following)
            entry = (_field(line, "system", str), _field(line, "tools", str), _head(line))
            score = (entry[0] == system, entry[1] == tools, entry[2] == head, common)
            if best is None or score >= best[0]:
                best = (score, len(commons) - 1, keep + len(added), *entry)
        if best is None:
            raise _BadLine("it holds no answer")
        score, index, length, best_system, best_tools, best_head = best

        def line_of(kind: str, digest: str) -> dict[str, Any]:
            where = places.get((kind, digest))
            if where is None:
                raise _BadLine(f"no {kind} line of hash {digest}")
            file.seek(where[0])
            return _parse(file.read(where[1]))

        following = nexts[index]
        return _Closest(
            (best_system, _field(line_of("system", best_system), "text", str)),
            (best_tools, _field(line_of("tools", best_tools), "tools", list)),
            best_head, score[3], length,
            None if following is None else _field(line_of("message", following), "body",
                                                   dict))

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
        replay_recorded: False for a recorder that always asks the model and appends the
            answer, never replaying one, and only logs an answer it could not keep (a paper
            desk in the daemon keeps its answers so ``backtest --from-desk`` can replay its
            day, :mod:`.desk_journal`).

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
                 sampling: Mapping[str, Any] | None = None,
                 replay_recorded: bool = True) -> None:
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
        self._replay_recorded = replay_recorded
        self._heads: dict[int | None, str] = {}
        self._system_memo: tuple[str, str] | None = None
        self._tools_memo: tuple[tuple[Mapping[str, Any], ...], str] | None = None
        self._recording: _Recording | None = None
        self._used: dict[bytes, int] = {}
        """How many of a loaded key's answers this run replayed (only loaded keys: an answer
        recorded in this run is never replayed in it, the next asking being a miss anyway)."""
        self._recent: deque[_Sent] = deque(maxlen=_RECENT)
        self._reader: IO[bytes] | None = None
        self._file: IO[bytes] | None = None
        self._write_lock: anyio.Lock | None = None
        self._lock_file: IO[bytes] | None = None
        """``<cache>.lock``: held while this process appends (``--jobs`` share the file)."""

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
            recording, self._reader = await anyio.to_thread.run_sync(_load, self.path)
            if self.mode == "strict":
                recording.messages = set()  # only a recording run writes bodies
            self._recording = recording

    async def aclose(self) -> None:
        """Closes the file (the wrapped backend is the caller's to close)."""
        files = [file for file in (self._file, self._reader, self._lock_file)
                 if file is not None]
        self._file = self._reader = self._lock_file = None
        for file in files:
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
        return self._parts(request).key.hex()

    def _parts(self, request: ModelRequestSpec) -> _Parts:
        head = self._heads.get(request.max_output_tokens)
        if head is None:
            head = _canonical({"format": FORMAT_VERSION, "model": self.model,
                               "sampling": self._sampling,
                               "max_output_tokens": request.max_output_tokens})
            self._heads[request.max_output_tokens] = head
        system = self._system_hash(request.system_prompt)
        tools = self._tools_hash(request.tools)
        sent = self._chain(request.messages)
        count = len(sent.chain)
        digest = hashlib.sha256(f"{head}\n{system}\n{tools}\n{count}\n".encode("ascii"))
        digest.update(sent.chain[-1] if count else b"")
        return _Parts(digest.digest(), head, system, tools, sent)

    def _chain(self, messages: Sequence[Message]) -> _Sent:
        """The request's chain: the recent request sharing the most leading message objects
        gives its links for them; only the messages after those are linked."""
        now = list(messages)  # a copy: the caller's list may change after the request
        closest: _Sent | None = None
        shared = 0
        for sent in reversed(self._recent):  # the newest first: it is usually the closest
            # Only one whose next message is also the same object can share more.
            if len(sent.messages) > shared < len(now) and sent.messages[shared] is now[shared]:
                common = _same_objects(sent.messages, now)
                if common > shared:
                    closest, shared = sent, common
        if closest is not None and shared == len(now) == len(closest.messages):
            return closest  # the same request again (its key asked, then the request itself)
        chain = closest.chain[:shared] if closest is not None else []
        link = chain[-1] if chain else b""
        for message in now[shared:]:
            link = _link(link, message)
            chain.append(link)
        sent = _Sent(now, chain)
        self._recent.append(sent)
        return sent

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
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        """Replays the recorded answer, or asks the wrapped backend (``record``, ``off``).

        A replayed answer is what was recorded: the same content and tool-call ids, usage
        and stop reason; its text goes to ``on_text`` in one piece.

        Args:
            request: What to send.
            on_text: Called with the answer's text.
            on_thinking: Called with the model's reasoning as it streams (a replayed answer
                has none: only the answer is cached).

        Returns:
            The answer.

        Raises:
            CacheMissError: Strict mode, and no recorded answer is left for this request.
            ContextOverflowError: The server refused the prompt as too long (live or
                recorded).
            TransientBackendError: From the wrapped backend, on a miss.
            BackendError: From the wrapped backend, on a miss.
            CacheFileError: The answer could not be appended to the file, or read back from
                it.
            RuntimeError: The cache was not opened.
        """
        self.requests += 1
        if self.mode == "off":
            self.model_calls += 1
            return await self.backend.complete(request, on_text, on_thinking)
        recording = self._recording
        if recording is None:
            raise RuntimeError("open the ResponseCache before use (async with, or open())")
        parts = self._parts(request)
        places = recording.answers.get(parts.key)
        used = self._used.get(parts.key, 0)
        if places is not None and used < len(places) and self._replay_recorded:
            entry, outcome = self._read_answer(places[used], parts.key)
            self._used[parts.key] = used + 1
            self.cache_hits += 1
            parts.sent.entry = entry
            return self._replay(outcome, on_text)
        if self.mode == "strict":
            message = await anyio.to_thread.run_sync(self._explain_miss, request, parts,
                                                     [_message_digest(m).hex()
                                                      for m in parts.sent.messages])
            raise CacheMissError(message, model=self.model)
        self.model_calls += 1
        try:
            reply = await self.backend.complete(request, on_text, on_thinking)
        except ContextOverflowError as exc:
            with anyio.CancelScope(shield=True):
                await self._keep(request, parts, _Overflow(exc.message, exc.status_code))
            raise
        # Paid for: keep it even when the turn is being cancelled.
        with anyio.CancelScope(shield=True):
            await self._keep(request, parts, reply)
        return reply

    async def _keep(self, request: ModelRequestSpec, parts: _Parts, outcome: _Outcome) -> None:
        """Records the answer; a live desk's recorder logs a failure instead of failing the
        turn (its replay then names the request it lacks)."""
        try:
            await self._record(request, parts, outcome)
        except CacheFileError as exc:
            if self._replay_recorded:
                raise
            _log.warning("model_answer_not_kept", path=str(self.path), error=str(exc))

    def _read_answer(self, place: int, key: bytes) -> tuple[int, _Outcome]:
        """Reads a recorded answer back from the file: its entry number and its outcome.

        One line of a few hundred bytes that the load just read (so in the page cache):
        read here, as a hop to a worker thread would cost more than the read.
        """
        entry, offset, length = _unplace(place)
        try:
            if self._reader is None:  # used again after aclose: the load's file is closed
                self._reader = open(self.path, "rb")  # noqa: SIM115  (closed by aclose)
            raw = os.pread(self._reader.fileno(), length, offset)
            line = _parse(raw)
            if line.get("kind") != "answer" or line.get("key") != key.hex():
                raise _BadLine("not the answer loaded there")
            return entry, _read_outcome(line)
        except (OSError, _BadLine) as exc:
            raise CacheFileError(
                f"{self.path}: the response cache changed while this run used it (the answer "
                f"at byte {offset}: {exc}); run again, or delete the file to record afresh"
            ) from None

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
            # Other processes (--jobs) may have appended since: take their lines first, under
            # the file lock, so this answer's base and bodies name what the file holds.
            await anyio.to_thread.run_sync(self._lock_and_catch_up)
            try:
                await self._append_answer(request, parts, outcome, recording)
            finally:
                await anyio.to_thread.run_sync(self._unlock)

    async def _append_answer(self, request: ModelRequestSpec, parts: _Parts,
                             outcome: _Outcome, recording: _Recording) -> None:
        """Appends one answer and its new bodies (the file lock held)."""
        lines: list[dict[str, Any]] = []
        system = (None if parts.system in recording.systems else request.system_prompt)
        if system is not None:
            lines.append({"v": FORMAT_VERSION, "kind": "system", "hash": parts.system,
                          "text": system})
        new_tools = parts.tools not in recording.tools
        if new_tools:
            lines.append({"v": FORMAT_VERSION, "kind": "tools", "hash": parts.tools,
                          "tools": json.loads(_canonical([dict(t) for t in request.tools]))})
        messages = parts.sent.messages
        base, keep = self._base_for(parts.sent)
        added: list[str] = []
        written: set[bytes] = set()
        for message in messages[keep:]:
            digest = _message_digest(message)
            added.append(digest.hex())
            if digest not in recording.messages and digest not in written:
                written.add(digest)
                lines.append({"v": FORMAT_VERSION, "kind": "message", "hash": added[-1],
                              "body": _message_body(message)})
        answer: dict[str, Any] = {
            "v": FORMAT_VERSION, "kind": "answer", "key": parts.key.hex(),
            "model": self.model, "sampling": self._sampling,
            "max_output_tokens": request.max_output_tokens, "system": parts.system,
            "tools": parts.tools, "base": base, "keep": keep, "messages": added}
        if isinstance(outcome, _Overflow):
            answer["error"] = {"kind": "context_overflow", "message": outcome.message,
                               "status_code": outcome.status_code}
        else:
            answer["reply"] = _reply_json(outcome)
        lines.append(answer)
        data = "".join(_canonical(line) + "\n" for line in lines).encode("ascii")
        await anyio.to_thread.run_sync(self._append, data)

        if system is not None:
            recording.systems.add(parts.system)
        if new_tools:
            recording.tools.add(parts.tools)
        recording.messages.update(written)
        recording.size += len(data)
        parts.sent.entry = len(recording.lengths)
        recording.lengths.append(len(messages))

    def _base_for(self, sent: _Sent) -> tuple[int | None, int]:
        """The recent answer sharing the most leading messages, and how many it shares: a
        binary search over each recent chain, so it costs no more than a few comparisons."""
        best: tuple[int | None, int] = (None, 0)
        for recent in self._recent:
            if recent.entry is not None:
                common = _same_content(recent.chain, sent.chain)
                if common > best[1]:
                    best = (recent.entry, common)
        return best

    def _lock_and_catch_up(self) -> None:
        """Takes the file lock, then the lines other processes appended since this one last
        read (in a thread). Under the lock nobody is writing, so a last line without its
        newline is a crash's, cut off by the next append.

        Raises:
            CacheFileError: The lock or the file cannot be opened, or a new line is
                unreadable.
        """
        recording = self._recording
        assert recording is not None
        try:
            if self._lock_file is None:
                private_folder(self.path.parent)
                self._lock_file = append_private(self.path.with_name(self.path.name + ".lock"))
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX)
            recording.torn_at = None
            try:
                file = open(self.path, "rb")  # noqa: SIM115  (closed below)
            except FileNotFoundError:
                return
            with file:
                file.seek(recording.size)
                offset = recording.size
                for raw in file:
                    if not raw.endswith(b"\n"):
                        recording.torn_at = offset
                        break
                    recording.take(raw, offset)
                    offset += len(raw)
                recording.size = offset
        except _BadLine as exc:
            self._unlock()
            raise CacheFileError(f"{self.path}: a line another run appended is unreadable: "
                                 f"{exc}. Delete the file to record afresh, or run with "
                                 "`--cache off`") from None
        except OSError as exc:
            self._unlock()
            raise CacheFileError(f"{self.path}: cannot lock or read the response cache "
                                 f"({exc}); fix it, or run with `--cache off`") from None

    def _unlock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)

    def _append(self, data: bytes) -> None:
        """Writes whole lines at the end of the file (in a thread, the file lock held)."""
        try:
            recording = self._recording
            if recording is not None and recording.torn_at is not None:
                os.truncate(self.path, recording.torn_at)  # a torn last line: cut it off
                recording.torn_at = None
            if self._file is None:
                private_folder(self.path.parent)
                # Kept open for the run, closed by aclose.
                self._file = append_private(self.path)
            view = memoryview(data)
            while view:  # unbuffered: each write goes to the OS, so a crash keeps it
                view = view[self._file.write(view) or 0:]
        except OSError as exc:
            raise CacheFileError(f"{self.path}: cannot append to the response cache ({exc}); "
                                 "fix it, or run with `--cache off`") from None

    # ------------------------------------------------------------------ misses

    def _explain_miss(self, request: ModelRequestSpec, parts: _Parts, now: list[str]) -> str:
        """Why a strict request has no answer, against the closest recorded request (run in
        a thread: it reads the file again, as the bodies are not kept in memory).

        Args:
            request: The request.
            parts: Its key and hashes.
            now: Its messages' hashes, in hex.
        """
        recording = self._recording
        assert recording is not None
        start = f"no recorded answer for request {self.requests} (strict cache)"
        if not recording.lengths:
            return (f"{start}: the cache file {self.path} is empty or missing; run with "
                    "`--cache record` first to record the model's answers")
        recorded_times = len(recording.answers.get(parts.key, ()))
        if recorded_times:
            return (f"{start}: this exact request was recorded {recorded_times} time(s) and "
                    f"this run asks it once more; the recording stops here")
        try:
            closest = _closest(self.path, recording.size, now, parts.system, parts.tools,
                               parts.head)
        except (OSError, _BadLine, LookupError) as exc:
            return (f"{start}; the closest recorded request cannot be shown, as the cache file "
                    f"{self.path} changed while this run used it ({exc})")
        if closest.system[0] != parts.system:
            before, after = _excerpts(closest.system[1], request.system_prompt)
            return f"{start}: the system prompt changed: recorded {before}, now {after}"
        if closest.tools[0] != parts.tools:
            change = _tools_change(closest.tools[1], [dict(t) for t in request.tools])
            return f"{start}: the tools changed ({change})"
        if closest.head != parts.head:
            return (f"{start}: the model or sampling settings changed: recorded "
                    f"{closest.head}, now {parts.head}")
        common = closest.common
        count = len(now)
        current = (_message_body(parts.sent.messages[common]) if common < count else None)
        then = closest.message
        if current is not None and then is not None:
            before, after = _excerpts(_render(then), _render(current))
            was = "" if _describe(then) == _describe(current) else f"({_describe(then)}) "
            return (f"{start}: message {common + 1} of {count} ({_describe(current)}) differs "
                    f"from the recording: recorded {was}{before}, now {after}")
        if current is not None:
            _, after = _excerpts("", _render(current))
            return (f"{start}: message {common + 1} of {count} ({_describe(current)}) is new: "
                    f"the closest recorded request ends after message {common}; now {after}")
        if then is not None:
            before, _ = _excerpts(_render(then), "")
            return (f"{start}: the request ends after message {count}, where the closest "
                    f"recorded request goes on with message {common + 1} ({_describe(then)}): "
                    f"recorded {before}")
        return f"{start}: it differs from every recorded request"
