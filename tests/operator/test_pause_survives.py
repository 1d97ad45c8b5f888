"""A paused desk stays paused across a restart: an operator who stopped a desk from thinking
does not find it trading again because systemd restarted the daemon."""

from __future__ import annotations

from pathlib import Path

import anyio

from tests.operator.harness import in_process_daemon, uds_client
from tests.operator.test_reload import _config
from tests.os_user import OS_USER
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until


async def test_a_pause_outlives_a_restart_and_a_message_waits_for_the_resume(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Back at work."))
    config = _config(state_dir, scripted_server.base_url, {"alpha": "You are alpha."})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        paused = await client.post("/api/desks/alpha/pause",
                                   json={"reason": "FOMC at 18:00"})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        after_restart = (await client.get("/api/desks/alpha")).json()
        await client.post("/api/desks/alpha/messages", json={"text": "Anything new?"})

        async def held() -> dict[str, object] | None:
            status: dict[str, object] = (await client.get("/api/desks/alpha")).json()
            return status if status["queued_triggers"] == 1 else None

        waiting = await wait_until(held, "the message held by the paused desk")
        asked_while_paused = len(scripted_server.requests)
        resumed = await client.post("/api/desks/alpha/resume", json={})
        with anyio.fail_after(10):
            while not scripted_server.requests:  # noqa: ASYNC110
                await anyio.sleep(0.02)

    assert paused.status_code == 200 and paused.json()["changed"] is True
    assert after_restart["state"] == "paused"
    assert after_restart["paused_reason"].startswith(f"paused by {OS_USER} at ")
    assert after_restart["paused_reason"].endswith(
        ": FOMC at 18:00 (until an operator resumes it)")
    assert waiting["state"] == "paused" and waiting["queued_triggers"] == 1
    assert asked_while_paused == 0
    assert resumed.json()["changed"] is True
    assert "Anything new?" in str(scripted_server.requests[0].messages[-1]["content"])
