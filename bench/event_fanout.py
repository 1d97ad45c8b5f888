"""Events per second delivered to 1, 10 and 100 operator streams while 10 desks work.

The daemon side runs in this process: 10 desks, each a real AgentLoop with a real
ToolCallExecutor, running turns back to back against an in-process model that streams 20
text deltas per answer and calls one tool every other answer (about 50 events per turn:
turn start and end, model requests, deltas, usage, tool call and result), and the operator
API serving them on its Unix socket. The watchers run in a second process, so their HTTP
parsing takes no time from the daemon's event loop: N streams (``GET /api/events``), each
counting the frames whose id falls in the measured window, and sampling the delivery latency
(receipt time minus the event's ``at``).

Printed per N (median of the runs): events published per second by the 10 desks (the
desks run flat out, so this is what the daemon can do while it also serves N streams),
events delivered per second to each stream and to all, the share of the window's events each
stream received, latency p50 and p99, and two ratios against references run in this same
process: the desks' publish rate against the one with no stream open (what the streams cost
the desks), and delivery against a plain in-process bus subscription per watcher (what HTTP
costs over the bus alone).

Two tables: desks flat out (the most the daemon can publish and deliver; the event loop is
saturated, so latency there is queueing), and desks paced like a fast real model (100 tokens
a second each: the latency an operator sees). A stream gathers events for 20 ms before a write
(``api._LINGER_SECONDS``), so that is the floor of the paced latency. On a shared machine the
flat-out figures move by tens of percent between runs; the paced ones are steadier.

Run: ``.venv/bin/python bench/event_fanout.py [--watchers 1 10 100] [--seconds 3] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import structlog
from pydantic import BaseModel

from trading_agent.agent.agent_loop import AgentLoop
from trading_agent.agent.backend import ModelReply, ModelRequestSpec, Usage
from trading_agent.agent.conversation import Conversation, TextBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import Event
from trading_agent.agent.tool_call_executor import ToolCallExecutor
from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.control import DeskStatus, UnknownDeskError
from trading_agent.operator.approvals import ApprovalBook
from trading_agent.operator.config import OperatorConfig
from trading_agent.operator.server import serve_operator_api

DESKS = 10
DELTAS_PER_ANSWER = 20
PACE = 0.01
"""Seconds between text deltas in the paced run (100 tokens a second per desk)."""


# --------------------------------------------------------------------------- the daemon side


class _StreamingModel:
    """A model in this process: 20 deltas per answer, a tool call every other answer."""

    model = "bench-model"
    context_window = 1_000_000

    def __init__(self, pace: float) -> None:
        self._calls = 0
        self._pace = pace

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        self._calls += 1
        for index in range(DELTAS_PER_ANSWER):
            if on_text is not None:
                on_text(f"word{index} ")
            if self._pace:
                await anyio.sleep(self._pace)  # a model writing at 1/pace tokens a second
            else:
                await anyio.lowlevel.checkpoint()  # a real stream awaits its socket
        text = TextBlock("answer " * DELTAS_PER_ANSWER)
        if self._calls % 2:
            call = ToolUseBlock(id=f"call_{self._calls}", name="get_price",
                                arguments='{"symbol": "BTC/USDT"}')
            return ModelReply((text, call), Usage(100, 20), "tool_calls")
        return ModelReply((text,), Usage(120, 20))


class _PriceArguments(BaseModel):
    symbol: str


def _registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Last price.")
    async def get_price(arguments: _PriceArguments, context: ToolContext) -> str:
        return f"{arguments.symbol} 64000"

    return registry


class _BenchControl:
    """The DeskControl of the bench: desks that work flat out, a store that keeps nothing."""

    def __init__(self, bus: EventBus, pace: float) -> None:
        self.event_bus = bus
        self._pace = pace
        self._names = [f"desk-{n:02d}" for n in range(DESKS)]

    def desk_names(self) -> Sequence[str]:
        return self._names

    async def desk_status(self, desk: str) -> DeskStatus:
        if desk not in self._names:
            raise UnknownDeskError(desk)
        return DeskStatus(name=desk, state="working", equity=10_000.0)

    async def send_message(self, desk: str, text: str, source: str = "operator",
                           images: object = (), *, message_id: str | None = None) -> str:
        return "unused"

    def message_delivery(self, desk: str, message_id: str) -> str:
        return "turn"

    async def compact(self, desk: str) -> bool:
        return False

    async def transcript(self, desk: str, *, before: int | None = None,
                         limit: int = 50) -> list[dict[str, Any]]:
        return []

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        return []

    async def work(self) -> None:
        async with anyio.create_task_group() as group:
            for name in self._names:
                group.start_soon(self._desk, name)

    async def _desk(self, name: str) -> None:
        executor = ToolCallExecutor(_registry(), heartbeat_seconds=3600)
        loop = AgentLoop(name, _StreamingModel(self._pace), executor, self.event_bus,
                         maximum_rounds=4)
        while True:
            # A fresh conversation each turn: the bench measures events, not history.
            await loop.run_turn(Conversation("bench"), Trigger(kind="tick", text="tick"))


class _Counter:
    """Counts published events without holding any (its filter never accepts)."""

    def __init__(self, bus: EventBus) -> None:
        self.last_id = 0
        self._subscription = bus.subscribe("bench-counter", accept=self._seen)

    def _seen(self, event: Event) -> bool:
        self.last_id = event.id
        return False


# --------------------------------------------------------------------------- the watchers


_WATCHERS = r"""
import json, sys, time
import anyio, httpx

socket, count = sys.argv[1], int(sys.argv[2])

async def watch(client, after, since, end, results, ready):
    # Cheap on purpose (the watchers share one process): frames are counted with bytes.count,
    # and only the oldest frame of each read is parsed, for its latency.
    counted, latencies, tail = 0, [], b""
    async with client.stream("GET", "/api/events", params={"after": after}) as response:
        ready()
        async for chunk in response.aiter_raw():
            data = tail + chunk
            cut = data.rfind(b"\n\n")
            if cut < 0:
                tail = data
                continue
            complete, tail = data[:cut + 2], data[cut + 2:]
            now = time.time()
            first = complete.find(b"id: ")
            if first >= 0 and since[0] is not None:
                frame = complete[first:complete.find(b"\n\n", first)]
                head, _, body = frame.partition(b"\n")
                if int(head[4:]) > since[0]:  # not the catch-up after connecting
                    latencies.append(now - json.loads(body[6:])["at"])
            last_start = complete.rfind(b"id: ")
            last_id = int(complete[last_start + 4:complete.find(b"\n", last_start)]) \
                if last_start >= 0 else -1
            if end[0] is None or last_id <= end[0]:
                counted += complete.count(b"id: ")
                if end[0] is not None and last_id == end[0]:
                    results.append({"counted": counted, "latencies": latencies, "done": now})
                    return
                continue
            for frame in complete.split(b"\n\n"):
                if frame.startswith(b"id: "):
                    if int(frame[4:frame.find(b"\n")]) > end[0]:
                        results.append({"counted": counted, "latencies": latencies,
                                        "done": now})
                        return
                    counted += 1

async def main():
    after = int(sys.stdin.readline())
    since, end, results, connected = [None], [None], [], 0
    def ready():
        nonlocal connected
        connected += 1
        if connected == count:
            print("ready", flush=True)
    limits = httpx.Limits(max_connections=count + 5)
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket, limits=limits),
                                 base_url="http://bench", timeout=None) as client:
        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(watch, client, after, since, end, results, ready)
            since[0] = int(await anyio.to_thread.run_sync(sys.stdin.readline))
            end[0] = int(await anyio.to_thread.run_sync(sys.stdin.readline))
            with anyio.move_on_after(60):
                while len(results) < count:
                    await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    for r in results:
        r["cpu"] = time.process_time()
    print(json.dumps(results), flush=True)

anyio.run(main)
"""


async def _measure(watchers: int, seconds: float, state_dir: Path,
                   pace: float) -> dict[str, Any]:
    """One run: the desks flat out for ``seconds``, ``watchers`` streams in another process
    counting the window's events (those with ids in it) until each has seen its last one."""
    bus = EventBus()
    control = _BenchControl(bus, pace)
    counter = _Counter(bus)
    config = OperatorConfig(socket_path=state_dir / "bench.sock", event_buffer_size=500_000)
    result: dict[str, Any] = {"watchers": watchers}
    async with anyio.create_task_group() as group:
        await group.start(lambda task_status: serve_operator_api(
            control, ApprovalBook(), config, state_dir=state_dir, task_status=task_status))
        group.start_soon(control.work)
        await anyio.sleep(0.5)  # warm up
        first_id, started, wall_started = counter.last_id, time.perf_counter(), time.time()
        process = None
        if watchers:
            process = await anyio.open_process(
                [sys.executable, "-c", _WATCHERS, str(config.socket_path), str(watchers)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)
            assert process.stdin is not None and process.stdout is not None
            await process.stdin.send(f"{first_id}\n".encode())
            lines = _lines(process.stdout)
            assert await lines.__anext__() == "ready"
            await process.stdin.send(f"{counter.last_id}\n".encode())
        await anyio.sleep(max(0.0, seconds - (time.perf_counter() - started)))
        last_id, elapsed = counter.last_id, time.perf_counter() - started
        window = last_id - first_id
        result["published_per_second"] = window / elapsed
        if process is not None:
            assert process.stdin is not None
            await process.stdin.send(f"{last_id}\n".encode())
            reports = json.loads(await lines.__anext__())
            await process.wait()
            rates = [r["counted"] / (r["done"] - wall_started) for r in reports]
            latencies = sorted(x for r in reports for x in r["latencies"])
            result.update(
                delivered_per_watcher=statistics.median(rates),
                delivered_total=sum(rates),
                complete=statistics.median(r["counted"] for r in reports) / max(1, window),
                catch_up=max(r["done"] for r in reports) - (wall_started + elapsed),
                watcher_cpu=reports[0]["cpu"] / (max(r["done"] for r in reports) - wall_started),
                latency_p50=latencies[len(latencies) // 2] if latencies else float("nan"),
                latency_p99=latencies[int(len(latencies) * 0.99)] if latencies else float("nan"),
            )
        group.cancel_scope.cancel()
    return result


async def _lines(stream: Any) -> Any:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            line, _, buffer = buffer.partition(b"\n")
            yield line.decode()


async def _bus_reference(watchers: int, seconds: float, pace: float) -> float:
    """Events per second per watcher with plain in-process bus subscriptions (no HTTP)."""
    bus = EventBus()
    control = _BenchControl(bus, pace)
    counts = [0] * watchers

    async def drain(index: int) -> None:
        with bus.subscribe(f"ref-{index}", max_buffer=1_000_000) as subscription:
            async for _ in subscription:
                counts[index] += 1

    async with anyio.create_task_group() as group:
        for index in range(watchers):
            group.start_soon(drain, index)
        group.start_soon(control.work)
        await anyio.sleep(0.5)
        before = list(counts)
        started = time.perf_counter()
        await anyio.sleep(seconds)
        elapsed = time.perf_counter() - started
        after = list(counts)
        group.cancel_scope.cancel()
    return statistics.median(a - b for a, b in zip(after, before, strict=True)) / elapsed


async def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}")
    print(f"{DESKS} desks, about 50 events per turn ({DELTAS_PER_ANSWER} text deltas per "
          f"answer); {args.seconds:g} s windows; median of {args.runs} runs; the streams "
          "are read by a second process")
    with tempfile.TemporaryDirectory(prefix="ta-bench-", dir="/tmp") as tmp:
        for title, pace in (("flat out: what the daemon can deliver", 0.0),
                            (f"paced: each model writes {1 / PACE:.0f} tokens a second, as a "
                             "fast real one does", PACE)):
            await _table(title, pace, args, Path(tmp))


async def _table(title: str, pace: float, args: argparse.Namespace, state_dir: Path) -> None:
    print(f"\n== {title}")
    baseline = statistics.median([
        (await _measure(0, args.seconds, state_dir, pace))["published_per_second"]
        for _ in range(args.runs)])
    print(f"reference, no stream open: the desks publish {baseline:,.0f} events/s")
    header = (f"{'streams':>7}  {'published/s':>11}  {'vs none':>7}  {'per stream/s':>12}  "
              f"{'all streams/s':>13}  {'received':>8}  {'p50 ms':>7}  {'p99 ms':>7}  "
              f"{'catch-up s':>10}  {'bus ref/s':>10}  {'vs bus':>6}  {'watcher CPU':>11}")
    print(header)
    print("-" * len(header))
    for watchers in args.watchers:
        runs = [await _measure(watchers, args.seconds, state_dir, pace)
                for _ in range(args.runs)]
        reference = await _bus_reference(watchers, args.seconds, pace)

        def median(key: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        published = median("published_per_second")
        per_watcher = median("delivered_per_watcher")
        print(f"{watchers:>7}  {published:>11,.0f}  {published / baseline:>7.2f}  "
              f"{per_watcher:>12,.0f}  {median('delivered_total'):>13,.0f}  "
              f"{median('complete'):>8.1%}  {median('latency_p50') * 1000:>7.1f}  "
              f"{median('latency_p99') * 1000:>7.1f}  {median('catch_up'):>10.2f}  "
              f"{reference:>10,.0f}  {per_watcher / reference:>6.2f}  "
              f"{median('watcher_cpu'):>11.0%}")


if __name__ == "__main__":
    anyio.run(main, backend="asyncio")
