"""``trading-agent chat`` in a real terminal (tmux) against a real daemon (``trading-agent run``)
whose model is the scripted server: type, watch it stream, steer mid-turn, compact."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from tests.operator.daemon_process import running_daemon
from tests.os_user import OS_USER
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, ToolCall

TMUX = shutil.which("tmux")

pytestmark = [
    pytest.mark.skipif(TMUX is None, reason="tmux is not installed (scripts/ensure-test-tools.sh "
                                            "installs it)"),
    pytest.mark.slow,
]


class Terminal:
    """A tmux session on a private server socket, driven like a person would."""

    def __init__(self, directory: Path) -> None:
        assert TMUX is not None
        self._base = [TMUX, "-S", str(directory / "tmux.sock")]
        self.session = "chat"

    async def _tmux(self, *args: str) -> str:
        result = await anyio.run_process([*self._base, *args], check=True)
        return result.stdout.decode()

    async def start(self, command: list[str], env: dict[str, str]) -> None:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        await self._tmux("new-session", "-d", "-s", self.session, "-x", "150", "-y", "50",
                         f"env {exports} {shlex.join(command)}; sleep 30")

    async def type(self, text: str) -> None:
        await self._tmux("send-keys", "-t", self.session, "-l", text)
        await self._tmux("send-keys", "-t", self.session, "Enter")

    async def screen(self) -> str:
        return await self._tmux("capture-pane", "-p", "-J", "-t", self.session, "-S", "-500")

    async def wait_for(self, check: Callable[[str], bool] | str) -> str:
        """Polls the screen (a terminal has no events to wait on) for up to 10 s."""
        test = check if callable(check) else (lambda screen: check in screen)
        screen = ""
        try:
            with anyio.fail_after(10):
                while not test(screen := await self.screen()):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(f"the terminal never showed {check!r}; it shows:\n"
                                 f"{screen}") from None
        return screen

    async def close(self) -> None:
        await anyio.run_process([*self._base, "kill-server"], check=False)


def _model(request: RecordedRequest) -> Reply:
    """The scripted model once the script has run out: summaries and memory flushes."""
    messages = request.messages
    system = str(messages[0].get("content")) if messages[0]["role"] == "system" else ""
    if "running summary" in system:
        return Reply("## Goal\n- watch BTC\n## Positions and open orders\n- none")
    if "[Memory flush]" in str(messages[-1].get("content")):
        return Reply("NO_REPLY")
    return Reply("Noted.")


async def test_chat_streams_steers_and_compacts_in_a_terminal(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    scripted_server.add(
        # Turn 1: a tool call held until the test has steered, so the steering is mid-turn...
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})], hold_until=release),
        # ...then an answer that streams in pieces.
        Reply("BTC trades at 64,000; volume is thin, so I keep it short.", text_chunks=12,
              chunk_delay=0.03),
    )
    scripted_server.responder = _model  # /compact: a memory flush (with a memory tool), a summary
    terminal = Terminal(state_dir)
    async with running_daemon(state_dir, scripted_server.base_url) as daemon:
        try:
            await terminal.start(
                [sys.executable, "-m", "trading_agent.cli", "chat", "alpha", "--config",
                 str(daemon.config)],
                {"TERM": "xterm-256color", "PYTHONPATH": os.pathsep.join(sys.path)})
            await terminal.wait_for("Connected to alpha · idle · paper · scripted-model")

            await terminal.type("How is BTC today?")
            screen = await terminal.wait_for("(sent; it starts a turn)")
            assert "How is BTC today?" in screen  # what was typed shows
            await scripted_server.wait_for_requests(1)  # the turn is waiting for the model

            await terminal.type("Keep it short.")  # mid-turn: it steers
            await terminal.wait_for("(sent; steering the running turn")
            release.set()
            await terminal.wait_for("✉ delivered to the desk after round 1: Keep it short.")
            screen = await terminal.wait_for("■ turn end")
            assert "→ get_ticker symbol=\"BTC/USDT\"" in screen
            assert "← get_ticker" in screen or "✗ get_ticker" in screen
            assert "alpha › BTC trades at 64,000; volume is thin, so I keep it short." in screen

            await terminal.type("/compact")
            await terminal.wait_for("Compacted.")  # the API's answer...
            await terminal.wait_for("⇣ compacted:")  # ...and the stream's event

            await terminal.type("/status")
            await terminal.wait_for(lambda s: s.count("alpha · idle · paper") >= 2)
            await terminal.type("/quit")
            await terminal.wait_for("Bye; the desk keeps running.")
        finally:
            release.set()  # never leave the scripted server holding a reply
            await terminal.close()
    assert not daemon.socket_path.exists()  # the daemon stopped cleanly
    steered = scripted_server.requests[1].messages[-1]
    assert steered["role"] == "user" and steered["content"].endswith("Keep it short.")
    assert OS_USER in steered["content"]
    assert scripted_server.remaining == 0 and not scripted_server.errors
