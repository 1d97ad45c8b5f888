"""Tools from MCP servers: each tool a server offers becomes one tool of the desk.

A desk names its MCP servers in its config (a stdio command or a streamable HTTP URL, see
:class:`~trading_agent.tools.config.McpServerConfig`). :class:`McpToolSource` connects to one
server with the official ``mcp`` package, lists its tools and registers each in the desk's
:class:`~trading_agent.agent.tool_registry.ToolRegistry` as ``<server>__<tool>`` (``news`` and
``search`` give ``news__search``), with the server's JSON schema as its arguments schema.
What reaches the model is what our own tools give it:

- arguments are checked against the tool's schema before the server is asked; a mismatch
  goes back to the model as our validation errors do (``Error: invalid arguments for ...``);
- text becomes text, pictures become :class:`~trading_agent.agent.conversation.ImageBlock`
  (the executor sizes them), other content a line saying what it was; ``isError`` becomes a
  :class:`~trading_agent.errors.ToolError` with the server's text;
- a call that outlives ``timeout``, a server that died or answers with something that is not
  a tool result gives a :class:`~trading_agent.errors.ToolError` naming the server and the
  tool, never an exception that ends the turn. A dead server is connected again on the next
  call (one attempt per call); the call it died in is not repeated, as it may have run.

What a server puts before the model is capped, as its results are (``max_result_chars``):
a tool's description at :data:`MAXIMUM_DESCRIPTION_CHARS` (cut, with a note saying so), its
argument schema at :data:`MAXIMUM_SCHEMA_CHARS` of JSON (a tool with a larger one is left
out), a server's tools at :data:`MAXIMUM_TOOLS` and :data:`MAXIMUM_DEFINITION_CHARS` of
definitions (the rest left out, logged with what to do: name the wanted ones in ``tools``),
and its error texts at ``max_result_chars``. A server cannot fill a desk's context window
with its listing, however large.

A server that cannot be reached when the desk is built need not stop the daemon
(:meth:`McpToolSource.register_later`): the desk starts without the server's tools, which
are registered as soon as it answers, tried again in the background with backoff (from
:data:`RETRY_FIRST_SECONDS` to :data:`RETRY_MAX_SECONDS`) and on each call. Until then each
tool the config names in ``tools`` stands in under its name and answers the model that the
server is not reachable yet, and why; a call that finds the server up registers its tools
and runs.

Secrets: header values (``headers_env``) and passed-through variables (``env``) are read
from the environment when a connection is made, never logged, and cut out of every text the
model or the logs get from this module.

An MCP client is bound to the task that opened it (its task groups), so the source holds
its connection in a task of its own, in :meth:`McpToolSource.run`, and tool calls from any
task share it. Two ways to run it::

    # A desk: register the tools now, hold the connection while the desk runs (a desk
    # service, stopped with the desk, whichever task built it).
    source = McpToolSource(config, registry)
    await source.register()      # a short connection that lists the tools
    services.append((f"mcp {config.name}", source.run))

    # One scope (a test, a script): connects, registers, closes on exit. Like any anyio
    # task group, it is entered and exited by the same task, in the same scope.
    async with McpToolSource(config, registry):
        ...

The ``mcp`` package is imported when a server is first connected, so building a desk without
MCP servers does not load it.
"""

from __future__ import annotations

import base64
import binascii
import copy
import hashlib
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Container, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Self, TextIO

import anyio
import structlog
from anyio.abc import TaskGroup, TaskStatus
from pydantic import BaseModel, ConfigDict, ValidationError, create_model, model_validator

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.tool_registry import (
    Tool,
    ToolContext,
    ToolHandler,
    ToolOutput,
    ToolRegistry,
)
from trading_agent.errors import ConfigError, ToolError, TradingAgentError
from trading_agent.tools.config import McpServerConfig

if TYPE_CHECKING:
    import mcp.types as mcp_types
    from mcp import Client
    from mcp.client._transport import TransportStreams

__all__ = [
    "MAXIMUM_DEFINITION_CHARS",
    "MAXIMUM_DESCRIPTION_CHARS",
    "MAXIMUM_SCHEMA_CHARS",
    "MAXIMUM_TOOLS",
    "RETRY_FIRST_SECONDS",
    "RETRY_MAX_SECONDS",
    "McpServerError",
    "McpToolSource",
]

_log = structlog.get_logger(__name__)

_MAXIMUM_NAME = 64
"""The longest function name OpenAI-compatible APIs accept."""
_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
_MAXIMUM_PROBLEMS = 5
"""Schema violations reported to the model for one call (the first few say enough)."""
_MAXIMUM_PROBLEM_CHARS = 300
_LIST_PAGES = 100
"""A server whose tool listing never ends is cut off here."""
_SHORTEST_ENV_SECRET = 8
"""A passed-through variable shorter than this (``DEBUG=1``) is not taken for a secret."""
_SHORTEST_SECRET_WORD = 8
_MAXIMUM_REASON_CHARS = 1000
"""The longest explanation of a failure to reach a server (its own words included)."""

MAXIMUM_DESCRIPTION_CHARS = 2000
"""The longest tool description a server may give the model; the rest is cut, saying so."""
MAXIMUM_SCHEMA_CHARS = 20_000
"""The largest argument schema (as JSON) of a server's tool; a tool with a larger one is left
out."""
MAXIMUM_TOOLS = 100
"""The most tools registered from one server (OpenAI's API takes 128 in all)."""
MAXIMUM_DEFINITION_CHARS = 60_000
"""The most characters of tool definitions (descriptions and schemas) from one server."""
RETRY_FIRST_SECONDS = 1.0
"""How long after a failed start the server is first tried again (then twice as long each
time)."""
RETRY_MAX_SECONDS = 60.0
"""The longest wait between two tries of a server that was not reachable at start."""


class McpServerError(TradingAgentError):
    """An MCP server could not be started, reached or understood when its tools were listed.

    Raised when a source registers its tools (the desk is being built); once the tools are
    registered, every failure reaches the model as a :class:`~trading_agent.errors.ToolError`.

    Attributes:
        lasting: Trying again cannot help (the command does not exist): a config to fix.
    """

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


class _Secrets:
    """Values that must never be shown; cut out of texts as ``[redacted]``."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        self._values: tuple[str, ...] = ()

    def add(self, value: str, *, shortest: int = 1) -> None:
        """Keeps ``value`` (and its long words, a token after ``Bearer``) to cut out."""
        parts = [value] if len(value) >= shortest else []
        parts += [w for w in value.split() if len(w) >= _SHORTEST_SECRET_WORD and w != value]
        # Longest first, so a value is cut whole before one of its words is.
        self._values = tuple(sorted({*self._values, *parts}, key=len, reverse=True))

    def redact(self, text: str) -> str:
        """``text`` with every secret replaced by ``[redacted]``."""
        for value in self._values:
            text = text.replace(value, "[redacted]")
        return text

    def __repr__(self) -> str:
        return f"_Secrets({len(self._values)} values, redacted)"


class _Unreachable(Exception):
    """The server could not be started or reached; the message says why (redacted).
    ``lasting``: trying again cannot help (its command does not exist)."""

    def __init__(self, message: str, *, lasting: bool = False) -> None:
        super().__init__(message)
        self.lasting = lasting


@dataclass(eq=False)
class _Connection:
    """One connection, held open by a task of the source's.

    Attributes:
        scope: Cancelling it closes the connection.
        ready: Set once it can be used, or has failed (then ``error`` says why).
        ended: Set when it is over: the server's stream ended, it failed, or it was closed.
        client: The connected client, while it is open.
        tools: The server's tools, as listed when it opened.
        error: Why it could not be opened.
    """

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ready: anyio.Event = field(default_factory=anyio.Event)
    ended: anyio.Event = field(default_factory=anyio.Event)
    client: Client | None = None
    tools: list[mcp_types.Tool] = field(default_factory=list)
    error: str = ""

    @property
    def usable(self) -> bool:
        """Whether calls may be sent on it."""
        return self.client is not None and not self.ended.is_set()


class _McpArguments(BaseModel):
    """The arguments of an MCP tool: any object its JSON schema accepts.

    Each tool gets a subclass holding its schema; the schema is both what the model is shown
    (:meth:`model_json_schema`) and what a call is checked against, so a violation reads as
    pydantic's do. The checked arguments are the model's extra fields.
    """

    model_config = ConfigDict(extra="allow")

    input_schema: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}
    schema_validator: ClassVar[Any] = None
    secrets: ClassVar[_Secrets] = _Secrets()

    @model_validator(mode="before")
    @classmethod
    def _matches_the_schema(cls, data: Any) -> Any:
        try:
            found = list(cls.schema_validator.iter_errors(data))
        except Exception as exc:  # a $ref that does not resolve: the server's schema is wrong
            raise ValueError(f"the tool's own schema cannot be applied ({type(exc).__name__}: "
                             f"{_shortened(str(exc))})") from None
        if not found:
            return data
        found.sort(key=lambda e: [str(part) for part in e.absolute_path])
        # Each violation where it is, as pydantic's own read ("a: Value error, ...").
        raise ValidationError.from_exception_data(cls.__name__, [
            {"type": "value_error", "loc": tuple(error.absolute_path), "input": error.instance,
             "ctx": {"error": ValueError(_shortened(cls.secrets.redact(error.message)))}}
            for error in found[:_MAXIMUM_PROBLEMS]])

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The server's schema for the tool (a copy: the registry edits what it gets)."""
        return copy.deepcopy(cls.input_schema)


class McpToolSource:
    """The tools of one MCP server, registered in a desk's registry.

    Args:
        config: The server.
        registry: Where its tools are registered.
        environ: Where ``env`` and ``headers_env`` are read from (``os.environ`` by default).
        errlog: Where a stdio server's stderr goes (the daemon's stderr by default).
    """

    def __init__(self, config: McpServerConfig, registry: ToolRegistry, *,
                 environ: Mapping[str, str] | None = None,
                 errlog: TextIO | None = None) -> None:
        self.config = config
        self._registry = registry
        self._environ = environ
        self._errlog = errlog
        self._secrets = _Secrets()
        self._lock = anyio.Lock()
        self._group: TaskGroup | None = None
        self._connection: _Connection | None = None
        self._names: dict[str, str] | None = None
        self._scope: AsyncExitStack | None = None
        self._pending: str | None = None
        """Why the server could not be reached at start, while its tools wait for it."""
        self._stand_ins: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"McpToolSource(name={self.config.name!r}, transport={self.config.transport!r})"

    @property
    def connected(self) -> bool:
        """Whether a connection to the server is open now."""
        return self._connection is not None and self._connection.usable

    @property
    def tool_names(self) -> list[str]:
        """The names the server's tools were registered under (empty before registering)."""
        return list(self._names or {})

    async def __aenter__(self) -> Self:
        """Connects, lists the server's tools and registers them.

        Raises:
            McpServerError: The server could not be started or reached, or its listing was
                not understood.
            ConfigError: A variable named in ``env`` or ``headers_env`` is not set, or a
                tool's name is taken already.
        """
        async with AsyncExitStack() as stack:
            group = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(group.cancel_scope.cancel)  # LIFO: cancelled, then awaited
            await group.start(self.run)
            try:
                await self.register()
            except Exception as exc:  # raised below, once the task group is closed
                failure = exc
            else:
                self._scope = stack.pop_all()
                return self
        raise failure

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, traceback: TracebackType | None) -> None:
        """Closes the connection (a stdio server is stopped); an exception of the body
        passes as it is."""
        scope, self._scope = self._scope, None
        if scope is not None:
            await scope.aclose()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Holds the connection to the server until cancelled: a desk service.

        The connection is made on the first call (or by :meth:`register` when it runs
        first) and made again on the call after it is lost.
        """
        if self._group is not None:
            raise RuntimeError(f"{self!r} is running already")
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                task_status.started()
                if self._pending is not None:
                    await self._register_when_reachable()
                await anyio.sleep_forever()
        finally:
            self._group = None
            self._connection = None

    async def register(self) -> list[str]:
        """Lists the server's tools and registers them, once.

        Uses the held connection when :meth:`run` is running, else a short one that is
        closed again (the tools are then connected on their first call).

        Returns:
            The names the tools were registered under.

        Raises:
            McpServerError: The server could not be started or reached, or its listing was
                not understood.
            ConfigError: A variable named in ``env`` or ``headers_env`` is not set, or a
                tool's name is taken already.
        """
        if self._names is not None:
            return list(self._names)
        self._settings()  # a missing variable is a ConfigError, said before anything starts
        try:
            if self._group is not None:
                listed = (await self._live()).tools
            else:
                listed = await self._list_once()
        except _Unreachable as exc:
            raise McpServerError(f"MCP server {self.config.name!r}: {exc}",
                                 lasting=exc.lasting) from None
        self._names = self._register(listed)
        _log.info("mcp_tools_registered", server=self.config.name, tools=list(self._names))
        return list(self._names)

    def register_later(self, reason: str) -> list[str]:
        """Lets the desk start without the server, which :meth:`register` found
        unreachable: its tools are registered once it answers (see the module's docstring).

        Args:
            reason: Why it could not be reached, as the model and the log are told.

        Returns:
            The names of the stand-ins registered for the tools the config names in
            ``tools`` (none without that list).
        """
        self._pending = reason
        stand_ins: dict[str, str] = {}
        for remote in self.config.tools or []:
            name = _tool_name(self.config.name, remote, _Taken(self._registry, stand_ins))
            self._registry.add(Tool(
                name=name,
                description=f"The {remote} tool (MCP server {self.config.name}, not reachable "
                            "yet)",
                arguments=_arguments_model(name, {"type": "object"}, self._secrets),
                handler=self._stand_in(name),
                timeout_seconds=self.config.timeout + self.config.connect_timeout + 5.0))
            stand_ins[name] = remote
        self._stand_ins = stand_ins
        _log.warning("mcp_server_not_reachable_yet", server=self.config.name, error=reason,
                     note="the desk starts without its tools; they are registered as soon "
                          "as the server answers")
        return list(stand_ins)

    def _stand_in(self, name: str) -> ToolHandler:
        async def call(arguments: _McpArguments, context: ToolContext) -> ToolOutput | str:
            if self._pending is not None:
                try:
                    self._adopt((await self._live()).tools)
                except _Unreachable as exc:
                    self._pending = str(exc)
                    raise ToolError(
                        f"{name} was not run: the MCP server {self.config.name!r} is not "
                        f"reachable yet ({exc}). Its tools are registered as soon as it "
                        "answers; it is tried again in the background.") from None
            tool = self._registry.get(name)
            if tool is None or tool.handler is call:
                raise ToolError(f"{name} was not run: the MCP server {self.config.name!r} "
                                "is reachable now but does not offer this tool.")
            try:
                checked = tool.arguments.model_validate(arguments.model_extra or {})
            except ValidationError as exc:
                raise ToolError(f"invalid arguments for {name}: "
                                f"{_shortened(str(exc))}") from None
            return await tool.handler(checked, context)

        return call

    async def _register_when_reachable(self) -> None:
        """Tries the server until it answers, with backoff, then registers its tools."""
        delay = RETRY_FIRST_SECONDS
        while self._pending is not None:
            await anyio.sleep(delay)
            if self._pending is None:  # a call got there first
                return
            try:
                self._adopt((await self._live()).tools)
            except _Unreachable as exc:
                self._pending = str(exc)
                delay = min(delay * 2, RETRY_MAX_SECONDS)
                _log.info("mcp_server_still_unreachable", server=self.config.name,
                          error=self._pending, next_try_seconds=delay)
            except ConfigError as exc:  # its tools' names are taken: only a config fixes it
                self._pending = str(exc)
                _log.error("mcp_tools_not_registered", server=self.config.name,
                           error=str(exc))
                return

    def _adopt(self, listed: Sequence[mcp_types.Tool]) -> None:
        """Replaces the stand-ins with the server's tools, once it answered."""
        if self._pending is None:
            return
        for name in self._stand_ins:
            self._registry.remove(name)
        self._names = self._register(listed)
        self._pending = None
        _log.info("mcp_tools_registered", server=self.config.name, tools=list(self._names),
                  late=True)

    # Connections

    def _settings(self) -> tuple[dict[str, str], dict[str, str]]:
        """The variables for a stdio server and the headers for an HTTP one, from the
        environment now; their values are remembered as secrets.

        Raises:
            ConfigError: A named variable is not set.
        """
        environ = os.environ if self._environ is None else self._environ
        key = f"mcp_servers.{self.config.name}"
        missing = [n for n in [*self.config.env, *self.config.headers_env.values()]
                   if n not in environ]
        if missing:
            raise ConfigError(f"{key}: the environment variable(s) {', '.join(missing)} "
                              "are not set")
        env = {name: environ[name] for name in self.config.env}
        headers = {header: environ[name] for header, name in self.config.headers_env.items()}
        for value in env.values():
            self._secrets.add(value, shortest=_SHORTEST_ENV_SECRET)
        for value in headers.values():
            self._secrets.add(value)
        return env, headers

    @asynccontextmanager
    async def _open(self, ended: anyio.Event) -> AsyncIterator[Client]:
        """A connected client; ``ended`` is set when the server's stream ends."""
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        env, headers = self._settings()
        async with AsyncExitStack() as stack:
            transport: Any
            if self.config.command is not None:
                program, *arguments = self.config.command
                parameters = StdioServerParameters(command=program, args=arguments, env=env)
                transport = stdio_client(parameters, errlog=self._errlog or sys.stderr)
            else:
                import httpx2
                from mcp.client.streamable_http import streamable_http_client

                assert self.config.url is not None
                # No read timeout: a call's deadline is ours (timeout), and the server may
                # hold an event stream open between calls.
                http = await stack.enter_async_context(httpx2.AsyncClient(
                    headers=headers,
                    timeout=httpx2.Timeout(self.config.connect_timeout, read=None)))
                transport = streamable_http_client(self.config.url, http_client=http)
            yield await stack.enter_async_context(
                Client(_watched(transport, ended), cache=None))

    async def _list_once(self) -> list[mcp_types.Tool]:
        """The server's tools, over a connection opened for this and closed again."""
        try:
            with anyio.move_on_after(self.config.connect_timeout) as deadline:
                async with self._open(anyio.Event()) as client:
                    return await _listed(client)
        except ConfigError:
            raise
        except Exception as exc:
            raise _Unreachable(self._why(exc), lasting=self._missing_command(exc)) from None
        assert deadline.cancelled_caught
        raise _Unreachable(f"no answer within {self.config.connect_timeout:g} s (connect_timeout)")

    async def _live(self) -> _Connection:
        """The open connection, opened now if there is none (one attempt).

        Raises:
            _Unreachable: It could not be opened, or the source is not running.
        """
        connection = self._connection
        if connection is not None and connection.usable:
            return connection
        async with self._lock:
            connection = self._connection
            # One attempt at a time: a call that comes while another connects waits for it.
            if connection is None or connection.ended.is_set():
                if self._group is None:
                    raise _Unreachable("not connected: the source is not running (the desk "
                                       "has stopped or is starting)")
                connection = self._connection = _Connection()
                self._group.start_soon(self._hold, connection, name=f"mcp {self.config.name}")
            with anyio.move_on_after(self.config.connect_timeout):
                await connection.ready.wait()
            if not connection.ready.is_set():
                connection.scope.cancel()
                raise _Unreachable(f"no answer within {self.config.connect_timeout:g} s "
                                   "(connect_timeout)")
            if not connection.usable:
                raise _Unreachable(connection.error or "the connection closed as it opened")
            return connection

    async def _hold(self, connection: _Connection) -> None:
        """Opens ``connection`` and keeps it open until it ends or is cancelled."""
        try:
            with connection.scope:
                async with self._open(connection.ended) as client:
                    connection.tools = await _listed(client)
                    connection.client = client
                    connection.ready.set()
                    _log.info("mcp_server_connected", server=self.config.name,
                              transport=self.config.transport, tools=len(connection.tools))
                    await connection.ended.wait()
                    _log.warning("mcp_server_disconnected", server=self.config.name)
        except* Exception as failures:  # a cancellation from outside passes on
            if connection.ready.is_set():
                _log.warning("mcp_server_lost", server=self.config.name,
                             error=self._why(failures))
            else:
                connection.error = self._why(failures)
        finally:
            connection.client = None
            connection.ended.set()
            connection.ready.set()

    def _missing_command(self, exc: BaseException) -> bool:
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        return isinstance(exc, FileNotFoundError) and self.config.command is not None

    def _why(self, exc: BaseException) -> str:
        """A failure in a line, its innermost cause first, secrets cut out."""
        from mcp import MCPError

        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, MCPError):
            text = f"the server answered with error {exc.code}: {exc.message}"
        elif isinstance(exc, FileNotFoundError) and self.config.command is not None:
            text = f"the command {self.config.command[0]!r} was not found"
        else:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return _cut(self._secrets.redact(text), _MAXIMUM_REASON_CHARS)

    # Tools

    def _register(self, listed: Sequence[mcp_types.Tool]) -> dict[str, str]:
        """Registers the allowed tools; returns registered name -> name on the server."""
        wanted = self.config.tools
        offered = {tool.name for tool in listed}
        if wanted is not None and (absent := [n for n in wanted if n not in offered]):
            _log.warning("mcp_tools_not_offered", server=self.config.name, tools=absent,
                         offered=sorted(offered))
        prefix = f"{self.config.name}__"
        if any(name.startswith(prefix) for name in self._registry.names):
            raise ConfigError(f"mcp_servers.{self.config.name}: the desk has tools named "
                              f"{prefix}... already; give each MCP server of a desk its own "
                              "name")
        names: dict[str, str] = {}
        left_out: list[str] = []
        too_large: list[str] = []
        budget = MAXIMUM_DEFINITION_CHARS
        for tool in listed:
            if wanted is not None and tool.name not in wanted:
                continue
            shown_name = _cut(tool.name, _MAXIMUM_NAME)
            if len(names) >= MAXIMUM_TOOLS:
                left_out.append(shown_name)
                continue
            schema_chars = len(json.dumps(tool.input_schema, ensure_ascii=False))
            if schema_chars > MAXIMUM_SCHEMA_CHARS:
                too_large.append(shown_name)
                continue
            description = _description(tool.description or tool.title
                                       or f"The {tool.name} tool")
            if schema_chars + len(description) > budget:
                left_out.append(shown_name)
                continue
            name = _tool_name(self.config.name, tool.name, _Taken(self._registry, names))
            try:
                arguments = _arguments_model(name, tool.input_schema, self._secrets)
            except Exception as exc:  # the server's schema is not a JSON schema
                _log.warning("mcp_tool_skipped", server=self.config.name, tool=shown_name,
                             reason=f"its input schema is not valid: {exc}"[:500])
                continue
            budget -= schema_chars + len(description)
            try:
                self._registry.add(Tool(
                    name=name,
                    description=f"{description} (MCP server {self.config.name})",
                    arguments=arguments,
                    handler=self._handler(name, tool.name),
                    # Ours fires first, with a message naming the server; this one is a
                    # backstop over a reconnection and a call.
                    timeout_seconds=self.config.timeout + self.config.connect_timeout + 5.0))
            except ValueError as exc:  # a tool of ours with that name
                raise ConfigError(f"mcp_servers.{self.config.name}: {exc}") from None
            names[name] = tool.name
        if too_large:  # one line, however many: a server must not flood the log either
            _log.warning("mcp_tools_skipped", server=self.config.name, count=len(too_large),
                         first=too_large[:10],
                         reason=f"their input schemas are longer than the "
                                f"{MAXIMUM_SCHEMA_CHARS:,} characters a tool may have")
        if left_out:
            _log.warning("mcp_tools_left_out", server=self.config.name, count=len(left_out),
                         first=left_out[:10],
                         reason=f"a server's tools are registered up to {MAXIMUM_TOOLS} tools "
                                f"and {MAXIMUM_DEFINITION_CHARS:,} characters of definitions; "
                                f"name the ones the desk needs in mcp_servers.tools")
        return names

    def _handler(self, name: str, remote: str) -> ToolHandler:
        async def call(arguments: _McpArguments, context: ToolContext) -> ToolOutput:
            try:
                return await self._call(name, remote, dict(arguments.model_extra or {}))
            except ToolError as exc:
                raise ToolError(self._secrets.redact(str(exc))) from None

        return call

    async def _call(self, name: str, remote: str, arguments: dict[str, Any]) -> ToolOutput:
        """Calls ``remote`` on the server; every failure is a ToolError naming both."""
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED

        server = f"the MCP server {self.config.name!r}"
        try:
            connection = await self._live()
        except _Unreachable as exc:
            raise ToolError(f"{name} was not run: {server} could not be reached ({exc}). "
                            "It is tried again on the next call.") from None
        assert connection.client is not None
        try:
            with anyio.fail_after(self.config.timeout):
                result = await connection.client.call_tool(remote, arguments)
        except TimeoutError:
            raise ToolError(f"{name}: {server} did not answer within {self.config.timeout:g} s; "
                            "the call was abandoned and may or may not have taken "
                            "effect.") from None
        except MCPError as exc:
            if connection.ended.is_set() or exc.code == CONNECTION_CLOSED:
                connection.ended.set()  # dropped: the next call connects again
                raise ToolError(f"{name}: the connection to {server} was lost during the call "
                                "(the server may have exited); the call may or may not have "
                                "taken effect. The server is connected again on the next "
                                "call.") from None
            raise ToolError(f"{name}: {server} refused the call with error {exc.code}: "
                            f"{_shortened(exc.message)}") from None
        except ValidationError as exc:
            problem = exc.errors(include_url=False)[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise ToolError(f"{name}: {server} answered with something that is not a tool "
                            f"result ({where}: {problem['msg']}); the call may or may not "
                            "have taken effect.") from None
        except Exception as exc:
            raise ToolError(f"{name}: {server} failed: {self._why(exc)}") from None
        return self._output(name, result)

    def _output(self, name: str, result: mcp_types.CallToolResult) -> ToolOutput:
        """The result as the model reads it (secrets cut out); ``isError`` raises the
        server's text."""
        import mcp.types as mcp_types

        texts: list[str] = []
        images: list[ImageBlock] = []
        for block in result.content:
            if isinstance(block, mcp_types.TextContent):
                texts.append(block.text)
            elif isinstance(block, mcp_types.ImageContent):
                try:
                    data = base64.b64decode(block.data, validate=True)
                except (binascii.Error, ValueError):
                    texts.append(f"[a picture ({block.mime_type}) that could not be decoded]")
                else:
                    images.append(ImageBlock(data, block.mime_type,
                                             description=f"picture from {name}"))
            else:
                texts.append(_summary(block))
        if not texts and not images and result.structured_content is not None:
            texts.append(json.dumps(result.structured_content, ensure_ascii=False))
        text = self._secrets.redact("\n".join(texts))
        limit = self.config.max_result_chars
        if result.is_error:
            if len(text) > limit:
                text = f"{text[:limit]}\n[error text cut: {len(text) - limit:,} more characters]"
            raise ToolError(text or f"{name} failed without saying why")
        if len(text) > limit:
            text = (f"{text[:limit]}\n[cut: {len(text) - limit:,} more characters; ask for "
                    "less]")
        if not text and not images:
            text = f"{name} returned nothing."
        return ToolOutput(text=text, images=tuple(images))


class _Taken:
    """The names taken in the registry and by this source so far."""

    def __init__(self, registry: ToolRegistry, names: Container[str]) -> None:
        self._registry = registry
        self._names = names

    def __contains__(self, name: object) -> bool:
        return name in self._registry or name in self._names


def _tool_name(prefix: str, remote: str, taken: Container[str]) -> str:
    """``<prefix>__<remote>`` in the characters and length function names allow; a name
    cut short or already taken ends in a hash of the server's name instead."""
    wanted = f"{prefix}__{_UNSAFE.sub('_', remote)}"
    if len(wanted) <= _MAXIMUM_NAME and wanted not in taken:
        return wanted
    digest = hashlib.sha256(remote.encode()).hexdigest()[:8]
    return f"{wanted[:_MAXIMUM_NAME - len(digest) - 1]}_{digest}"


def _arguments_model(name: str, schema: Mapping[str, Any],
                     secrets: _Secrets) -> type[_McpArguments]:
    """A model whose JSON schema is the tool's and whose validation applies it (its
    messages with ``secrets`` cut out).

    Raises:
        jsonschema.SchemaError: The schema is not a valid JSON schema.
    """
    from jsonschema.validators import validator_for  # type: ignore[import-untyped]
    from referencing import Registry

    checked = dict(schema)
    validator_class = validator_for(checked)
    validator_class.check_schema(checked)
    shown = {k: v for k, v in checked.items() if k not in ("$schema", "title")}
    shown.setdefault("type", "object")
    if shown["type"] == "object":
        shown.setdefault("properties", {})
    model = create_model(f"{name}_arguments", __base__=_McpArguments)
    model.input_schema = shown
    # An empty registry: a $ref resolves inside the schema or not at all (no fetching).
    model.schema_validator = validator_class(checked, registry=Registry())
    model.secrets = secrets
    return model


async def _listed(client: Client) -> list[mcp_types.Tool]:
    """Every tool the server lists, page after page."""
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    for _ in range(_LIST_PAGES):
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


def _summary(block: Any) -> str:
    """A line for content the model is not given as it is (audio, resources)."""
    import mcp.types as mcp_types

    if isinstance(block, mcp_types.AudioContent):
        return f"[audio ({block.mime_type}, {len(block.data) * 3 // 4:,} bytes) not shown]"
    if isinstance(block, mcp_types.ResourceLink):
        about = f" — {block.description}" if block.description else ""
        return f"[resource {block.name}: {block.uri}{about}]"
    if isinstance(block, mcp_types.EmbeddedResource):
        resource = block.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return f"[resource {resource.uri}]\n{resource.text}"
        kind = resource.mime_type or "binary"
        return f"[resource {resource.uri} ({kind}, {len(resource.blob) * 3 // 4:,} bytes) " \
               "not shown]"
    return f"[{getattr(block, 'type', type(block).__name__)} content not shown]"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _description(text: str) -> str:
    """A server's description of a tool, cut at :data:`MAXIMUM_DESCRIPTION_CHARS` with a
    note saying how much was left out."""
    if len(text) <= MAXIMUM_DESCRIPTION_CHARS:
        return text
    return (f"{text[:MAXIMUM_DESCRIPTION_CHARS]} [description cut: "
            f"{len(text) - MAXIMUM_DESCRIPTION_CHARS:,} more characters]")


def _shortened(text: str) -> str:
    return text if len(text) <= _MAXIMUM_PROBLEM_CHARS else \
        text[:_MAXIMUM_PROBLEM_CHARS - 1] + "…"


class _WatchedStream:
    """A transport's read stream that sets ``ended`` when it ends (the server has gone),
    so a connection known dead is opened again before a call, not failed on."""

    def __init__(self, inner: Any, ended: anyio.Event) -> None:
        self._inner = inner
        self._ended = ended

    @property
    def last_context(self) -> Any:
        """The sender's context, for a transport that keeps it (streamable HTTP)."""
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._ended.set()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> _WatchedStream:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, traceback: TracebackType | None) -> None:
        await self.aclose()


@asynccontextmanager
async def _watched(transport: Any, ended: anyio.Event) -> AsyncIterator[TransportStreams]:
    """``transport`` with its read stream watched (see :class:`_WatchedStream`)."""
    try:
        async with transport as (read, write):
            yield _WatchedStream(read, ended), write
    finally:
        ended.set()
