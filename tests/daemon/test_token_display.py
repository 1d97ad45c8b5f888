"""A web token made at start is shown on a terminal only, never where logs are kept.

With ``generate_token`` the daemon used to print the token in its banner on stderr whatever
stderr was: under systemd that is the journal, which anyone in the ``systemd-journal`` group
reads, and it is kept for months. Now, when stderr is not a terminal, the token is written to
a file readable by the owner alone and the banner names the file.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import ScriptedServer
from trading_agent.app import running
from trading_agent.operator.server import OperatorEndpoints

pytestmark = pytest.mark.slow


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _tcp_url(log: str) -> str:
    for line in log.splitlines():
        if '"operator_api_listening"' in line:
            return str(json.loads(line)["tcp"])
    raise AssertionError(f"no operator_api_listening line in:\n{log}")


async def test_a_generated_token_goes_to_an_owner_only_file_not_to_a_captured_stderr(
        scripted_server: ScriptedServer, folder: Path) -> None:
    config = write_config(folder, scripted_server.base_url, operator={
        "tcp_address": "127.0.0.1:0", "generate_token": True})
    daemon = DaemonProcess(config, environ={"TRADING_AGENT_OPERATOR_TOKEN": ""})
    try:
        await daemon.wait_ready()
        token_file = daemon.state_dir / "web-token"
        log = daemon.log()
        assert f"#token=<the token in {token_file}>" in log, log
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        assert token not in log
        async with httpx.AsyncClient(base_url=_tcp_url(log), trust_env=False) as client:
            refused = await client.get("/api/desks")
            allowed = await client.get("/api/desks",
                                       headers={"Authorization": f"Bearer {token}"})
        assert refused.status_code == 401
        assert allowed.status_code == 200, allowed.text
        assert token not in daemon.log()
    finally:
        daemon.close()


def test_on_a_terminal_the_banner_shows_the_token_and_writes_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = os.openpty()
    endpoints = OperatorEndpoints(tmp_path / "operator.sock", ("127.0.0.1", 8765),
                                  "made-for-this-run-3f9c2a71b6d0", "TRADING_AGENT_OPERATOR_TOKEN")
    with os.fdopen(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stderr", terminal)
        running._print_banner(["alpha"], endpoints, {})
    shown = os.read(leader, 65536).decode()
    os.close(leader)

    assert "http://127.0.0.1:8765/#token=made-for-this-run-3f9c2a71b6d0" in shown
    assert not (tmp_path / "web-token").exists()
