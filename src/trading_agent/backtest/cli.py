"""``trading-agent backtest``: run desks over history and write their report.

::

    trading-agent backtest CONFIG --desk NAME --from ISO --to ISO --out DIR
        [--cache record|strict|off] [--cache-dir DIR] [--data SYMBOL=FILE]
        [--messages FILE] [--force] [--mask [--mask-seed N]] [--require-unseen]
        [--audit] [--jobs N] [--concurrency N]
    trading-agent backtest CONFIG --from ISO --to ISO --out DIR --window DAYS
        (--windows N [--spacing random|even] | --walk-forward) [--seed S]
        [--random-traders N] [--jobs N]
    trading-agent backtest --compare A.toml B.toml ... --from ISO --to ISO --out DIR
    trading-agent backtest CONFIG --desk A --desk B ... --from ISO --to ISO --out DIR
    trading-agent backtest CONFIG --from-desk DESK --from ISO --to ISO --out DIR

Everything a run needs is checked before the first model call, and the report is written
into a temporary folder beside ``--out`` and moved into place only once whole: a bad input
or a failed run exits non-zero and leaves nothing half-written in ``--out``. Exit codes:
0 done, 1 the run failed (the model, a strict cache miss), 2 bad input; with
``--from-desk``, 3 the replay differs from what the desk did live (the first difference is
named).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from trading_agent.errors import ConfigError, TradingAgentError

__all__ = ["add_backtest_subcommand"]

_EXIT_FAILURE = 1
_EXIT_INPUT = 2
_EXIT_INTERRUPTED = 130

T = TypeVar("T")


@dataclass(frozen=True)
class _Run:
    label: str
    config: Path
    desk: str


def add_backtest_subcommand(subparsers: Any) -> None:
    """Adds ``backtest`` to the ``trading-agent`` command.

    Args:
        subparsers: The command's subparsers.
    """
    parser = subparsers.add_parser(
        "backtest", help="run a desk over historical candles and write a report",
        description="Runs a desk over historical candles exactly as the daemon runs it (the "
                    "same loop, tools, risk limits and paper exchange, on a simulated "
                    "clock) and writes report.json, trades.csv (round trips), fills.csv and "
                    "report.html to --out. "
                    "Model answers are cached: a re-run replays them for free.")
    parser.add_argument("config", type=Path, nargs="?", metavar="CONFIG",
                        help="the TOML config file")
    parser.add_argument("--desk", action="append", default=[], metavar="NAME",
                        help="the desk to run (may be left out when the config has one; "
                             "repeat it to compare desks)")
    parser.add_argument("--compare", type=Path, nargs="+", default=[], metavar="CONFIG",
                        help="several config files run over the same span, side by side")
    parser.add_argument("--from", dest="start", required=True, metavar="ISO",
                        help="the span's start, such as 2023-01-05 or 2023-01-05T12:00 (UTC)")
    parser.add_argument("--to", dest="end", required=True, metavar="ISO",
                        help="the span's end")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="where the report goes (new or empty, unless --force)")
    parser.add_argument("--force", action="store_true",
                        help="replace what --out holds")
    parser.add_argument("--cache", choices=["record", "strict", "off"], default="record",
                        help="record: replay cached answers, ask the model on a miss (the "
                             "default); strict: fail on the first miss; off: no cache")
    parser.add_argument("--cache-dir", type=Path, metavar="DIR",
                        help="where model answers are cached "
                             "(~/.cache/trading-agent/responses by default)")
    parser.add_argument("--data", action="append", default=[], metavar="[SYMBOL=]FILE",
                        help="an OHLCV CSV file to use instead of the desk's candles")
    parser.add_argument("--data-dir", type=Path, metavar="DIR",
                        help="where `trading-agent data fetch` keeps candles")
    parser.add_argument("--messages", type=Path, metavar="FILE",
                        help="operator messages to send during the run, one per line: "
                             "ISO-TIME TEXT")
    parser.add_argument("--mask", action="store_true",
                        help="the model reads a disguised market: times shifted by whole "
                             "weeks, prices scaled by one factor, the symbol renamed "
                             "ASSET/USD; fills, fees and the report stay real")
    parser.add_argument("--mask-seed", type=int, default=0, metavar="N",
                        help="picks the mask's time offset and price factor (0 by default)")
    parser.add_argument("--audit", action="store_true",
                        help="run the span plain and masked and report the difference: "
                             "return, trades, how many decisions agree, and what it suggests")
    parser.add_argument("--windows", type=int, metavar="N",
                        help="run N windows of --window days inside --from..--to (random "
                             "starts from --seed, or --spacing even) and report a scorecard "
                             "against baselines")
    parser.add_argument("--window", type=float, metavar="DAYS",
                        help="each window's length in days (with --windows or --walk-forward)")
    parser.add_argument("--spacing", choices=["random", "even"], default="random",
                        help="how --windows start: at random (seeded) or evenly spaced")
    parser.add_argument("--walk-forward", action="store_true",
                        help="consecutive windows of --window days from --from to --to")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the random windows, random traders and bootstrap")
    parser.add_argument("--random-traders", type=int, default=20, metavar="N",
                        help="random traders per window (20 by default)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run windows (or several desks and configs) in N worker "
                             "processes; the response cache is shared")
    parser.add_argument("--concurrency", type=int, metavar="N",
                        help="at most N model calls in flight across all --jobs (for a "
                             "remote model); a 429 is waited out and asked again")
    parser.add_argument("--require-unseen", action="store_true",
                        help="refuse a span that starts before the end of the model's "
                             "knowledge_cutoff (the model may have seen it)")
    parser.add_argument("--from-desk", metavar="DESK",
                        help="replay what paper desk DESK did in the daemon (CONFIG is the "
                             "daemon's) from --from to --to, from its stored triggers, "
                             "operator messages and model answers, and name the first "
                             "request, order or fill that differs (exit 3)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(handler=_backtest)


def _backtest(args: argparse.Namespace) -> int:
    if args.from_desk is not None:
        from trading_agent.backtest.replay_cli import replay_command

        return replay_command(args)
    try:
        runs, out, specs = _prepare(args)
    except ConfigError as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return _EXIT_INPUT
    if args.windows is not None or args.walk_forward:
        return _sweep(args, runs, out, specs)
    import anyio  # here: the other commands need none of the engine

    from trading_agent.backtest.engine import run_backtest
    from trading_agent.backtest.progress import ProgressBar
    from trading_agent.backtest.record import BacktestRecord
    from trading_agent.backtest.report import summary_table, write_comparison, write_report

    records: list[BacktestRecord] = []
    in_workers = args.jobs > 1 and len(specs) > 1
    if in_workers:
        from trading_agent.backtest.parallel import run_records

        try:
            records = run_records(specs, workers=args.jobs)
        except ConfigError as exc:
            print(f"backtest: {exc}", file=sys.stderr)
            return _EXIT_INPUT
        except (TradingAgentError, KeyboardInterrupt) as exc:
            why = ("interrupted" if isinstance(exc, KeyboardInterrupt)
                   else f"failed: {type(exc).__name__}: {exc}")
            print(f"backtest {why}\nNothing was written to {out}. Every answer the model "
                  "gave is kept in the response cache: a re-run replays them for free.",
                  file=sys.stderr)
            return _EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else _EXIT_FAILURE
    for run, spec in zip(runs, specs, strict=True):
        if in_workers:
            break  # run by the workers
        bar = ProgressBar(run.label)
        try:
            records.append(anyio.run(_one, run_backtest, spec,
                                     None if args.quiet else bar, backend="asyncio"))
        except ConfigError as exc:
            bar.finish()
            print(f"backtest: {exc}", file=sys.stderr)
            return _EXIT_INPUT
        except (TradingAgentError, KeyboardInterrupt) as exc:
            bar.finish()
            why = ("interrupted" if isinstance(exc, KeyboardInterrupt)
                   else f"failed: {type(exc).__name__}: {exc}")
            print(f"backtest of {run.label} {why}\n"
                  f"Nothing was written to {out}. Every answer the model gave is kept in "
                  "the response cache: a re-run replays them for free.", file=sys.stderr)
            return _EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else _EXIT_FAILURE
        bar.finish()
    audited = None
    if args.audit:
        from trading_agent.backtest.audit import audit
        from trading_agent.backtest.metrics import compute_figures

        plain, masked = records
        audited = audit(plain, masked, compute_figures(plain), compute_figures(masked))

    def write(staging: Path) -> list[tuple[str, Any]]:
        if audited is not None:
            return list(zip(["plain", "masked"],
                            write_comparison(records, ["plain", "masked"], staging,
                                             audit=audited), strict=True))
        if len(records) == 1:
            return [(runs[0].label, write_report(records[0], staging))]
        labels = [run.label for run in runs]
        return list(zip(labels, write_comparison(records, labels, staging), strict=True))

    try:
        figures = _write_out(out, write)
    except _OutNotWritten as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return _EXIT_FAILURE
    print(summary_table(figures))
    if audited is not None:
        agreement = "n/a" if audited.agreement is None else f"{audited.agreement:.0%}"
        print(f"\nAudit: return plain {audited.plain_return:+.2%}, masked "
              f"{audited.masked_return:+.2%}; trades {audited.plain_trades} vs "
              f"{audited.masked_trades}; decisions agreeing {agreement} of "
              f"{audited.decisions}.\n{audited.verdict}")
    for label, figure in figures:
        for notice in figure.notices:
            print(f"\nRead this first ({label}): {notice}.")
    trades = ("trades.csv and fills.csv" if len(records) == 1
              else "a trades-<run>.csv and a fills-<run>.csv per run")
    print(f"\nReport: {out / 'report.html'} (with report.json, {trades})")
    return 0


async def _one(run_backtest: Any, spec: Any, bar: Any) -> Any:
    return await run_backtest(spec, on_progress=bar)


def _prepare(args: argparse.Namespace) -> tuple[list[_Run], Path, list[Any]]:
    """Checks every argument, config and output before anything runs.

    Raises:
        ConfigError: What is wrong, with the file, key or value.
    """
    from trading_agent.backtest.engine import (
        BacktestSpec,
        desk_settings,
        load_history,
        load_scripted_messages,
        span_notice,
    )
    from trading_agent.backtest.mask import choose_mask
    from trading_agent.logging_setup import configure_logging
    from trading_agent.settings import load_settings

    start, end = _time(args.start, "--from"), _time(args.end, "--to")
    if start >= end:
        raise ConfigError(f"--from {args.start} is not before --to {args.end}")
    out = _check_out(args.out, force=args.force)
    runs = _runs(args)
    named = [_data_file(text) for text in args.data]
    data = {symbol: path for symbol, path in named if symbol is not None}
    unnamed = [path for symbol, path in named if symbol is None]
    if len(unnamed) > 1:
        raise ConfigError("--data: several files without a symbol; use --data SYMBOL=FILE")
    messages = load_scripted_messages(args.messages) if args.messages else []
    specs = []
    secrets: set[str] = set()
    for run in runs:
        settings = load_settings(run.config, check_environment=True)
        secrets.update(settings.secret_env_vars())
        spec = BacktestSpec(settings, run.desk, start, end, cache_mode=args.cache,
                            cache_dir=args.cache_dir, data=data, data_dir=args.data_dir,
                            messages=messages, source=str(run.config),
                            concurrency=args.concurrency)
        config = desk_settings(spec)
        if unnamed:
            if len(config.symbols) != 1:
                raise ConfigError(f"--data {unnamed[0]}: desk {run.desk} trades "
                                  f"{', '.join(config.symbols)}; name the symbol: "
                                  "--data SYMBOL=FILE")
            spec = replace(spec, data={**data, config.symbols[0]: unnamed[0]})
        load_history(spec, config)  # the data and the span, checked now
        if args.mask:
            spec = replace(spec, mask=choose_mask(config.symbols, start, args.mask_seed))
        notice = span_notice(spec, config)
        if notice is not None:
            if args.require_unseen:
                raise ConfigError(f"--require-unseen: desk {run.desk} of {run.config}: "
                                  f"{notice}")
            print(f"backtest: warning: desk {run.desk}: {notice}", file=sys.stderr)
        specs.append(spec)
    if args.concurrency is not None and args.concurrency < 1:
        raise ConfigError("--concurrency must be 1 or more")
    if args.jobs < 1:
        raise ConfigError("--jobs must be 1 or more")
    if args.windows is not None or args.walk_forward:
        _check_windows(args)
    if args.audit:
        if len(specs) != 1 or args.mask or args.windows is not None or args.walk_forward:
            raise ConfigError("--audit runs one desk plain and masked: name one desk and one "
                              "config, without --mask or --compare")
        spec = specs[0]
        desk = desk_settings(spec).symbols
        runs = [replace(runs[0], label="plain"), replace(runs[0], label="masked")]
        specs = [spec, replace(spec, mask=choose_mask(desk, start, args.mask_seed))]
    configure_logging("warning", "auto", secret_env_names=secrets, stream=sys.stderr)
    return runs, out, specs


def _check_windows(args: argparse.Namespace) -> None:
    if args.window is None or args.window <= 0:
        raise ConfigError("--windows and --walk-forward need --window DAYS (above 0)")
    if args.windows is not None and args.walk_forward:
        raise ConfigError("choose --windows N or --walk-forward, not both")
    if args.windows is not None and args.windows < 1:
        raise ConfigError("--windows must be 1 or more")
    if args.random_traders < 0:
        raise ConfigError("--random-traders must be 0 or more")


def _sweep(args: argparse.Namespace, runs: list[_Run], out: Path, specs: list[Any]) -> int:
    """Many windows of each run, with baselines: the scorecard."""
    from datetime import timedelta

    from trading_agent.backtest.engine import desk_settings, span_notice
    from trading_agent.backtest.parallel import run_jobs
    from trading_agent.backtest.scorecard import scorecard, with_deflated_sharpe
    from trading_agent.backtest.scorecard_report import scorecard_text, write_scorecard
    from trading_agent.backtest.sweep import WindowJob
    from trading_agent.backtest.windows import choose_windows
    from trading_agent.trading.exchange import timeframe_delta

    first = specs[0]
    step = timeframe_delta(desk_settings(first).exchange.replay.timeframe)
    try:
        windows = choose_windows(
            first.start, first.end, timedelta(days=args.window), count=args.windows or 0,
            spacing="walk-forward" if args.walk_forward else args.spacing, seed=args.seed,
            step=step)
    except ValueError as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return _EXIT_INPUT
    jobs = [WindowJob(spec, window, args.random_traders, args.seed * 1000)
            for spec in specs for window in windows]
    try:
        results = run_jobs(jobs, workers=args.jobs, quiet=args.quiet)
    except ConfigError as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return _EXIT_INPUT
    except (TradingAgentError, KeyboardInterrupt) as exc:
        why = ("interrupted" if isinstance(exc, KeyboardInterrupt)
               else f"failed: {type(exc).__name__}: {exc}")
        print(f"backtest {why}\nNothing was written to {out}. Every answer the model gave "
              "is kept in the response cache: a re-run replays them for free.",
              file=sys.stderr)
        return _EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else _EXIT_FAILURE
    cards = with_deflated_sharpe([
        scorecard(run.label, results[index * len(windows):(index + 1) * len(windows)],
                  seed=args.seed) for index, run in enumerate(runs)])
    notices = [f"{run.label}: {notice}" for run, spec in zip(runs, specs, strict=True)
               if (notice := span_notice(spec, desk_settings(spec))) is not None]
    try:
        _write_out(out, lambda staging: write_scorecard(cards, windows, staging,
                                                        notices=notices))
    except _OutNotWritten as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return _EXIT_FAILURE
    print(scorecard_text(cards, windows))
    for notice in notices:
        print(f"Read this first: {notice}.")
    print(f"Report: {out / 'report.html'} (with report.json and windows.csv)")
    return 0


def _time(text: str, flag: str) -> datetime:
    from trading_agent.backtest.engine import parse_time

    try:
        return parse_time(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not an ISO 8601 date or time (use a form like "
                          "2023-01-05 or 2023-01-05T12:00, UTC unless it has an offset)") from None


def _check_out(out: Path, *, force: bool) -> Path:
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"--out {out} exists and is not a folder")
        if any(out.iterdir()) and not force:
            raise ConfigError(f"--out {out} exists and is not empty; choose another folder "
                              "or pass --force to replace what it holds")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {parent} does not exist")
    return out


def _runs(args: argparse.Namespace) -> list[_Run]:
    from trading_agent.settings import load_settings

    configs: list[Path] = list(args.compare)
    if args.config is not None:
        configs.insert(0, args.config)
    if not configs:
        raise ConfigError("name a config file (trading-agent backtest CONFIG ...) or several "
                          "with --compare")
    runs: list[_Run] = []
    for config in configs:
        desks = list(args.desk)
        if not desks:
            known = list(load_settings(config).desks)
            if len(known) != 1:
                raise ConfigError(f"{config} has {len(known)} desks ({', '.join(known)}); "
                                  "choose with --desk NAME")
            desks = known
        runs.extend(_Run(desk, config, desk) for desk in desks)
    labels = [run.desk for run in runs]
    if len(set(labels)) != len(labels):
        runs = [replace(run, label=f"{run.config.stem}:{run.desk}") for run in runs]
    if len({run.label for run in runs}) != len(runs):
        raise ConfigError("the same desk of the same config is named twice")
    return runs


def _data_file(text: str) -> tuple[str | None, Path]:
    symbol, sep, path = text.rpartition("=")
    if not sep:
        return None, Path(text)
    if not symbol or not path:
        raise ConfigError(f"--data {text!r}: use FILE or SYMBOL=FILE")
    return symbol.strip().upper(), Path(path)


class _OutNotWritten(Exception):
    """The report could not be written (a full disk, no permission): one line saying so."""


def _write_out(out: Path, write: Callable[[Path], T]) -> T:
    """Writes the report into a temporary folder beside ``out``, then moves it into place;
    a file system error leaves ``out`` as it was.

    Raises:
        _OutNotWritten: The system refused a write, naming ``out``, the file and why.
    """
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        result = write(staging)
        _move_into_place(staging, out)
        return result
    except OSError as exc:
        file = f" ({Path(exc.filename).name})" if exc.filename else ""
        raise _OutNotWritten(
            f"cannot write the report to {out}: {exc.strerror or exc}{file}; nothing was "
            "written there (the response cache keeps every answer: a re-run after freeing "
            "space replays them for free)") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _move_into_place(staging: Path, out: Path) -> None:
    """The finished report replaces ``out`` (checked empty, or --force)."""
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
