"""``trading-agent audit``: who did what to the desks, from where, and how it ended.

Reads the running daemon's audit through its operator API (``GET /api/audit``), found as for
``desks`` (``--socket``, ``--url``, ``--config``...). Exit codes: 0 done; 1 the daemon cannot
be reached; 2 refused (a bad ``--since``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from trading_agent.operator.cli import add_connection_options, run_with_client
from trading_agent.operator.client import OperatorClient, OperatorRequestError
from trading_agent.operator.render import printable

__all__ = ["add_audit_subcommand", "format_action"]


def add_audit_subcommand(subparsers: Any) -> None:
    """Adds ``audit``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.
    """
    audit = subparsers.add_parser(
        "audit", help="operators' actions: who, what, which desk, from where, the outcome",
        description="Every operator action the daemon answered (sends, approvals, pauses, "
                    "the kill switch, reloads...), refused ones included, oldest first.")
    audit.add_argument("--desk", metavar="DESK", help="only this desk's")
    audit.add_argument("--since", metavar="ISO",
                       help="only from this time on (ISO 8601, such as 2026-12-05T09:00; UTC "
                            "when no offset is given)")
    audit.add_argument("--limit", type=int, default=200, metavar="N",
                       help="the newest N (default 200)")
    audit.add_argument("--json", action="store_true", help="one JSON array")
    add_connection_options(audit)
    audit.set_defaults(handler=lambda args: run_with_client(args, _audit))


def format_action(entry: dict[str, Any]) -> str:
    """One action as a line: ``TIME WHO (ROLE) ACTION DESK via SURFACE: OUTCOME``."""
    desk = f" {entry['desk']}" if entry.get("desk") else ""
    outcome = entry["outcome"] + (f" ({entry['detail']})" if entry["outcome"] != "ok" else "")
    return printable(f"{entry['at']} {entry['who']} ({entry['role']}) {entry['action']}{desk} "
                     f"via {entry['surface']}: {outcome}")


async def _audit(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        actions = await client.audit(desk=args.desk, since=args.since, limit=args.limit)
    except OperatorRequestError as exc:
        print(f"trading-agent: {exc.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(actions, indent=2))
        return 0
    if not actions:
        print("No operator actions" + (f" on {args.desk}" if args.desk else "")
              + (f" since {args.since}" if args.since else "") + ".")
    for entry in actions:
        print(format_action(entry))
    return 0
