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
trading_agent.backends.llama_chat_handler`` (llama-cpp-python's server plus our chat handler) on a
free loopback port, and (3) waits until ``GET /v1/models`` answers. On exit it terminates the
child, and kills it after a grace period; on Linux the child also dies with its parent, should
the daemon itself be killed. llama.cpp itself is only ever imported in the child.

The child's stderr goes to a log file next to the model, truncated at each start; when the
child dies, the error quotes its last lines.

Tool calling: the child registers :data:`TOOL_CHAT_FORMAT`, a chat handler of ours (see
:mod:`.llama_chat_handler` for why), and uses it by default.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import httpx
import structlog

from trading_agent.backends import llama_chat_handler
from trading_agent.backends.config import LocalModelConfig
from trading_agent.backends.llama_chat_handler import PARENT_PID_VARIABLE
from trading_agent.errors import BackendUnavailableError, ConfigError

__all__ = [
    "LocalModelServer",
    "ensure_model_file",
]

_log = structlog.get_logger(__name__)

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
_BIND_ATTEMPTS = 3
_POLL_INTERVAL = 0.2
_TAIL_BYTES = 4096


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
                env={**_child_environment(os.environ), PARENT_PID_VARIABLE: str(os.getpid())})
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
        sys.executable, "-m", llama_chat_handler.__name__,
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
