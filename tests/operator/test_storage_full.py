"""A full disk under the store: the daemon stays up, refuses what it cannot store (HTTP 507,
naming the state directory), alerts, and carries on once space is freed, losing nothing it
accepted.

The disk is made "full" for real, without root: SQLite's ``max_page_count`` on the
daemon's own connection caps the database file at its size now, so the next write that needs
a new page fails with SQLITE_FULL, as on a full file system.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.harness import in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until
from trading_agent.agent.events import Event
from trading_agent.daemon.events import StorageChanged
from trading_agent.settings import load_settings
from trading_agent.store.database import Database
from trading_agent.telemetry.webhooks import webhook_kind

pytestmark = pytest.mark.timeout(60)


async def _fill(database: Database) -> None:
    pages = await database.read(lambda c: c.execute("PRAGMA page_count").fetchone()[0])
    await database.write(lambda c: c.execute(f"PRAGMA max_page_count = {pages}"))


async def _free(database: Database) -> None:
    await database.write(lambda c: c.execute("PRAGMA max_page_count = 1073741823"))


def _storage_full_gauge(text: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("trading_agent_storage_full "):
            return float(line.split()[1])
    return None


async def test_a_full_disk_is_refused_with_507_alerted_waited_out_and_nothing_is_lost(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    release = threading.Event()
    long_answer = "Second answer. " + "y" * 6000  # needs new pages: it cannot be stored
    disk = {"full": True}
    scripted_server.add(Reply("First answer."), Reply(long_answer, hold_until=release))
    scripted_server.responder = lambda request: Reply(
        long_answer if disk["full"] else "Answered after the disk was freed.")
    config = write_daemon_config(state_dir, scripted_server.base_url, daemon=FAST_RESTARTS)
    state_directory = str(load_settings(config).state_directory({}))
    seen: list[Event] = []

    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        daemon = running.daemon
        database = daemon.store.database
        with daemon.event_bus.subscribe("test", max_buffer=100_000) as events:
            def drained() -> list[Event]:
                while (event := events.get_nowait()) is not None:
                    seen.append(event)
                return seen

            def storage(full: bool) -> list[StorageChanged]:
                return [e for e in drained() if isinstance(e, StorageChanged) and e.full == full]

            first = await client.post("/api/desks/alpha/messages", json={
                "text": "First question.", "source": "ann", "wait": True, "timeout": 10})
            assert first.status_code == 200 and first.json()["reply"]["ok"], first.text
            accepted = await client.post("/api/desks/alpha/messages", json={
                "text": "Second question.", "source": "ann"})
            assert accepted.status_code == 202, accepted.text
            await scripted_server.wait_for_requests(2)  # the desk waits for its answer

            await _fill(database)
            refused = await client.post("/api/desks/alpha/messages", json={
                "text": "A paste too long for a full disk. " + "z" * 7000, "source": "ann"})
            assert refused.status_code == 507, refused.text
            error = refused.json()["error"]
            assert error["code"] == "storage_full"
            assert state_directory in error["message"] and "full" in error["message"]
            assert storage(True)[0].location == state_directory
            assert webhook_kind(storage(True)[0]) == "storage"
            metrics = await client.get("/metrics")
            assert _storage_full_gauge(metrics.text) == 1.0

            # The model answers; the answer cannot be stored; the desk waits for space and
            # tries again (each try asks the model once more), well past the five failed
            # turns that switch a crashing desk's kill switch on, and the daemon stays up.
            release.set()
            await wait_until(lambda: len(scripted_server.requests) >= 9, "the desk to try again")
            # Between its tries (each a turn, "working") the desk shows as paused, waiting.
            waiting: dict[str, Any] = {}

            async def paused() -> bool:
                waiting.update((await client.get("/api/desks/alpha")).json())
                return waiting["state"] == "paused"

            await wait_until(paused, "the desk to show it waits for disk space")
            status = waiting
            assert "waiting for disk space" in status["paused_reason"]
            assert state_directory in status["paused_reason"]
            assert status["kill_switch"] == ""

            disk["full"] = False
            await _free(database)
            await wait_until(lambda: bool(storage(False)), "storage writable again")
            async def idle() -> bool:
                return bool((await client.get("/api/desks/alpha")).json()["state"] == "idle")

            await wait_until(idle, "the desk to carry on")
            again = await client.post("/api/desks/alpha/messages", json={
                "text": "A paste too long for a full disk. " + "z" * 7000, "source": "ann",
                "wait": True, "timeout": 10})
            assert again.status_code == 200, again.text
            assert _storage_full_gauge((await client.get("/metrics")).text) == 0.0
            transcript = (await client.get("/api/desks/alpha/transcript",
                                           params={"limit": 100})).json()
            kill_switch = (await client.get("/api/desks/alpha")).json()["kill_switch"]

    texts = [m["text"] for m in transcript["messages"]]
    second = next(i for i, text in enumerate(texts) if text.endswith("Second question."))
    assert any("Answered after the disk was freed." in text for text in texts[second:])
    assert any(text.endswith("z" * 7000) for text in texts)
    assert kill_switch == ""
