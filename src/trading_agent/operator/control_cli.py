"""The operator's controls over money and thinking, as commands: ``kill-switch``,
``reduce-only``, ``pause``, ``resume``, ``cancel``, ``retry``, ``send``, ``pin``, ``pins``,
``unpin`` and ``reload``.

Each talks to the running daemon through its operator API, found as for ``desks`` and
``chat`` (``--socket``, ``--url``, ``--config``...). Exit codes: 0 done; 1 the daemon cannot
be reached; 2 refused (a bad argument, an unknown desk); 3 for ``send --wait`` when the
desk's turn failed or was cancelled, or no answer came in time.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from trading_agent.operator.cli import (
    OPERATOR_IGNORED_HELP,
    add_connection_options,
    run_with_client,
)
from trading_agent.operator.client import OperatorClient, OperatorRequestError
from trading_agent.operator.render import (
    describe_kill_switch,
    describe_reduce_only,
    pin_lines,
    printable,
)

__all__ = ["EXIT_REFUSED", "EXIT_TURN_FAILED", "add_control_subcommands"]

EXIT_REFUSED = 2
"""The daemon refused the request (an unknown desk, a missing reason...)."""

EXIT_TURN_FAILED = 3
"""``send --wait``: the turn failed, was cancelled, or did not answer in time."""

_Body = Callable[[OperatorClient, argparse.Namespace], Awaitable[int]]
"""A command's work, given a client connected to the daemon; returns the exit code."""


def add_control_subcommands(subparsers: Any) -> None:
    """Adds ``kill-switch``, ``reduce-only``, ``pause``, ``resume``, ``cancel``, ``retry``,
    ``send`` and ``reload``.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.
    """
    kill = subparsers.add_parser(
        "kill-switch", help="stop every new order of a desk (or of every desk) at once",
        description="on: from this instant every new order of the desk (every desk without "
                    "--desk) is refused by its risk policy with 'halted by NAME at TIME: "
                    "REASON', before any exchange sees it; it stays on across restarts until "
                    "switched off. off: switches that scope's switch off.")
    kill.add_argument("state", choices=["on", "off"])
    kill.add_argument("--desk", metavar="DESK", help="one desk (default: every desk)")
    kill.add_argument("--reason", default="", metavar="TEXT",
                      help="why (required with on; every refused order quotes it)")
    kill.add_argument("--cancel-orders", action="store_true",
                      help="with on: also cancel the open orders")
    kill.add_argument("--flatten", action="store_true",
                      help="with on: also close every position at market")
    _talks_to_the_daemon(kill, _kill_switch)

    reduce = subparsers.add_parser(
        "reduce-only", help="let a desk only shrink its positions (or lift that)",
        description="on: from this instant every order of DESK that would open, grow or "
                    "reverse a position is refused by its risk policy, naming who set it and "
                    "why; an order that makes a position smaller passes. It stays on across "
                    "restarts until switched off. off: lifts it, whoever set it (an "
                    "operator, a protection, a spend cap).")
    reduce.add_argument("state", choices=["on", "off"])
    reduce.add_argument("desk", metavar="DESK")
    reduce.add_argument("--reason", default="", metavar="TEXT",
                        help="why (every refused order quotes it)")
    _talks_to_the_daemon(reduce, _reduce_only)

    pause = subparsers.add_parser(
        "pause", help="stop a desk from thinking until it is resumed",
        description="No turns run while a desk is paused; a running turn ends at its next "
                    "safe point. Triggers wait (ticks coalesced) or are dropped, as its "
                    "controls.when_paused says; operator messages wait.")
    pause.add_argument("desk", metavar="DESK")
    pause.add_argument("--reason", default="", metavar="TEXT", help="shown in its status")
    _talks_to_the_daemon(pause, _pause)

    resume = subparsers.add_parser("resume", help="let a paused desk take turns again",
                                   description="What waited while it was paused runs now.")
    resume.add_argument("desk", metavar="DESK")
    _talks_to_the_daemon(resume, _resume)

    cancel = subparsers.add_parser(
        "cancel", help="end a desk's running turn",
        description="Ends the running turn at its next safe point (every tool call "
                    "answered, nothing lost), or at once with --now (calls in flight are "
                    "stored as interrupted and looked up). The desk then takes its next "
                    "trigger.")
    cancel.add_argument("desk", metavar="DESK")
    cancel.add_argument("--now", action="store_true", help="at once, not at a safe point")
    _talks_to_the_daemon(cancel, _cancel)

    retry = subparsers.add_parser(
        "retry", help="run a desk's last turn again from its trigger",
        description="The desk's last answer (and the tool calls it made) leaves what the "
                    "desk is sent; the transcript keeps it, marked. Its turn then runs again "
                    "from the same trigger, before any other. Refused while a turn runs.")
    retry.add_argument("desk", metavar="DESK")
    _talks_to_the_daemon(retry, _retry)

    send = subparsers.add_parser(
        "send", help="send one message to a desk (from a script or cron)",
        description="Sends TEXT to DESK: it steers a running turn or starts one. With "
                    "--wait, prints the desk's final answer and exits 3 if the turn failed, "
                    "was cancelled, or no answer came within --timeout.")
    send.add_argument("desk", metavar="DESK")
    send.add_argument("text", metavar="TEXT", help="the message ('-' reads standard input)")
    send.add_argument("--wait", action="store_true", help="print the desk's answer")
    send.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                      help="with --wait: how long to wait (default 900)")
    send.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    _talks_to_the_daemon(send, _send)

    pin = subparsers.add_parser(
        "pin", help="pin a standing instruction to a desk",
        description="TEXT is sent verbatim at the end of the desk's system prompt in every "
                    "request from its next one, never summarised away by a compaction, "
                    "until someone unpins it; it outlives restarts and reloads. Refused, "
                    "with the numbers, when the desk's window cannot hold it.")
    pin.add_argument("desk", metavar="DESK")
    pin.add_argument("text", metavar="TEXT", help="the instruction ('-' reads standard input)")
    _talks_to_the_daemon(pin, _pin)

    pins = subparsers.add_parser("pins", help="list a desk's standing instructions",
                                 description="Each pin's id, who pinned it and when, and its "
                                             "text; then those the desk's config pins.")
    pins.add_argument("desk", metavar="DESK")
    pins.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    _talks_to_the_daemon(pins, _pins)

    unpin = subparsers.add_parser("unpin", help="take a standing instruction off a desk",
                                  description="The desk's next request goes without it.")
    unpin.add_argument("desk", metavar="DESK")
    unpin.add_argument("pin_id", metavar="ID", type=int, help="the pin's id (see pins)")
    _talks_to_the_daemon(unpin, _unpin)

    reload = subparsers.add_parser(
        "reload", help="read the daemon's config file again (as SIGHUP does)",
        description="The config is read and validated again; a bad one changes nothing and "
                    "says why. Prompts, limits, triggers and models apply from each desk's "
                    "next turn; desks added start; desks removed stop at a safe point.")
    _talks_to_the_daemon(reload, _reload)


def _talks_to_the_daemon(parser: argparse.ArgumentParser, body: _Body) -> None:
    """What every control command shares: ``--operator``, where the daemon is, and its body
    run with a client."""
    parser.add_argument("--operator", default=None, metavar="NAME",
                        help=OPERATOR_IGNORED_HELP)
    add_connection_options(parser)
    parser.set_defaults(handler=lambda args: run_with_client(args, body))


def _operator(args: argparse.Namespace) -> str:
    if args.operator:
        return str(args.operator)
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "operator"


def _refused(exc: OperatorRequestError) -> int:
    print(f"trading-agent: {exc.message}", file=sys.stderr)
    return EXIT_REFUSED


async def _kill_switch(client: OperatorClient, args: argparse.Namespace) -> int:
    on = args.state == "on"
    if not on and (args.cancel_orders or args.flatten):
        print("trading-agent: --cancel-orders and --flatten go with 'kill-switch on'",
              file=sys.stderr)
        return EXIT_REFUSED
    try:
        result = await client.kill_switch(on, desk=args.desk, operator=_operator(args),
                                          reason=args.reason, cancel_orders=args.cancel_orders,
                                          flatten=args.flatten)
    except OperatorRequestError as exc:
        return _refused(exc)
    print(describe_kill_switch(result))
    return 1 if result.get("failed") else 0


async def _reduce_only(client: OperatorClient, args: argparse.Namespace) -> int:
    on = args.state == "on"
    try:
        result = await client.reduce_only(args.desk, on, _operator(args), args.reason)
    except OperatorRequestError as exc:
        return _refused(exc)
    print(printable(describe_reduce_only(result)))
    return 0


async def _pause(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        result = await client.pause(args.desk, _operator(args), args.reason)
    except OperatorRequestError as exc:
        return _refused(exc)
    reason = result["status"].get("paused_reason", "")
    print(printable(f"{args.desk} is paused: {reason}" if result["changed"]
                    else f"{args.desk} was already paused: {reason}"))
    return 0


async def _resume(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        result = await client.resume(args.desk, _operator(args))
    except OperatorRequestError as exc:
        return _refused(exc)
    waiting = result.get("waiting", 0)
    print(f"{args.desk} resumed; {waiting} trigger(s) waiting run now." if result["changed"]
          else f"{args.desk} was not paused.")
    return 0


async def _cancel(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        cancelled = await client.cancel(args.desk, _operator(args), now=args.now)
    except OperatorRequestError as exc:
        return _refused(exc)
    if not cancelled:
        print(f"{args.desk} was not running a turn; nothing to cancel.")
    elif args.now:
        print(f"{args.desk}'s turn was cut; calls in flight are stored as interrupted.")
    else:
        print(f"{args.desk}'s turn ends at its next safe point (after the tool round in "
              "flight).")
    return 0


async def _retry(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        dropped = await client.retry(args.desk, _operator(args))
    except OperatorRequestError as exc:
        return _refused(exc)
    print(f"{args.desk}'s last answer ({dropped} message{'s' if dropped != 1 else ''}) left "
          "what it is sent; its turn runs again.")
    return 0


async def _send(client: OperatorClient, args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        if not args.wait:
            sent = await client.send_message(args.desk, text, source=_operator(args))
        else:
            sent = await client.send_and_wait(args.desk, text, source=_operator(args),
                                              wait_seconds=args.timeout)
    except OperatorRequestError as exc:
        if exc.code == "no_reply":
            print(f"trading-agent: {exc.message}", file=sys.stderr)
            return EXIT_TURN_FAILED
        return _refused(exc)
    if args.json:
        print(json.dumps(sent, indent=2))
    if not args.wait:
        if not args.json:
            print(f"sent ({sent['id']}; {sent['delivery']})")
        return 0
    reply = sent["reply"]
    if not args.json:
        print(printable(str(reply.get("text", ""))))
    if not reply.get("ok"):
        print(f"trading-agent: {reply.get('error') or 'the turn failed'}", file=sys.stderr)
        return EXIT_TURN_FAILED
    return 0


async def _pin(client: OperatorClient, args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        result = await client.pin(args.desk, text, _operator(args))
    except OperatorRequestError as exc:
        return _refused(exc)
    pin = result["pin"]
    print(printable(f"Pinned #{pin['id']} to {args.desk}; it is in every request from the "
                    f"next ({len(result['pins'])} pin(s))."))
    return 0


async def _pins(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        result = await client.pins(args.desk)
    except OperatorRequestError as exc:
        return _refused(exc)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for line in pin_lines(result):
        print(printable(line))
    return 0


async def _unpin(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        result = await client.unpin(args.desk, args.pin_id, _operator(args))
    except OperatorRequestError as exc:
        return _refused(exc)
    print(printable(f"Unpinned #{result['unpinned']['id']} from {args.desk}; its next request "
                    f"goes without it ({len(result['pins'])} pin(s) left)."))
    return 0


async def _reload(client: OperatorClient, args: argparse.Namespace) -> int:
    try:
        result = await client.reload(_operator(args))
    except OperatorRequestError as exc:
        print(printable(f"trading-agent: the config was not reloaded; {exc.message}"),
              file=sys.stderr)
        return EXIT_REFUSED
    changes = result.get("changes") or []
    print("Config reloaded." + ("" if changes else " Nothing changed."))
    for line in changes:
        print(printable(f"  {line}"))
    return 0
