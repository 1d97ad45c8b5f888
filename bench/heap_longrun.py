"""Does the heap keeper make a long-running daemon's memory grow? RSS over many turns and
compactions, with the keeper and without.

In-process, no network: ``--desks`` conversations each get ``--turns`` turns of four messages
(tick, tool call, tool result, answer), after each of which the desk's request body is built
by one OpenAI backend that all desks share, as a request builds it (each message's wire
encoding made once, the desk's joined history kept in pieces until its next compaction).
Every ``--compact-every`` turns a desk compacts (the oldest messages replaced by a summary,
dropped from memory), after which the keeper runs as the daemon runs it
(``HeapKeeper.compacted``: a freeze, or an hourly refresh; here the refresh period is scaled
down to ``--refresh-every`` compactions). One message in fifty holds a reference cycle, so
that garbage only a collection can reclaim is made too. The keeper's run and the run without
it (the collector alone) alternate in child processes, and each prints its RSS every tenth of
the run; the figures are the RSS at the end and its growth over the second half.

Run: ``.venv/bin/python bench/heap_longrun.py [--desks 50] [--turns 2000]``
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import subprocess
import sys
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent))

from probes import machine
from trading_agent.agent.backend import ModelRequestSpec
from trading_agent.agent.conversation import (
    Conversation,
    Message,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from trading_agent.app import event_loop
from trading_agent.backends.config import OpenAIBackendConfig
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.daemon.heap import HeapKeeper


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _turn(number: int) -> list[Message]:
    call = ToolUseBlock(id=f"call_{number}", name="get_ticker", arguments='{"symbol": "BTC"}')
    messages = [
        Message.user_text(f"[tick: BTC/USDT]\nBTC/USDT moved 0.5% to {21000 + number}"),
        Message(role="assistant", content=(TextBlock("Checking the market."), call)),
        Message(role="user", kind="tool_results", content=(ToolResultBlock(
            call.id, (TextBlock("BTC/USDT last 21,034.50 bid 21,034.40 ask 21,034.60"),)),)),
        Message(role="assistant", content=(TextBlock(f"No trade at {21000 + number}."),)),
    ]
    if number % 12 == 0:  # about one message in fifty holds a cycle
        messages[0].cache["self"] = messages[0]
    return messages


async def run(desks: int, turns: int, compact_every: int, refresh_every: int,
              keeper_on: bool) -> None:
    clock = [0.0]
    keeper = HeapKeeper(refresh_seconds=refresh_every - 0.5, clock=lambda: clock[0])
    conversations = [Conversation(f"desk {d}") for d in range(desks)]
    for conversation in conversations:  # start-up: some history restored
        conversation.messages.extend(m for n in range(compact_every) for m in _turn(n))
    if keeper_on:
        keeper.freeze()
    compactions = 0
    backend = OpenAICompatibleBackend(OpenAIBackendConfig(  # never connects: bodies only
        base_url="http://127.0.0.1:9/v1", model="bench", context_window=1_000_000))
    for turn in range(turns):
        for number, conversation in enumerate(conversations):
            conversation.messages.extend(_turn(turn))
            backend.request_body(ModelRequestSpec(conversation.system_prompt,
                                                  conversation.window(), [],
                                                  cache_key=f"desk-{number}"))
            if (turn + 1) % compact_every == 0:
                await conversation.compact(Message.user_text("Summary.", kind="summary"),
                                           len(conversation.messages) - 40)
                compactions += 1
                clock[0] = compactions / desks
                if keeper_on:
                    keeper.compacted()
        if (turn + 1) % (turns // 10) == 0:
            print(f"{turn + 1} {rss_mib():.1f} {gc.get_freeze_count()}", flush=True)
    print(f"refreshes {keeper.refreshes} freezes {keeper.freezes}", flush=True)


def child(mode: str, args: argparse.Namespace) -> tuple[list[float], str]:
    output = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--desks", str(args.desks), "--turns",
         str(args.turns), "--compact-every", str(args.compact_every), "--refresh-every",
         str(args.refresh_every)], capture_output=True, text=True, check=True).stdout
    lines = output.splitlines()
    return [float(line.split()[1]) for line in lines[:-1]], lines[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--desks", type=int, default=50)
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--compact-every", type=int, default=100,
                        help="turns between a desk's compactions")
    parser.add_argument("--refresh-every", type=int, default=5,
                        help="compaction rounds (every desk once) between refreshes")
    parser.add_argument("--child", choices=("on", "off"))
    args = parser.parse_args()
    if args.child:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        event_loop.run(functools.partial(  # the daemon's loop (daemon.event_loop = "auto")
            run, args.desks, args.turns, args.compact_every, args.refresh_every,
            args.child == "on"))
        return
    loop = "uvloop" if event_loop.uses_uvloop("auto") else "asyncio"
    print("heap_longrun: RSS over a long run, the heap keeper on and off (child processes), "
          f"on the daemon's event loop ({loop})")
    print(machine())
    print(f"{args.desks} desks x {args.turns} turns (4 messages each), a compaction every "
          f"{args.compact_every} turns (all but 40 messages dropped), a refresh every "
          f"{args.refresh_every} compaction rounds; reference: the same run without the keeper")
    for mode in ("off", "on", "off", "on"):
        samples, tail = child(mode, args)
        half = samples[len(samples) // 2 - 1]
        print(f"keeper {mode:>3}: RSS MiB by tenths {' '.join(f'{s:.0f}' for s in samples)}; "
              f"end {samples[-1]:.1f}, growth over the second half {samples[-1] - half:+.1f} "
              f"MiB ({tail})")
    print(machine())


if __name__ == "__main__":
    main()
