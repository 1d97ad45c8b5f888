"""An operator's message longer than the desk's model can read: sent, shortened, said so.

A real daemon in this process (store, supervisor, a paper desk, the operator API on its Unix
socket) with a 2,048-token model window, answered by the scripted server. The API stores the
whole message and answers with what the model reads of it; ``chat`` prints that.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from tests.daemon_config import write_daemon_config
from tests.operator.harness import in_process_daemon
from tests.operator.test_images import _read_until, _type, _wait_turn_end
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer
from trading_agent.operator.client import OperatorClient
from trading_agent.operator.server import OperatorEndpoints


@contextlib.asynccontextmanager
async def _running(folder: Path, base_url: str) -> AsyncIterator[OperatorEndpoints]:
    """A daemon whose one desk has a 2,048-token window, as ``run`` runs it."""
    path = write_daemon_config(
        folder, base_url,
        model={"context_window": 2048, "max_output_tokens": 64, "request_timeout": None},
        desks={"alpha": {"system_prompt": "You are alpha.", "tools": ["get_ticker"]}})
    async with in_process_daemon(path) as running:
        yield running.endpoints


@pytest.mark.parametrize("size", [300, 7000])
async def test_a_message_too_long_for_the_window_is_shortened_and_the_api_says_so(
        scripted_server: ScriptedServer, state_dir: Path, size: int) -> None:
    scripted_server.add(Reply("Read it."))
    text = "Closes: " + " ".join(["16751.3"] * (size // 8))
    async with _running(state_dir, scripted_server.base_url) as endpoints, \
            OperatorClient(socket_path=endpoints.socket_path) as client:
        sent = await client.send_message("alpha", text)
        await _wait_turn_end(client)
        transcript = await client.transcript("alpha")

    [request] = scripted_server.requests
    read = request.messages[-1]["content"]
    read = read if isinstance(read, str) else read[0]["text"]
    [stored] = [m for m in transcript if m["kind"] == "operator"]
    assert stored["text"].endswith(text)  # the store keeps every character
    if size < 1000:
        assert "shortened" not in sent
        assert read.endswith(text)
        return
    shortened = sent["shortened"]
    assert shortened["message_chars"] == len(text)
    assert shortened["limit_chars"] < len(text)
    assert "the middle was cut" in shortened["note"] and "stored" in shortened["note"]
    # What the model read: the head and the tail, saying how much was cut.
    assert len(read) <= shortened["limit_chars"] + 200
    assert read.startswith(f"[Message from {OS_USER}, a human operator]\nCloses: 16751.3")
    assert "characters of this message were cut here" in read


@pytest.mark.slow
async def test_chat_says_when_a_message_was_shortened(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Read it."))
    async with _running(state_dir, scripted_server.base_url) as endpoints:
        process = await anyio.open_process(
            [sys.executable, "-m", "trading_agent.cli", "chat", "alpha", "--socket",
             str(endpoints.socket_path)],
            env={**os.environ, "NO_COLOR": "1"})
        seen: list[str] = []
        assert process.stdout is not None
        try:
            with anyio.fail_after(30):
                await _read_until(process.stdout, seen, "Connected to alpha")
                await _type(process, "Closes: " + " ".join(["16751.3"] * 800))
                await _read_until(process.stdout, seen, "(sent; it starts a turn)")
                output = await _read_until(process.stdout, seen, "The whole message is stored.")
                await _type(process, "/quit")
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
    said = " ".join(output.split())
    assert "Shortened: The message is 6,407 characters; this desk's model reads at most" in said
    assert "the middle was cut in what it is sent. The whole message is stored." in said
