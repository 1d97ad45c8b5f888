"""What the benches measure beside their own figures: the machine, collector pauses, loop lag.

- :func:`machine`: the line every bench prints first (CPU model, cores, load average,
  Python), since the machine is shared and its load varies.
- :class:`CollectorWatch`: every cyclic-garbage collection while it is on, through
  ``gc.callbacks``: how many of each generation and how long each paused the thread that ran
  it (a collection runs in whichever thread allocated past the threshold, and holds the GIL).
- :class:`LoopLag`: an event-loop probe that sleeps a short period and records how late it
  wakes; the longest lateness is the longest stall of the loop (a collector pause is one).
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import anyio

__all__ = ["CollectorWatch", "LoopLag", "machine"]


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """One line: the CPU model, its cores, the load average now, Python."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return (f"machine: {_processor()}, {os.cpu_count()} cores, {platform.platform()}; "
            f"load average {load}; Python {platform.python_version()}")


@dataclass
class CollectorWatch:
    """Collections of the cyclic collector while :meth:`on`; ``pauses`` holds
    ``(generation, seconds)`` for each."""

    pauses: list[tuple[int, float]] = field(default_factory=list)
    _started: float = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._started))

    def on(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def off(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def reset(self) -> None:
        self.pauses.clear()

    def count(self, generation: int) -> int:
        return sum(1 for g, _ in self.pauses if g == generation)

    def seconds(self, generation: int | None = None) -> float:
        return sum(s for g, s in self.pauses if generation is None or g == generation)

    def longest(self) -> float:
        return max((s for _, s in self.pauses), default=0.0)


@dataclass
class LoopLag:
    """Run :meth:`run` in a task: every ``period`` it notes how much later than asked it
    woke; ``longest`` is the longest stall seen since the last :meth:`reset`."""

    period: float = 0.005
    longest: float = 0.0
    stopped: bool = False

    def reset(self) -> None:
        self.longest = 0.0

    async def run(self) -> None:
        while not self.stopped:
            asked = time.perf_counter()
            await anyio.sleep(self.period)
            self.longest = max(self.longest, time.perf_counter() - asked - self.period)
