"""``trading-agent reload``: the config file read again while the daemon runs.

A real daemon (store, desks, API on its Unix socket) against the scripted model server; the
config file is rewritten between requests as an operator would edit it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio

from tests.daemon_config import write_daemon_config
from tests.operator.harness import collect_events, in_process_daemon, uds_client
from tests.scripted_server import Reply, ScriptedServer


def _config(folder: Path, base_url: str, desks: dict[str, str], *,
            max_order: str = "10000") -> Path:
    """A daemon with one paper desk per name on the replay, each with its prompt."""
    return write_daemon_config(folder, base_url, desks={
        name: {"system_prompt": prompt, "tools": ["get_ticker"],
               "risk": {"max_order_notional": max_order}}
        for name, prompt in desks.items()})


def _system_prompt(server: ScriptedServer, index: int) -> str:
    first = server.requests[index].messages[0]
    assert first["role"] == "system"
    return str(first["content"])


async def test_a_reload_applies_prompts_limits_and_desks_from_the_next_turn(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("First answer."), Reply("Second answer."), Reply("Gamma here."))
    config = _config(state_dir, scripted_server.base_url,
                     {"alpha": "You are alpha.", "beta": "You are beta."})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        sent = await client.post("/api/desks/alpha/messages",
                                 json={"text": "Hello.", "wait": True})
        assert sent.json()["reply"]["text"] == "First answer."

        _config(state_dir, scripted_server.base_url,
                {"alpha": "You are alpha, more careful now.", "gamma": "You are gamma."},
                max_order="500")
        reloaded = await client.post("/api/reload", json={"operator": "alice"})
        desks = (await client.get("/api/desks")).json()["desks"]
        again = await client.post("/api/desks/alpha/messages",
                                  json={"text": "Hello again.", "wait": True})
        gamma = await client.post("/api/desks/gamma/messages",
                                  json={"text": "Hi gamma.", "wait": True})
        beta = await client.get("/api/desks/beta")
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: any(e.type == "config_reloaded"
                                                           for e in es))
        alpha = running.daemon.supervisor.desk("alpha")

    assert reloaded.status_code == 200
    changes = reloaded.json()["changes"]
    assert "desk beta removed: stopped at a safe point" in changes
    assert "desk alpha: risk, system_prompt changed; applies from its next turn" in changes
    assert "desk gamma added and started" in changes
    assert [d["name"] for d in desks] == ["alpha", "gamma"]
    assert beta.status_code == 404
    # The same conversation goes on, under the new prompt and limits.
    assert _system_prompt(scripted_server, 0) == "You are alpha."
    assert _system_prompt(scripted_server, 1) == "You are alpha, more careful now."
    assert [m["content"] for m in scripted_server.requests[1].messages
            if m["role"] == "assistant"] == ["First answer."]
    assert again.json()["reply"] == {"ok": True, "text": "Second answer.", "error": ""}
    assert gamma.json()["reply"]["text"] == "Gamma here."
    assert str(alpha.loop) and running.daemon.venues["alpha"].risk is not None
    assert running.daemon.venues["alpha"].risk.limits.max_order_notional == 500
    [event] = [e for e in events if e.type == "config_reloaded"]
    assert event.data["ok"] is True and event.data["desk"] == "*"


async def test_a_bad_config_changes_nothing_and_says_why(scripted_server: ScriptedServer,
                                                         state_dir: Path) -> None:
    scripted_server.add(Reply("Still alpha."))
    config = _config(state_dir, scripted_server.base_url, {"alpha": "You are alpha."})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        text = config.read_text()
        config.write_text(text.replace('symbols = ["BTC/USDT"]', 'symbols = "BTC/USDT"')
                          + "\n[desks.beta]\nsystem_prompt = \"x\"\n")
        refused = await client.post("/api/reload", json={})
        desks = (await client.get("/api/desks")).json()["desks"]
        answer = await client.post("/api/desks/alpha/messages",
                                   json={"text": "Still there?", "wait": True})
        events = await collect_events(client, params={"after": 0},
                                      until=lambda es: any(e.type == "config_reloaded"
                                                           for e in es))

    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "config_invalid"
    assert error["message"].startswith(f"nothing changed: {config}: ")
    assert "desks.alpha.symbols" in error["message"]
    assert [d["name"] for d in desks] == ["alpha"]
    assert answer.json()["reply"]["text"] == "Still alpha."
    assert _system_prompt(scripted_server, 0) == "You are alpha."
    [event] = [e for e in events if e.type == "config_reloaded"]
    assert event.data["ok"] is False and "desks.alpha.symbols" in event.data["changes"][0]


async def test_sighup_reloads_a_running_daemon_and_the_cli_reports_a_bad_config(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(Reply("Under the new prompt."))
    config = _config(state_dir, scripted_server.base_url, {"alpha": "You are alpha."})
    env = {**os.environ, "TRADING_AGENT_SOCKET": str(state_dir / "state" / "operator.sock")}
    command = [sys.executable, "-m", "trading_agent.cli", "run", "--config", str(config)]
    async with await anyio.open_process(command, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL) as daemon:
        try:
            socket = state_dir / "state" / "operator.sock"
            with anyio.fail_after(30):
                while not socket.exists():  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            async with uds_client(socket) as client:
                with anyio.fail_after(30):
                    while (await client.get("/api/health")).status_code != 200:  # noqa: ASYNC110
                        await anyio.sleep(0.05)
                _config(state_dir, scripted_server.base_url,
                        {"alpha": "You are alpha, reloaded."})
                daemon.send_signal(signal.SIGHUP)
                await collect_events(client, params={"after": 0},
                                     until=lambda es: any(e.type == "config_reloaded"
                                                          for e in es))
                answer = await client.post("/api/desks/alpha/messages",
                                           json={"text": "Hello.", "wait": True})
            config.write_text(config.read_text().replace("context_window = 32000",
                                                         "context_window = true"))
            cli = await anyio.run_process(
                [sys.executable, "-m", "trading_agent.cli", "reload"], env=env, check=False)
        finally:
            daemon.send_signal(signal.SIGTERM)
            with anyio.fail_after(15):
                await daemon.wait()

    assert answer.json()["reply"]["text"] == "Under the new prompt."
    assert _system_prompt(scripted_server, 0) == "You are alpha, reloaded."
    assert cli.returncode == 2
    assert b"the config was not reloaded; nothing changed:" in cli.stderr
    assert b"context_window" in cli.stderr
    assert daemon.returncode == 0


async def test_a_desk_a_reload_adds_on_a_replay_of_its_own_gets_it_running(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    config = _config(state_dir, scripted_server.base_url, {"alpha": "You are alpha."})
    async with in_process_daemon(config) as running, \
            uds_client(running.endpoints.socket_path) as client:
        config.write_text(config.read_text() + """
[desks.fast]
system_prompt = "You are fast."
symbols = ["BTC/USDT"]
tools = ["get_ticker"]

[desks.fast.exchange.replay]
speed = 6000
""")
        reloaded = await client.post("/api/reload", json={})
        feed = running.daemon.venues["fast"].feed
        started = feed.now()
        with anyio.fail_after(10):
            while feed.now() == started:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        services = [name for name, _ in running.daemon.supervisor.services]

    assert "desk fast added and started" in reloaded.json()["changes"]
    assert feed is not running.daemon.venues["alpha"].feed
    assert "replay (BTC/USDT)" in services
