"""``trading-agent backtest CONFIG --from-desk DESK --from ISO --to ISO --out DIR``.

Replays what a paper desk did in the daemon (:mod:`.replay_day`), prints whether it
matched or the first difference, and writes ``replay.json`` to ``--out``. Exit codes: 0 the
replay matched, 3 it differs, 2 bad input (an unknown desk, a live desk, nothing stored in
the span, another flag that does not apply), 1 it failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime

import anyio

from trading_agent.backtest.engine import parse_time
from trading_agent.backtest.files import private_folder, write_private
from trading_agent.backtest.replay_day import ReplaySpec, replay_desk_day
from trading_agent.errors import ConfigError, TradingAgentError
from trading_agent.logging_setup import configure_logging
from trading_agent.settings import load_settings

__all__ = ["EXIT_DIFFERS", "replay_command"]

EXIT_DIFFERS = 3
"""The replay ran and parted from what the desk did live."""

_NOT_WITH = {"desk": "--desk", "compare": "--compare", "data": "--data",
             "messages": "--messages", "mask": "--mask", "audit": "--audit",
             "windows": "--windows", "walk_forward": "--walk-forward"}
"""Flags that shape a new run: a replay runs the stored day as it ran."""


def replay_command(args: argparse.Namespace) -> int:
    """Runs ``--from-desk``; the exit code."""
    try:
        spec = _spec(args)
    except ConfigError as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return 2
    try:
        outcome = anyio.run(replay_desk_day, spec, backend="asyncio")
    except ConfigError as exc:
        print(f"backtest: {exc}", file=sys.stderr)
        return 2
    except TradingAgentError as exc:
        print(f"backtest --from-desk {spec.desk} failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    out = args.out
    private_folder(out)
    write_private(out / "replay.json",
                  (json.dumps(outcome.to_json(), indent=2) + "\n").encode("utf-8"))
    print(outcome.summary())
    print(f"\nReport: {out / 'replay.json'}")
    return 0 if outcome.matched else EXIT_DIFFERS


def _spec(args: argparse.Namespace) -> ReplaySpec:
    for name, flag in _NOT_WITH.items():
        if getattr(args, name):
            raise ConfigError(f"{flag} does not apply to --from-desk: a replay runs the "
                              "stored day as the desk ran it")
    if args.config is None:
        raise ConfigError("--from-desk: name the daemon's config file "
                          "(trading-agent backtest CONFIG --from-desk DESK ...)")
    start, end = _time(args.start, "--from"), _time(args.end, "--to")
    if start >= end:
        raise ConfigError(f"--from {args.start} is not before --to {args.end}")
    out = args.out
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not args.force)):
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose another "
                          "or pass --force to replace its replay.json")
    settings = load_settings(args.config)
    # Warnings and worse, on stderr, secrets hidden: as a backtest logs.
    configure_logging("warning", "auto", secret_env_names=settings.secret_env_vars(),
                      stream=sys.stderr)
    return ReplaySpec(settings, args.from_desk, start, end, settings.state_directory(),
                      source=str(args.config))


def _time(text: str, flag: str) -> datetime:
    try:
        return parse_time(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not an ISO 8601 date or time (use a form like "
                          "2023-01-05T12:00, UTC unless it has an offset)") from None
