"""The ``trading-agent`` command.

- ``trading-agent check-config FILE``: validates a config file (with the ``TRADING_AGENT_*``
  variables over it); prints ``OK: ...`` and exits 0, or prints every problem and exits 2.
- ``trading-agent run --config FILE``: starts the daemon (:mod:`trading_agent.app`); a bad
  config is refused the same way (exit 2), before anything starts. The daemon runs with the
  umask 0077: what it writes (the state directory, the SQLite files, the lock, the socket)
  is its user's alone.
- The operator's commands (chat, status, ...) come from :mod:`trading_agent.operator.cli`.
- ``trading-agent backtest`` and ``trading-agent data fetch`` come from
  :mod:`trading_agent.backtest.cli` and :mod:`trading_agent.backtest.fetch`.

Each subcommand sets ``handler``: a function of the parsed arguments returning the exit code.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trading_agent import __version__
from trading_agent.backends.providers import provider
from trading_agent.errors import ConfigError, TradingAgentError
from trading_agent.logging_setup import configure_logging
from trading_agent.settings import Settings, load_settings, missing_secrets

__all__ = ["EXIT_CONFIG", "EXIT_FAILURE", "build_parser", "main"]

EXIT_CONFIG = 2
"""The exit code for a configuration that is refused."""

EXIT_FAILURE = 1
"""The exit code when the daemon stops on an error (systemd's Restart=on-failure restarts)."""

_DAEMON_UMASK = 0o077
"""Files and folders the daemon makes are its user's alone (the unit sets ``UMask=0077`` too;
a daemon started by hand under the usual 0022 would make them readable by everyone)."""


def _check_config(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.file)
        _check_windows(settings)
        _check_fleet_files(settings, args.file)
    except ConfigError as exc:
        print(f"{args.file}: the configuration is not valid:", file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    print(_summary(settings))
    for line in missing_secrets(settings, args.file):
        print(f"warning: {line}")
    for line in _unheld_protection(settings):
        print(f"warning: {line}")
    return 0


def _unheld_protection(settings: Settings) -> list[str]:
    """One line per live desk whose exchange cannot hold its stops or targets itself."""
    live = {name: desk.exchange.ccxt for name, desk in settings.desks.items()
            if desk.exchange.mode == "live" and desk.exchange.ccxt is not None}
    if not live:
        return []
    # Imported here: ccxt takes a second to import, and a paper config never needs it.
    from trading_agent.trading.ccxt_exchange import protection_held_by
    from trading_agent.trading.protection import unheld_notice

    lines = []
    for name, ccxt_config in live.items():
        exchange = ccxt_config.exchange_id + (" testnet" if ccxt_config.sandbox else "")
        notice = unheld_notice(exchange, protection_held_by(ccxt_config))
        if notice is not None:
            lines.append(f"desk {name}: {notice}")
    return lines


def _check_windows(settings: Settings) -> None:
    """Refuses a desk whose system prompt and tools, with room for an answer, do not fit
    its model's window (measured with the model's tokenizer where the provider has one
    offline, the local model's; else estimated on the large side; ``run`` measures with the
    server's tokenizer).

    Raises:
        ConfigError: A desk does not fit, naming the numbers.
    """
    # Imported here: building a desk loads its tools, the agent loop and the model
    # clients, which the operator's commands never need.
    import anyio

    from trading_agent.desks.building import check_fixed_part, offline_tool_definitions

    async def check() -> None:
        for name, desk in settings.desks.items():
            count = await provider(desk.model.provider).offline_counter(desk.model)
            await check_fixed_part(name, desk, await offline_tool_definitions(name, desk),
                                   count=count)

    anyio.run(check, backend="asyncio")


def _check_fleet_files(settings: Settings, path: Path) -> None:
    """Refuses NATS certificate files that cannot be used (``run`` reads them too).

    Raises:
        ConfigError: A file of ``[fleet]`` cannot be read or used, naming it and its key.
    """
    if settings.in_fleet and (settings.fleet.nats_url or "").startswith("tls://"):
        try:
            settings.fleet.tls_context()
        except ValueError as exc:
            raise ConfigError(f"{path}: {exc}") from exc


def _summary(settings: Settings) -> str:
    desks = settings.desks
    where = (f"state in {settings.state_directory()}" if settings.store.url is None else
             f"a fleet: state on {settings.store.url}, daemons meeting on "
             f"{settings.fleet.nats_url}")
    lines = [f"OK: {len(desks)} desk{'s' if len(desks) != 1 else ''} "
             f"({', '.join(desks)}); {where}"]
    for name, desk in desks.items():
        model = desk.model
        model_name = provider(model.provider).model_name(model)
        triggers = desk.triggers
        wakes = []
        if triggers.ticks.move_percent is not None:
            wakes.append(f"moves of {triggers.ticks.move_percent}%")
        if triggers.ticks.on_candle_close:
            wakes.append(f"{'/'.join(triggers.ticks.on_candle_close)} candle closes")
        wakes.extend(f"schedule {schedule.key!r}" for schedule in triggers.schedules)
        lines.append(
            f"  {name}: {desk.exchange.mode} on {desk.exchange.feed}, "
            f"{', '.join(desk.symbols)}; model {model.provider}:{model_name}; "
            f"wakes on {', '.join(wakes) or 'operator messages only'}")
    telegram = settings.telegram
    if telegram is not None:
        operators = [o.name for o in settings.operator.operators
                     if o.telegram_user_id is not None]
        summary = (f" daily summary at {telegram.daily_summary_at} UTC;"
                   if telegram.daily_summary_at else "")
        lines.append(f"  telegram: token from {telegram.token_env}, chats start on desk "
                     f"{telegram.default_desk};{summary} operators "
                     f"{', '.join(operators) or 'none (give one a telegram_user_id)'}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, check_environment=True)
    except ConfigError as exc:
        print(f"{args.config}: refusing to start, the configuration is not valid:",
              file=sys.stderr)
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG
    configure_logging(settings.daemon.log_level, settings.daemon.log_format,
                      secret_env_names=settings.secret_env_vars())
    # Imported here: check-config and the operator's commands need none of the daemon's
    # services (the fleet's NATS client, telemetry, the API server).
    from trading_agent.app.event_loop import run as run_on_loop
    from trading_agent.app.running import run_daemon

    previous_umask = os.umask(_DAEMON_UMASK)
    try:
        run_on_loop(functools.partial(run_daemon, settings, config_path=Path(args.config)),
                    settings.daemon.event_loop)
    except ConfigError as exc:
        print(f"{args.config}: refusing to start: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except TradingAgentError as exc:
        print(f"trading-agent stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        os.umask(previous_umask)  # for a caller in the same process (tests)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="trading-agent",
        description="Runs LLM trading desks, and talks to a running daemon.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    check = subparsers.add_parser(
        "check-config", help="validate a config file and exit",
        description="Validates a config file with the TRADING_AGENT_* environment variables "
                    "over it. Exit 0 when valid, 2 with every problem listed otherwise.")
    check.add_argument("file", type=Path, metavar="FILE", help="the TOML config file")
    check.set_defaults(handler=_check_config)

    run = subparsers.add_parser(
        "run", help="start the daemon",
        description="Starts the daemon on a config file; refuses (exit 2) a bad config.")
    run.add_argument("--config", type=Path, required=True, metavar="FILE",
                     help="the TOML config file")
    run.set_defaults(handler=_run)

    # The operator's commands (desks, chat, events, the controls, the books): imported
    # here, as only they need them.
    from trading_agent.operator.audit_cli import add_audit_subcommand
    from trading_agent.operator.books_cli import add_books_subcommands
    from trading_agent.operator.cli import add_subcommands
    from trading_agent.operator.control_cli import add_control_subcommands

    add_subcommands(subparsers)
    add_control_subcommands(subparsers)
    add_books_subcommands(subparsers)
    add_audit_subcommand(subparsers)

    from trading_agent.backtest.cli import add_backtest_subcommand
    from trading_agent.backtest.fetch import add_data_subcommand

    add_backtest_subcommand(subparsers)
    add_data_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: The arguments (``sys.argv[1:]`` by default).

    Returns:
        The exit code.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
