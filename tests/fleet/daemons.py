"""A fleet of real daemons for the tests and the bench: one config (the store on a
PostgreSQL database of the test's own, NATS on the machine's server), each daemon
``trading-agent run`` in a process of its own with its own state directory (its operator
socket) and daemon id; and the careful scripted trader's books read back from PostgreSQL and
audited as after a ``kill -9``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import psycopg

from tests.daemon.careful_trading import audit, text_of
from tests.daemon.process import DaemonProcess
from tests.daemon_config import write_daemon_config
from tests.fleet.books import read_fleet_books
from tests.scripted_server import RecordedRequest

DESKS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot")

LEASE_SECONDS = 3.0
"""Short leases, so the take-over is quick to test; the bound the issue sets is 30 s."""

FLEET_KEY_ENV = "TEST_FLEET_KEY"
FLEET_KEY = b"test fleet key, 32 bytes or more!"
"""The fleet's shared key, which each daemon of a test's fleet reads from its environment."""

def fleet_config(folder: Path, base_url: str, store_url: str, nats_prefix: str,
                 desks: Sequence[str] = DESKS, *, lease_seconds: float = LEASE_SECONDS,
                 operator: Mapping[str, Any] | None = None,
                 context_window: int = 200_000, tools: Sequence[str] | None = None) -> Path:
    """One config every daemon of the fleet reads: paper desks on a replay, the scripted
    model, the store on ``store_url``, NATS on the machine's server; each daemon's state
    directory comes from its environment (``$STATE_DIRECTORY``); ``tools`` narrows what
    each desk may call (a small window holds only a few tool definitions)."""
    roomy: dict[str, Any] = {"risk": {"max_open_orders": 1000, "max_orders_per_hour": 100000}}
    if tools is not None:
        roomy["tools"] = list(tools)
    return write_daemon_config(
        folder, base_url, file_name="fleet.toml",
        daemon={"state_dir": None, "log_format": "json", "shutdown_timeout_seconds": 5,
                "restart_backoff_seconds": 0.1},
        model={"context_window": context_window, "max_output_tokens": 64,
               "request_timeout": 30},
        tables={"store": {"url": store_url},
                "fleet": {"nats_url": "nats://127.0.0.1:4222", "nats_prefix": nats_prefix,
                          "lease_seconds": lease_seconds, "key_env": FLEET_KEY_ENV,
                          # The machine's NATS asks no sign-in; the key guards the desks.
                          "trusted_network": True}},
        exchange={"replay": {"speed": 60}}, operator=operator,
        desks={name: roomy for name in desks})


class Fleet:
    """The daemons of one fleet, started and stopped by the test."""

    def __init__(self, folder: Path, config: Path, store_url: str,
                 desks: Sequence[str] = DESKS) -> None:
        self.folder = folder
        self.config = config
        self.store_url = store_url
        self.desks = list(desks)
        self.daemons: dict[str, DaemonProcess] = {}
        self.sent: dict[str, list[str]] = {desk: [] for desk in self.desks}

    def start(self, daemon_id: str) -> DaemonProcess:
        daemon = DaemonProcess(self.config, {
            "STATE_DIRECTORY": str(self.folder / daemon_id),
            "TRADING_AGENT_FLEET__DAEMON_ID": daemon_id, FLEET_KEY_ENV: FLEET_KEY.decode()})
        self.daemons[daemon_id] = daemon
        return daemon

    async def holders(self, via: str) -> dict[str, str]:
        """Each desk's daemon, as daemon ``via``'s API shows it: "" for none, and for a desk
        whose lease is taken but which does not run yet (its status says stopped)."""
        async with self.daemons[via].client() as client:
            return {desk["name"]: desk.get("daemon", "") if desk["state"] != "stopped" else ""
                    for desk in await client.desks()}

    async def wait_held(self, via: str, by: Sequence[str], within: float) -> dict[str, str]:
        """Waits until every desk is held by one of ``by``, spread evenly among them."""
        share = -(-len(self.desks) // len(by))
        holders: dict[str, str] = {}
        try:
            with anyio.fail_after(within):
                while True:
                    holders = await self.holders(via)
                    counts = [list(holders.values()).count(daemon) for daemon in by]
                    if set(holders.values()) <= set(by) and max(counts) <= share \
                            and sum(counts) == len(self.desks):
                        return holders
                    await anyio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(f"the desks were not spread over {list(by)} within {within} "
                                 f"s: {holders}\n{self.logs()}") from None

    async def send_turn(self, via: str, turn: int) -> None:
        """``Turn N`` to every desk, all through daemon ``via``."""
        async with self.daemons[via].client() as client:
            for desk in self.desks:
                reply = await client.send_message(desk, f"Turn {turn}: trade as planned.",
                                                  "ann")
                self.sent[desk].append(reply["id"])

    async def wait_answered(self, turn: int, within: float = 60) -> None:
        """Waits until every desk's transcript ends with its answer to ``turn``."""
        answer = f"Turn {turn} done."
        waiting = list(self.desks)
        try:
            with anyio.fail_after(within):
                while waiting:
                    waiting = [desk for desk in waiting if not ends_with(
                        read_fleet_books(self.store_url, desk).messages, answer)]
                    await anyio.sleep(0.2)
        except TimeoutError:
            raise AssertionError(f"{waiting} did not answer turn {turn} within {within} s\n"
                                 f"{self.logs()}") from None

    def audit(self) -> dict[str, list[str]]:
        """Each desk's findings (none is the goal)."""
        found = {desk: sorted(audit(read_fleet_books(self.store_url, desk), self.sent[desk]))
                 for desk in self.desks}
        return {desk: problems for desk, problems in found.items() if problems}

    def sessions(self) -> list[tuple[object, ...]]:
        """The store's sessions now (who waits on what), for a failure's report."""
        with psycopg.connect(self.store_url) as connection:
            return connection.execute(
                "SELECT pid, application_name, state, wait_event_type, wait_event, "
                "pg_blocking_pids(pid), now() - xact_start, left(query, 120) "
                "FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()

    def logs(self, tail: int = 2500) -> str:
        return "\n".join(f"--- {name}:\n{daemon.log()[-tail:]}"
                         for name, daemon in self.daemons.items())

    def close(self) -> None:
        for daemon in self.daemons.values():
            daemon.close()


def ends_with(messages: Sequence[tuple[str, str, str, list[dict[str, Any]]]],
               answer: str) -> bool:
    return bool(messages) and messages[-1][1] == "assistant" \
        and text_of(messages[-1][3]) == answer


def desk_of(request: RecordedRequest) -> str:
    """The desk a model request came from (its system prompt names it)."""
    system = str(request.messages[0]["content"])
    return system.removeprefix("You are the trading desk ").partition(".")[0]
