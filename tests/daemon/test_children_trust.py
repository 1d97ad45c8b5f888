"""A process the daemon starts cannot read the daemon's secrets nor act as its operator.

A stdio MCP server runs as the daemon's user, with only the variables its config names. It
used to read the daemon's whole environment (exchange secret included) from
``/proc/<ppid>/environ``, and to send commands to ``operator.sock``, which trusted any
process of the same user. Here a hostile server of the test's own tries both, through the
model's tool calls, against a real ``trading-agent run``; the CLI run by the test (not a
child of the daemon) still works.

A process with ``CAP_SYS_PTRACE`` (root, as in a container) reads any process's environment
whatever the daemon does, and a process with fewer capabilities than its target none; a
daemon's user has none. So when the tests run as root the daemon (and so its children) runs
without capabilities (``setpriv``), as it would under its own user.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.operator.command_line import run_cli
from tests.scripted_server import Reply, ScriptedServer, ToolCall

pytestmark = pytest.mark.slow

SECRET = "exchange-secret-5b2f9e61c0d84a7f"
"""An exchange secret, as the daemon's environment holds it."""

MCP_SERVER = Path(__file__).resolve().parents[1] / "mcp_server.py"


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _without_capabilities() -> list[str]:
    """A command prefix that runs a program as this user without capabilities."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a child keeps CAP_SYS_PTRACE")
    return [setpriv, "--bounding-set", "-all", "--inh-caps", "-all"]


def _tool_results(messages: list[dict[str, object]]) -> list[str]:
    return [str(message["content"]) for message in messages if message["role"] == "tool"]


async def test_an_mcp_server_can_read_neither_the_daemons_environment_nor_use_its_socket(
        scripted_server: ScriptedServer, folder: Path) -> None:
    socket_path = folder / "state" / "operator.sock"
    scripted_server.add(
        Reply(tool_calls=[ToolCall("probe__read_parent_environ", {}),
                          ToolCall("probe__call_operator", {"socket_path": str(socket_path)})]),
        Reply("Probed."))
    config = write_config(folder, scripted_server.base_url, desks={"alpha": {"mcp_servers": [
        {"name": "probe", "command": [sys.executable, str(MCP_SERVER), "stdio"],
         "tools": ["read_parent_environ", "call_operator"]}]}})
    daemon = DaemonProcess(config, environ={"TEST_EXCHANGE_SECRET": SECRET},
                           wrapper=_without_capabilities())
    try:
        await daemon.wait_ready()
        assert daemon.socket_path == socket_path
        async with daemon.client() as client:
            sent = await client.send_and_wait("alpha", "Probe.", wait_seconds=30)
        assert sent["reply"]["text"] == "Probed."

        environ, operator = _tool_results(scripted_server.requests[1].messages)
        assert SECRET not in environ
        assert environ.startswith("could not read /proc/"), environ
        assert "PermissionError" in environ
        assert SECRET not in operator
        assert operator.startswith("HTTP/1.1 403"), operator
        assert "refuses processes the daemon started" in operator
        assert '"alpha"' not in operator  # no desk list leaked

        # The operator at a terminal (this test process, not the daemon's child) still works.
        code, out, err = await run_cli(socket_path, "desks", "--json")
        assert code == 0, err
        assert [desk["name"] for desk in json.loads(out)] == ["alpha"]
        log = daemon.log()
    finally:
        daemon.close()
    assert SECRET not in log
    refused = [json.loads(line) for line in log.splitlines()
               if '"operator_api_peer_refused"' in line]
    assert refused and refused[0]["pid"] != os.getpid()
