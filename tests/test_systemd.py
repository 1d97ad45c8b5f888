"""systemd: the notify protocol against a real datagram socket, and the unit file verified."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from trading_agent.app.systemd import SystemdNotifier

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "trading-agent.service"
ENV_EXAMPLE = ROOT / "deploy" / "trading-agent.env.example"


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's, at a short path (Unix paths are limited)."""
    with tempfile.TemporaryDirectory(prefix="ta-", dir="/tmp") as folder:
        path = os.path.join(folder, "notify")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind(path)
        listener.settimeout(2)
        try:
            yield listener, path
        finally:
            listener.close()


def _received(listener: socket.socket) -> str:
    return listener.recv(4096).decode()


def test_ready_watchdog_status_and_stopping_reach_the_socket(
        notify_socket: tuple[socket.socket, str]) -> None:
    listener, path = notify_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    try:
        assert notifier.enabled
        assert notifier.ready("2 desks running")
        assert _received(listener) == "READY=1\nSTATUS=2 desks running"
        assert notifier.watchdog()
        assert _received(listener) == "WATCHDOG=1"
        assert notifier.status("alpha: idle\nbeta: working")
        assert _received(listener) == "STATUS=alpha: idle beta: working"
        assert notifier.stopping()
        assert _received(listener) == "STOPPING=1"
    finally:
        notifier.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_an_abstract_socket_name_starting_with_at_works() -> None:
    name = f"trading-agent-test-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)
    listener.settimeout(2)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
    try:
        assert notifier.ready()
        assert _received(listener) == "READY=1"
    finally:
        notifier.close()
        listener.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert notifier.watchdog_interval is None
    assert not notifier.ready() and not notifier.watchdog() and not notifier.stopping()


def test_a_missing_socket_is_logged_not_raised(tmp_path: Path) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.ready() is False
    notifier.close()


def test_the_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert SystemdNotifier({"WATCHDOG_USEC": "60000000"}).watchdog_interval == 30.0
    mine = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(mine).watchdog_interval == 5.0
    # The watchdog is meant for another process.
    other = {"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}
    assert SystemdNotifier(other).watchdog_interval is None
    assert SystemdNotifier({"WATCHDOG_USEC": "soon"}).watchdog_interval is None


async def test_run_watchdog_pings_every_interval_with_the_status(
        notify_socket: tuple[socket.socket, str]) -> None:
    listener, path = notify_socket
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    slept: list[float] = []
    three_pings = anyio.Event()
    count = 0

    def status() -> str:
        nonlocal count
        count += 1
        return f"check {count}"

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            three_pings.set()
            await anyio.sleep_forever()

    with anyio.move_on_after(5) as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: notifier.run_watchdog(status, sleep=sleep))
            await three_pings.wait()
            group.cancel_scope.cancel()
    notifier.close()
    assert not scope.cancelled_caught
    assert slept == [2.0, 2.0, 2.0]
    assert [_received(listener) for _ in range(3)] == [
        "WATCHDOG=1\nSTATUS=check 1", "WATCHDOG=1\nSTATUS=check 2", "WATCHDOG=1\nSTATUS=check 3"]


async def test_run_watchdog_returns_when_no_watchdog_is_asked() -> None:
    with anyio.fail_after(1):
        await SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent"}).run_watchdog()


# --- the unit file ---------------------------------------------------------------------------


def _directives(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z]+)=(.*)$", line.strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_the_unit_asks_for_notify_watchdog_restarts_state_and_hardening() -> None:
    directives = _directives(UNIT.read_text())
    expected = {
        "Type": "notify", "Restart": "on-failure", "StateDirectory": "trading-agent",
        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }
    assert {key: directives.get(key) for key in expected} == expected
    assert directives["WatchdogSec"].rstrip("s").isdigit()
    assert directives["ExecStart"].split()[1:] == [
        "run", "--config", "/etc/trading-agent/config.toml"]
    assert directives["EnvironmentFile"] == "/etc/trading-agent/env"


def test_the_unit_sets_a_descriptor_limit_with_room_beyond_the_tcp_api() -> None:
    from trading_agent.operator.server import MAX_TCP_CONNECTIONS

    directives = _directives(UNIT.read_text())
    assert "LimitNOFILE" in directives, "the unit must set LimitNOFILE="
    limit = directives["LimitNOFILE"]
    assert limit.isdigit(), f"LimitNOFILE={limit}: one number, soft and hard alike"
    # The TCP listener takes at most a quarter of the limit: here its full allowance.
    assert int(limit) >= 4 * MAX_TCP_CONNECTIONS


def test_the_env_example_names_every_secret_the_live_template_needs() -> None:
    from trading_agent.settings import load_settings

    names = set(load_settings(ROOT / "config" / "example-live.toml").secret_env_vars())
    example = ENV_EXAMPLE.read_text()
    for name in names:
        assert re.search(rf"^#?{name}=", example, re.MULTILINE), name


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (Debian package: systemd)")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists that ExecStart's program exists, and the unit points where a deployment
    # installs it (/opt/trading-agent). So a copy is verified, with ExecStart rewritten to
    # this checkout's installed script; every other line is the shipped one.
    script = Path(sys.executable).parent / "trading-agent"
    assert script.exists(), "the package's console script is not installed in this venv"
    text = UNIT.read_text()
    rewritten = re.sub(r"^ExecStart=\S+", f"ExecStart={script}", text, count=1, flags=re.M)
    assert rewritten != text
    copy = tmp_path / "trading-agent.service"
    copy.write_text(rewritten)
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(copy)],
                            capture_output=True, text=True, timeout=30, check=False)
    # A misspelt directive is only a warning (exit 0), so any output is a failure too.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
