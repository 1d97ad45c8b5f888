"""What ``synchronous=FULL`` costs the store: one message append, FULL against NORMAL.

The store commits every message before the conversation goes on (an operator's message is
kept before the model is called). This times ``store.transcripts.append_message`` (FULL, through a
worker thread) against the same INSERT on a plain connection with ``synchronous=NORMAL``
and against one with FULL, all on the same disk in the same process, then restoring the
300-message conversation.

Then group commit: many desks appending at the same moment (every desk storing its trigger
when a candle closes) share commits. It times ``DESKS`` concurrent appends, one per desk,
against the same number made one after another, and counts the commits (fsyncs) each took.

Run: ``.venv/bin/python bench/store_appends.py``.
"""

from __future__ import annotations

import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from trading_agent.agent.conversation import Message, TextBlock
from trading_agent.store import Store

ROUNDS = 300
DESKS = 200
REPEATS = 5


def _message(i: int) -> Message:
    return Message(role="assistant", content=(TextBlock(f"Round {i}: BTC holds 64,000. " * 8),))


def _plain(path: Path, synchronous: str) -> Callable[[Message], None]:
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={synchronous}")
    connection.execute("CREATE TABLE m (id TEXT PRIMARY KEY, content TEXT)")

    def append(message: Message) -> None:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO m VALUES (?, ?)", (message.id, message.text))
        connection.execute("COMMIT")

    return append


async def _bench(folder: Path) -> None:
    timings: dict[str, list[float]] = {}
    for synchronous in ("NORMAL", "FULL"):
        append = _plain(folder / f"plain-{synchronous}.sqlite3", synchronous)
        samples = []
        for i in range(ROUNDS):
            message = _message(i)
            start = time.perf_counter()
            append(message)
            samples.append(time.perf_counter() - start)
        timings[f"plain sqlite3, synchronous={synchronous}"] = samples

    store = await Store.open(folder / "store.sqlite3")
    samples = []
    for i in range(ROUNDS):
        message = _message(i)
        start = time.perf_counter()
        await store.transcripts.append_message("alpha", message)
        samples.append(time.perf_counter() - start)
    timings["transcripts.append_message (FULL, worker thread)"] = samples
    await store.transcripts.append_message("alpha", Message.user_text("[tick]"))
    restores = []
    for _ in range(5):
        start = time.perf_counter()
        conversation = await store.transcripts.restore_conversation("alpha", "prompt")
        restores.append(time.perf_counter() - start)

    concurrent: dict[str, list[float]] = {"one after another": [], "all at once": []}
    commits: dict[str, int] = {}
    for _ in range(REPEATS):
        for name in concurrent:
            messages = [(f"desk{number}", _message(number)) for number in range(DESKS)]
            before = store.database.commits
            start = time.perf_counter()
            if name == "all at once":
                async with anyio.create_task_group() as group:
                    for desk, message in messages:
                        group.start_soon(store.transcripts.append_message, desk, message)
            else:
                for desk, message in messages:
                    await store.transcripts.append_message(desk, message)
            concurrent[name].append(time.perf_counter() - start)
            commits[name] = store.database.commits - before
    await store.close()

    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python "
          f"{sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}")
    print(f"{ROUNDS} appends each, one commit per message; medians:")
    reference = statistics.median(timings["plain sqlite3, synchronous=NORMAL"])
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"  {name:45s} {median * 1e3:7.3f} ms  ({median / reference:5.1f}x NORMAL)")
    print(f"restore of {len(conversation.messages)} messages: "
          f"{statistics.median(restores) * 1e3:.1f} ms (median of {len(restores)})")
    print(f"{DESKS} desks appending one message each (transcripts.append_message, FULL); "
          f"medians of {REPEATS}:")
    sequential = statistics.median(concurrent["one after another"])
    for name, values in concurrent.items():
        median = statistics.median(values)
        print(f"  {name:20s} {median * 1e3:8.1f} ms for all, {commits[name]:4d} commits  "
              f"({sequential / median:5.1f}x faster than one after another)")


def main() -> None:
    """Runs the benchmark in a temporary folder on the system's temp disk."""
    with tempfile.TemporaryDirectory() as folder:
        anyio.run(_bench, Path(folder))


if __name__ == "__main__":
    main()
