"""``trading-agent desks`` in a fleet: a DAEMON column naming the daemon that holds each desk,
and none outside a fleet. The real CLI in a process of its own, against the real operator API
of a test daemon whose desk statuses name their daemon as a fleet's do."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import anyio

from tests.operator.harness import LoopDeskControl, build_control, running_api, uds_client
from tests.scripted_server import ScriptedServer
from trading_agent.daemon.control import DeskStatus
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig

CLI = [sys.executable, "-m", "trading_agent.cli"]


class FleetDesks(LoopDeskControl):
    """The test daemon as a daemon of a fleet shows every desk: each status names the daemon
    holding the desk, empty for one no daemon holds at the moment (as ``FleetControl``'s).

    Args:
        control: The test daemon's desks.
        holders: The daemon holding each desk.
    """

    def __init__(self, control: LoopDeskControl, holders: Mapping[str, str]) -> None:
        super().__init__(control.event_bus, list(control.desks.values()))
        self.holders = dict(holders)

    async def desk_status(self, desk: str) -> DeskStatus:
        status = await super().desk_status(desk)
        return status.model_copy(update={"daemon": self.holders.get(desk, "")})


async def _desks(socket: Path) -> list[str]:
    """Runs ``trading-agent desks --socket SOCKET``; the lines it printed."""
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TRADING_AGENT_SOCKET", "STATE_DIRECTORY")}
    environment["NO_COLOR"] = "1"
    with anyio.fail_after(20):
        result = await anyio.run_process([*CLI, "desks", "--socket", str(socket)],
                                         check=False, env=environment)
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().splitlines()


async def test_desks_shows_which_daemon_holds_each_desk_only_in_a_fleet(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    control, _ = build_control(scripted_server.base_url, ["alpha", "beta", "gamma"])
    # gamma is moving: its daemon died and no other has taken it yet.
    fleet = FleetDesks(control, {"alpha": "host-a", "beta": "host-b.example-17", "gamma": ""})
    async with running_api(fleet, ApprovalBook(), OperatorConfig(),
                           state_dir) as (endpoints, _):
        socket = endpoints.socket_path
        header, *rows = await _desks(socket)
        assert header.split()[:5] == ["DESK", "DAEMON", "STATE", "MODE", "MODEL"]
        column = header.index("DAEMON")
        by_desk = {row.split()[0]: row for row in rows[:3]}
        assert {desk: row[column:].split()[0] for desk, row in by_desk.items()} == {
            "alpha": "host-a", "beta": "host-b.example-17", "gamma": "-"}
        assert by_desk["alpha"].split()[2:4] == ["idle", "paper"]
        async with uds_client(socket) as client:  # the API's own field
            statuses = (await client.get("/api/desks")).json()["desks"]
        assert [(d["name"], d["daemon"]) for d in statuses] == [
            ("alpha", "host-a"), ("beta", "host-b.example-17"), ("gamma", "")]

        fleet.holders.clear()  # one daemon: no desk names a daemon
        header, *rows = await _desks(socket)
        assert "DAEMON" not in header
        assert header.split()[:4] == ["DESK", "STATE", "MODE", "MODEL"]
        assert [row.split()[:3] for row in rows[:3]] == [
            ["alpha", "idle", "paper"], ["beta", "idle", "paper"], ["gamma", "idle", "paper"]]
