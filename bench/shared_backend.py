"""What a request body costs a desk that shares its model's backend with other desks, against
a desk alone on it, in the same process.

Desks on the same model share one backend. The parts of a body that stay the same from one
request of a desk to the next (its system prompt, its tool definitions: some 8 KB of JSON for
a demo desk's 14 tools) are encoded once and kept. They were kept in one slot, which each desk
overwrote in turn, so with two desks or more every request encoded both again: on an AMD
EPYC, 113 to 120 us a body for desks taking turns against 8.1 us for a desk alone (14x).

The desks are the demo's (``config/demo.toml``, opened as the daemon opens them: their real
tools and prompts), each with a conversation of 40 messages; only the bodies are built (no
request is sent). The reference is one desk building its bodies alone; then 2, 10 and 100
desks (the demo's, repeated with prompts of their own) take turns. The median of seven
measurements of each is printed, and the ratio to the reference.

Bar: a desk taking turns with others pays at most 1.2x what it pays alone.

Run: ``.venv/bin/python bench/shared_backend.py``
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probes import machine
from trading_agent.agent.backend import ModelRequestSpec, desk_cache_key
from trading_agent.agent.conversation import Message
from trading_agent.app.services import open_daemon
from trading_agent.settings.loading import load_settings

ROOT = Path(__file__).resolve().parents[1]
BODIES = 2_000
"""Bodies built per measurement."""
SIZES = (2, 10, 100)


def _requests(prompts: list[str], tools: list[list[dict[str, Any]]],
              count: int) -> list[ModelRequestSpec]:
    """``count`` desks' requests: the demo desks' prompts and tools, repeated, each desk's
    prompt its own and its conversation 40 messages long."""
    requests = []
    for number in range(count):
        messages = [Message.user_text(f"desk {number}: tick {turn}, BTC/USDT 64,{turn:03d}")
                    for turn in range(40)]
        requests.append(ModelRequestSpec(
            f"{prompts[number % len(prompts)]}\nYou are desk number {number}.", messages,
            tools[number % len(tools)], cache_key=desk_cache_key(f"desk{number}")))
    return requests


def _per_body(backend: Any, requests: list[ModelRequestSpec]) -> float:
    """Seconds a body, the desks taking turns."""
    started = time.perf_counter()
    for number in range(BODIES):
        backend.request_body(requests[number % len(requests)])
    return (time.perf_counter() - started) / BODIES


async def main() -> None:
    with tempfile.TemporaryDirectory() as state:
        os.environ["TRADING_AGENT_DAEMON__STATE_DIR"] = state
        settings = load_settings(ROOT / "config" / "demo.toml")
        async with open_daemon(settings) as daemon:
            desks = [daemon.supervisor.desk(name) for name in daemon.supervisor.desk_names()]
            backend = desks[0].loop.backend
            prompts = [desk.system_prompt for desk in desks]
            tools = [desk.loop.tool_definitions() for desk in desks]
    print(machine())
    print(f"the demo's {len(desks)} desks: {[len(t) for t in tools]} tools; each request "
          f"builds its body only ({BODIES} bodies a measurement, median of 7)")
    alone = _requests(prompts, tools, 1)
    lines = {count: _requests(prompts, tools, count) for count in SIZES}
    for requests in [alone, *lines.values()]:
        _per_body(backend, requests)  # every desk's memos filled: measured as they run
    timings: dict[int, list[float]] = {1: [], **{count: [] for count in SIZES}}
    for _ in range(7):  # side by side, so that the machine's noise weighs on all alike
        timings[1].append(_per_body(backend, alone))
        for count, requests in lines.items():
            timings[count].append(_per_body(backend, requests))
    reference = statistics.median(timings[1])
    print(f"  1 desk alone (the reference): {reference * 1e6:7.1f} us a body")
    worst = 0.0
    for count in SIZES:
        median = statistics.median(timings[count])
        worst = max(worst, median / reference)
        print(f"{count:>3} desks taking turns:       {median * 1e6:7.1f} us a body "
              f"({median / reference:.2f}x)")
    print(f"a desk sharing its backend: at most {worst:.2f}x its cost alone "
          f"(bar: at most 1.2x) -> {'PASS' if worst <= 1.2 else 'FAIL'}")


if __name__ == "__main__":
    asyncio.run(main())
