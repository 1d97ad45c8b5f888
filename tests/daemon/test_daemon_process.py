"""The daemon as a process: kill -9 mid-turn, SIGTERM mid-turn, a second signal, systemd.

Each test starts ``python -m trading_agent.cli run`` on a config pointing at the scripted
server, with a desk whose ``delegate`` tool (a subagent asking the model) is held by the
server, so a signal lands in the middle of a tool call.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import pytest

from tests.daemon.harness import is_valid_transcript, wait_for
from tests.daemon.process import (
    DaemonProcess,
    paper_books,
    place_resting_order,
    short_dir,
    write_config,
)
from tests.daemon_config import write_daemon_config
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall
from trading_agent.store.store import Store

pytestmark = pytest.mark.slow


class DeskScript:
    """Answers the desk and its subagent by what they were sent.

    - "Start." -> the desk places a resting paper order and, in the same round, delegates a
      research task (its subagent is held by ``hold``);
    - a resume notice -> "Resumed.";
    - "Are you there?" -> "Yes, here.";
    - anything else -> "Noted."
    """

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.subagent_asked = threading.Event()

    def __call__(self, request: RecordedRequest) -> Step:
        system = request.messages[0]["content"]
        last = _last_user_text(request)
        if "research assistant" in system:
            self.subagent_asked.set()
            return Reply("Research done: BTC is range-bound.", hold_until=self.hold)
        if request.messages[-1]["role"] == "tool":
            return Reply("Read the research.")
        if last.endswith("Start."):
            return Reply(tool_calls=[
                ToolCall("place_order", {"symbol": "BTC/USDT", "side": "buy", "type": "limit",
                                         "amount": "0.01", "price": "2"}),
                ToolCall("delegate", {"task": "Study BTC/USDT."})])
        if last.startswith("[resume"):
            return Reply("Resumed.")
        if "Are you there?" in last:
            return Reply("Yes, here.")
        return Reply("Noted.")


def _last_user_text(request: RecordedRequest) -> str:
    for message in reversed(request.messages):
        if message["role"] == "user":
            content = message["content"]
            return content if isinstance(content, str) else "\n".join(
                part.get("text", "") for part in content)
    return ""


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def _wait_until_async(condition: Callable[[], Awaitable[bool]], within: float,
                            what: str) -> None:
    try:
        with anyio.fail_after(within):
            while not await condition():  # noqa: ASYNC110 (state in another process)
                await anyio.sleep(0.05)
    except TimeoutError:
        raise TimeoutError(f"timed out waiting for {what}") from None


async def _open_orders_are(state_dir: Path, count: int) -> bool:
    return len((await paper_books(state_dir))["open_orders"]) == count


async def _transcript_has(daemon: DaemonProcess, text: str) -> bool:
    async with daemon.client() as client:
        rows = await client.transcript("alpha", limit=200)
    return any(row["role"] == "assistant" and row["text"] == text for row in rows)


async def _stored(state_dir: Path) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The desk's transcript and events, read from the file after the daemon ended."""
    async with await Store.open(state_dir / "trading-agent.sqlite3") as store:
        transcript = await store.transcripts.transcript("alpha", limit=1000,
                                                        include_subagents=False)
        events = await store.events.events_since(0, "alpha", limit=100_000)
    return transcript, events


async def test_kill_9_mid_turn_loses_no_message_repeats_none_and_the_desk_resumes(
        scripted_server: ScriptedServer, folder: Path) -> None:
    script = DeskScript()
    scripted_server.responder = script
    config = write_config(folder, scripted_server.base_url)
    resting = await place_resting_order(folder / "state")

    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            started = await client.send_message("alpha", "Start.", "ann")
            await wait_for(script.subagent_asked.is_set, 15, "the subagent's request")
            await _wait_until_async(
                lambda: _open_orders_are(folder / "state", 2), 10, "the desk's order")
            steering = await client.send_message("alpha", "Are you there?", "ann")
        assert steering["delivery"] == "steering"
        daemon.kill()  # mid-turn: the delegate call is in flight
    finally:
        daemon.close()
    script.hold.set()
    books_at_kill = await paper_books(folder / "state")

    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        await _wait_until_async(lambda: _transcript_has(daemon, "Yes, here."), 20,
                                "the desk to answer the message sent before the kill")
        daemon.signal(signal.SIGTERM)
        assert await daemon.wait_exit(10) == 0, daemon.log()
    finally:
        daemon.close()

    transcript, _ = await _stored(folder / "state")
    ids = [row["id"] for row in transcript]
    assert len(ids) == len(set(ids)), "a message was stored twice"
    delivered = [row["id"] for row in transcript if row["kind"] in ("operator", "steering")]
    assert delivered == [started["id"], steering["id"]]
    assert [row["text"] for row in transcript if row["role"] == "assistant"][-2:] == [
        "Resumed.", "Yes, here."]
    interrupted = next(row for row in transcript if row["kind"] == "tool_results")
    assert "interrupted" in json.dumps(interrupted["content"])
    async with await Store.open(folder / "state" / "trading-agent.sqlite3") as store:
        assert await store.inbox.undelivered_operator_messages("alpha") == []
        restored = await store.transcripts.restore_conversation("alpha", "x")
    assert is_valid_transcript(restored.messages)
    assert await paper_books(folder / "state") == books_at_kill
    assert len(books_at_kill["open_orders"]) == 2 and resting in books_at_kill["open_orders"]
    assert books_at_kill["balances"]["USDT"][1] > 0  # the order's funds stay reserved


async def test_sigterm_mid_turn_exits_0_within_10_s_with_the_turn_checkpointed(
        scripted_server: ScriptedServer, folder: Path) -> None:
    script = DeskScript()  # the subagent is never released: only the timeout ends it
    scripted_server.responder = script
    config = write_config(folder, scripted_server.base_url, shutdown_timeout=3)

    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            await client.send_message("alpha", "Start.", "ann")
        await wait_for(script.subagent_asked.is_set, 15, "the subagent's request")
        sent = time.monotonic()
        daemon.signal(signal.SIGTERM)
        code = await daemon.wait_exit(10)
        took = time.monotonic() - sent
    finally:
        daemon.close()
        script.hold.set()

    assert code == 0, daemon.log()
    assert took < 10
    transcript, events = await _stored(folder / "state")
    assert [row["kind"] for row in transcript] == ["operator", "assistant", "tool_results"]
    assert "interrupted" in json.dumps(transcript[-1]["content"])
    desk_steps = [e["type"] for e in events if e["subagent"] is None]
    assert desk_steps[:2] == ["turn_start", "model_request"]
    assert "tool_call" in desk_steps  # the events buffered at the signal were written


class HangingServer:
    """An HTTP receiver on loopback that reads each request and never answers (until the
    test ends): a webhook receiver or an OTLP collector gone wrong."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.requests = 0
        self._held: list[socket.socket] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            connection.recv(65536)  # the request's head: it came, and is never answered
            self.requests += 1
            self._held.append(connection)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for connection in self._held:
            connection.close()


async def test_sigterm_with_a_hanging_webhook_receiver_and_collector_exits_within_10_s(
        scripted_server: ScriptedServer, folder: Path) -> None:
    """A desk mid-turn (its tool call never returns: the whole 1 s drain is spent), a
    webhook receiver and an OTLP collector that accept and never answer, with attempt and
    export timeouts of 30 s: the sinks get what is left of the 10 s, not their own."""
    script = DeskScript()
    scripted_server.responder = script
    hook, collector = HangingServer(), HangingServer()
    config = write_daemon_config(
        folder, scripted_server.base_url,
        daemon={"log_format": "json", "shutdown_timeout_seconds": 1,
                "restart_backoff_seconds": 0.1},
        model={"request_timeout": 30}, exchange={"replay": {"speed": 60}},
        desks={"alpha": {"subagents": {"timeout_seconds": 60}}, "beta": {}},
        tables={"telemetry": {"otlp_endpoint": f"http://127.0.0.1:{collector.port}",
                              "export_timeout_seconds": 30},
                "webhooks": [{"url": f"http://127.0.0.1:{hook.port}/hook",
                              "events": ["desk_paused", "error", "kill_switch"],
                              "secret_env": "TEST_WEBHOOK_SECRET", "timeout_seconds": 30}]})

    daemon = DaemonProcess(config, {"TEST_WEBHOOK_SECRET": "s3cret-for-the-test"})
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            await client.pause("beta", "ann", "a webhook that will hang")
            await client.send_message("alpha", "Start.", "ann")
        await wait_for(lambda: hook.requests > 0, 15, "the webhook receiver's first request")
        await wait_for(script.subagent_asked.is_set, 15, "the subagent's request")
        sent = time.monotonic()
        daemon.signal(signal.SIGTERM)
        code = await daemon.wait_exit(20)
        took = time.monotonic() - sent
    finally:
        daemon.close()
        script.hold.set()
        hook.close()
        collector.close()

    print(f"SIGTERM to exit: {took:.2f} s")
    assert code == 0, daemon.log()
    assert took < 9, f"{took:.2f} s"  # the README's ten seconds, with a second to spare
    assert collector.requests > 0  # the last spans were offered to the collector


async def test_a_second_signal_exits_at_once_and_the_store_stays_sound(
        scripted_server: ScriptedServer, folder: Path) -> None:
    script = DeskScript()
    scripted_server.responder = script
    config = write_config(folder, scripted_server.base_url, shutdown_timeout=8)

    daemon = DaemonProcess(config)
    try:
        await daemon.wait_ready()
        async with daemon.client() as client:
            await client.send_message("alpha", "Start.", "ann")
        await wait_for(script.subagent_asked.is_set, 15, "the subagent's request")
        daemon.signal(signal.SIGTERM)
        await wait_for(lambda: '"shutdown_started"' in daemon.log(), 10, "the first signal")
        assert daemon.process.poll() is None  # draining: the tool call still runs
        sent = time.monotonic()
        daemon.signal(signal.SIGINT)
        code = await daemon.wait_exit(5)
        took = time.monotonic() - sent
    finally:
        daemon.close()
        script.hold.set()

    assert code == 0, daemon.log()
    assert took < 3  # at once: no waiting for the tool call (9 s of drain allowed)
    database = sqlite3.connect(folder / "state" / "trading-agent.sqlite3")
    try:
        assert database.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        database.close()
    transcript, _ = await _stored(folder / "state")
    assert [row["kind"] for row in transcript] == ["operator", "assistant", "tool_results"]


async def test_systemd_hears_ready_watchdog_and_stopping(
        scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.responder = DeskScript()
    config = write_config(folder, scripted_server.base_url)
    notify_path = folder / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.setblocking(False)
    heard: list[str] = []

    def read() -> None:
        while True:
            try:
                heard.append(listener.recv(4096).decode())
            except BlockingIOError:
                return

    def heard_line(line: str) -> bool:
        read()
        return any(line in message.splitlines() for message in heard)

    daemon = DaemonProcess(config, {"NOTIFY_SOCKET": str(notify_path),
                                    "WATCHDOG_USEC": "400000"})
    try:
        await wait_for(lambda: heard_line("READY=1"), 20, "READY=1")
        await wait_for(lambda: heard_line("WATCHDOG=1"), 5, "WATCHDOG=1")
        daemon.signal(signal.SIGTERM)
        await wait_for(lambda: heard_line("STOPPING=1"), 5, "STOPPING=1")
        assert await daemon.wait_exit(10) == 0, daemon.log()
        log = daemon.log()
    finally:
        daemon.close()
        listener.close()

    ready = next(message for message in heard if "READY=1" in message.splitlines())
    assert "STATUS=1 desk (1 idle)" in ready
    logged = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    ready_line = next(line for line in logged if line["event"] == "daemon_ready")
    assert ready_line["event_loop"] == "uvloop"  # daemon.event_loop = "auto", on Linux
    pings = [message for message in heard if "WATCHDOG=1" in message.splitlines()]
    assert any("STATUS=1 desk" in message for message in pings)
