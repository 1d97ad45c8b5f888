"""Client CPU per model round: AgentLoop against a plain openai SDK loop doing the same work.

Both talk to the scripted OpenAI-compatible server (tests/scripted_server.py) on loopback; the
servers run in a process of their own and keep no requests. Two clocks are read around every
turn: the CPU time of the client's thread (the event loop) and of the whole process (all its
threads: what a host pays), and the rounds are measured both after a ``gc.collect()`` (the
pre-fill's garbage collected first) and without one (as a daemon that runs for months meets
them). Where the difference goes is named: every collection of the cyclic collector during
the timed turns is counted with its pause (``gc.callbacks``), and process CPU less thread CPU
is what other threads spent. (In a thread of this process, the servers
shared the client's interpreter: every request they kept, parsed, stayed in the heap that
the client's garbage collections walk.) Each turn makes three tool rounds and a final
answer (four model calls). The conversation is pre-filled to about 40 and about 800 messages
(ticks, tool calls, tool results, answers), so the figures show whether a desk gets slower as
it talks. Each size is a desk of its own (its own prompt-cache key), as in a daemon: one desk
taking turns on two conversations made the first request of every turn join the whole
history again, which a desk does after a compaction, not every turn.

The cost is measured *at* each size (the turns after the pre-fill, once the pre-fill's
garbage is collected), not as a mean over a growing run; the sizes and the two backends are
measured turn by turn in turn, and each ratio is the median of side-by-side pairs of turns,
so that the shared machine's noise weighs on both sides alike. A third line grows ten desks'
conversations turn by turn, as desks' grow, each compacted after 100 turns (its window starts
over) and the desks started ten turns apart, so that once all have started every step holds
conversations of every size; it gives the cost in the turns around 40 messages and in the last
tenth (~800), taken side by side in a process whose heap has settled. A control run of that
line pads every body to the largest sent, so that what is left of its growth is not the bytes
a long history sends.
Bars (issue 14): at ~800 messages AgentLoop uses at most 2 ms of CPU per round
and at most 1.2x its cost at ~40 (flat: a round costs what changed since the last one), and
at most 1/20 of the plain loop's CPU per round. Issue 31: the same as a host pays it, the
whole process's CPU with no collection before timing: at ~800 messages at most 1.2x its cost
at ~40 (the grown line) and at most 1/100 of the plain SDK loop's, in the same run.

The same AgentLoop on the Anthropic backend runs against the scripted Anthropic server (issue
16: no slower per round than the OpenAI backend).

Run: ``.venv/bin/python bench/round_overhead.py``
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from openai import AsyncOpenAI
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.scripted_anthropic_server import AnthropicScriptedServer
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall

from probes import CollectorWatch, machine
from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    Message,
    ModelRequestSpec,
    TextBlock,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    ToolResultBlock,
    ToolUseBlock,
    Trigger,
)
from trading_agent.app import event_loop
from trading_agent.backends.anthropic import AnthropicBackend
from trading_agent.backends.config import AnthropicBackendConfig, OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.heap import HeapKeeper

TOOL_ROUNDS = 3
TURNS = 5
REPEATS = 12
GROWN_REPEATS = 1
"""The grown line's runs with and without the heap keeper, taken in turn (in either order)."""
GROWN_DESKS = 10
GROWN_TURNS = 100
"""A grown desk's turns between two compactions (~800 messages at the last)."""
GROWN_STAGGER = GROWN_TURNS // GROWN_DESKS
"""The grown line's desks start this many steps apart, so that at every step their
conversations are spread over every size."""
GROWN_STEPS = 3 * GROWN_TURNS
"""The grown line's steps: the first :data:`GROWN_TURNS` bring every desk in, the rest are
measured."""
PLAIN_REPEATS = 5
"""The plain SDK loop is the reference: a few repeats give its median (it costs ~100x more)."""
SIZES = (40, 800)
TICKER_TEXT = "BTC/USDT last 21,034.50 bid 21,034.40 ask 21,034.60 24h +2.31% vol 14,201 BTC"


MODES = ("collected", "uncollected")
"""Timed after a ``gc.collect()`` of the pre-fill's garbage, and without one."""


class Cpu(NamedTuple):
    """CPU seconds per model round: the event loop's thread, and the whole process."""

    thread: float
    process: float


class _Clocks:
    """Both CPU clocks at once."""

    def __init__(self) -> None:
        self.thread, self.process = time.thread_time(), time.process_time()

    def per_round(self, rounds: int) -> Cpu:
        return Cpu((time.thread_time() - self.thread) / rounds,
                   (time.process_time() - self.process) / rounds)


class TickerArguments(BaseModel):
    symbol: str


def _responder(request: RecordedRequest) -> Step:
    """Three tool calls, then an answer: counts tool results since the last user message."""
    messages = request.messages
    since_user = 0
    for message in reversed(messages):
        if message["role"] == "user":
            break
        since_user += message["role"] == "tool"
    if since_user < TOOL_ROUNDS:
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                     usage=(1000, 20))
    return Reply("Holding: no setup worth trading at 21,034.", text_chunks=4, usage=(1000, 12))


def _history(size: int) -> list[Message]:
    """About ``size`` messages of a desk's past: tick, call, result, answer, repeated."""
    messages: list[Message] = []
    index = 0
    while len(messages) < size:
        call = ToolUseBlock(id=f"hist_{index}", name="get_ticker",
                            arguments='{"symbol": "BTC/USDT"}')
        messages += [
            Message.user_text(f"[tick: BTC/USDT]\nBTC/USDT moved 0.5% to {21000 + index}"),
            Message(role="assistant", content=(TextBlock("Checking the market."), call)),
            Message(role="user", kind="tool_results", content=(ToolResultBlock(
                call.id, (TextBlock(TICKER_TEXT),)),)),
            Message(role="assistant", content=(TextBlock(f"No trade at {21000 + index}."),)),
        ]
        index += 1
    return messages


def _wire(messages: list[Message]) -> list[dict[str, Any]]:
    """The same history as plain OpenAI message dicts, for the SDK loop."""
    wire: list[dict[str, Any]] = [{"role": "system", "content": "You run a BTC desk."}]
    for message in messages:
        if message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": message.text}
            calls = message.tool_uses
            if calls:
                entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": c.arguments}} for c in calls]
            wire.append(entry)
        elif message.kind == "tool_results":
            wire += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text}
                     for r in message.tool_results]
        else:
            wire.append({"role": "user", "content": message.text})
    return wire


def _anthropic_responder(request: RecordedRequest) -> Step:
    """The same script in Anthropic's shape: tool results are user messages of blocks."""
    since_trigger = 0
    for message in reversed(request.json["messages"]):
        blocks = message["content"]
        if message["role"] == "user" and any(b["type"] == "text" for b in blocks):
            break
        since_trigger += message["role"] == "user"
    if since_trigger < TOOL_ROUNDS:
        return Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
                     usage=(1000, 20))
    return Reply("Holding: no setup worth trading at 21,034.", text_chunks=4, usage=(1000, 12))


def _backend(base_url: str, provider: str) -> OpenAICompatibleBackend | AnthropicBackend:
    if provider == "anthropic":
        return AnthropicBackend(AnthropicBackendConfig(
            base_url=base_url, model="scripted-claude", context_window=1_000_000,
            api_key_env=None))
    return OpenAICompatibleBackend(OpenAIBackendConfig(
        base_url=base_url, model="scripted-model", context_window=1_000_000))


Samples = dict[tuple[str, int, str], list[Cpu]]


async def _agent_loop_samples(base_urls: dict[str, str],
                              watches: dict[str, CollectorWatch]) -> Samples:
    """CPU per model round of AgentLoop, one sample per turn for each backend
    (``base_urls``: provider -> its scripted server), each size and each of :data:`MODES`
    (repeats alternate between them; ``watches[mode]`` counts the collections of its timed
    turns).

    The samples are taken turn by turn in turn (40 then 800, one backend then the other,
    the backends' order swapped every turn), so that what the shared machine does meanwhile
    weighs on all of them alike; a conversation is filled again every :data:`TURNS` turns so
    that it stays near its size."""
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        return TICKER_TEXT

    samples: Samples = {}
    async with contextlib.AsyncExitStack() as stack:
        loops = {}
        for provider, base_url in base_urls.items():
            backend = await stack.enter_async_context(_backend(base_url, provider))
            for size in SIZES:  # a desk per size, as a daemon's desks share a backend
                loops[provider, size] = AgentLoop(f"bench-{size}", backend,
                                                  ToolCallExecutor(registry), EventBus(),
                                                  maximum_rounds=10)
        providers = list(base_urls)
        for repeat in range(REPEATS):
            mode = MODES[repeat % 2]
            conversations = {}
            for key, loop in loops.items():
                conversation = Conversation("You run a BTC desk.", _history(key[1]))
                await loop.run_turn(conversation, Trigger("tick", "warm-up"))
                conversations[key] = conversation
            if mode == "collected":
                gc.collect()  # the pre-fill's garbage is not the rounds' to pay for
            for turn in range(TURNS):
                order = providers[::-1] if turn % 2 else providers
                for size in SIZES:
                    for provider in order:
                        clocks = _Clocks()
                        watches[mode].on()
                        result = await loops[provider, size].run_turn(
                            conversations[provider, size], Trigger("tick", f"move {turn}"))
                        watches[mode].off()
                        samples.setdefault((provider, size, mode), []).append(
                            clocks.per_round(result.rounds))
    return samples


def _paired(samples: Samples, top: tuple[str, int, str], bottom: tuple[str, int, str],
            clock: str = "thread") -> float:
    """The median of the ratios of samples taken side by side, on one clock."""
    return statistics.median(getattr(a, clock) / getattr(b, clock)
                             for a, b in zip(samples[top], samples[bottom], strict=True))


def _median(samples: list[Cpu]) -> Cpu:
    return Cpu(statistics.median(s.thread for s in samples),
               statistics.median(s.process for s in samples))


class GrownTurn(NamedTuple):
    """One turn of the grown line: the step it was taken at, the desk's turn number since its
    last compaction, its conversation's size before the turn, its model rounds and CPU per
    round."""

    step: int
    turn: int
    size: int
    rounds: int
    cpu: Cpu


def _measured(turns: list[GrownTurn], late: bool) -> list[GrownTurn]:
    """The grown line's measured turns (after the ramp) near ~40 messages, or in the last
    tenth of a desk's turns between two compactions (~800)."""
    return [t for t in turns if t.step >= GROWN_TURNS
            and (t.turn >= GROWN_TURNS - 10 if late else 30 <= t.size <= 60)]


class _PaddedBackend(OpenAICompatibleBackend):
    """The grown line's control: every body padded with trailing spaces (still the same
    JSON) to the largest body sent so far, so that young conversations send as many bytes
    as old ones; what is left of the growth is not in the bytes a long history sends."""

    largest = 0

    def request_body(self, request: ModelRequestSpec) -> bytes:
        body = super().request_body(request)
        self.largest = max(self.largest, len(body))
        return body + b" " * (self.largest - len(body)) if len(body) < self.largest else body


async def _grown_turns(base_url: str, watch: CollectorWatch, keeper: bool,
                       padded: bool = False) -> list[GrownTurn]:
    """:data:`GROWN_DESKS` desks growing their conversations turn by turn with no collection
    before timing, as desks grow in a daemon: each compacts after :data:`GROWN_TURNS` turns
    (its window starts over from nothing) and grows again. Desk ``k`` starts
    :data:`GROWN_STAGGER` x ``k`` steps after the first, and at every step each desk takes a
    turn; after the first :data:`GROWN_TURNS` steps (the ramp: every desk brought in, not
    measured) the desks' conversations are spread evenly over every size at every step, so
    that turns near ~40 messages and near ~800 are taken side by side all through the
    measured steps. (Grown once from nothing, the young turns all fell in the process's first
    seconds and the old ones in its last: a young process's turns measured a quarter cheaper
    than the same turns once its heap had grown and been freed, a state a daemon is in for
    its first minutes only.) Every turn (:class:`GrownTurn`); ``watch`` counts the collections
    of the measured last-tenth turns. With ``keeper``, the daemon's heap keeper freezes the
    heap once the loops are built and after every compaction, as the daemon does. With
    ``padded``, the bodies are padded (:class:`_PaddedBackend`)."""
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        return TICKER_TEXT

    config = OpenAIBackendConfig(base_url=base_url, model="scripted-model",
                                 context_window=1_000_000)
    per_turn: list[GrownTurn] = []
    heap = HeapKeeper() if keeper else None
    model = _PaddedBackend if padded else OpenAICompatibleBackend
    async with model(config) as backend:  # one model, shared by the desks
        loops = [AgentLoop(f"bench-{k}", backend, ToolCallExecutor(registry), EventBus(),
                           maximum_rounds=10) for k in range(GROWN_DESKS)]
        conversations = [Conversation("You run a BTC desk.", []) for _ in loops]
        if heap is not None:
            heap.freeze()
        try:
            for step in range(GROWN_STEPS):
                for k, loop in enumerate(loops):
                    if step < GROWN_STAGGER * k:
                        continue
                    turn = (step - GROWN_STAGGER * k) % GROWN_TURNS
                    if turn == 0 and step >= GROWN_TURNS:  # a compaction: starts over
                        conversations[k] = Conversation("You run a BTC desk.", [])
                        if heap is not None:
                            heap.compacted()
                    conversation = conversations[k]
                    size = len(conversation.messages)
                    clocks = _Clocks()
                    timed = step >= GROWN_TURNS and turn >= GROWN_TURNS - 10
                    if timed:
                        watch.on()
                    result = await loop.run_turn(conversation, Trigger("tick", f"move {turn}"))
                    watch.off()
                    per_turn.append(GrownTurn(step, turn, size, result.rounds,
                                              clocks.per_round(result.rounds)))
        finally:
            gc.unfreeze()
    return per_turn


class Grown(NamedTuple):
    """The grown line: medians near ~40 and in the last tenth, and the mean of the last
    tenth (what a host pays, rare full collections included), process CPU per round."""

    early: Cpu
    late: Cpu
    late_mean: float
    late_rounds: int


async def _grown_cpu(base_url: str, watches: dict[bool, CollectorWatch]
                    ) -> tuple[dict[bool, Grown], Grown]:
    """The grown line without the keeper and with it, in turn (the order swapped each
    repeat); medians over every desk's measured turns of each size, of every repeat. And
    the control: a run with the keeper and padded bodies (its ratio is its own: a run's
    figures move by up to a fifth with its place in the process, its ratio does not)."""
    runs: dict[bool, list[GrownTurn]] = {False: [], True: []}
    for repeat in range(GROWN_REPEATS):
        for keeper in (False, True) if repeat % 2 == 0 else (True, False):
            runs[keeper] += await _grown_turns(base_url, watches[keeper], keeper)
    control = await _grown_turns(base_url, CollectorWatch(), True, padded=True)
    return {keeper: _grown(turns) for keeper, turns in runs.items()}, _grown(control)


def _grown(turns: list[GrownTurn]) -> Grown:
    late = _measured(turns, late=True)
    rounds = sum(t.rounds for t in late)
    return Grown(_median([t.cpu for t in _measured(turns, late=False)]),
                 _median([t.cpu for t in late]),
                 sum(t.cpu.process * t.rounds for t in late) / rounds, rounds)


async def _plain_sdk_cpu(base_url: str, size: int) -> Cpu:
    """CPU per model round of a plain openai SDK loop, median over repeats."""
    tools = [{"type": "function", "function": {
        "name": "get_ticker", "description": "Last price of a market.",
        "parameters": TickerArguments.model_json_schema()}}]
    samples = []
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        for _ in range(PLAIN_REPEATS):
            messages = _wire(_history(size))
            rounds = 0
            clocks = _Clocks()
            for turn in range(TURNS + 1):
                if turn == 1:
                    clocks, rounds = _Clocks(), 0
                messages.append({"role": "user", "content": f"[tick]\nmove {turn}"})
                while True:
                    rounds += 1
                    stream = await client.chat.completions.create(
                        model="scripted-model", messages=messages, tools=tools,  # type: ignore[arg-type]
                        stream=True, stream_options={"include_usage": True})
                    text, calls = "", {}
                    async for chunk in stream:
                        if not chunk.choices:
                            continue
                        delta = chunk.choices[0].delta
                        text += delta.content or ""
                        for call in delta.tool_calls or []:
                            slot = calls.setdefault(call.index, {"id": "", "name": "", "args": ""})
                            slot["id"] = call.id or slot["id"]
                            if call.function is not None:
                                slot["name"] += call.function.name or ""
                                slot["args"] += call.function.arguments or ""
                    entry: dict[str, Any] = {"role": "assistant", "content": text}
                    if calls:
                        entry["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                            "name": c["name"], "arguments": c["args"]}} for c in calls.values()]
                    messages.append(entry)
                    if not calls:
                        break
                    for c in calls.values():
                        json.loads(c["args"])
                        messages.append({"role": "tool", "tool_call_id": c["id"],
                                         "content": TICKER_TEXT})
            samples.append(clocks.per_round(rounds))
    return _median(samples)


def _forgetful(server: ScriptedServer,
               responder: Callable[[RecordedRequest], Step]) -> Callable[[RecordedRequest], Step]:
    """``responder``, for a server that keeps none of the requests it answers (kept, the
    grown line's ten thousand requests took the servers' process longer to exit than the
    bench waits)."""
    def respond(request: RecordedRequest) -> Step:
        server.requests.clear()
        server.answered.clear()
        return responder(request)
    return respond


def _serve() -> None:
    """Runs both scripted servers until standard input closes; prints their base URLs."""
    with ScriptedServer() as server, AnthropicScriptedServer() as anthropic_server:
        server.responder = _forgetful(server, _responder)
        anthropic_server.responder = _forgetful(anthropic_server, _anthropic_responder)
        print(server.base_url, anthropic_server.base_url, flush=True)
        sys.stdin.read()


@contextlib.contextmanager
def _servers() -> Iterator[tuple[str, str]]:
    """The two scripted servers in a process of their own: their base URLs."""
    process = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None
    try:
        openai_url, anthropic_url = process.stdout.readline().split()
        yield openai_url, anthropic_url
    finally:
        process.stdin.close()
        process.wait(10)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _collections(watch: CollectorWatch, rounds: int) -> str:
    counts = "/".join(str(watch.count(g)) for g in range(3))
    return (f"collections gen0/1/2 {counts}, paused {watch.seconds() * 1000 / rounds:.3f} "
            f"ms/round (gen 2: {watch.seconds(2) * 1000 / rounds:.3f}), longest "
            f"{watch.longest() * 1000:.1f} ms")


async def _main() -> None:
    print("round_overhead: client CPU per model round, the event loop's thread and the whole "
          "process (all threads)")
    print(machine())
    print(f"each turn: {TOOL_ROUNDS} tool rounds + answer; {TURNS} turns x {REPEATS} repeats "
          f"(half after a gc.collect(), half without); medians; reference: the plain openai "
          f"SDK loop in this run; gc thresholds {gc.get_threshold()}, "
          f"{gc.get_freeze_count()} objects frozen; the daemon's event loop: "
          f"{event_loop.loop_name()}")
    figures: dict[tuple[str, int], Cpu] = {}
    watches = {mode: CollectorWatch() for mode in MODES}
    grown_watches = {False: CollectorWatch(), True: CollectorWatch()}
    with _servers() as (openai_url, anthropic_url):
        samples = await _agent_loop_samples({"openai": openai_url, "anthropic": anthropic_url},
                                            watches)
        for size in SIZES:
            figures["plain", size] = plain = await _plain_sdk_cpu(openai_url, size)
            print(f"~{size:>3} messages: plain SDK loop thread {plain.thread * 1000:7.2f} "
                  f"process {plain.process * 1000:7.2f} ms/round (the reference)")
            for mode in MODES:
                figures[mode, size] = agent = _median(samples["openai", size, mode])
                anthropic = _median(samples["anthropic", size, mode])
                print(f"   {mode:>11}: AgentLoop thread {agent.thread * 1000:5.2f} process "
                      f"{agent.process * 1000:5.2f} ms/round (on the Anthropic backend "
                      f"{anthropic.thread * 1000:.2f} / {anthropic.process * 1000:.2f})")
        grown, padded = await _grown_cpu(openai_url, grown_watches)
        for keeper, line in grown.items():
            print(f"grown, 100 turns between compactions, no collection, heap keeper "
                  f"{'on' if keeper else 'off'}: AgentLoop process "
                  f"{line.early.process * 1000:.2f} ms/round near ~40 "
                  f"(thread {line.early.thread * 1000:.2f}); {line.late.process * 1000:.2f} "
                  f"in the last tenth (~800; thread {line.late.thread * 1000:.2f}), mean "
                  f"{line.late_mean * 1000:.2f}")
    timed_rounds = len(samples["openai", SIZES[0], MODES[0]]) * len(SIZES) * 2 * (
        TOOL_ROUNDS + 1)
    for mode in MODES:
        print(f"where it goes, {mode}: {_collections(watches[mode], timed_rounds)}; other "
              f"threads (process - thread) at ~800 "
              f"{(figures[mode, 800].process - figures[mode, 800].thread) * 1000:.3f} ms/round")
    for keeper, watch in grown_watches.items():
        print(f"where it goes, grown line's last tenth, keeper {'on' if keeper else 'off'}: "
              f"{_collections(watch, grown[keeper].late_rounds)}")

    at_800 = figures["collected", 800].thread * 1000
    print(f"issue 14 (thread CPU, collected): AgentLoop at ~800: {at_800:.2f} ms/round (bar: at "
          f"most 2 ms) -> {_verdict(at_800 <= 2)}")
    growth = _paired(samples, ("openai", 800, "collected"), ("openai", 40, "collected"))
    print(f"issue 14: AgentLoop ~800 / ~40 = {growth:.2f}x thread CPU, median of side-by-side "
          f"pairs (bar: at most 1.2x) -> {_verdict(growth <= 1.2)}")
    share = figures["collected", 800].thread / figures["plain", 800].thread
    print(f"issue 14: at ~800 AgentLoop / plain = 1/{1 / share:.1f} thread CPU (bar: at most "
          f"1/20) -> {_verdict(share <= 1 / 20)}")
    process_growth = _paired(samples, ("openai", 800, "uncollected"),
                             ("openai", 40, "uncollected"), "process")
    late, early = grown[True].late, grown[True].early  # as the daemon runs: keeper on
    grown_growth = late.process / early.process
    print(f"issue 31 (process CPU, no collection): AgentLoop ~800 / ~40 = "
          f"{process_growth:.2f}x side by side, {grown_growth:.2f}x over the grown line with the "
          f"keeper (without: {grown[False].late.process / grown[False].early.process:.2f}x; "
          f"bar: "
          f"at most 1.2x) -> {_verdict(max(process_growth, grown_growth) <= 1.2)}")
    padded_growth = padded.late.process / padded.early.process
    print(f"where the grown line's growth goes: with every body padded to the largest sent "
          f"(young conversations send as many bytes as ~800 messages), ~800 / ~40 = "
          f"{padded_growth:.2f}x in that run; the bytes a long history sends are the "
          f"difference ({grown_growth - padded_growth:+.2f}x), the collector's pauses and other "
          f"threads are counted above")
    process_share = figures["uncollected", 800].process / figures["plain", 800].process
    grown_share = late.process / figures["plain", 800].process
    print(f"issue 31: at ~800 AgentLoop / plain = 1/{1 / process_share:.0f} side by side, "
          f"1/{1 / grown_share:.0f} grown (bar: at most 1/100) -> "
          f"{_verdict(max(process_share, grown_share) <= 1 / 100)}")
    # Issue 16: the Anthropic backend no slower per round than the OpenAI one (a tenth more
    # is the noise of a shared machine between two runs of the same work).
    for size in SIZES:
        ratio = _paired(samples, ("anthropic", size, "collected"),
                        ("openai", size, "collected"))
        print(f"issue 16: at ~{size}: Anthropic / OpenAI backend = {ratio:.2f}x thread CPU, "
              f"median of side-by-side pairs (bar: at most 1.1x) -> {_verdict(ratio <= 1.1)}")
    print(machine())


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        event_loop.run(_main)  # the daemon's loop (daemon.event_loop = "auto")
