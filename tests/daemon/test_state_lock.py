"""One daemon per state directory: the lock refuses a second holder, by pid, and is freed
when its holder ends (even by kill -9)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import ScriptedServer
from trading_agent.daemon.state_lock import LOCK_NAME, hold_state_lock
from trading_agent.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

_HOLDER = textwrap.dedent("""
    import sys, time
    from trading_agent.daemon.state_lock import hold_state_lock
    with hold_state_lock(sys.argv[1]):
        print("locked", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of ``tmp_path / "state"``."""
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    process = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "state")],
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "locked"
        yield process
    finally:
        process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def test_a_second_process_is_refused_naming_the_holder_pid(
        holder: subprocess.Popen[str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    with pytest.raises(ConfigError) as caught, hold_state_lock(state):
        pass
    assert str(caught.value) == (
        f"another trading-agent daemon (pid {holder.pid}) is already running on state "
        f"directory {state}; stop it first or use another state_dir")


def test_the_lock_is_freed_when_its_holder_is_killed(
        holder: subprocess.Popen[str], tmp_path: Path) -> None:
    holder.kill()  # SIGKILL: no clean-up runs
    holder.wait(10)
    with hold_state_lock(tmp_path / "state") as path:
        assert path.read_text() == f"{os.getpid()}\n"


def test_the_same_process_twice_is_refused_then_free_after_the_first_ends(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    with hold_state_lock(state) as path:
        assert path == state / LOCK_NAME
        assert path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError, match=rf"\(pid {os.getpid()}\) is already running"), \
                hold_state_lock(state):
            pass
        assert path.read_text() == f"{os.getpid()}\n"  # the refused one changed nothing
    assert (state / LOCK_NAME).read_text() == ""
    with hold_state_lock(state):  # free again
        pass


def test_another_state_directory_is_not_held(tmp_path: Path) -> None:
    with hold_state_lock(tmp_path / "one"), hold_state_lock(tmp_path / "two"):
        pass


async def test_a_second_daemon_on_the_same_state_directory_is_refused_by_pid(
        scripted_server: ScriptedServer) -> None:
    with short_dir() as folder:
        config = write_config(folder, scripted_server.base_url)
        other = folder / "other.toml"  # the same state, another socket: it used to run too
        other.write_text(config.read_text() + f'\n[operator]\nsocket_path = "{folder}/b.sock"\n')
        first = DaemonProcess(config)
        try:
            await first.wait_ready()
            second = await anyio.run_process(
                [sys.executable, "-m", "trading_agent.cli", "run", "--config", str(other)],
                check=False)
            async with first.client() as still:  # the first one runs on, unharmed
                health = await still.health()
        finally:
            first.close()

    assert second.returncode == 2
    assert (f"refusing to start: another trading-agent daemon (pid {first.process.pid}) is "
            f"already running on state directory {folder / 'state'}").encode() in second.stderr
    assert health["status"] == "ok"
