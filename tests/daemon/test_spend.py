"""Daily spend caps: an alert at 80%, a pause until 00:00 UTC at 100%, an operator's resume
that stands for the day, the daemon's cap over every desk, and a restart that forgets nothing.

First :class:`SpendGuard` itself, fed usage on a real :class:`EventBus` with a clock the test
sets; then the real daemon (:func:`in_process_daemon`) whose scripted model reports usage,
watched through the operator API as an operator would.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon.process import short_dir
from tests.daemon_config import FAST_RESTARTS, write_daemon_config
from tests.operator.harness import collect_events, in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer
from tests.waiting import wait_until
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event
from trading_agent.daemon.events import SpendAlert
from trading_agent.daemon.spend import SpendGuard
from trading_agent.settings import SpendCaps

NOON = datetime(2026, 3, 10, 12, 0, tzinfo=UTC).timestamp()
MIDNIGHT = datetime(2026, 3, 11, tzinfo=UTC).timestamp()
"""The first second of the UTC day after :data:`NOON`'s."""


class _Guarded:
    """A guard over desks alpha and beta, with what it published and whom it paused."""

    def __init__(self, alpha: SpendCaps | None = None, beta: SpendCaps | None = None,
                 daemon: SpendCaps | None = None) -> None:
        self.now = NOON
        self.bus = EventBus()
        self.seen = self.bus.subscribe("test")
        self.paused: list[tuple[str, str, float]] = []
        self.guard = SpendGuard({"alpha": alpha or SpendCaps(), "beta": beta or SpendCaps()},
                                daemon or SpendCaps(), self.bus, self._pause,
                                clock=lambda: self.now)

    async def _pause(self, desk: str, reason: str, until: float) -> None:
        self.paused.append((desk, reason, until))

    def alerts(self) -> list[SpendAlert]:
        found: list[Event] = []
        while (event := self.seen.get_nowait()) is not None:
            found.append(event)
        assert all(isinstance(e, SpendAlert) for e in found), found
        return [e for e in found if isinstance(e, SpendAlert)]


async def test_an_alert_at_80_percent_once_then_a_pause_until_utc_midnight() -> None:
    guarded = _Guarded(alpha=SpendCaps(max_tokens_per_day=1000))
    guard = guarded.guard
    assert guard.active
    await guard.count("alpha", 500, None)
    assert guarded.alerts() == [] and guarded.paused == []
    await guard.count("alpha", 300, None)
    [alert] = guarded.alerts()
    assert (alert.desk, alert.scope, alert.measure, alert.used, alert.cap) == (
        "alpha", "desk", "tokens", 800, 1000)
    assert alert.share == pytest.approx(0.8)
    assert alert.text == ("desk alpha's daily spend cap is 80% used: 800 of 1,000 tokens today "
                          "(UTC)")
    await guard.count("alpha", 100, None)
    await guard.count("beta", 5000, None)  # beta has no cap of its own, and none is shared
    assert guarded.alerts() == [] and guarded.paused == []

    await guard.count("alpha", 150, None)
    [full] = guarded.alerts()
    assert full.share == pytest.approx(1.05)
    text = "desk alpha's daily spend cap is used up: 1,050 of 1,000 tokens today (UTC)"
    assert full.text == text
    assert guarded.paused == [("alpha", text, MIDNIGHT)]
    await guard.count("alpha", 10, None)
    assert guarded.alerts() == [] and len(guarded.paused) == 1  # once a day
    assert guard.figures("alpha") == [{"scope": "desk", "measure": "tokens", "used": 1060.0,
                                       "cap": 1000.0, "share": pytest.approx(1.06)}]
    assert guard.figures("beta") == []


async def test_a_single_request_past_the_cap_pauses_without_a_separate_alert() -> None:
    guarded = _Guarded(alpha=SpendCaps(max_tokens_per_day=1000))
    await guarded.guard.count("alpha", 1500, None)
    [full] = guarded.alerts()
    assert "used up: 1,500 of 1,000 tokens" in full.text
    assert [p[0] for p in guarded.paused] == ["alpha"]


async def test_an_operators_resume_stands_for_the_day_and_a_new_day_starts_afresh() -> None:
    guarded = _Guarded(alpha=SpendCaps(max_tokens_per_day=1000))
    guard = guarded.guard
    await guard.count("alpha", 1000, None)
    assert len(guarded.paused) == 1 and len(guarded.alerts()) == 1
    await guard.resumed("alpha")
    await guard.count("alpha", 5000, None)
    assert len(guarded.paused) == 1 and guarded.alerts() == []

    guarded.now = MIDNIGHT + 60  # the next UTC day: counted from zero, capped again
    assert guard.figures("alpha")[0]["used"] == 0
    await guard.count("alpha", 850, None)
    [alert] = guarded.alerts()
    assert alert.used == 850 and "85% used" in alert.text
    await guard.count("alpha", 200, None)
    assert len(guarded.paused) == 2
    assert guarded.paused[1][2] == datetime(2026, 3, 12, tzinfo=UTC).timestamp()


async def test_the_daemons_cap_counts_every_desk_and_pauses_them_all() -> None:
    guarded = _Guarded(daemon=SpendCaps(max_tokens_per_day=1000))
    guard = guarded.guard
    await guard.count("alpha", 600, None)
    assert guarded.alerts() == []
    await guard.count("beta", 250, None)
    [alert] = guarded.alerts()
    assert (alert.desk, alert.scope, alert.used) == ("*", "daemon", 850)
    assert alert.text == "the daemon's daily spend cap is 85% used: 850 of 1,000 tokens today (UTC)"
    await guard.count("beta", 200, None)
    [full] = guarded.alerts()
    assert full.desk == "*" and full.text.startswith("the daemon's daily spend cap is used up: "
                                                     "1,050 of 1,000 tokens")
    assert [(desk, until) for desk, _, until in guarded.paused] == [
        ("alpha", MIDNIGHT), ("beta", MIDNIGHT)]
    assert guard.figures("alpha") == [{"scope": "daemon", "measure": "tokens", "used": 1050.0,
                                       "cap": 1000.0, "share": pytest.approx(1.05)}]


async def test_a_cost_cap_counts_the_model_cost() -> None:
    guarded = _Guarded(alpha=SpendCaps(max_cost_per_day=2.0))
    await guarded.guard.count("alpha", 10, 1.7)
    [alert] = guarded.alerts()
    assert alert.measure == "cost"
    assert alert.text == ("desk alpha's daily spend cap is 85% used: 1.7000 of 2.0000 in model "
                          "cost today (UTC)")
    await guarded.guard.count("alpha", 10, None)  # a request of unknown cost adds nothing
    assert guarded.alerts() == []
    await guarded.guard.count("alpha", 10, 0.4)
    assert [p[0] for p in guarded.paused] == ["alpha"]


async def test_a_guard_loaded_from_todays_usage_pauses_again() -> None:
    guarded = _Guarded(alpha=SpendCaps(max_tokens_per_day=1000),
                       daemon=SpendCaps(max_tokens_per_day=5000))
    used = {"alpha": (1200, None), "beta": (3000, None)}

    async def usage_today(desk: str) -> tuple[int, float | None]:
        return used[desk]

    await guarded.guard.load(usage_today)
    alerts = guarded.alerts()
    assert [a.desk for a in alerts] == ["alpha", "*"]
    assert [a.share for a in alerts] == pytest.approx([1.2, 0.84])
    assert [p[0] for p in guarded.paused] == ["alpha"]
    assert guarded.guard.figures("beta") == [{"scope": "daemon", "measure": "tokens",
                                              "used": 4200.0, "cap": 5000.0,
                                              "share": pytest.approx(0.84)}]


# --------------------------------------------------------------------------- the daemon


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_dir() as path:
        yield path


async def _ask(client: httpx.AsyncClient, desk: str, text: str) -> dict[str, Any]:
    """Sends an operator message and waits for the turn that reads it (``send --wait``)."""
    response = await client.post(f"/api/desks/{desk}/messages",
                                 json={"text": text, "source": "ann", "wait": True,
                                       "timeout": 10})
    assert response.status_code == 200, response.text
    return dict(response.json()["reply"])


async def _status(client: httpx.AsyncClient, desk: str) -> dict[str, Any]:
    return dict((await client.get(f"/api/desks/{desk}")).json())


async def _stored_tokens(client: httpx.AsyncClient, desk: str, tokens: int) -> None:
    """Waits until the store has counted the desk's usage (what a restart reads back)."""
    async def counted() -> bool:
        return int((await _status(client, desk))["tokens_today"]) >= tokens
    await wait_until(counted, f"{tokens} tokens of {desk} in the store")


def _capped(folder: Path, base_url: str, **caps: int) -> Path:
    desk = {key: value for key, value in caps.items() if key != "daemon"}
    daemon: dict[str, Any] = dict(FAST_RESTARTS)
    if "daemon" in caps:
        daemon["spend"] = {"max_tokens_per_day": caps["daemon"]}
    return write_daemon_config(folder, base_url, daemon=daemon,
                               desks={"alpha": {"controls": desk} if desk else {}, "beta": {}})


def _tomorrow() -> str:
    today = datetime.now(UTC).date()
    return datetime.fromtimestamp(datetime(today.year, today.month, today.day,
                                           tzinfo=UTC).timestamp() + 86_400,
                                  UTC).strftime("%Y-%m-%d 00:00 UTC")


async def test_a_desk_over_its_cap_pauses_until_midnight_and_a_restart_pauses_it_again(
        scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.add(Reply("One.", usage=(700, 150)), Reply("Two.", usage=(200, 50)))
    config = _capped(folder, scripted_server.base_url, max_tokens_per_day=1000)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "alpha", "First."))["ok"]
        alerts = await collect_events(client, params={"after": 0}, until=lambda es: any(
            e.type == "spend_alert" for e in es))
        [alert] = [e for e in alerts if e.type == "spend_alert"]
        assert alert.data["desk"] == "alpha" and alert.data["share"] == pytest.approx(0.85)
        assert (await _status(client, "alpha"))["state"] == "idle"

        assert (await _ask(client, "alpha", "Second."))["ok"]
        events = await collect_events(client, params={"after": 0}, until=lambda es: any(
            e.type == "desk_paused" for e in es))
        status = await _status(client, "alpha")
        await _stored_tokens(client, "alpha", 1100)
    [full] = [e for e in events if e.type == "spend_alert"][1:]
    assert full.data["text"].startswith("desk alpha's daily spend cap is used up: 1,100 of "
                                        "1,000 tokens today (UTC)")
    paused = next(e for e in events if e.type == "desk_paused")
    assert paused.data["by"] == "spend cap" and paused.data["reason"] == full.data["text"]
    assert datetime.fromtimestamp(paused.data["until"], UTC).strftime(
        "%Y-%m-%d %H:%M UTC") == _tomorrow()
    assert status["state"] == "paused"
    assert status["paused_reason"].startswith("paused by spend cap at ")
    assert status["paused_reason"].endswith(f"(until {_tomorrow()}, or until an operator "
                                            "resumes it)")
    assert status["spend"] == [{"scope": "desk", "measure": "tokens", "used": 1100.0,
                                "cap": 1000.0, "share": pytest.approx(1.1)}]
    assert (await _status_after_restart(config, "alpha"))["state"] == "paused"
    scripted_server.assert_complete()


async def _status_after_restart(config: Path, desk: str) -> dict[str, Any]:
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        return await _status(client, desk)


async def test_an_operators_resume_stands_for_the_day_even_across_a_restart(
        scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.add(Reply("One.", usage=(1000, 100)), Reply("Two.", usage=(900, 100)))
    config = _capped(folder, scripted_server.base_url, max_tokens_per_day=1000)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "alpha", "First."))["ok"]
        await wait_until(lambda: running.daemon.supervisor.desk("alpha").hold is not None,
                         "the cap's pause")
        response = await client.post("/api/desks/alpha/resume", json={"operator": "ann"})
        assert response.json()["changed"] is True
        assert (await _ask(client, "alpha", "Second."))["ok"]  # it runs, and is not paused
        await _stored_tokens(client, "alpha", 2100)
        status = await _status(client, "alpha")
        assert status["state"] == "idle" and status["paused_reason"] == ""
        assert status["spend"][0]["share"] == pytest.approx(2.1)
    status = await _status_after_restart(config, "alpha")
    assert status["state"] == "idle", status["paused_reason"]  # the person's word stands
    scripted_server.assert_complete()


async def test_a_pause_and_resume_earlier_in_the_day_leaves_the_cap_in_force(
        scripted_server: ScriptedServer, folder: Path) -> None:
    scripted_server.add(Reply("Over the cap.", usage=(1000, 100)))
    config = _capped(folder, scripted_server.base_url, max_tokens_per_day=1000)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        await client.post("/api/desks/alpha/pause", json={"operator": "ann", "reason": "lunch"})
        await client.post("/api/desks/alpha/resume", json={"operator": "ann"})
        assert (await _ask(client, "alpha", "Go."))["ok"]
        # The cap was never reached when ann resumed: it still pauses the desk.
        await wait_until(lambda: running.daemon.supervisor.desk("alpha").hold is not None,
                         "the cap to pause the desk", within=3)
        assert (await _status(client, "alpha"))["paused_reason"].startswith(
            "paused by spend cap")


async def test_the_daemons_cap_pauses_every_desk(scripted_server: ScriptedServer,
                                                 folder: Path) -> None:
    scripted_server.add(Reply("Costly.", usage=(900, 200)))
    config = _capped(folder, scripted_server.base_url, daemon=1000)
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        assert (await _ask(client, "alpha", "Go."))["ok"]
        events = await collect_events(client, params={"after": 0}, until=lambda es: sum(
            e.type == "desk_paused" for e in es) >= 2)
        statuses = {d["name"]: d for d in (await client.get("/api/desks")).json()["desks"]}
    [alert] = [e for e in events if e.type == "spend_alert"]
    assert alert.data["desk"] == "*" and alert.data["scope"] == "daemon"
    assert alert.data["text"].startswith("the daemon's daily spend cap is used up: 1,100 of "
                                         "1,000 tokens")
    assert sorted(e.data["desk"] for e in events if e.type == "desk_paused") == ["alpha", "beta"]
    for name in ("alpha", "beta"):
        assert statuses[name]["state"] == "paused"
        assert statuses[name]["spend"] == [{"scope": "daemon", "measure": "tokens",
                                            "used": 1100.0, "cap": 1000.0,
                                            "share": pytest.approx(1.1)}]
    scripted_server.assert_complete()
