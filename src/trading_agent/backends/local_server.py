"""The embedded local model: llama-cpp-python's OpenAI-compatible server as a child process.

The desks talk to the local model exactly as to any other server (vLLM, Ollama, OpenAI):
over OpenAI-compatible HTTP, through :mod:`.openai_compatible`. This module only owns the
child's life::

    async with LocalModelServer(LocalModelConfig(cache_dir=state_dir / "models")) as server:
        backend = OpenAICompatibleBackend(
            OpenAIBackendConfig(base_url=server.base_url, model=server.model,
                                context_window=server.context_window),
            unix_socket=server.unix_socket)

On entry it (1) writes the GGUF file out of the model's Python package into ``cache_dir``
once (the package ships it in chunks; the file is assembled into a temporary file and renamed,
so a crash never leaves a half-written model behind), (2) starts ``python -m
trading_agent.backends.llama_chat_handler`` (llama-cpp-python's server plus our chat handler),
which listens on a Unix socket in a fresh directory of mode 0700, and (3) waits until ``GET
/v1/models`` answers there. On exit it terminates the child, and kills it after a grace
period; on Linux the child also dies with its parent, should the daemon itself be killed.
llama.cpp itself is only ever imported in the child.

Only the daemon reaches the model (see :mod:`.owned_socket`): no TCP port at all; the
socket's directory (``$RUNTIME_DIRECTORY`` under systemd, else the system's temporary
directory, a new random name each start, mode 0700) keeps other users out, and every
connection, the readiness probe's included, is refused unless the process listening on the
socket is the child this server started (``SO_PEERCRED``), so a process of the same user that
takes the socket's place receives nothing. The child's environment is built from an
allow-list (:data:`_CHILD_VARIABLES`: the path, locale, Python's and the GPU's variables), so
no exchange or model secret reaches it; its command line names the model file and its
settings, never where it listens.

The child's stderr goes to a log file next to the model, truncated at each start; when the
child dies, the error quotes its last lines.

Tool calling: the child registers :data:`TOOL_CHAT_FORMAT`, a chat handler of ours (see
:mod:`.llama_chat_handler` for why), and uses it by default.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import anyio
import anyio.abc
import structlog

from trading_agent.backends import llama_chat_handler
from trading_agent.backends.config import LocalModelConfig
from trading_agent.backends.llama_chat_handler import PARENT_PID_VARIABLE, SOCKET_VARIABLE
from trading_agent.backends.owned_socket import ImpostorError, OwnedUnixConnector, OwnedUnixSocket
from trading_agent.errors import BackendUnavailableError, ConfigError

__all__ = [
    "LocalModelServer",
    "ensure_model_file",
]

_log = structlog.get_logger(__name__)

_INSTALL_HINT = "install the local model extra: pip install -e '.[local]'"
_BASE_URL = "http://local-model/v1"
"""The API root the backend is given: the host is only a name, the connection goes to the
Unix socket."""
_SOCKET_NAME = "model.sock"
# The modules the child needs: llama-cpp-python and what its ``[server]`` extra brings.
_SERVER_MODULES = ("llama_cpp", "fastapi", "uvicorn", "sse_starlette", "starlette_context",
                   "pydantic_settings")
_CHILD_VARIABLES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
    "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
})
"""The variables the child gets from the daemon's environment, and those starting with
:data:`_CHILD_PREFIXES`: none holds a secret, and none is one of llama-cpp-python's server
settings (it reads ``PORT``, ``API_KEY``... from the environment, over its command line)."""
_CHILD_PREFIXES = ("LC_", "GGML_")
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
        self._socket: OwnedUnixSocket | None = None
        self._model_path: Path | None = None
        self._load_seconds: float | None = None
        self._running: Any = None  # the entered _serving() context manager

    @property
    def config(self) -> LocalModelConfig:
        """The settings this server was started with."""
        return self._config

    @property
    def base_url(self) -> str:
        """The API root, ending in ``/v1``, for an OpenAI-compatible client that connects
        through :attr:`unix_socket` (its host is only a name)."""
        self._require_running()
        return _BASE_URL

    @property
    def unix_socket(self) -> OwnedUnixSocket:
        """Where the server listens, and its process: connect there, to it alone."""
        if self._socket is None:
            raise RuntimeError("the local model server is not running")
        return self._socket

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

    def _require_running(self) -> None:
        if self._socket is None:
            raise RuntimeError("the local model server is not running")

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
        directory = await anyio.to_thread.run_sync(_socket_directory)
        path = directory / _SOCKET_NAME
        try:
            async with self._child(path) as process:
                endpoint = OwnedUnixSocket(str(path), process.pid)
                await self._wait_until_ready(process, endpoint)
                self._socket = endpoint
                try:
                    yield
                finally:
                    self._socket = None
        finally:
            await anyio.to_thread.run_sync(shutil.rmtree, directory, True)

    @asynccontextmanager
    async def _child(self, path: Path) -> AsyncIterator[anyio.abc.Process]:
        config = self._config
        command = _server_command(config, self.model_path)
        log_file = await anyio.to_thread.run_sync(_open_log, config.log_path)
        try:
            _log.info("local_model.starting", socket=str(path), model=str(self.model_path),
                      chat_format=config.chat_format, log=str(config.log_path))
            process = await anyio.open_process(
                # stdout carries only uvicorn's access log: a line per request, for months.
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log_file,
                env={**_child_environment(os.environ), PARENT_PID_VARIABLE: str(os.getpid()),
                     SOCKET_VARIABLE: str(path)})
        finally:
            log_file.close()  # the child holds its own descriptor
        try:
            yield process
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(process, config.shutdown_grace)
                _log.info("local_model.stopped", socket=str(path),
                          returncode=process.returncode)

    async def _wait_until_ready(self, process: anyio.abc.Process,
                                endpoint: OwnedUnixSocket) -> None:
        config = self._config
        started = time.monotonic()
        # Every connection checked: an impostor on the socket gets no request, not even this.
        session = aiohttp.ClientSession(connector=OwnedUnixConnector(endpoint),
                                        timeout=aiohttp.ClientTimeout(total=5.0),
                                        trust_env=False)
        async with session:
            with anyio.move_on_after(config.startup_timeout) as deadline:
                while True:
                    if process.returncode is not None:
                        await self._raise_died(process.returncode, endpoint)
                    try:
                        async with session.get(f"{_BASE_URL}/models") as response:
                            if response.status == 200:
                                break
                    except ImpostorError as exc:
                        raise BackendUnavailableError(
                            f"local model server: {exc.os_error.strerror}; is another "
                            "program of this user taking its place?",
                            model=config.model_alias) from None
                    except (aiohttp.ClientError, OSError, TimeoutError):
                        pass  # not listening yet, or still loading the model
                    await anyio.sleep(_POLL_INTERVAL)
        if deadline.cancelled_caught:
            tail = await anyio.to_thread.run_sync(_read_tail, config.log_path)
            raise BackendUnavailableError(
                f"local model server did not answer within {config.startup_timeout:g} s "
                f"(log {config.log_path}); its last output:\n{tail}", model=config.model_alias)
        self._load_seconds = time.monotonic() - started
        _log.info("local_model.ready", socket=endpoint.path, pid=endpoint.owner_pid,
                  load_seconds=round(self._load_seconds, 2))

    async def _raise_died(self, returncode: int, endpoint: OwnedUnixSocket) -> None:
        config = self._config
        tail = await anyio.to_thread.run_sync(_read_tail, config.log_path)
        taken = ""
        if "address already in use" in tail.lower():
            taken = (f"another process took its socket {endpoint.path} before it could "
                     "listen there (is a program of this user taking its place?); ")
        raise BackendUnavailableError(
            f"local model server exited with code {returncode} before it was ready: {taken}"
            f"log {config.log_path}; its last output:\n{tail}", model=config.model_alias)


def _require_modules(names: Sequence[str], what: str) -> None:
    # find_spec on a top-level name never imports it: llama_cpp stays out of our process.
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"local model: {what} is not installed (missing Python modules: "
                          f"{', '.join(missing)}); {_INSTALL_HINT}")


def _socket_directory() -> Path:
    """A new directory of mode 0700 for the socket: ``$RUNTIME_DIRECTORY`` under systemd
    (``RuntimeDirectory=``), else the system's temporary directory (a short path: a socket's
    path holds at most 107 bytes)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
    return Path(tempfile.mkdtemp(prefix="trading-agent-model-", dir=runtime))


def _server_command(config: LocalModelConfig, model_path: Path) -> list[str]:
    threads = str(config.threads or os.cpu_count() or 1)
    return [
        sys.executable, "-m", llama_chat_handler.__name__,
        "--model", str(model_path), "--model_alias", config.model_alias,
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
        llama_chat_handler.KEPT_CONTEXTS_OPTION, str(config.kept_contexts_mb),
    ]


def _child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items()
            if key in _CHILD_VARIABLES or key.startswith(_CHILD_PREFIXES)}


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
