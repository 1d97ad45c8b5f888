"""Running many windows (or several desks and configs): in this process, or in worker
processes with ``--jobs N``.

Each window is a :class:`~.sweep.WindowJob` run by :func:`~.sweep.run_window`, its own
engine on its own event loop. With several workers the jobs go to a process pool (spawned
processes: nothing of this process's loop or threads is inherited); the response cache file
is shared, each process appending under a file lock (:mod:`.cache`). Results come back in
the jobs' order whatever order they finish in, so the report is the same as one job's.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import anyio

from trading_agent.backtest.engine import BacktestSpec, run_backtest
from trading_agent.backtest.record import BacktestRecord
from trading_agent.backtest.scorecard import WindowResult
from trading_agent.backtest.sweep import WindowJob, run_window
from trading_agent.logging_setup import configure_logging

__all__ = ["run_jobs", "run_records"]


def run_jobs(jobs: Sequence[WindowJob], *, workers: int = 1,
             quiet: bool = True) -> list[WindowResult]:
    """Runs every job; the results in the jobs' order.

    Args:
        jobs: The windows to run.
        workers: Worker processes; 1 runs them here, one after another.
        quiet: No line per finished window on stderr.

    Raises:
        ConfigError: Bad input found by a job.
        BackendError: A job's model failed.
    """
    if workers <= 1 or len(jobs) <= 1:
        results = []
        for number, job in enumerate(jobs, start=1):
            results.append(run_window(job))
            _done(number, len(jobs), job, quiet)
        return results
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context,
                             initializer=_worker_logging) as pool:
        futures = [pool.submit(run_window, job) for job in jobs]
        found: list[WindowResult] = []
        for number, (job, future) in enumerate(zip(jobs, futures, strict=True), start=1):
            found.append(future.result())
            _done(number, len(jobs), job, quiet)
        return found


def run_records(specs: Sequence[BacktestSpec], *, workers: int) -> list[BacktestRecord]:
    """Runs several whole backtests (desks, configs) in worker processes; the records in
    the specs' order, their transcripts read into memory to come back.

    Raises:
        ConfigError: Bad input found by a run.
        BackendError: A run's model failed.
    """
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context,
                             initializer=_worker_logging) as pool:
        return list(pool.map(_one_record, specs))


def _one_record(spec: BacktestSpec) -> BacktestRecord:
    record: BacktestRecord = anyio.run(run_backtest, spec, backend="asyncio")
    # A spooled transcript reads a temporary file of this process: brought along whole.
    record.decisions = [replace(decision, transcript=tuple(decision.transcript))
                        for decision in record.decisions]
    return record


def _worker_logging() -> None:
    """A worker logs warnings and worse to stderr, as the command does (a fill per order at
    info would drown the output)."""
    configure_logging("warning", "auto", stream=sys.stderr)


def _done(number: int, total: int, job: WindowJob, quiet: bool) -> None:
    if not quiet:
        print(f"window {number}/{total} done: {job.spec.desk} from {job.window.label} UTC",
              file=sys.stderr, flush=True)
