"""Client CPU per model round: AgentLoop against a plain openai SDK loop doing the same work.

Both talk to the scripted OpenAI-compatible server (tests/scripted_server.py) on loopback; the
servers run in a process of their own and keep no requests, and only the CPU time of the
client's thread (the event loop) is counted. (In a thread of this process, the servers
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
so that the shared machine's noise weighs on both sides alike. A third line grows one
conversation from nothing over 100 turns, as a desk's does, and gives the cost in the turns
around 40 messages and in the last tenth (~800).
Bars (issue 14): at ~800 messages AgentLoop uses at most 2 ms of CPU per round
and at most 1.2x its cost at ~40 (flat: a round costs what changed since the last one), and
at most 1/20 of the plain loop's CPU per round.

The same AgentLoop on the Anthropic backend runs against the scripted Anthropic server (issue
16: no slower per round than the OpenAI backend).

Run: ``.venv/bin/python bench/round_overhead.py``
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
from openai import AsyncOpenAI
from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.scripted_anthropic_server import AnthropicScriptedServer
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, Step, ToolCall

from trading_agent.agent import (
    AgentLoop,
    Conversation,
    EventBus,
    Message,
    TextBlock,
    ToolCallExecutor,
    ToolContext,
    ToolRegistry,
    ToolResultBlock,
    ToolUseBlock,
    Trigger,
)
from trading_agent.backends.anthropic import AnthropicBackend
from trading_agent.backends.config import AnthropicBackendConfig, OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend

TOOL_ROUNDS = 3
TURNS = 5
REPEATS = 12
PLAIN_REPEATS = 5
"""The plain SDK loop is the reference: a few repeats give its median (it costs ~100x more)."""
SIZES = (40, 800)
TICKER_TEXT = "BTC/USDT last 21,034.50 bid 21,034.40 ask 21,034.60 24h +2.31% vol 14,201 BTC"


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


async def _agent_loop_samples(base_urls: dict[str, str]) -> dict[tuple[str, int], list[float]]:
    """CPU seconds per model round of AgentLoop, one sample per turn for each backend
    (``base_urls``: provider -> its scripted server) and each size.

    The samples are taken turn by turn in turn (40 then 800, one backend then the other,
    the backends' order swapped every turn), so that what the shared machine does meanwhile
    weighs on all of them alike; a conversation is filled again every :data:`TURNS` turns so
    that it stays near its size."""
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        return TICKER_TEXT

    samples: dict[tuple[str, int], list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        loops = {}
        for provider, base_url in base_urls.items():
            backend = await stack.enter_async_context(_backend(base_url, provider))
            for size in SIZES:  # a desk per size, as a daemon's desks share a backend
                loops[provider, size] = AgentLoop(f"bench-{size}", backend,
                                                  ToolCallExecutor(registry), EventBus(),
                                                  maximum_rounds=10)
        providers = list(base_urls)
        for _ in range(REPEATS):
            conversations = {}
            for key, loop in loops.items():
                conversation = Conversation("You run a BTC desk.", _history(key[1]))
                await loop.run_turn(conversation, Trigger("tick", "warm-up"))
                conversations[key] = conversation
            gc.collect()  # the pre-fill's garbage is not the rounds' to pay for
            for turn in range(TURNS):
                order = providers[::-1] if turn % 2 else providers
                for size in SIZES:
                    for provider in order:
                        started = time.thread_time()
                        result = await loops[provider, size].run_turn(
                            conversations[provider, size], Trigger("tick", f"move {turn}"))
                        samples.setdefault((provider, size), []).append(
                            (time.thread_time() - started) / result.rounds)
    return samples


def _paired(samples: dict[tuple[str, int], list[float]], top: tuple[str, int],
            bottom: tuple[str, int]) -> float:
    """The median of the ratios of samples taken side by side."""
    return statistics.median(a / b for a, b in zip(samples[top], samples[bottom], strict=True))


async def _grown_cpu(base_url: str) -> tuple[float, float]:
    """CPU seconds per round of AgentLoop while one conversation grows over 100 turns: the
    median of the turns that start near 40 messages, and of the last ten (near 800)."""
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        return TICKER_TEXT

    config = OpenAIBackendConfig(base_url=base_url, model="scripted-model",
                                 context_window=1_000_000)
    per_turn: list[tuple[int, float]] = []
    async with OpenAICompatibleBackend(config) as backend:
        loop = AgentLoop("bench", backend, ToolCallExecutor(registry), EventBus(),
                         maximum_rounds=10)
        conversation = Conversation("You run a BTC desk.", [])
        for turn in range(100):
            size = len(conversation.messages)
            started = time.thread_time()
            result = await loop.run_turn(conversation, Trigger("tick", f"move {turn}"))
            per_turn.append((size, (time.thread_time() - started) / result.rounds))
    early = [cpu for size, cpu in per_turn if 30 <= size <= 60]
    return statistics.median(early), statistics.median(cpu for _, cpu in per_turn[90:])


async def _plain_sdk_cpu(base_url: str, size: int) -> float:
    """CPU seconds per model round of a plain openai SDK loop, median over repeats."""
    tools = [{"type": "function", "function": {
        "name": "get_ticker", "description": "Last price of a market.",
        "parameters": TickerArguments.model_json_schema()}}]
    samples = []
    async with AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        for _ in range(PLAIN_REPEATS):
            messages = _wire(_history(size))
            rounds = 0
            started = 0.0
            for turn in range(TURNS + 1):
                if turn == 1:
                    started, rounds = time.thread_time(), 0
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
            samples.append((time.thread_time() - started) / rounds)
    return statistics.median(samples)


def _forgetful(server: ScriptedServer,
               responder: Callable[[RecordedRequest], Step]) -> Callable[[RecordedRequest], Step]:
    """``responder``, for a server that keeps none of the requests it answers."""
    def respond(request: RecordedRequest) -> Step:
        server.requests.clear()
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


async def _main() -> None:
    print("round_overhead: client CPU per model round (thread CPU of the event loop)")
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}")
    print(f"each turn: {TOOL_ROUNDS} tool rounds + answer; {TURNS} turns x {REPEATS} repeats; "
          "medians")
    figures: dict[tuple[str, int], float] = {}
    with _servers() as (openai_url, anthropic_url):
        samples = await _agent_loop_samples({"openai": openai_url, "anthropic": anthropic_url})
        for size in SIZES:
            figures["agent", size] = statistics.median(samples["openai", size])
            figures["anthropic", size] = statistics.median(samples["anthropic", size])
            figures["plain", size] = await _plain_sdk_cpu(openai_url, size)
            print(f"~{size:>3} messages: AgentLoop {figures['agent', size] * 1000:7.2f} ms/round"
                  f" (on the Anthropic backend {figures['anthropic', size] * 1000:.2f})"
                  f"   plain SDK loop {figures['plain', size] * 1000:7.2f} ms/round")
        early, late = await _grown_cpu(openai_url)
        print(f"grown over 100 turns: AgentLoop {early * 1000:.2f} ms/round near ~40, "
              f"{late * 1000:.2f} ms/round in the last tenth (~800)")
    share = figures["agent", 800] / figures["plain", 800]
    growth = _paired(samples, ("openai", 800), ("openai", 40))
    at_800 = figures["agent", 800] * 1000
    print(f"AgentLoop at ~800: {at_800:.2f} ms/round  (bar: at most 2 ms)"
          f" -> {'PASS' if at_800 <= 2 else 'FAIL'}")
    print(f"AgentLoop ~800 / ~40 = {growth:.2f}x, median of side-by-side pairs  (bar: at most "
          f"1.2x) -> {'PASS' if growth <= 1.2 else 'FAIL'}")
    print(f"at ~800: AgentLoop / plain = 1/{1 / share:.1f}  (bar: at most 1/20)"
          f" -> {'PASS' if share <= 1 / 20 else 'FAIL'}")
    # Issue 16: the Anthropic backend no slower per round than the OpenAI one (a tenth more
    # is the noise of a shared machine between two runs of the same work).
    for size in SIZES:
        ratio = _paired(samples, ("anthropic", size), ("openai", size))
        print(f"at ~{size}: Anthropic / OpenAI backend = {ratio:.2f}x, median of side-by-side "
              f"pairs  (bar: at most 1.1x) -> {'PASS' if ratio <= 1.1 else 'FAIL'}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        anyio.run(_main)
