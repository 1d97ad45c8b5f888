"""How the daemon scales with desks: memory per desk, turns per second, trigger latency.

N desks (10, 100, 500 and 1,000 by default) are built as the daemon builds them (an
AgentLoop with an OpenAI-compatible backend, a mailbox, a context compressor, a Desk
restored from a real SQLite store whose event recorder runs) and started idle under a
Supervisor. Then every desk is triggered at once, a few rounds, against the scripted
OpenAI-compatible server answering each request after 50 ms; the server runs in a process of
its own so it takes no time from the desks' event loop.

Printed per N:

- memory per desk: what Python allocated (tracemalloc) from before the desks were built to
  when all were idle, divided by N; and the growth of the process's RSS over the same span
  (cruder: memory freed by an earlier N is reused). The one backend the desks share is
  counted in both, and the reference run's figure also holds what is imported at first use;
- turns per second: N turns over the time from the triggers to the last turn's end (the
  median of the rounds); the bound set by the model alone would be N / 0.05 s;
- trigger-to-first-request delay: from a trigger's creation to the desk's first model
  request (its ``model_request`` event), median and 99th percentile over every desk of every
  round; and the ratio of that p99 to the one of the reference run, one desk, in the same
  process;
- CPU per turn: the desks' process's CPU over the timed rounds (all threads), per turn; and
  beside it the scripted server's. The server streams a fixed answer without parsing or
  keeping the prompt: a model server elsewhere costs the daemon's machine nothing, and here,
  on two cores, parsing every 100 KB prompt took most of a core from the desks (3.3 ms of
  server CPU a turn, with the desks' p99 at 634 ms in that run).

With ``--history M`` every desk's store holds M messages before it starts (ticks, tool calls
and results, answers; written straight into the messages table, out of the timing), so the
desks restore long conversations and the heap holds all of them, as a daemon that ran for
months does. Then also printed (issue 31): the longest stall of the event loop while the
desks wake (a probe task sleeping 5 ms notes how late it wakes; a collector pause is one),
and the collector's runs over the timed rounds (``gc.callbacks``): how many full (gen-2)
collections and the longest pause. ``--keeper off`` runs without the daemon's heap keeper
(:mod:`trading_agent.daemon.heap`), for the figures before it. The desks run on the
daemon's event loop (``daemon.event_loop = "auto"``: uvloop where installed); ``--loop
asyncio`` gives the figures on asyncio's own loop.

Bars (issue 14), at 500 desks: p99 trigger-to-request at most 500 ms, and memory per idle
desk under 50 KiB (without history); issue 31, 500 desks of 1,000 messages: the longest
stall at most 50 ms and p99 trigger-to-request at most 500 ms; turns per second are compared
with a run of the code before (the closing note of issue 14 gives both, from one machine).

Across daemons (a fleet on PostgreSQL and NATS, one daemon against two): ``bench/fleet.py``,
which runs real daemon processes.

Run: ``.venv/bin/python bench/desks_scale.py [--desks 10 100 500 1000] [--rounds 3]
[--history 1000] [--keeper on|off] [--loop auto|uvloop|asyncio]``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import structlog

from probes import CollectorWatch, LoopLag, machine
from round_overhead import _history
from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event
from trading_agent.agent.pacing import SLICE_SECONDS
from trading_agent.agent.retry import RetryPolicy
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.app import event_loop
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.desk import Desk, DeskProfile
from trading_agent.daemon.mailbox import Mailbox
from trading_agent.daemon.supervisor import DeskRuntime, Supervisor
from trading_agent.store.codec import encode_content
from trading_agent.store.store import Store

ROOT = Path(__file__).resolve().parents[1]
MODEL_LATENCY = 0.05

_SERVER = """
import json, sys
sys.path.insert(0, {root!r})
from tests.scripted_server import RawSSE, ScriptedServer

def event(value):
    return "data: " + json.dumps(value) + "\\n\\n"

def chunk(delta, finish=None):
    return event({{"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                  "model": "scripted-model",
                  "choices": [{{"index": 0, "delta": delta, "finish_reason": finish}}]}})

HEAD = (chunk({{"role": "assistant", "content": ""}}) + chunk({{"content": "Nothing to do."}})
        + chunk({{}}, "stop"))

def answer(request):
    # The stream a model server sends, with the prompt's tokens (a quarter of its bytes, as
    # the scripted server counts), without parsing the prompt or keeping it: a model server
    # elsewhere costs this machine nothing, and on two cores a parse of every long prompt
    # here took most of a core from the desks.
    server.requests.clear()
    server.answered.clear()
    prompt = max(1, len(request.body) // 4)
    usage = event({{"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 0,
                   "model": "scripted-model", "choices": [],
                   "usage": {{"prompt_tokens": prompt, "completion_tokens": 4,
                             "total_tokens": prompt + 4}}}})
    return RawSSE(HEAD + usage + "data: [DONE]\\n\\n", delay={latency})

server = ScriptedServer(responder=answer)
server.start()
print(server.base_url, flush=True)
sys.stdin.read()
server.stop()
"""


_SERVER_PIDS: dict[str, int] = {}
"""Each scripted model server's process, by base URL."""


@contextmanager
def scripted_model(latency: float = MODEL_LATENCY) -> Iterator[str]:
    """The scripted OpenAI-compatible server in a process of its own (so its work is not
    the desks'), answering every request after ``latency`` seconds; yields its base URL."""
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(root=str(ROOT), latency=latency)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdin is not None
    try:
        base_url = server.stdout.readline().strip()
        _SERVER_PIDS[base_url] = server.pid
        yield base_url
    finally:
        server.stdin.close()
        server.wait(10)


def server_cpu(base_url: str) -> float:
    """The CPU seconds the scripted model server at ``base_url`` has used (its process's
    user and system time): on a machine of two cores, time it takes from the desks."""
    with open(f"/proc/{_SERVER_PIDS[base_url]}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Figures:
    """One N's results."""

    desks: int
    memory_per_desk: float
    rss_per_desk: float
    turns_per_second: float
    delay_p50: float
    delay_p99: float
    store_seconds: float
    stall: float = 0.0
    full_collections: int = 0
    longest_pause: float = 0.0
    restore_seconds: float = 0.0
    prepare_seconds: float = 0.0
    cpu_per_turn: float = 0.0
    collector_seconds: float = 0.0
    server_cpu_per_turn: float = 0.0


def rss_bytes() -> int:
    """The process's resident set size."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fill_history(path: Path, desks: list[str], size: int) -> None:
    """Writes ``size`` messages for each desk straight into the store's messages table."""
    connection = sqlite3.connect(path)
    try:
        for desk in desks:
            rows = []
            for message in _history(size)[:size]:
                content, _ = encode_content(message.content)
                rows.append((desk, f"{desk}-{message.id}", message.role, message.kind,
                             content, message.created_at))
            connection.executemany(
                "INSERT INTO messages (desk, message_id, role, kind, content, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)", rows)
        connection.commit()
    finally:
        connection.close()


def build_desk(name: str, store: Store, bus: EventBus, backend: OpenAICompatibleBackend, *,
               context_window: int = 32_000) -> Desk:
    """A desk built as the daemon's wiring builds one (no trading tools: no exchange); like
    the wiring, desks on the same model share its backend."""
    mailbox = Mailbox()
    loop = AgentLoop(name, backend, ToolCallExecutor(ToolRegistry()), bus, maximum_rounds=8,
                     compressor=ContextCompressor(context_window), steering_inbox=mailbox)
    loop.retry_policy = RetryPolicy(max_retries=2, base_delay=0.05)
    return Desk(DeskProfile(name, model=backend.model), loop, f"You are the desk {name}.",
                store, mailbox=mailbox, event_bus=bus)


async def measure(count: int, rounds: int, base_url: str, folder: Path, *, history_size: int = 0,
                  keeper: bool = True) -> Figures:
    """Builds ``count`` desks (each with ``history_size`` stored messages), starts them
    idle, then triggers all of them ``rounds`` times."""
    path = folder / f"bench-{count}.sqlite3"
    names = [f"desk{i:04d}" for i in range(count)]
    if history_size:
        await (await Store.open(path)).close()  # the tables
        fill_history(path, names, history_size)
    store = await Store.open(path)
    bus = EventBus()
    recorded = bus.subscribe("store", max_buffer=1_000_000)
    requests = bus.subscribe("bench", max_buffer=1_000_000,
                             accept=lambda e: e.type == "model_request")
    ends = bus.subscribe("bench-ends", max_buffer=1_000_000,
                         accept=lambda e: e.type == "turn_end")
    before = rss_bytes()
    tracemalloc.start()
    backend = OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=base_url, model="scripted-model", context_window=32_000))
    window = 10_000_000 if history_size else 32_000  # no compaction of the long histories
    desks = [build_desk(name, store, bus, backend, context_window=window) for name in names]
    supervisor = Supervisor([DeskRuntime(desk) for desk in desks], bus, store,
                            **_keeper_argument(keeper))
    throughput: list[float] = []
    delays: list[float] = []
    lag, watch = LoopLag(), CollectorWatch()
    async with anyio.create_task_group() as group:
        group.start_soon(store.events.persist_events, recorded)
        if history_size:  # traced, restoring 500 desks of 1,000 messages takes minutes
            tracemalloc.stop()
        restoring = time.perf_counter()
        await group.start(supervisor.run)
        restore_seconds = time.perf_counter() - restoring
        prepared = time.perf_counter()
        for desk in desks:  # each prepares its first request once all have restored
            await desk.prepared.wait()
        prepare_seconds = time.perf_counter() - prepared
        await anyio.sleep(0.2)  # idle
        memory = tracemalloc.get_traced_memory()[0] / count
        tracemalloc.stop()  # the timed rounds run untraced
        rss = (rss_bytes() - before) / count
        group.start_soon(lag.run)
        await anyio.sleep(0.05)
        lag.reset()
        watch.on()
        cpu_started, server_started = time.process_time(), server_cpu(base_url)
        for number in range(1, rounds + 1):
            fired = {desk.name: Trigger(kind="schedule", text="Check.", source="bench")
                     for desk in desks}
            started = time.perf_counter()
            for desk in desks:
                desk.fire(fired[desk.name])
            with anyio.fail_after(120):
                for _ in desks:  # woken by the turns' ends, not by polling 500 desks
                    await ends.get()
                while any(desk.turns < number for desk in desks):  # noqa: ASYNC110
                    await anyio.sleep(0.002)  # its end is stored before the desk counts it
            throughput.append(count / (time.perf_counter() - started))
            delays.extend(_first_request_delays(requests, fired))
        cpu_per_turn = (time.process_time() - cpu_started) / (count * rounds)
        server_per_turn = (server_cpu(base_url) - server_started) / (count * rounds)
        watch.off()
        lag.stopped = True
        supervisor.shutdown()
        await supervisor.stopped.wait()
        recorded.close()
    store_started = time.perf_counter()
    await store.close()
    await backend.aclose()
    delays.sort()
    return Figures(count, memory, rss, statistics.median(throughput), statistics.median(delays),
                   _percentile(delays, 0.99), time.perf_counter() - store_started,
                   lag.longest, watch.count(2), watch.longest(), restore_seconds, prepare_seconds,
                   cpu_per_turn, watch.seconds(), server_per_turn)


def _keeper_argument(keeper: bool) -> dict[str, object]:
    """The supervisor's heap keeper, when it has one and it is asked for."""
    if not keeper:
        return {}
    try:
        from trading_agent.daemon.heap import HeapKeeper
    except ImportError:  # the code before the keeper
        return {}
    return {"heap_keeper": HeapKeeper()}


def _first_request_delays(requests: object, fired: dict[str, Trigger]) -> list[float]:
    """Seconds from each desk's trigger to its first model request of that turn."""
    first: dict[str, Event] = {}
    while (event := requests.get_nowait()) is not None:  # type: ignore[attr-defined]
        if event.desk in fired and event.desk not in first:
            first[event.desk] = event
    missing = set(fired) - set(first)
    assert not missing, f"{len(missing)} desks sent no request"
    return [first[name].at - trigger.at for name, trigger in fired.items()]


def _percentile(ordered: list[float], share: float) -> float:
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--desks", type=int, nargs="+", default=[10, 100, 500, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--history", type=int, default=0,
                        help="messages each desk's store holds before it starts")
    parser.add_argument("--keeper", choices=("on", "off"), default="on",
                        help="the daemon's heap keeper (off: the figures without it)")
    parser.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="the event loop, as daemon.event_loop (auto: the daemon's)")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where the SQLite files go (a temporary folder by default; "
                             "/dev/shm shows the figures without fsync)")
    args = parser.parse_args()
    # The figures only: the daemon's info lines (a shutdown per N) would interleave.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(machine())
    print(f"model latency {MODEL_LATENCY * 1000:.0f} ms (scripted server in its own process); "
          f"{args.rounds} rounds of all desks triggered at once; store in "
          f"{args.state_dir or tempfile.gettempdir()}; {args.history} messages per desk; heap "
          f"keeper {args.keeper}; gc thresholds {gc.get_threshold()}; desks' steps paced in "
          f"{SLICE_SECONDS * 1000:g} ms slices of the event loop; event loop "
          f"{'uvloop' if event_loop.uses_uvloop(args.loop) else 'asyncio'} (--loop {args.loop})")
    keeper = args.keeper == "on"
    with scripted_model() as base_url, \
            tempfile.TemporaryDirectory(prefix="desks-scale-", dir=args.state_dir) as folder:
        reference = event_loop.run(functools.partial(
            measure, 1, args.rounds * 3, base_url, Path(folder), history_size=args.history,
            keeper=keeper), args.loop)
        results = [event_loop.run(functools.partial(
            measure, n, args.rounds, base_url, Path(folder), history_size=args.history,
            keeper=keeper), args.loop) for n in args.desks]
    print(f"{'desks':>7} {'memory/desk':>12} {'RSS/desk':>9} {'turns/s':>8} {'bound':>7} "
          f"{'delay p50':>10} {'delay p99':>10} {'p99 / ref':>9} {'stall':>8} {'gen2':>4} "
          f"{'gc max':>8} {'gc all':>8} {'CPU/turn':>9} {'server':>9}")
    for figures in [reference, *results]:
        label = f"{figures.desks}{' (ref)' if figures is reference else ''}"
        print(f"{label:>7} {figures.memory_per_desk / 1024:>8.1f} KiB "
              f"{figures.rss_per_desk / 1024:>5.0f} KiB "
              f"{figures.turns_per_second:>8.1f} {figures.desks / MODEL_LATENCY:>7.0f} "
              f"{figures.delay_p50 * 1000:>7.1f} ms {figures.delay_p99 * 1000:>7.1f} ms "
              f"{figures.delay_p99 / reference.delay_p99:>8.1f}x "
              f"{figures.stall * 1000:>5.0f} ms {figures.full_collections:>4} "
              f"{figures.longest_pause * 1000:>5.0f} ms "
              f"{figures.collector_seconds * 1000:>5.0f} ms {figures.cpu_per_turn * 1000:>6.2f} ms"
              f" {figures.server_cpu_per_turn * 1000:>6.2f} ms")
    for figures in results:
        if figures.desks == 500:
            p99, memory = figures.delay_p99 * 1000, figures.memory_per_desk / 1024
            print(f"500 desks: p99 {p99:.0f} ms (bar: at most 500 ms) -> "
                  f"{'PASS' if p99 <= 500 else 'FAIL'}; memory per idle desk {memory:.1f} KiB "
                  f"(bar: under 50 KiB) -> {'PASS' if memory < 50 else 'FAIL'}")
            if args.history >= 1000:
                stall = figures.stall * 1000
                print(f"500 desks of {args.history} messages: longest stall {stall:.0f} ms "
                      f"(bar: at most 50 ms) -> {'PASS' if stall <= 50 else 'FAIL'}; p99 "
                      f"{p99:.0f} ms (bar: at most 500 ms) -> {'PASS' if p99 <= 500 else 'FAIL'}"
                      f"; start-up: restored in {figures.restore_seconds:.1f} s, first requests "
                      f"prepared {figures.prepare_seconds:.1f} s later")
    print(machine())


if __name__ == "__main__":
    main()
