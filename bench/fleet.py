"""The fleet's figures (issue 17): how fast a dead daemon's desks move, and what a second
daemon adds to the turns per second.

The daemons are real ``trading-agent run`` processes sharing one config (a PostgreSQL store
and NATS), started by the fleet tests' harness (``tests/fleet/daemons.py``). Each part runs
on a database of its own (dropped after) and a NATS prefix of its own (its streams deleted
after).

**Take-over** (``--kills``, ``--stops``): three daemons share six desks, leases of
``--lease`` seconds. Every desk is given a turn of orders by the careful scripted trader of
the kill tests (five model calls, each reply held 0.1 s: buy at market, rest a limit buy,
cancel it, sell, answer). While the turns run, the oldest daemon is killed with SIGKILL once
its first desk has sent its 2nd, 3rd or 4th request of the turn (drawn), plus a drawn 0 to
150 ms; timed: from the signal until a survivor's API (``desks``, each status naming its
``daemon``) shows every desk held by the survivors. Polls start every 0.1 s without waiting
for the one before, because a poll waits up to 2 s for a dead daemon's desks. Then a
replacement daemon starts and the desks spread over three again, and the cut-off turns end.
The same with SIGTERM: a graceful stop hands the desks over at once instead of waiting for
the leases to run out. At the end every desk's books are audited as after a ``kill -9``
(``tests.daemon.careful_trading.audit``: no message lost or twice, every call answered, the
ledger equal to the transcript, no client order id twice).

Bars (the issue): a killed daemon's desks taken over within 30 s; a graceful stop's within
the lease (at once, not after it). The take-over's reference is the lease itself: the ratio
says what a take-over costs beyond waiting for it to run out.

**Turns per second** (``--desks``, ``--rounds``): the desks on a fleet of one daemon (the
reference) and on a fleet of two, both up at once, each on a database and a NATS prefix of
its own. A round gives every desk of one fleet a turn at once and is timed until every desk
has answered; after a warm-up round each, the two fleets' rounds alternate (ABBA), so a load
that drifts on the shared machine weighs on both alike, while the other fleet idles. Each
desk's message goes to the daemon that holds it and waits there for the turn's end
(``send_and_wait``), so what is timed is the desks' work and not a hop through NATS. A turn
is one ``get_ticker`` call and an answer: two model calls, each answered after
``--model-delay`` by the scripted server in a process of its own (as in
``bench/desks_scale.py``). Figures: the median over the rounds of desks / round time for
each fleet, and the ratio of two daemons to one; then, on the fleet of one, the time of one
desk's turn alone (the least a round can take). Beside them, the CPU each part of the
machine spent per turn over the timed rounds (read from ``/proc``): the timed fleet's
daemons, the idle fleet's, the PostgreSQL backends of the timed fleet's database, the NATS
server (shared with anything else that uses it), the model server and this driver; how many
cores were busy, and how many of them with other processes (the machine is shared). On two
cores the ratio cannot reach 2: PostgreSQL, NATS, the model server and the driver run on the
same cores as the daemons.

Run: ``.venv/bin/python bench/fleet.py [--kills 6] [--stops 3] [--lease 3] [--desks 12]
[--rounds 5] [--model-delay 0.02]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import nats
import psycopg
import pytest

from trading_agent.operator.client import OperatorClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' harness

from tests.daemon.careful_trading import CarefulTrader
from tests.daemon.process import short_dir
from tests.fleet.daemons import DESKS, Fleet, desk_of, fleet_config
from tests.postgres import fresh_database
from tests.scripted_server import RecordedRequest, Reply, Responder, ScriptedServer, ToolCall

ROOT = Path(__file__).resolve().parents[1]
NATS_URL = "nats://127.0.0.1:4222"
TAKE_OVER_BAR = 30.0
"""Seconds within which a killed daemon's desks are taken over (the issue)."""
HOLD = 0.1
"""Seconds the careful trader holds each reply in the take-over part."""
_POLL = 0.1
"""Seconds between the starts of two polls of a daemon's ``desks``."""
_SETTLE = 60.0
"""Seconds a fleet has to start, spread its desks or end its turns before the bench fails."""


# --------------------------------------------------------------------------- the machine


def machine() -> str:
    """The platform, CPU count and model, Python, and the load average."""
    model = "unknown CPU"
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    return (f"machine: {platform.platform()}, {os.cpu_count()} CPUs ({model}), "
            f"Python {platform.python_version()}; load average {load}")


def services() -> str:
    """PostgreSQL's and NATS' versions.

    Raises:
        RuntimeError: One is absent (the message names it).
    """
    try:
        with fresh_database() as target, psycopg.connect(target.url) as connection:
            postgres = connection.info.parameter_status("server_version")
    except pytest.skip.Exception as exc:
        raise RuntimeError(exc.msg) from None
    try:
        with socket.create_connection(("127.0.0.1", 4222), timeout=2) as connection:
            info = connection.recv(4096).decode(errors="replace")  # the server's INFO line
    except OSError:
        raise RuntimeError("NATS is not running on 127.0.0.1:4222") from None
    found = re.search(r'"version":"([^"]+)"', info)
    return (f"PostgreSQL {postgres} on 127.0.0.1:5432, NATS "
            f"{found.group(1) if found else '(version unknown)'} with JetStream on "
            "127.0.0.1:4222")


@asynccontextmanager
async def nats_prefix() -> AsyncIterator[str]:
    """A prefix of NATS subjects and streams of the bench's own; the streams whose names
    start with it are deleted at the end (as ``tests/fleet/conftest.py`` does)."""
    prefix = f"b{uuid.uuid4().hex[:16]}"
    try:
        yield prefix
    finally:
        with anyio.CancelScope(shield=True), anyio.fail_after(10):
            client = await nats.connect(NATS_URL, allow_reconnect=False)
            try:
                stream = client.jetstream()
                for info in await stream.streams_info():
                    name = info.config.name
                    if name is not None and name.startswith(f"{prefix}_"):
                        await stream.delete_stream(name)
            finally:
                await client.close()


# --------------------------------------------------------------------------- take-over


@dataclass
class Disruption:
    """One daemon stopped while its desks were in turns, and what followed."""

    daemon: str
    desks: list[str]
    at_request: int
    """The request of its first desk's turn after which it was stopped."""
    after_request: float
    """Seconds after that request's arrival."""
    seconds: float
    """From the signal until the survivors held every desk, as the API shows."""
    settled: float
    """From the replacement's start until the desks were spread over three daemons again."""
    exit_code: int | None = None


async def until_held(fleet: Fleet, via: str, by: Sequence[str], since: float) -> float:
    """Seconds from ``since`` until daemon ``via``'s API shows every desk held by one of
    ``by``. A poll starts every 0.1 s whatever the ones before are waiting for (a desk of a
    dead daemon whose lease still runs makes its poll wait 2 s for an answer)."""
    seen: list[float] = []
    done = anyio.Event()

    async def poll() -> None:
        holders = await fleet.holders(via)
        if all(holders.get(desk) in by for desk in fleet.desks) and not seen:
            seen.append(time.monotonic())
            done.set()

    # The polls still out are let finish: anyio logs an InvalidStateError when a task is
    # cancelled while its connect to a Unix socket waits.
    with anyio.fail_after(_SETTLE):
        async with anyio.create_task_group() as group:
            while not done.is_set():
                group.start_soon(poll)
                with anyio.move_on_after(_POLL):
                    await done.wait()
    return seen[0] - since


async def stop_mid_turn(fleet: Fleet, server: ScriptedServer, alive: list[str], turn: int,
                        how: signal.Signals, replacement: str,
                        draw: random.Random) -> Disruption:
    """Gives every desk turn ``turn``, stops the oldest daemon in the middle of its desks'
    turns, times the take-over, starts ``replacement`` and waits until the desks are spread
    and every turn has ended."""
    victim, survivors = alive[0], alive[1:]
    via = survivors[0]
    its_desks = sorted(desk for desk, daemon in (await fleet.holders(via)).items()
                       if daemon == victim)
    at_request, after_request = draw.randint(2, 4), draw.uniform(0, HOLD + 0.05)
    base = len(server.requests)
    await fleet.send_turn(via, turn)
    with anyio.fail_after(_SETTLE):
        while sum(desk_of(request) == its_desks[0]  # noqa: ASYNC110 (another process)
                  for request in server.requests[base:]) < at_request:
            await anyio.sleep(0.002)
    await anyio.sleep(after_request)
    stopped_at = time.monotonic()
    if how == signal.SIGKILL:
        fleet.daemons[victim].kill()
    else:
        fleet.daemons[victim].signal(how)
    seconds = await until_held(fleet, via, survivors, stopped_at)
    exit_code = None if how == signal.SIGKILL else await fleet.daemons[victim].wait_exit(15)
    started_at = time.monotonic()
    fleet.start(replacement)
    await fleet.daemons[replacement].wait_ready(within=_SETTLE)
    alive[:] = [*survivors, replacement]
    await fleet.wait_held(via, alive, within=_SETTLE)
    settled = time.monotonic() - started_at
    await fleet.wait_answered(turn, within=_SETTLE)
    return Disruption(victim, its_desks, at_request, after_request, seconds, settled,
                      exit_code)


@dataclass
class TakeOvers:
    """The take-over part's results."""

    killed: list[Disruption]
    stopped: list[Disruption]
    findings: dict[str, list[str]]
    """The audit's, by desk."""
    turns: int
    """Turns given to each desk."""


async def take_overs(kills: int, stops: int, lease: float) -> TakeOvers:
    """Three daemons, six desks: ``kills`` SIGKILLs then ``stops`` SIGTERMs, each in the
    middle of turns of orders, then the audit of the books."""
    server = ScriptedServer(responder=CarefulTrader(hold=HOLD)).start()
    draw = random.Random(17)
    names = (f"d{number}" for number in itertools.count(1))
    try:
        with fresh_database() as target, short_dir() as folder:
            async with nats_prefix() as prefix:
                fleet = Fleet(folder, fleet_config(folder, server.base_url, target.url, prefix,
                                                   DESKS, lease_seconds=lease), target.url)
                try:
                    alive = [next(names) for _ in range(3)]
                    for daemon in alive:
                        fleet.start(daemon)
                    for daemon in alive:
                        await fleet.daemons[daemon].wait_ready(within=_SETTLE)
                    await fleet.wait_held(alive[0], alive, within=_SETTLE)
                    await fleet.send_turn(alive[0], 1)  # warm-up: every desk's first turn
                    await fleet.wait_answered(1, within=_SETTLE)
                    killed: list[Disruption] = []
                    stopped: list[Disruption] = []
                    for number in range(kills + stops):
                        how = signal.SIGKILL if number < kills else signal.SIGTERM
                        done = await stop_mid_turn(fleet, server, alive, number + 2, how,
                                                   next(names), draw)
                        (killed if how == signal.SIGKILL else stopped).append(done)
                        print(f"  {describe(done, how)}", flush=True)
                    return TakeOvers(killed, stopped, fleet.audit(), kills + stops + 1)
                finally:
                    fleet.close()
    finally:
        server.stop()


def describe(done: Disruption, how: signal.Signals) -> str:
    exited = "" if done.exit_code is None else f", exit code {done.exit_code}"
    return (f"{how.name} {done.daemon} at request {done.at_request} of {done.desks[0]}'s turn "
            f"+{done.after_request * 1000:.0f} ms{exited}: its {len(done.desks)} desks held by "
            f"the others after {done.seconds:.2f} s; replacement up and desks spread after "
            f"{done.settled:.1f} s")


def spread(seconds: Sequence[float]) -> str:
    return (f"min {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s, "
            f"max {max(seconds):.2f} s")


def report_take_overs(results: TakeOvers, lease: float) -> None:
    """The take-over and hand-over times against their bars, and the audit."""
    kills = [done.seconds for done in results.killed]
    print(f"take-over after SIGKILL, {len(kills)} kills: {spread(kills)}; median "
          f"{statistics.median(kills) / lease:.2f}x the lease of {lease:g} s (bar: within "
          f"{TAKE_OVER_BAR:g} s) -> {'PASS' if max(kills) <= TAKE_OVER_BAR else 'FAIL'}")
    if results.stopped:
        stops = [done.seconds for done in results.stopped]
        codes = [done.exit_code for done in results.stopped]
        print(f"hand-over on SIGTERM, {len(stops)} stops: {spread(stops)} (bar: within the "
              f"lease, {lease:g} s) -> {'PASS' if max(stops) < lease else 'FAIL'}; exit codes "
              f"{'all 0' if set(codes) == {0} else codes}")
    count = sum(len(problems) for problems in results.findings.values())
    print(f"audit of the {len(DESKS)} desks' books after {results.turns} turns each: "
          f"{count} findings")
    for desk, problems in results.findings.items():
        for problem in problems:
            print(f"  {desk}: {problem}")


# --------------------------------------------------------------------------- throughput

_TURN = re.compile(r"^Turn (\d+):", re.MULTILINE)


def ticker_then_answer(delay: float) -> Responder:
    """The throughput part's model: each ``Turn N: ...`` message opens a turn of one
    ``get_ticker`` call, then the answer ``Turn N done.``; every reply after ``delay`` s."""

    def respond(request: RecordedRequest) -> Reply:
        messages = request.messages
        for index in range(len(messages) - 1, -1, -1):
            content = messages[index].get("content") or ""
            text = content if isinstance(content, str) else " ".join(
                part.get("text", "") for part in content)
            opening = _TURN.search(text) if messages[index]["role"] == "user" else None
            if opening is not None:
                break
        else:
            return Reply("Noted.", delay=delay)
        if any(message["role"] == "tool" for message in messages[index:]):
            return Reply(f"Turn {opening.group(1)} done.", delay=delay)
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})], delay=delay)

    return respond


_SERVER = """
import sys
sys.path[:0] = [{root!r}, {bench!r}]
from fleet import ticker_then_answer
from tests.scripted_server import ScriptedServer
server = ScriptedServer(responder=ticker_then_answer({delay}))
server.start()
print(server.base_url, flush=True)
sys.stdin.read()
server.stop()
"""


@contextmanager
def model_server(delay: float) -> Iterator[tuple[str, int]]:
    """The scripted server in a process of its own, answering :func:`ticker_then_answer`;
    yields its base URL and its process id."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(root=str(ROOT), bench=str(ROOT / "bench"),
                                              delay=delay)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    try:
        yield server.stdout.readline().strip(), server.pid
    finally:
        server.stdin.close()
        server.wait(10)


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(pid: int | str) -> float:
    """CPU seconds (user and system) a process has used; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def _processes(command: str, holding: str = "") -> list[str]:
    """The ids of the processes named ``command`` whose command line holds ``holding``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/cmdline", "rb") as line:
                if comm.read().strip() == command and holding.encode() in line.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _machine_busy() -> tuple[float, float]:
    """The machine's busy and total CPU seconds since boot, over every core."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle and iowait
    return (sum(ticks) - idle) / _TICK, sum(ticks) / _TICK


@dataclass
class CpuSnapshot:
    """CPU seconds used so far by each part of the machine the bench looks at."""

    parts: dict[str, float]
    busy: float
    total: float

    @classmethod
    def take(cls, timed: FleetRounds, idle: FleetRounds, model: int) -> CpuSnapshot:
        busy, total = _machine_busy()
        return cls({
            "daemons": sum(_cpu_of(pid) for pid in timed.pids),
            "idle fleet": sum(_cpu_of(pid) for pid in idle.pids),
            "PostgreSQL": sum(_cpu_of(pid) for pid in _processes("postgres", timed.database)),
            "NATS": sum(_cpu_of(pid) for pid in _processes("nats-server")),
            "model": _cpu_of(model),
            "driver": _cpu_of("self"),
        }, busy, total)


@dataclass
class Throughput:
    """One fleet's timed rounds."""

    daemons: int
    desks: int
    round_seconds: list[float]
    cpu_per_turn: dict[str, float]
    busy_cores: float
    """How many of the machine's cores were busy, on average over the timed rounds."""
    other_cores: float
    """How many of them were busy with what the bench does not look at (other processes)."""
    findings: dict[str, list[str]]
    alone: list[float] | None = None
    """The times of turns of one desk alone (the fleet of one daemon only)."""

    @property
    def turns_per_second(self) -> float:
        return self.desks / statistics.median(self.round_seconds)


class FleetRounds:
    """A fleet of the throughput part, its desks spread, and its rounds so far.

    Args:
        fleet: The fleet, its daemons up.
        holders: Each desk's daemon.
        clients: An API client for each daemon.
        database: The name of the fleet's database.
    """

    def __init__(self, fleet: Fleet, holders: dict[str, str],
                 clients: dict[str, OperatorClient], database: str) -> None:
        self.fleet = fleet
        self.holders = holders
        self.clients = clients
        self.database = database
        self.pids = [daemon.process.pid for daemon in fleet.daemons.values()]
        self.round_seconds: list[float] = []
        self.cpu: dict[str, float] = {}
        self.busy = self.total = 0.0

    async def one_round(self, turn: int, desks: Sequence[str] | None = None) -> float:
        """Gives every desk (or ``desks``) turn ``turn`` at once; returns the seconds until
        all answered."""

        async def ask(desk: str) -> None:
            answer = await self.clients[self.holders[desk]].send_and_wait(
                desk, f"Turn {turn}: trade as planned.", "ann", wait_seconds=_SETTLE)
            self.fleet.sent[desk].append(answer["id"])
            reply = answer.get("reply") or {}
            if reply.get("text") != f"Turn {turn} done.":
                raise RuntimeError(f"{desk} answered turn {turn} with {reply}")

        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for desk in self.fleet.desks if desks is None else desks:
                group.start_soon(ask, desk)
        return time.perf_counter() - started

    def record(self, seconds: float, before: CpuSnapshot, after: CpuSnapshot) -> None:
        """Keeps a timed round's time and what the CPU did meanwhile."""
        self.round_seconds.append(seconds)
        for part, used in after.parts.items():
            self.cpu[part] = self.cpu.get(part, 0.0) + used - before.parts[part]
        self.busy += after.busy - before.busy
        self.total += after.total - before.total

    def figures(self) -> Throughput:
        turns = len(self.fleet.desks) * len(self.round_seconds)
        cores = os.cpu_count() or 1
        return Throughput(len(self.pids), len(self.fleet.desks), self.round_seconds,
                          {part: used / turns for part, used in self.cpu.items()},
                          self.busy / self.total * cores,
                          (self.busy - sum(self.cpu.values())) / self.total * cores,
                          self.fleet.audit())


@asynccontextmanager
async def fleet_of(count: int, desks: list[str], lease: float,
                   base_url: str) -> AsyncIterator[FleetRounds]:
    """``count`` daemons on a database and a NATS prefix of their own, running ``desks``;
    yields once the desks are spread over them."""
    async with AsyncExitStack() as stack:
        target = stack.enter_context(fresh_database())
        folder = stack.enter_context(short_dir())
        prefix = await stack.enter_async_context(nats_prefix())
        fleet = Fleet(folder, fleet_config(folder, base_url, target.url, prefix, desks,
                                           lease_seconds=lease), target.url, desks)
        stack.callback(fleet.close)
        names = [f"t{number}" for number in range(1, count + 1)]
        for name in names:
            fleet.start(name)
        for name in names:
            await fleet.daemons[name].wait_ready(within=_SETTLE)
        holders = await fleet.wait_held(names[0], names, within=_SETTLE)
        clients = {name: await stack.enter_async_context(fleet.daemons[name].client())
                   for name in names}
        await _wait_served(holders, clients)
        yield FleetRounds(fleet, holders, clients, target.url.rpartition("/")[2])


async def _wait_served(holders: dict[str, str], clients: dict[str, OperatorClient]) -> None:
    """Waits until each desk runs on its holder. A status can name a desk's holder from the
    lease alone, before that daemon has started the desk (then it says ``stopped``), and a
    message sent to the holder meanwhile cannot wait there for its answer."""
    with anyio.fail_after(_SETTLE):
        for desk, holder in holders.items():
            while True:
                status = await clients[holder].desk(desk)
                if status.get("daemon") == holder and status.get("state") != "stopped":
                    break
                await anyio.sleep(0.1)


async def throughputs(desks: list[str], rounds: int, lease: float, base_url: str,
                      model_pid: int) -> list[Throughput]:
    """A fleet of one daemon and one of two, both up; after a warm-up round each, their
    timed rounds alternate (ABBA), so a load that drifts on the shared machine weighs on
    both alike. The fleet not being timed idles meanwhile (its leases renewed)."""
    async with fleet_of(1, desks, lease, base_url) as one, \
            fleet_of(2, desks, lease, base_url) as two:
        await one.one_round(1)
        await two.one_round(1)
        for number in range(rounds):
            order = [(one, two), (two, one)] if number % 2 == 0 else [(two, one), (one, two)]
            for timed, idle in order:
                before = CpuSnapshot.take(timed, idle, model_pid)
                seconds = await timed.one_round(number + 2)
                timed.record(seconds, before, CpuSnapshot.take(timed, idle, model_pid))
        # The least a round can take: one desk's turn with nothing else to do.
        alone = [await one.one_round(turn, desks[:1])
                 for turn in range(rounds + 2, 2 * rounds + 2)]
        return [dataclasses.replace(one.figures(), alone=alone), two.figures()]


def report_throughput(results: list[Throughput], delay: float) -> None:
    """The turns per second of each fleet, their ratio, and where the CPU went."""
    print(f"{'daemons':>7} {'turns/s':>8} {'round median':>13} {'min':>8} {'max':>8}")
    for result in results:
        rounds = result.round_seconds
        print(f"{result.daemons:>7} {result.turns_per_second:>8.1f} "
              f"{statistics.median(rounds):>11.3f} s {min(rounds):>6.3f} s "
              f"{max(rounds):>6.3f} s")
    one, two = results
    print(f"2 daemons / 1 daemon: {two.turns_per_second / one.turns_per_second:.2f}x "
          f"(the bound the model alone sets: {one.desks / (2 * delay):.0f} turns/s)")
    if one.alone:
        print(f"one desk's turn alone, on 1 daemon: median {statistics.median(one.alone):.3f} "
              f"s over {len(one.alone)} turns (the least a round can take; the model's share "
              f"{2 * delay:.3f} s)")
    parts = list(one.cpu_per_turn)
    print("CPU ms per turn over the timed rounds (from /proc); the machine's busy cores, and "
          "of them those busy with other processes:")
    print(f"{'daemons':>7} " + " ".join(f"{part:>10}" for part in parts)
          + f" {'busy':>9} {'others':>7}")
    for result in results:
        print(f"{result.daemons:>7} "
              + " ".join(f"{result.cpu_per_turn[part] * 1000:>10.1f}" for part in parts)
              + f" {result.busy_cores:>4.2f} of {os.cpu_count()} {result.other_cores:>7.2f}")
    print(f"notes: {os.cpu_count()} cores are shared by the daemons, PostgreSQL, NATS, the "
          "model server and this driver (and the fleet not being timed, idle); a second "
          "daemon can only use what they leave. PostgreSQL counts the backends of the timed "
          "fleet's database only; NATS and 'busy' count whatever else ran on the machine.")
    for result in results:
        for desk, problems in result.findings.items():
            print(f"audit finding, {result.daemons} daemon(s), {desk}: {problems}")
    findings = sum(len(problems) for result in results for problems in result.findings.values())
    print(f"audit of both fleets' books: {findings} findings")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=6, help="SIGKILLs (at least 5)")
    parser.add_argument("--stops", type=int, default=3, help="graceful stops (SIGTERM)")
    parser.add_argument("--lease", type=float, default=3.0, help="lease_seconds of the fleet")
    parser.add_argument("--desks", type=int, default=12, help="desks of the throughput part")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per fleet")
    parser.add_argument("--model-delay", type=float, default=0.02,
                        help="seconds the throughput part's model server waits per reply")
    args = parser.parse_args()
    if args.kills < 5:
        parser.error("--kills must be at least 5 (the issue's minimum)")
    began = time.monotonic()
    print(machine(), flush=True)
    try:
        print(services(), flush=True)
    except RuntimeError as exc:
        print(f"skipped: {exc}")
        return

    print(f"\ntake-over: 3 daemons, {len(DESKS)} desks, lease {args.lease:g} s; every desk in "
          f"a turn of orders (the careful trader, each reply held {HOLD:g} s) when the oldest "
          "daemon is stopped; a replacement joins after each", flush=True)
    report_take_overs(anyio.run(take_overs, args.kills, args.stops, args.lease), args.lease)

    names = [f"desk{number:02d}" for number in range(1, args.desks + 1)]
    print(f"\nturns per second: {args.desks} desks on a fleet of 1 daemon (the reference) and "
          f"one of 2, their rounds alternating; a turn is get_ticker and an answer (2 model "
          f"calls, each answered after {args.model_delay * 1000:.0f} ms by the scripted server "
          f"in its own process); median of {args.rounds} rounds each after a warm-up",
          flush=True)
    with model_server(args.model_delay) as (base_url, model_pid):
        results = anyio.run(throughputs, names, args.rounds, args.lease, base_url, model_pid)
    report_throughput(results, args.model_delay)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"\nload average at the end {load}; the whole run took "
          f"{time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
