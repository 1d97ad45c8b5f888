"""The daemon's state is its user's alone: the state directory 0700, every file in it 0600.

Under the usual umask 0022 the directory used to be 0755 and the SQLite file 0644: anyone on
the machine could read the conversations, orders and balances. A state directory that
cannot be made used to end ``run`` with a traceback.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.process import ROOT, DaemonProcess, short_dir, write_config
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.errors import ConfigError
from trading_agent.store.database import prepare_state_directory
from trading_agent.store.store import Store

DATABASE = "trading-agent.sqlite3"


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _modes(state_dir: Path) -> dict[str, str]:
    """The directory's mode and each entry's below it, in octal, by relative path ("." for
    the directory)."""
    modes = {".": oct(_mode(state_dir))}
    modes.update({str(entry.relative_to(state_dir)): oct(_mode(entry))
                  for entry in state_dir.rglob("*")})
    return modes


def _private(state_dir: Path, modes: dict[str, str]) -> dict[str, str]:
    """What ``modes`` must be: folders 0700, files 0600."""
    return {name: oct(0o700) if (state_dir / name).is_dir() else oct(0o600) for name in modes}


def _start_under_umask_022(config: Path) -> DaemonProcess:
    """A daemon started the way a person starts it from a shell (umask 0022)."""
    previous = os.umask(0o022)
    try:
        return DaemonProcess(config)
    finally:
        os.umask(previous)


async def _talk_and_stop(daemon: DaemonProcess, scripted_server: ScriptedServer) -> None:
    """One exchange (the store writes, the WAL grows), then SIGTERM."""
    scripted_server.add(Reply("Noted."))
    await daemon.wait_ready()
    async with daemon.client() as client:
        answer = await client.send_and_wait("alpha", "Hello.", wait_seconds=20)
    assert answer["reply"]["text"] == "Noted."


@pytest.mark.slow
async def test_a_daemon_started_under_umask_022_keeps_its_state_to_its_user(
        scripted_server: ScriptedServer, folder: Path) -> None:
    daemon = _start_under_umask_022(write_config(folder, scripted_server.base_url))
    try:
        await _talk_and_stop(daemon, scripted_server)
        state = folder / "state"
        modes = _modes(state)
        # While it runs: the store's file with its WAL and shared memory, the lock, the socket.
        assert {DATABASE, f"{DATABASE}-wal", f"{DATABASE}-shm", "daemon.lock",
                "operator.sock"} <= set(modes), modes
        assert modes == _private(state, modes)
        assert "state_permissions_tightened" not in daemon.log()
    finally:
        daemon.close()


@pytest.mark.slow
async def test_state_an_earlier_run_left_open_is_closed_and_the_log_says_so(
        scripted_server: ScriptedServer, folder: Path) -> None:
    state = folder / "state"
    async with await Store.open(state / DATABASE):  # as a version before this rule left it
        pass
    (state / "daemon.lock").write_text("")
    for path in state.iterdir():
        path.chmod(0o644)
    state.chmod(0o755)

    daemon = _start_under_umask_022(write_config(folder, scripted_server.base_url))
    try:
        await _talk_and_stop(daemon, scripted_server)
        modes = _modes(state)
        assert modes == _private(state, modes)
        tightened = [line for line in daemon.log().splitlines()
                     if "state_permissions_tightened" in line]
        assert len(tightened) == 1, daemon.log()
        assert str(state) in tightened[0] and DATABASE in tightened[0]
    finally:
        daemon.close()


# --- in this process: the directory alone ----------------------------------------------------


def test_a_new_state_directory_is_0700_whatever_the_umask(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        prepare_state_directory(tmp_path / "a" / "state")
    finally:
        os.umask(previous)
    assert _mode(tmp_path / "a" / "state") == 0o700


def test_open_state_is_closed_but_links_and_folders_in_it_are_left_alone(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    (state / DATABASE).write_bytes(b"")
    (state / DATABASE).chmod(0o664)
    (state / "daemon.lock").write_bytes(b"")
    (state / "daemon.lock").chmod(0o600)
    elsewhere = tmp_path / "shared.txt"
    elsewhere.write_text("not the daemon's")
    elsewhere.chmod(0o644)
    (state / "link").symlink_to(elsewhere)
    (state / "backups").mkdir(mode=0o755)
    (state / "backups").chmod(0o755)

    prepare_state_directory(state)

    assert (_mode(state), _mode(state / DATABASE), _mode(state / "daemon.lock")) == (
        0o700, 0o600, 0o600)
    assert _mode(elsewhere) == 0o644  # what a link points to is not ours to change
    assert _mode(state / "backups") == 0o755  # unreachable now: its parent is 0700


@pytest.mark.parametrize(
    ("where", "reason"),
    [("file", "Not a directory"), ("the file itself", "it exists and is not a directory"),
     ("/proc", "No such file or directory")],
)
def test_a_state_directory_that_cannot_be_made_is_named_with_the_reason(
        tmp_path: Path, where: str, reason: str) -> None:
    (tmp_path / "file").write_text("")
    state = {"file": tmp_path / "file" / "state", "the file itself": tmp_path / "file",
             "/proc": Path("/proc/trading-agent-state")}[where]
    with pytest.raises(ConfigError) as caught:
        prepare_state_directory(state)
    assert str(caught.value) == f"cannot create the state directory {state}: {reason}"


# --- the command ---------------------------------------------------------------------------


@pytest.mark.parametrize("under", ["a file", "/proc"])
def test_run_says_in_one_line_that_the_state_directory_cannot_be_made(
        tmp_path: Path, under: str) -> None:
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "state" if under == "a file" else Path("/proc/ta-state")
    config = tmp_path / "daemon.toml"
    config.write_text(f"""
[daemon]
state_dir = "{state}"

[model]
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "scripted-model"
context_window = 32000

[desks.alpha]
system_prompt = "You trade."
symbols = ["BTC/USDT"]
""")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("TRADING_AGENT_") and key != "STATE_DIRECTORY"}
    env["PYTHONPATH"] = str(ROOT / "src")
    done = subprocess.run(
        [sys.executable, "-m", "trading_agent.cli", "run", "--config", str(config)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"{config}: refusing to start: cannot create the state directory {state}: "
        f"{'Not a directory' if under == 'a file' else 'No such file or directory'}"]
    assert "Traceback" not in done.stdout + done.stderr
