"""The chat handler our local model server runs with, and the server process's entry point.

Everything here runs inside the child process that :mod:`.local_server` starts (``python -m
trading_agent.backends.llama_chat_handler``), where llama_cpp is importable; the daemon never
imports llama_cpp itself. A chat handler receives the OpenAI request's fields as keywords and
returns an OpenAI response dict (or an iterator of chunk dicts when streaming); llama-cpp-
python's server does the HTTP.

Why a handler of ours: the packaged Gemma 3 270M GGUF is a base model with no chat template,
and llama-cpp-python's ``chatml-function-calling`` format drops tool results from the prompt,
answers every text reply with an empty string, fails streamed tool calls with an empty 200
body, and ignores tools unless ``tool_choice`` is sent. :data:`TOOL_CHAT_FORMAT` works in the
same spirit (a grammar first picks ``message:`` or ``functions.<name>:``, then a JSON-schema
grammar writes the arguments) but keeps tool results and text, streams both kinds of answer,
reports usage on the last stream chunk, and turns a context overflow into a 400 (plain) or an
``error`` event (streamed). Left to choose (``tool_choice`` ``auto``), the model never repeats,
right after its results, the call it just made (same name, same arguments): the 270M model at
greedy decoding would do so until the client's round limit; it writes its message instead.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the server's process imports it; the settings, which read names here, not
    from trading_agent.backends.llama_contexts import ContextShelf

__all__ = ["KEPT_CONTEXTS_OPTION", "PARENT_PID_VARIABLE", "SOCKET_VARIABLE", "TOOL_CHAT_FORMAT"]

TOOL_CHAT_FORMAT = "trading-agent-tools"
"""The chat format name our handler is registered under."""

PARENT_PID_VARIABLE = "TRADING_AGENT_LOCAL_SERVER_PARENT"
"""Set by the parent to its pid, so the child can tell whether it was orphaned at start."""

SOCKET_VARIABLE = "TRADING_AGENT_LOCAL_SERVER_SOCKET"
"""Set by the parent to the Unix socket's path (in a 0700 directory of its own) the server
listens on; no TCP port is opened."""

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

_TURN_OPEN = "<|im_start|>{role}\n"
_TURN_CLOSE = "<|im_end|>\n"
_TURN_MARKERS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")
_TURN_STOPS = ["<|im_end|>", "<|im_start|>", "<end_of_turn>", "<start_of_turn>"]
KEPT_CONTEXTS_OPTION = "--kept_contexts_mb"
"""The server's option for :class:`~.llama_contexts.ContextShelf`'s budget, in MiB."""

_SHELF: ContextShelf | None = None  # made by ``_serve``
_OVERFLOW_MARGIN = 16  # room for "functions.<name>:\n" after the prompt
_MAX_ARGUMENT_TOKENS = 512


def _text_of(content: Any) -> str:
    """A message's text; image parts become a placeholder (the model reads no pictures)."""
    if content is None:
        return ""
    if isinstance(content, str):
        text = content
    else:
        text = "\n".join(part.get("text", "") if part.get("type") == "text"
                         else "[image omitted]" for part in content)
    for marker in _TURN_MARKERS:  # market data must not be able to open a turn
        text = text.replace(marker, "")
    return text


def _tool_instructions(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = ["You can call these functions:"]
    for tool in tools:
        function = tool["function"]
        lines.append(f"\nfunctions.{function['name']}: {function.get('description') or ''}"
                     .rstrip())
        lines.append("Parameters (JSON schema): " + json.dumps(
            function.get("parameters") or {"type": "object", "properties": {}}))
    lines.append("\nAnswer either with a message, starting with 'message:', or with one "
                 "function call, starting with 'functions.<name>:' and the JSON arguments "
                 "on the next line.")
    return "\n".join(lines)


def _render_prompt(messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[Mapping[str, Any]]) -> str:
    """ChatML turns; the 270M base model follows them better than Gemma's own turn tokens."""
    system = "\n\n".join(_text_of(m.get("content")) for m in messages if m["role"] == "system")
    if tools:
        system = f"{system}\n\n{_tool_instructions(tools)}" if system else (
            _tool_instructions(tools))
    turns = [_TURN_OPEN.format(role="system") + system + _TURN_CLOSE] if system else []
    call_names: dict[str, str] = {}
    for message in messages:
        role = message["role"]
        if role == "user":
            turns.append(_TURN_OPEN.format(role="user") + _text_of(message.get("content"))
                         + _TURN_CLOSE)
        elif role == "assistant":
            parts = []
            text = _text_of(message.get("content"))
            if text:
                parts.append(f"message:\n{text}" if tools else text)
            for call in message.get("tool_calls") or []:
                function = call["function"]
                call_names[call.get("id") or ""] = function["name"]
                parts.append(f"functions.{function['name']}:\n{function.get('arguments') or '{}'}")
            turns.append(_TURN_OPEN.format(role="assistant") + "\n".join(parts) + _TURN_CLOSE)
        elif role in ("tool", "function"):
            name = call_names.get(message.get("tool_call_id") or "", message.get("name") or "tool")
            turns.append(_TURN_OPEN.format(role="tool") + f"Result of functions.{name}:\n"
                         + _text_of(message.get("content")) + _TURN_CLOSE)
    return "".join(turns) + _TURN_OPEN.format(role="assistant")


def _tidy_json(text: str) -> str:
    """Arguments as strict JSON: the grammar lets raw newlines into strings. Else as they are."""
    try:
        return json.dumps(json.loads(text, strict=False), ensure_ascii=False)
    except ValueError:
        return text.strip()  # cut short by max_tokens: let the tool's validation say so


def _repeats_last_call(messages: Sequence[Mapping[str, Any]],
                       function: Mapping[str, str]) -> bool:
    """Whether ``function`` (name, arguments) is the call the latest assistant message made,
    with nothing but its results after it."""
    for message in reversed(messages):
        if message["role"] in ("tool", "function"):
            continue
        if message["role"] != "assistant":
            return False
        calls = [call["function"] for call in message.get("tool_calls") or []]
        return any(call["name"] == function["name"]
                   and _same_json(call.get("arguments") or "{}", function["arguments"])
                   for call in calls)
    return False


def _same_json(left: str, right: str) -> bool:
    try:
        return bool(json.loads(left) == json.loads(right))
    except ValueError:
        return left.strip() == right.strip()


def _overflow_error(prompt_tokens: int, n_ctx: int) -> dict[str, Any]:
    return {"message": (f"This model's maximum context length is {n_ctx} tokens. However, "
                        f"your messages resulted in {prompt_tokens} tokens."),
            "type": "invalid_request_error", "param": "messages",
            "code": "context_length_exceeded"}


def _tool_chat_handler(*, llama: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                       functions: list[dict[str, Any]] | None = None,
                       stream: bool = False, stop: str | list[str] | None = None,
                       max_tokens: int | None = None, model: str | None = None,
                       **sampling: Any) -> Any:
    """The :data:`TOOL_CHAT_FORMAT` chat handler (runs in the child)."""
    llama_grammar: Any = importlib.import_module("llama_cpp.llama_grammar")

    options = {key: sampling[key] for key in (
        "temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "repeat_penalty",
        "presence_penalty", "frequency_penalty") if sampling.get(key) is not None}
    offered = list(tools or []) or [{"type": "function", "function": f} for f in functions or []]
    choice = tool_choice if tool_choice is not None else "auto"  # OpenAI's default with tools
    if choice == "none":
        offered = []
    prompt = _render_prompt(messages, offered)
    n_ctx: int = llama.n_ctx()
    tokens = llama.tokenize(prompt.encode(), add_bos=True, special=True)
    prompt_tokens = len(tokens)
    if prompt_tokens + _OVERFLOW_MARGIN >= n_ctx:
        if not stream:  # the server turns this exact sentence into a 400
            raise ValueError(
                f"Requested tokens ({prompt_tokens}) exceed context window of {n_ctx}")
        return iter([{"error": _overflow_error(prompt_tokens, n_ctx)}])
    stops = ([stop] if isinstance(stop, str) else list(stop or [])) + _TURN_STOPS
    # The shelf ``_serve`` made (it registers this handler) readies the model's context.
    cached = _SHELF.prepare(llama, tokens) if _SHELF is not None else 0
    reply = _Reply(model or str(llama.model_path), prompt_tokens, cached_tokens=cached)

    selected: str | None = None
    if offered:
        names = [tool["function"]["name"] for tool in offered]
        if isinstance(choice, dict):
            selected = choice["function"]["name"]
            if selected not in names:
                raise ValueError(f"tool_choice names {selected!r}, which is not in tools")
        else:
            options_grammar = [json.dumps(f"functions.{name}:") for name in names]
            if choice != "required":
                options_grammar.insert(0, json.dumps("message:"))
            decision = llama.create_completion(
                prompt=prompt, temperature=0.0, max_tokens=64, stream=False,
                grammar=llama_grammar.LlamaGrammar.from_string(
                    "root ::= " + " | ".join(options_grammar), verbose=False))
            reply.completion_tokens += decision["usage"]["completion_tokens"]
            picked: str = decision["choices"][0]["text"].strip()
            if picked.startswith("functions."):
                selected = picked.removeprefix("functions.").removesuffix(":")

    if selected is not None:
        tool = next(tool for tool in offered if tool["function"]["name"] == selected)
        schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        try:
            grammar = llama_grammar.LlamaGrammar.from_json_schema(json.dumps(schema),
                                                                  verbose=False)
        except Exception:  # a schema the converter cannot take: any JSON will do
            grammar = llama_grammar.LlamaGrammar.from_string(llama_grammar.JSON_GBNF,
                                                             verbose=False)
        arguments = llama.create_completion(
            prompt=f"{prompt}functions.{selected}:\n", grammar=grammar, stream=False,
            max_tokens=min(max_tokens or _MAX_ARGUMENT_TOKENS, _MAX_ARGUMENT_TOKENS),
            stop=stops, **options)
        reply.completion_tokens += arguments["usage"]["completion_tokens"]
        finish = "length" if arguments["choices"][0]["finish_reason"] == "length" else (
            "tool_calls")
        function = {"name": selected, "arguments": _tidy_json(arguments["choices"][0]["text"])}
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}
        free_choice = not isinstance(choice, dict) and choice != "required"
        if not (free_choice and _repeats_last_call(messages, function)):
            if not stream:
                return reply.message(
                    {"role": "assistant", "content": None, "tool_calls": [call]}, finish)
            return iter([reply.chunk({"role": "assistant", "content": None}),
                         reply.chunk({"tool_calls": [{"index": 0, **call}]}),
                         reply.chunk({}, finish, usage=True)])
        # Greedy decoding, a prompt grown only by the result: the small model would make the
        # same call again, round after round, until the client's round limit. Its result is
        # already there to read, so the model writes its message instead.

    text_prompt = f"{prompt}message:\n" if offered else prompt
    if offered:
        stops.append("\nfunctions.")  # a call written inside a message: end the message there
    if not stream:
        result = llama.create_completion(prompt=text_prompt, max_tokens=max_tokens, stop=stops,
                                         stream=False, **options)
        reply.completion_tokens += result["usage"]["completion_tokens"]
        return reply.message({"role": "assistant", "content": result["choices"][0]["text"]},
                             result["choices"][0]["finish_reason"] or "stop")
    return _stream_text(llama, reply, text_prompt, max_tokens, stops, options)


def _stream_text(llama: Any, reply: _Reply, prompt: str, max_tokens: int | None,
                 stops: list[str], options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield reply.chunk({"role": "assistant", "content": ""})
    pieces: list[str] = []
    finish = "stop"
    try:
        for chunk in llama.create_completion(prompt=prompt, max_tokens=max_tokens, stop=stops,
                                             stream=True, **options):
            choice = chunk["choices"][0]
            if choice["text"]:
                pieces.append(choice["text"])
                yield reply.chunk({"content": choice["text"]})
            finish = choice["finish_reason"] or finish
    except Exception as exc:  # the headers are sent: an error event is all a client can get
        yield {"error": {"message": str(exc), "type": "internal_server_error",
                         "param": None, "code": None}}
        return
    text = "".join(pieces)
    reply.completion_tokens += len(llama.tokenize(text.encode(), add_bos=False, special=True))
    yield reply.chunk({}, finish, usage=True)


class _Reply:
    """Builds one answer's response dicts, sharing its id, time and token counts."""

    def __init__(self, model: str, prompt_tokens: int, *, cached_tokens: int) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = 0

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                # The prompt's tokens the model had read already, in OpenAI's field.
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def message(self, message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish_reason}],
                "usage": self.usage()}

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, *,
              usage: bool = False) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}
        if usage:  # the server drops stream_options, so usage always rides on the last chunk
            chunk["usage"] = self.usage()
        return chunk


def _exit_with_parent() -> None:
    """On Linux, dies with the daemon, even a SIGKILLed one: no orphan keeps the memory."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.get(PARENT_PID_VARIABLE)
    if parent is not None and os.getppid() != int(parent):
        raise SystemExit("local model server: the process that started it is gone")


def _listen(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 from its creation. Listening here (not
    in uvicorn) makes this process the one the kernel reports to the daemon's connections."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        listener.bind(path)
    finally:
        os.umask(previous)
    listener.listen(64)
    return listener


def _serve() -> None:
    """The child's entry point: llama-cpp-python's server, with our chat handler known, on
    the Unix socket the parent named (its ``main`` would listen on TCP)."""
    _exit_with_parent()
    path = os.environ.get(SOCKET_VARIABLE)
    if not path:
        raise SystemExit(f"local model server: {SOCKET_VARIABLE} names no socket to listen on")
    listener = _listen(path)  # first: the path is ours before the model loads
    # Imported by name, so that mypy sees the same thing with or without the local extra.
    chat_formats: Any = importlib.import_module("llama_cpp.llama_chat_format")
    settings: Any = importlib.import_module("llama_cpp.server.settings")
    cli: Any = importlib.import_module("llama_cpp.server.cli")
    application: Any = importlib.import_module("llama_cpp.server.app")
    uvicorn: Any = importlib.import_module("uvicorn")
    chat_formats.LlamaChatCompletionHandlerRegistry().register_chat_completion_handler(
        TOOL_CHAT_FORMAT, _tool_chat_handler, overwrite=True)
    parser = argparse.ArgumentParser(description="the local model server of trading-agent")
    cli.add_args_from_model(parser, settings.Settings)
    parser.add_argument(KEPT_CONTEXTS_OPTION, type=int, default=0)
    arguments = parser.parse_args()
    global _SHELF
    from trading_agent.backends.llama_contexts import ContextShelf
    _SHELF = ContextShelf(arguments.kept_contexts_mb * 2**20)
    app = application.create_app(
        server_settings=cli.parse_model_from_args(settings.ServerSettings, arguments),
        model_settings=[cli.parse_model_from_args(settings.ModelSettings, arguments)])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])


if __name__ == "__main__":
    _serve()
