"""A secret an operator pastes is redacted everywhere, as the README promises of "logs, events
and errors": the event stream, the stored events and conversation, and the model's request.

It used to be hidden in the log lines only, and kept verbatim in the events, the stream and
the store.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon.process import DaemonProcess, short_dir, write_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step
from trading_agent.logging_setup import REDACTED
from trading_agent.store.store import Store

pytestmark = pytest.mark.slow

KEY = "sk-test-6f1d0c9b8a7e4d3c"
"""The model's API key, as the daemon's environment holds it."""


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _user_texts(request: RecordedRequest) -> list[str]:
    texts = []
    for message in request.messages:
        if message["role"] == "user":
            content = message["content"]
            texts.append(content if isinstance(content, str) else "\n".join(
                part.get("text", "") for part in content))
    return texts


async def test_a_pasted_api_key_is_redacted_in_events_the_stream_the_store_and_the_model(
        scripted_server: ScriptedServer, folder: Path) -> None:
    def answer(request: RecordedRequest) -> Step:
        return Reply("Noted.")

    scripted_server.responder = answer
    config = write_config(folder, scripted_server.base_url)
    daemon = DaemonProcess(config, environ={"TRADING_AGENT_MODEL__API_KEY_ENV": "TEST_MODEL_KEY",
                                            "TEST_MODEL_KEY": KEY})
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            sent = await client.send_and_wait(
                "alpha", f"Here is the key: {KEY}. Keep it.", wait_seconds=20)
            assert sent["reply"]["text"] == "Noted."
            await client.pause("alpha", "ops", f"rotating {KEY}")
            await client.resume("alpha", "ops")
            streamed = [event.data async for event in client.events(desk="alpha", after=0,
                                                                    follow=False)]
            transcript = await client.transcript("alpha", limit=100)
        # The key did reach the server, as the credential it is...
        assert scripted_server.requests[0].headers["authorization"] == f"Bearer {KEY}"
        # ...and never as text.
        texts = [text for request in scripted_server.requests if request.messages
                 for text in _user_texts(request)]
        assert any(f"Here is the key: {REDACTED}. Keep it." in text for text in texts), texts
        assert not any(KEY in text for text in texts)

        assert KEY not in json.dumps(streamed)
        turn = next(e for e in streamed if e["type"] == "turn_start")
        assert f"Here is the key: {REDACTED}. Keep it." in turn["trigger_text"]
        paused = next(e for e in streamed if e["type"] == "desk_paused")
        assert paused["reason"] == f"rotating {REDACTED}"
        assert KEY not in json.dumps(transcript)
        assert any(f"Here is the key: {REDACTED}" in str(row["text"]) for row in transcript)

        daemon.signal(signal.SIGTERM)
        assert await daemon.wait_exit(10) == 0
        assert KEY not in daemon.log()
    finally:
        daemon.close()

    state = folder / "state"
    async with await Store.open(state / "trading-agent.sqlite3") as store:
        stored = await store.events.events_since(0, "alpha", limit=10_000)
    assert {"turn_start", "desk_paused"} <= {event["type"] for event in stored}
    assert KEY not in json.dumps(stored)
    for path in state.rglob("*"):  # nowhere on disk (a paper desk's replay files too)
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
