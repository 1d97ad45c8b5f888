"""Tools from MCP servers, against the small server in ``tests/mcp_server.py`` started as a
real process, over stdio and over streamable HTTP on loopback.

What the model reads is checked through the project's :class:`ToolCallExecutor`, as a turn
runs it: the tools' names and schemas, their text and pictures, bad arguments, a server's
own errors, a call that takes too long, a server that dies, headers from the environment
that never show.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import anyio
import pytest
from anyio.abc import Process
from pydantic import ValidationError
from structlog.testing import capture_logs

from tests.waiting import wait_until
from trading_agent.agent.conversation import ImageBlock, ToolResultBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.errors import ConfigError
from trading_agent.tools.config import McpServerConfig
from trading_agent.tools.mcp import (
    MAXIMUM_DEFINITION_CHARS,
    MAXIMUM_DESCRIPTION_CHARS,
    MAXIMUM_TOOLS,
    McpServerError,
    McpToolSource,
)

SERVER = str(Path(__file__).resolve().parents[1] / "mcp_server.py")
SECRET = "s3cret-api-key-0123456789"
"""The X-Api-Key the HTTP server requires; it must never reach the model."""
KEY_VARIABLE = "DESK_MCP_KEY"
ALL_TOOLS = ["add", "call_operator", "echo", "exit_server", "fail", "malformed", "picture",
             "process_id", "quote.last", "read_parent_environ", "show_env", "show_header",
             "slow"]


@dataclass
class HttpServer:
    """The test server, serving streamable HTTP in a process of its own."""

    url: str
    process: Process


@pytest.fixture
def errlog(tmp_path: Path) -> Iterator[TextIO]:
    """Where the stdio servers' stderr goes (read it when a test fails)."""
    with (tmp_path / "mcp-server-stderr.log").open("w") as log:
        yield log


@pytest.fixture
async def http_server(tmp_path: Path) -> AsyncIterator[HttpServer]:
    """The test server over HTTP on a free loopback port, requiring ``X-Api-Key``."""
    env = {**os.environ, "MCP_TEST_API_KEY": SECRET}
    with (tmp_path / "mcp-http-stderr.log").open("wb") as log:
        process = await anyio.open_process([sys.executable, SERVER, "http"], env=env,
                                           stdout=subprocess.PIPE, stderr=log)
    try:
        assert process.stdout is not None
        with anyio.fail_after(20):
            received = b""
            while not received.endswith(b"\n"):
                received += await process.stdout.receive()
        yield HttpServer(received.decode().strip(), process)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with anyio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()
        await process.aclose()


def _stdio(**settings: Any) -> McpServerConfig:
    return McpServerConfig(name="t", command=[sys.executable, SERVER, "stdio"], **settings)


def _http(server: HttpServer, **settings: Any) -> McpServerConfig:
    return McpServerConfig(name="t", url=server.url,
                           headers_env={"X-Api-Key": KEY_VARIABLE}, **settings)


@pytest.fixture(params=["stdio", "http"])
def server_config(request: pytest.FixtureRequest) -> Any:
    """Makes the test server's config over stdio or over HTTP (the server then started)."""
    if request.param == "stdio":
        return _stdio
    server = request.getfixturevalue("http_server")
    return lambda **settings: _http(server, **settings)


@dataclass
class Desk:
    """A desk's registry and executor, with one MCP server's tools."""

    registry: ToolRegistry
    source: McpToolSource
    executor: ToolCallExecutor
    calls: int = 0

    async def call(self, name: str, arguments: dict[str, Any] | list[Any] | str
                   ) -> ToolResultBlock:
        """Runs one call as a turn would; the result is what the model reads."""
        self.calls += 1
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
        [executed] = await self.executor.execute(
            [ToolUseBlock(f"c{self.calls}", name, raw)], "alpha", "t1", EventBus(), {})
        return executed.result


@asynccontextmanager
async def _opened(config: McpServerConfig, errlog: TextIO) -> AsyncIterator[Desk]:
    """A desk with the server's tools, the key in its environment."""
    registry = ToolRegistry()
    async with McpToolSource(config, registry, environ={KEY_VARIABLE: SECRET},
                             errlog=errlog) as source:
        yield Desk(registry, source, ToolCallExecutor(registry))


# The tools and their schemas


async def test_tools_are_listed_under_the_prefix_with_their_schemas(server_config: Any,
                                                                    errlog: TextIO) -> None:
    expected = ["t__quote_last" if name == "quote.last" else f"t__{name}" for name in ALL_TOOLS]
    async with _opened(server_config(), errlog) as desk:
        assert sorted(desk.registry.names) == sorted(expected)
        assert sorted(desk.source.tool_names) == sorted(expected)
        definitions = {d["function"]["name"]: d for d in desk.registry.definitions()}
        add = definitions["t__add"]
        assert add["type"] == "function"
        assert "Adds two integers." in add["function"]["description"]
        parameters = add["function"]["parameters"]
        assert parameters["type"] == "object"
        assert parameters["required"] == ["a", "b"]
        assert parameters["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
        assert "title" not in parameters
        assert definitions["t__picture"]["function"]["parameters"] == {"type": "object",
                                                                       "properties": {}}


async def test_a_call_gives_the_servers_text(server_config: Any, errlog: TextIO) -> None:
    async with _opened(server_config(), errlog) as desk:
        result = await desk.call("t__add", {"a": 2, "b": 3})
        assert not result.is_error
        assert result.text == "5"
        result = await desk.call("t__echo", {"text": "héllo, desk"})
        assert result.text == "héllo, desk"
        result = await desk.call("t__quote_last", {"symbol": "BTC/USDT"})
        assert result.text == "BTC/USDT last 100"


async def test_calls_of_one_round_share_the_connection(server_config: Any,
                                                       errlog: TextIO) -> None:
    calls = [ToolUseBlock(f"c{i}", "t__add", json.dumps({"a": i, "b": 1})) for i in range(5)]
    async with _opened(server_config(), errlog) as desk:
        executed = await desk.executor.execute(calls, "alpha", "t1", EventBus(), {})
        assert [e.result.text for e in executed] == ["1", "2", "3", "4", "5"]
        pids = {(await desk.call("t__process_id", {})).text for _ in range(2)}
        assert len(pids) == 1


async def test_a_picture_reaches_the_model_as_an_image(server_config: Any,
                                                       errlog: TextIO) -> None:
    async with _opened(server_config(), errlog) as desk:
        result = await desk.call("t__picture", {})
        assert not result.is_error
        [image] = [block for block in result.content if isinstance(block, ImageBlock)]
        assert image.data.startswith(b"\x89PNG")
        assert "t__picture" in image.description


# What goes wrong, as the model reads it


BAD_ARGUMENTS: list[tuple[Any, str]] = [
    ({"a": "two", "b": 3},
     "invalid arguments for t__add: a: Value error, 'two' is not of type 'integer'"),
    ({"a": 2}, "invalid arguments for t__add: arguments: Value error, 'b' is a required "
               "property"),
    ({"a": "one", "b": None}, "a: Value error, 'one' is not of type 'integer'; b: Value "
                              "error, None is not of type 'integer'"),
    ('{"a": 2, "b":', "the arguments for t__add are not valid JSON"),
    ([1, 2], "invalid arguments for t__add: arguments: Value error, [1, 2] is not of type "
             "'object'"),
]


async def test_bad_arguments_come_back_readable(server_config: Any, errlog: TextIO) -> None:
    async with _opened(server_config(), errlog) as desk:
        for arguments, expected in BAD_ARGUMENTS:
            result = await desk.call("t__add", arguments)
            assert result.is_error
            assert expected in result.text, result.text
        assert (await desk.call("t__add", {"a": 1, "b": 1})).text == "2"


async def test_the_servers_error_text_reaches_the_model(server_config: Any,
                                                        errlog: TextIO) -> None:
    async with _opened(server_config(), errlog) as desk:
        result = await desk.call("t__fail", {"reason": "the news feed is down"})
        assert result.is_error
        assert result.text.startswith("Error: ")
        assert "the news feed is down" in result.text


async def test_a_slow_call_is_abandoned_and_the_next_one_works(server_config: Any,
                                                                errlog: TextIO) -> None:
    async with _opened(server_config(timeout=0.5), errlog) as desk:
        started = anyio.current_time()
        result = await desk.call("t__slow", {"seconds": 20})
        assert anyio.current_time() - started < 5
        assert result.is_error
        assert ("t__slow: the MCP server 't' did not answer within 0.5 s; the call was "
                "abandoned") in result.text
        assert (await desk.call("t__echo", {"text": "still here"})).text == "still here"


async def test_the_allow_list_keeps_only_the_named_tools(server_config: Any,
                                                         errlog: TextIO) -> None:
    async with _opened(server_config(tools=["echo", "quote.last", "not_offered"]),
                       errlog) as desk:
        assert sorted(desk.registry.names) == ["t__echo", "t__quote_last"]
        result = await desk.call("t__fail", {"reason": "x"})
        assert result.is_error
        assert "there is no tool named 't__fail'" in result.text
        assert (await desk.call("t__echo", {"text": "ok"})).text == "ok"


async def test_a_stdio_server_that_exits_mid_call_is_started_again(errlog: TextIO) -> None:
    async with _opened(_stdio(), errlog) as desk:
        first = (await desk.call("t__process_id", {})).text
        result = await desk.call("t__exit_server", {})
        assert result.is_error
        assert ("t__exit_server: the connection to the MCP server 't' was lost during the "
                "call") in result.text
        assert "may or may not have taken effect" in result.text
        assert (await desk.call("t__echo", {"text": "back"})).text == "back"
        assert (await desk.call("t__process_id", {})).text != first


async def test_a_stdio_server_that_died_between_calls_is_started_before_the_next(
        errlog: TextIO) -> None:
    async with _opened(_stdio(), errlog) as desk:
        pid = int((await desk.call("t__process_id", {})).text)
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10):
            while desk.source.connected:  # noqa: ASYNC110 (the source's state, polled)
                await anyio.sleep(0.01)
        result = await desk.call("t__echo", {"text": "fresh"})
        assert not result.is_error, result.text
        assert result.text == "fresh"


async def test_an_http_server_that_dies_gives_readable_errors(http_server: HttpServer,
                                                              errlog: TextIO) -> None:
    async with _opened(_http(http_server), errlog) as desk:
        await _dies_for_good(desk)


async def _dies_for_good(desk: Desk) -> None:
    result = await desk.call("t__exit_server", {})
    assert result.is_error
    assert "t__exit_server: the connection to the MCP server 't' was lost" in result.text
    result = await desk.call("t__echo", {"text": "anyone?"})
    assert result.is_error
    assert "t__echo was not run: the MCP server 't' could not be reached" in result.text
    assert "tried again on the next call" in result.text


async def test_a_malformed_answer_is_a_readable_error(http_server: HttpServer,
                                                      errlog: TextIO) -> None:
    # Over HTTP the server's middleware answers with a result that is not a tool result.
    async with _opened(_http(http_server), errlog) as desk:
        result = await desk.call("t__malformed", {})
        assert result.is_error
        assert ("t__malformed: the MCP server 't' answered with something that is not a "
                "tool result") in result.text
        assert (await desk.call("t__echo", {"text": "fine"})).text == "fine"


# Headers from the environment


async def test_the_header_reaches_the_server_and_never_the_model(http_server: HttpServer,
                                                                 errlog: TextIO) -> None:
    config = _http(http_server, timeout=0.5)
    async with _opened(config, errlog) as desk:
        source = desk.source
        # The server refuses any request without the key: that the tools were listed and
        # are called shows it arrived; echoed back, it is cut out of what the model reads.
        shown = await desk.call("t__show_header", {"name": "X-Api-Key"})
        assert not shown.is_error
        assert shown.text == "X-Api-Key: [redacted]"
        echoed = await desk.call("t__echo", {"text": f"key {SECRET} and {SECRET[:-1]}"})
        assert echoed.text == f"key [redacted] and {SECRET[:-1]}"
        texts = [shown.text, echoed.text]
        calls: list[tuple[str, dict[str, Any]]] = [
            ("t__fail", {"reason": f"bad key {SECRET}"}), ("t__slow", {"seconds": 5}),
            ("t__add", {"a": SECRET}), ("t__malformed", {})]
        for name, arguments in calls:
            result = await desk.call(name, arguments)
            assert result.is_error
            texts.append(result.text)
        assert all(SECRET not in text for text in texts), texts
        assert SECRET not in repr(source) + repr(config)


async def test_a_wrong_key_fails_the_start_without_showing_it(http_server: HttpServer) -> None:
    wrong = "wrong-key-abcdefghij"
    with pytest.raises(McpServerError) as raised:
        async with McpToolSource(_http(http_server), ToolRegistry(),
                                 environ={KEY_VARIABLE: wrong}):
            pass
    assert "MCP server 't'" in str(raised.value)
    assert wrong not in str(raised.value)


async def test_a_missing_variable_is_a_config_error(http_server: HttpServer) -> None:
    with pytest.raises(ConfigError, match="mcp_servers.t: the environment variable"
                                          r"\(s\) DESK_MCP_KEY are not set"):
        async with McpToolSource(_http(http_server), ToolRegistry(), environ={}):
            pass


async def test_only_the_named_variables_reach_a_stdio_server_and_are_cut_out(
        errlog: TextIO, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DESK_OTHER_SECRET", "not for the mcp server")
    async with _opened(_stdio(env=[KEY_VARIABLE]), errlog) as desk:
        shown = await desk.call("t__show_env", {"name": KEY_VARIABLE})
        assert shown.text == f"{KEY_VARIABLE}=[redacted]"
        other = await desk.call("t__show_env", {"name": "DESK_OTHER_SECRET"})
        assert other.text == "DESK_OTHER_SECRET is not set"
        result = await desk.call("t__echo", {"text": f"the key is {SECRET}"})
        assert result.text == "the key is [redacted]"


# Starting and stopping


async def test_registering_first_and_running_as_a_desk_service(errlog: TextIO) -> None:
    registry = ToolRegistry()
    source = McpToolSource(_stdio(tools=["echo"]), registry, errlog=errlog)
    assert await source.register() == ["t__echo"]
    assert not source.connected  # the listing's connection is closed again
    executor = ToolCallExecutor(registry)
    call = ToolUseBlock("c1", "t__echo", '{"text": "early"}')
    [early] = await executor.execute([call], "alpha", "t1", EventBus(), {})
    assert early.result.is_error
    assert "t__echo was not run" in early.result.text and "not running" in early.result.text
    async with anyio.create_task_group() as services:
        await services.start(source.run)
        [executed] = await executor.execute([call], "alpha", "t1", EventBus(), {})
        assert executed.result.text == "early"
        assert source.connected
        services.cancel_scope.cancel()
    assert not source.connected
    assert await source.register() == ["t__echo"]  # once only
    assert registry.names == ["t__echo"]


async def test_a_missing_command_fails_the_start() -> None:
    config = McpServerConfig(name="gone", command=["/nonexistent/mcp-server"])
    with pytest.raises(McpServerError, match="MCP server 'gone': the command "
                                             "'/nonexistent/mcp-server' was not found"):
        async with McpToolSource(config, ToolRegistry()):
            pass


async def test_a_server_that_never_answers_fails_the_start_in_time(errlog: TextIO) -> None:
    config = McpServerConfig(name="mute", connect_timeout=0.5,
                             command=[sys.executable, "-c", "import time; time.sleep(60)"])
    with anyio.fail_after(15), pytest.raises(McpServerError, match=r"no answer within 0\.5 s"):
        async with McpToolSource(config, ToolRegistry(), errlog=errlog):
            pass


async def test_two_servers_of_one_name_are_a_config_error(errlog: TextIO) -> None:
    registry = ToolRegistry()
    async with McpToolSource(_stdio(tools=["echo"]), registry, errlog=errlog):
        with pytest.raises(ConfigError, match="give each MCP server of a desk its own name"):
            async with McpToolSource(_stdio(tools=["echo"]), registry, errlog=errlog):
                pass


# The config


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"name": "t"}, "exactly one of command"),
        ({"name": "t", "command": ["x"], "url": "http://127.0.0.1/mcp"}, "exactly one of"),
        ({"name": "News", "command": ["x"]}, "String should match pattern"),
        ({"name": "t", "command": []}, "at least 1 item"),
        ({"name": "t", "url": "ftp://host/mcp"}, "String should match pattern"),
        ({"name": "t", "command": ["x"], "headers_env": {"A": "B"}}, "headers_env is for"),
        ({"name": "t", "url": "http://h/mcp", "env": ["A"]}, "env is for a stdio server"),
        ({"name": "t", "command": ["x"], "env": ["NOT-A-NAME"]}, "not an environment"),
        ({"name": "t", "url": "http://h/mcp", "headers_env": {"Bad Header": "A"}},
         "not an HTTP header name"),
        ({"name": "t", "command": ["x"], "timeout": 0}, "greater than 0"),
        ({"name": "t", "command": ["x"], "retries": 3}, "Extra inputs are not permitted"),
    ],
)
def test_the_config_refuses_what_cannot_work(settings: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        McpServerConfig.model_validate(settings)


def test_the_config_reads_a_desk_table() -> None:
    config = McpServerConfig.model_validate({
        "name": "news", "url": "https://mcp.example/mcp",
        "headers_env": {"Authorization": "NEWS_MCP_TOKEN"}, "tools": ["search"]})
    assert config.transport == "http"
    assert (config.timeout, config.connect_timeout) == (30.0, 15.0)
    assert McpServerConfig(name="n", command=["npx", "server"]).transport == "stdio"


# What a server may put before the model


@pytest.mark.slow  # the server lists ten thousand tools
async def test_a_servers_huge_descriptions_schemas_tool_counts_and_errors_are_capped(
        errlog: TextIO) -> None:
    config = McpServerConfig(name="big", command=[sys.executable, SERVER, "stdio"],
                             env=["MCP_TEST_HUGE"], max_result_chars=4000, connect_timeout=30)
    registry = ToolRegistry()
    with capture_logs() as logs:
        async with McpToolSource(config, registry, environ={"MCP_TEST_HUGE": "1"},
                                 errlog=errlog) as source:
            names = source.tool_names
            definitions = registry.definitions()
            executor = ToolCallExecutor(registry)
            [failed] = await executor.execute(
                [ToolUseBlock("c1", "big__huge_error", "{}")], "alpha", "t1", EventBus(), {})

    # Ten thousand and sixteen tools offered; a hundred at most registered.
    assert len(names) == MAXIMUM_TOOLS
    assert "big__echo" in names and "big__many_0" in names
    sent = len(json.dumps(definitions))
    assert sent < MAXIMUM_DEFINITION_CHARS + 20_000, sent  # names and framing on top
    wordy = next(d["function"] for d in definitions if d["function"]["name"] == "big__wordy")
    assert len(wordy["description"]) < MAXIMUM_DESCRIPTION_CHARS + 200
    assert "[description cut: " in wordy["description"]
    assert "big__schema_heavy" not in names
    [skipped] = [entry for entry in logs if entry["event"] == "mcp_tools_skipped"]
    assert skipped["first"] == ["schema_heavy"]
    assert "longer than the 20,000 characters a tool may have" in skipped["reason"]
    left_out = [entry for entry in logs if entry["event"] == "mcp_tools_left_out"]
    assert left_out and left_out[0]["count"] == 10_016 - MAXIMUM_TOOLS - 1
    assert "name the ones the desk needs in mcp_servers.tools" in left_out[0]["reason"]

    # The server's 1 MB error text reaches the model cut, saying so.
    assert failed.result.is_error
    assert len(failed.result.text) < 4200
    assert failed.result.text.endswith("\n[error text cut: 996,033 more characters]")


async def test_a_server_down_at_start_is_tried_again_and_its_tools_registered_when_it_comes(
        tmp_path: Path, errlog: TextIO) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])  # nothing listens there now
    registry = ToolRegistry()
    source = McpToolSource(McpServerConfig(name="late", url=f"http://127.0.0.1:{port}/mcp",
                                           connect_timeout=5), registry)
    with pytest.raises(McpServerError) as raised:
        await source.register()
    assert not raised.value.lasting  # it may come: the desk starts without it
    assert source.register_later(str(raised.value)) == []  # no list of tools: no stand-ins

    async with anyio.create_task_group() as services:
        await services.start(source.run)
        with (tmp_path / "mcp-http.log").open("wb") as log:
            server = await anyio.open_process(
                [sys.executable, SERVER, "http", "--port", str(port)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        try:
            # No call needed: the background tries find it (1 s, then 2 s, 4 s... apart).
            await wait_until(lambda: "late__add" in registry, "the late server's tools",
                             within=20)
            result = await Desk(registry, source, ToolCallExecutor(registry)).call(
                "late__add", {"a": 2, "b": 40})
            assert result.text == "42"
        finally:
            with anyio.CancelScope(shield=True):
                server.terminate()
                await server.wait()
                await server.aclose()
            services.cancel_scope.cancel()


async def test_a_command_that_does_not_exist_is_not_tried_again() -> None:
    source = McpToolSource(McpServerConfig(name="gone", command=["/nonexistent/mcp-server"]),
                           ToolRegistry())
    with pytest.raises(McpServerError) as raised:
        await source.register()
    assert raised.value.lasting  # a config to fix: the daemon refuses to start
