"""The operator's commands: ``desks``, ``chat DESK`` and ``events``.

They talk to a running daemon through its operator API. Where the daemon is, first match:
``--socket PATH``; ``--url http://host:port`` (TCP, with the token from ``--token-env``,
default ``TRADING_AGENT_OPERATOR_TOKEN``); ``--config FILE`` (its state directory's socket);
the ``TRADING_AGENT_SOCKET`` variable; ``$STATE_DIRECTORY/operator.sock`` or
``./state/operator.sock``.

In ``chat``, a line you type is sent at once (mid-turn it steers the desk: it reads it after
the current tool round); the desk's text streams as it is written, tool calls and results
show as compact lines. Commands: ``/image PATH [caption]`` (send a picture: PNG, JPEG, GIF or
WebP), ``/compact``, ``/pin TEXT``, ``/pins``, ``/unpin ID``, ``/status``, the desk's own
books ``/positions``, ``/orders``,
``/trades [--open] [--since YYYY-MM-DD]`` and ``/profit [--weekly]``, ``/approvals``,
``/approve ID [note]``, ``/deny ID [reason]``, the controls ``/pause [reason]``, ``/resume``,
``/cancel [--now]``, ``/retry``,
``/kill on|off
...`` and ``/reload``, ``/help``, ``/quit``. Start a line with ``//`` to send text that begins
with a slash.
"""

from __future__ import annotations

import argparse
import getpass
import json
import mimetypes
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

import anyio

from trading_agent.errors import ConfigError
from trading_agent.jsontext import json_text
from trading_agent.operator.client import (
    ImageAttachment,
    OperatorClient,
    OperatorClientError,
    OperatorRequestError,
)
from trading_agent.operator.config import DEFAULT_TOKEN_ENV, SOCKET_NAME
from trading_agent.operator.render import (
    EventPrinter,
    Style,
    describe_kill_switch,
    describe_reduce_only,
    format_cache_share,
    format_money,
    format_table,
    pin_lines,
    printable,
)

__all__ = ["EXIT_UNREACHABLE", "OPERATOR_IGNORED_HELP", "add_connection_options",
           "add_subcommands", "resolve_client", "run_with_client"]

EXIT_UNREACHABLE = 1
"""The exit code when the daemon cannot be reached or refuses."""

SOCKET_ENV = "TRADING_AGENT_SOCKET"
"""The environment variable that names the daemon's socket."""


def add_subcommands(subparsers: Any) -> None:
    """Adds ``desks``, ``chat`` and ``events`` to the ``trading-agent`` command.

    Each sets ``handler``: a function of the parsed arguments returning the exit code.

    Args:
        subparsers: What ``ArgumentParser.add_subparsers()`` returned.
    """
    desks = subparsers.add_parser(
        "desks", help="list the running daemon's desks and their status",
        description="A table of the desks: state, mode, equity, the profit its own books "
                    "realized today and hold unrealized at the marks (- when it keeps no "
                    "books), open orders, tokens today, "
                    "the share of prompt tokens served from the model's cache, cost today, "
                    "pending approvals, last turn.")
    add_connection_options(desks)
    desks.add_argument("--json", action="store_true", help="print the statuses as JSON")
    desks.set_defaults(handler=_run_desks)

    chat = subparsers.add_parser(
        "chat", help="talk to a desk and watch it work",
        description="An interactive session with one desk: its text streams as it is "
                    "written, tool calls show as compact lines, and a line you type is sent at "
                    "once (mid-turn it steers the desk). Commands: /image PATH [caption], "
                    "/compact, /pin TEXT, /pins, /unpin ID, /status, /positions, /orders, "
                    "/trades, /profit, /approvals, "
                    "/approve ID [note], /deny ID [reason], "
                    "/pause [reason], /resume, /cancel [--now], /retry, /kill on|off [--all] "
                    "[--cancel-orders] [--flatten] REASON, /reload, /help, /quit.")
    chat.add_argument("desk", metavar="DESK", help="the desk's name")
    add_connection_options(chat)
    chat.add_argument("--operator", default=None, metavar="NAME",
                      help=OPERATOR_IGNORED_HELP)
    chat.set_defaults(handler=_run_chat)

    events = subparsers.add_parser(
        "events", help="print the daemon's event stream",
        description="Every step of every desk (or one desk): turns, text, tool calls and "
                    "results, approvals, compactions, errors.")
    add_connection_options(events)
    events.add_argument("--desk", metavar="DESK", help="only this desk's events")
    events.add_argument("--follow", "-f", action="store_true",
                        help="keep printing new events (reconnects if the daemon restarts)")
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument("--after", type=int, metavar="ID",
                        help="start after this event id (older ones come from the store)")
    events.add_argument("--tail", type=int, default=50, metavar="N",
                        help="without --after, start with the last N events the daemon holds "
                             "in memory since it started (default 50); --after 0 prints "
                             "everything stored")
    events.add_argument("--verbose", "-v", action="store_true",
                        help="also show model requests and token usage")
    events.set_defaults(handler=_run_events)


def add_connection_options(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where the daemon is")
    where.add_argument("--socket", type=Path, metavar="PATH",
                       help=f"the daemon's Unix socket (or set {SOCKET_ENV})")
    where.add_argument("--config", type=Path, metavar="FILE",
                       help="the daemon's config file: its state directory holds the socket")
    where.add_argument("--url", metavar="URL",
                       help="the API over TCP (http://127.0.0.1:8765), with a bearer token")
    where.add_argument("--token-env", default=DEFAULT_TOKEN_ENV, metavar="NAME",
                       help="the environment variable holding the TCP bearer token "
                            f"(default {DEFAULT_TOKEN_ENV})")


def resolve_client(args: argparse.Namespace,
                   environ: dict[str, str] | None = None) -> OperatorClient:
    """The client for the daemon the arguments point at.

    Args:
        args: Parsed arguments with the connection options.
        environ: The environment (``os.environ`` by default).

    Returns:
        A client (not yet connected).

    Raises:
        ConfigError: The config file is invalid, or a TCP URL has no token.
    """
    env = dict(os.environ) if environ is None else environ
    if args.socket is not None:
        return OperatorClient(socket_path=args.socket)
    if args.url:
        token = env.get(args.token_env, "").strip()
        if not token:
            raise ConfigError(f"--url needs the bearer token in the environment variable "
                              f"{args.token_env} (--token-env)")
        return OperatorClient(url=args.url, token=token)
    if args.config is not None:
        from trading_agent.settings import load_settings

        settings = load_settings(args.config)
        state_dir = settings.state_directory(env)
        return OperatorClient(socket_path=settings.operator.socket_in(state_dir))
    if env.get(SOCKET_ENV):
        return OperatorClient(socket_path=Path(env[SOCKET_ENV]))
    state_dir = Path(env.get("STATE_DIRECTORY", "").split(":")[0] or "state")
    return OperatorClient(socket_path=state_dir / SOCKET_NAME)


def run_with_client(args: argparse.Namespace,
         body: Callable[[OperatorClient, argparse.Namespace], Awaitable[int]]) -> int:
    """Runs a command's body with a client, turning failures into a message and exit code."""
    try:
        client = resolve_client(args)
    except ConfigError as exc:
        print(f"trading-agent: {exc}", file=sys.stderr)
        return 2

    async def main() -> int:
        async with client:
            if getattr(args, "operator", None):
                await _say_operator_ignored(client, str(args.operator))
            return await body(client, args)

    try:
        return anyio.run(main, backend="asyncio")
    except OperatorClientError as exc:
        print(f"trading-agent: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


OPERATOR_IGNORED_HELP = ("ignored, kept so older scripts run: the daemon records the name "
                         "your credential gives (on the socket, your OS user; on TCP, the "
                         "token's operator)")
"""The help of ``--operator``, which every command taking it shares."""


async def _say_operator_ignored(client: OperatorClient, given: str) -> None:
    """Tells on stderr that ``--operator`` no longer names who acts, and who does: a script
    that passes it keeps working, and its user learns which name the records carry."""
    try:
        name = str((await client.me())["name"])
    except (OperatorRequestError, KeyError):
        name = "the one your credential gives"
    if name != given:
        print(printable(f"trading-agent: --operator {given!r} is ignored; the records name "
                        f"{name!r}, who your credential says you are"), file=sys.stderr)


# --------------------------------------------------------------------------- desks


def _ago(at: Any) -> str:
    if not isinstance(at, int | float):
        return "never"
    seconds = max(0, time.time() - at)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"


def _state(status: dict[str, Any], style: Style) -> str:
    state = str(status.get("state", "?"))
    if state == "working":
        return style.good(state)
    if state in ("paused", "stopped"):
        return style.bad(state)
    return state


async def _desks(client: OperatorClient, args: argparse.Namespace) -> int:
    desks = await client.desks()
    if args.json:
        print(json.dumps(desks, indent=2))
        return 0
    if not desks:
        print("The daemon runs no desks.")
        return 0
    style = Style(False)  # colour codes would break the alignment
    in_fleet = any(d.get("daemon") for d in desks)  # which daemon of a fleet runs each
    rows = []
    for d in desks:
        cost = d.get("cost_today")
        rows.append([
            str(d.get("name")), *([str(d.get("daemon") or "-")] if in_fleet else []),
            str(d.get("state")), str(d.get("mode")), str(d.get("model")),
            format_money(d.get("equity")), format_money(d.get("realized_today")),
            format_money(d.get("unrealized")), str(d.get("open_orders", 0)),
            f"{int(d.get('tokens_today') or 0):,}",
            format_cache_share(d.get("cached_tokens_today"), d.get("prompt_tokens_today")),
            f"${cost:.2f}" if isinstance(cost, int | float) else "-",
            str(d.get("pending_approvals", 0)), _ago(d.get("last_turn_at")),
        ])
    print(format_table(rows, ["DESK", *(["DAEMON"] if in_fleet else []), "STATE", "MODE",
                              "MODEL", "EQUITY", "REALIZED TODAY", "UNREALIZED", "ORDERS",
                              "TOKENS TODAY", "CACHED", "COST",
                              "APPROVALS", "LAST TURN"], style))
    for d in desks:
        if d.get("kill_switch"):
            print(f"{d['name']}: KILL SWITCH ON, new orders refused: "
                  f"{printable(str(d['kill_switch']))}")
        if d.get("reduce_only"):
            print(f"{d['name']}: REDUCE-ONLY, new exposure refused: "
                  f"{printable(str(d['reduce_only']['text']))}")
        if d.get("state") == "paused" and d.get("paused_reason"):
            print(f"{d['name']} is paused: {printable(str(d['paused_reason']))}")
        if d.get("spend"):
            print(f"{d['name']} spend caps today: {format_spend(d['spend'])}")
    return 0


def format_spend(rows: list[dict[str, Any]]) -> str:
    """Today's use of a desk's spend caps: ``desk tokens 81% of 1,000,000; ...``."""
    parts = []
    for row in rows:
        cap = float(row.get("cap") or 0)
        figure = f"{cap:,.0f}" if row.get("measure") == "tokens" else f"{cap:,.2f}"
        parts.append(f"{row.get('scope')} {row.get('measure')} {float(row.get('share') or 0):.0%}"
                     f" of {figure}")
    return "; ".join(parts)


def _run_desks(args: argparse.Namespace) -> int:
    return run_with_client(args, _desks)


# --------------------------------------------------------------------------- events


async def _events(client: OperatorClient, args: argparse.Namespace) -> int:
    if args.desk:
        await client.desk(args.desk)  # a clear 404 before streaming nothing
    style = Style.for_stream(sys.stdout)
    printer = EventPrinter(sys.stdout.write, sys.stdout.flush, style, show_desk=True,
                           verbose=args.verbose)
    opened = False
    async for event in client.events(desk=args.desk, after=args.after, tail=args.tail,
                                     follow=args.follow):
        if event.type == "stream_open":
            if args.follow and not opened:
                opened = True
                sys.stderr.write("following the event stream (Ctrl-C stops)\n")
                sys.stderr.flush()
            continue
        if args.json:
            if event.id is not None:
                sys.stdout.write(json_text(event.data) + "\n")
                sys.stdout.flush()
        else:
            printer.event(event.data)
    if not args.json:
        printer.line("")
    return 0


def _run_events(args: argparse.Namespace) -> int:
    return run_with_client(args, _events)


# --------------------------------------------------------------------------- chat


_HELP = """Type a message and press Enter to send it; while the desk works it steers the turn
(the desk reads it after the current tool round). Commands:
  /image PATH [caption]  send a picture (PNG, JPEG, GIF or WebP) with a caption;
                         quote a path with spaces ("/tmp/my chart.png")
  /status              the desk's state, equity, usage today
  /positions           its own open positions: entry, mark, unrealized profit
  /orders              its own open orders
  /trades [--open] [--since YYYY-MM-DD]
                       its round trips and the profit of each
  /profit [--weekly]   profit today and all time, then by day (or week)
  /compact             save memory and compact the desk's conversation now
  /pin TEXT            pin a standing instruction: sent verbatim in every request of
                       the desk from its next one, never compacted away
  /pins                the desk's standing instructions: id, who, when, text
  /unpin ID            take one off
  /approvals           the desk's tool calls waiting for an operator
  /approve ID [note]   let a held tool call run
  /deny ID [reason]    refuse it; the desk reads your reason
  /pause [reason]      no turns until /resume (a running turn ends at a safe point)
  /resume              take turns again; what waited runs now
  /cancel [--now]      end the running turn at its next safe point (or at once)
  /retry               run the last turn again from its trigger (its answer is dropped
                       from what the desk is sent; the transcript keeps it, marked)
  /kill on [--all] [--cancel-orders] [--flatten] REASON
                       refuse every new order of this desk (--all: of every desk);
                       --flatten closes positions at market, after you confirm
  /kill off [--all]    switch it off
  /reduce_only on REASON | off
                       let the desk only shrink its positions (or lift that, whoever
                       set it: you, a protection, a spend cap)
  /reload              read the daemon's config file again (a bad one changes nothing)
  /help                this help
  /quit                leave (the desk keeps running)
Start a line with // to send text beginning with a slash."""


class _Chat:
    """One chat session: the stream printer and the line handler."""

    def __init__(self, client: OperatorClient, desk: str, operator: str, out: TextIO) -> None:
        self.client = client
        self.desk = desk
        self.operator = operator
        self.style = Style.for_stream(out)
        self.printer = EventPrinter(out.write, out.flush, self.style)
        self.done = anyio.Event()
        self.confirming: dict[str, Any] | None = None
        """A kill switch with --flatten waiting for the operator's yes."""

    def say(self, text: str) -> None:
        self.printer.line(text)

    async def status_line(self) -> str:
        s = await self.client.desk(self.desk)
        cost = s.get("cost_today")
        cached = format_cache_share(s.get("cached_tokens_today"),
                                    s.get("prompt_tokens_today"))
        parts = [self.style.bold(str(s["name"])), str(s.get("state")), str(s.get("mode")),
                 str(s.get("model")), f"equity {format_money(s.get('equity'))}",
                 f"{s.get('open_orders', 0)} open order(s)",
                 f"{int(s.get('tokens_today') or 0):,} tokens today"
                 + (f" (${cost:.2f})" if isinstance(cost, int | float) else "")
                 + (f", {cached} of the prompt cached" if cached != "-" else ""),
                 f"{s.get('pending_approvals', 0)} pending approval(s)"]
        if s.get("state") == "paused" and s.get("paused_reason"):
            parts.append(f"paused: {s['paused_reason']}")
        if s.get("kill_switch"):
            parts.append(self.style.bad(f"KILL SWITCH ON: {s['kill_switch']}"))
        if s.get("reduce_only"):
            parts.append(self.style.warn(f"REDUCE-ONLY: {s['reduce_only']['text']}"))
        if s.get("spend"):
            parts.append(f"spend caps: {format_spend(s['spend'])}")
        return " · ".join(parts)

    async def follow(self, after: int | None) -> None:
        async for event in self.client.events(desk=self.desk, after=after):
            self.printer.event(event.data)

    async def handle(self, line: str, group: Any) -> None:
        text = line.strip()
        if self.confirming is not None:
            request, self.confirming = self.confirming, None
            if text.lower() != "yes":
                self.say("Not done: the kill switch is as it was.")
                return
            try:
                await self.switch(request)
            except OperatorClientError as exc:
                self.say(self.style.bad(getattr(exc, "message", str(exc))))
            return
        if not text:
            return
        if text.startswith("//"):
            await self.send(text[1:])
            return
        if not text.startswith("/"):
            await self.send(line.rstrip("\r\n"))
            return
        command, _, rest = text.partition(" ")
        rest = rest.strip()
        try:
            if command in ("/quit", "/exit", "/q"):
                self.done.set()
            elif command == "/help":
                self.say(_HELP)
            elif command == "/image":
                await self.send_image(rest)
            elif command == "/status":
                self.say(await self.status_line())
            elif command in ("/positions", "/orders", "/trades", "/profit"):
                for text_line in await self.books(command, rest):
                    self.say(text_line)
            elif command == "/compact":
                group.start_soon(self.compact)
            elif command in ("/pin", "/pins", "/unpin"):
                await self.pins(command, rest)
            elif command == "/approvals":
                pending = await self.client.approvals(self.desk)
                if not pending:
                    self.say("No tool call is waiting for approval.")
                for a in pending:
                    self.say(self.style.warn(
                        f"{a['id']}: {a['tool']} {json.dumps(a['arguments'])} ({a['reason']}); "
                        f"denied in {max(0, a['expires_at'] - time.time()):.0f} s"))
            elif command in ("/approve", "/deny"):
                await self.decide(command, rest)
            elif command == "/pause":
                result = await self.client.pause(self.desk, self.operator, rest)
                self.say(self.style.warn(f"Paused: {result['status'].get('paused_reason')}")
                         if result["changed"] else "Already paused.")
            elif command == "/resume":
                result = await self.client.resume(self.desk, self.operator)
                self.say(self.style.good("Resumed.") if result["changed"]
                         else "The desk was not paused.")
            elif command == "/cancel":
                now = rest == "--now"
                cancelled = await self.client.cancel(self.desk, self.operator, now=now)
                self.say(("Cancelled at once." if now else "The turn ends at its next safe "
                          "point.") if cancelled else "No turn is running.")
            elif command == "/retry":
                dropped = await self.client.retry(self.desk, self.operator)
                self.say(f"The last answer ({dropped} message{'s' if dropped != 1 else ''}) "
                         "left what the desk is sent; its turn runs again.")
            elif command == "/kill":
                await self.kill(rest)
            elif command == "/reduce_only":
                await self.reduce_only(rest)
            elif command == "/reload":
                result = await self.client.reload(self.operator)
                changes = result.get("changes") or ["nothing changed"]
                self.say(self.style.good("Config reloaded: " + "; ".join(changes)))
            else:
                self.say(self.style.bad(f"Unknown command {command}; /help lists them "
                                        "(// sends a line starting with a slash)."))
        except OperatorRequestError as exc:
            self.say(self.style.bad(exc.message))
        except OperatorClientError as exc:
            self.say(self.style.bad(str(exc)))

    async def books(self, command: str, rest: str) -> list[str]:
        """``/positions``, ``/orders``, ``/trades [--open] [--since DAY]``, ``/profit
        [--weekly]``: the desk's own books, a line each."""
        words = rest.split()
        if command == "/positions":
            answer = await self.client.positions(self.desk)
            lines = [f"{p['symbol']} {p['side']} {p['amount']} @ {p['entry_price']}, mark "
                     f"{p['mark'] or '-'}, unrealized {format_money(p['unrealized'])}, realized "
                     f"{format_money(p['realized'])}" for p in answer["positions"]]
            lines = lines or ["No open positions."]
        elif command == "/orders":
            answer = await self.client.orders(self.desk)
            lines = [f"{o['order_id'] or o['client_order_id']}: {o['side']} {o['type']} "
                     f"{o['amount']} {o['symbol']}"
                     + (f" @ {o['price']}" if o["price"] else "")
                     + f", filled {o['filled']} ({o['status']})" for o in answer["orders"]]
            lines = lines or ["No open orders."]
        elif command == "/trades":
            since = words[words.index("--since") + 1] if "--since" in words[:-1] else None
            if "--since" in words and since is None:
                return [self.style.bad("Usage: /trades [--open] [--since YYYY-MM-DD]")]
            answer = await self.client.trades(self.desk, since=since,
                                              open_only="--open" in words)
            lines = [f"#{t['id']} {t['symbol']} {t['side']} {t['amount']} @ {t['entry_price']}"
                     + (" (open)" if t["open"] else f" -> {t['exit_price']}")
                     + f": profit {format_money(t['profit'])} ({t['profit_percent']}%), fees "
                     f"{format_money(t['fees'])}"
                     + (f", {t['exit_reason']}" if t["exit_reason"] else "")
                     for t in answer["trades"]]
            lines = lines or ["No trades."]
        else:
            period = "weekly" if "--weekly" in words else "daily"
            answer = await self.client.profit(self.desk, period=period)
            s = answer["summary"]
            lines = [f"Realized today {format_money(s['realized_today'])}, all time "
                     f"{format_money(s['realized_total'])}; unrealized "
                     f"{format_money(s['unrealized'])}; fees {format_money(s['fees_total'])}; "
                     f"{s['trades_closed']} trade(s) closed, {s['wins']} won, "
                     f"{s['open_trades']} open"]
            lines += [f"  {r['day']}: {format_money(r['realized'])} ({r['fills']} fill(s), "
                      f"{r['trades_closed']} closed)" for r in answer["rows"]]
        if not answer.get("books"):
            lines.append(self.style.dim(f"{self.desk} keeps no books."))
        return [printable(line) for line in lines]

    async def pins(self, command: str, rest: str) -> None:
        """``/pin TEXT``, ``/pins``, ``/unpin ID``."""
        if command == "/pins":
            for line in pin_lines(await self.client.pins(self.desk)):
                self.say(printable(line))
        elif command == "/pin":
            if not rest:
                self.say(self.style.bad("Usage: /pin TEXT"))
                return
            result = await self.client.pin(self.desk, rest, self.operator)
            self.say(self.style.good(f"Pinned #{result['pin']['id']}: it is in every request "
                                     "from the next."))
        elif not rest.isdigit():
            self.say(self.style.bad("Usage: /unpin ID (/pins lists them)"))
        else:
            result = await self.client.unpin(self.desk, int(rest), self.operator)
            self.say(self.style.good(f"Unpinned #{result['unpinned']['id']}."))

    async def kill(self, rest: str) -> None:
        """``/kill on|off [--all] [--cancel-orders] [--flatten] REASON``; flattening asks for
        a ``yes`` first."""
        words = rest.split()
        flags = {w for w in words if w.startswith("--")}
        state = words[0] if words else ""
        reason = " ".join(w for w in words[1:] if not w.startswith("--"))
        unknown = flags - {"--all", "--cancel-orders", "--flatten"}
        if state not in ("on", "off") or unknown or (state == "on" and not reason):
            self.say(self.style.bad("Usage: /kill on [--all] [--cancel-orders] [--flatten] "
                                    "REASON, or /kill off [--all]"))
            return
        desk = None if "--all" in flags else self.desk
        request = {"on": state == "on", "desk": desk, "operator": self.operator,
                   "reason": reason, "cancel_orders": "--cancel-orders" in flags,
                   "flatten": "--flatten" in flags}
        if request["flatten"]:
            whose = "every desk" if desk is None else desk
            self.say(self.style.warn(f"This closes every position of {whose} at market. "
                                     "Type yes to go on; anything else cancels."))
            self.confirming = request
            return
        await self.switch(request)

    async def reduce_only(self, rest: str) -> None:
        """``/reduce_only on REASON`` or ``/reduce_only off``."""
        state, _, reason = rest.partition(" ")
        if state not in ("on", "off"):
            self.say(self.style.bad("Usage: /reduce_only on REASON, or /reduce_only off"))
            return
        result = await self.client.reduce_only(self.desk, state == "on", self.operator,
                                               reason.strip())
        text = describe_reduce_only(result)
        self.say(self.style.warn(text) if state == "on" else self.style.good(text))

    async def switch(self, request: dict[str, Any]) -> None:
        on = bool(request.pop("on"))
        result = await self.client.kill_switch(on, **request)
        text = describe_kill_switch(result)
        self.say(self.style.bad(text) if on else self.style.good(text))

    async def send(self, text: str) -> None:
        try:
            sent = await self.client.send_message(self.desk, text, source=self.operator)
        except OperatorRequestError as exc:
            self.say(self.style.bad(f"Not sent: {exc.message}"))
            return
        except OperatorClientError as exc:
            self.say(self.style.bad(f"Not sent: {exc}"))
            return
        how = ("steering the running turn: the desk reads it after its current tool round"
               if sent.get("delivery") == "steering" else "it starts a turn")
        self.say(self.style.dim(f"you › {_one_line(text)}  (sent; {how})"))
        shortened = sent.get("shortened")
        if isinstance(shortened, dict):
            self.say(self.style.warn(f"Shortened: {shortened.get('note')}"))

    async def send_image(self, rest: str) -> None:
        """``/image PATH [caption]``: the file and the caption, in one message."""
        path_text, caption = _path_and_rest(rest)
        if not path_text:
            self.say(self.style.bad("Usage: /image PATH [caption]"))
            return
        path = await anyio.Path(path_text).expanduser()
        try:
            size = (await path.stat()).st_size
            if size > _LARGEST_FILE:
                self.say(self.style.bad(
                    f"Not sent: {path} is {size:,} bytes; a picture may be at most "
                    f"{_LARGEST_FILE:,} bytes here, and the daemon's own limit "
                    "(operator.max_image_bytes) is usually lower."))
                return
            data = await path.read_bytes()
        except OSError as exc:
            self.say(self.style.bad(f"Not sent: cannot read {path}: {exc.strerror or exc}"))
            return
        image = ImageAttachment(data, _media_type(data, path.name), path.name)
        try:
            sent = await self.client.send_message(self.desk, caption, source=self.operator,
                                                  images=[image])
        except OperatorRequestError as exc:
            self.say(self.style.bad(f"Not sent: {exc.message}"))
            return
        except OperatorClientError as exc:
            self.say(self.style.bad(f"Not sent: {exc}"))
            return
        how = ("steering the running turn" if sent.get("delivery") == "steering"
               else "it starts a turn")
        shown = f"[picture {path.name}, {len(data) / 1024:,.0f} KB]"
        self.say(self.style.dim(f"you › {shown} {_one_line(caption)}".rstrip()
                                + f"  (sent; {how})"))

    async def compact(self) -> None:
        self.say(self.style.dim("Compacting (waits for a running turn to finish)…"))
        try:
            compacted = await self.client.compact(self.desk)
        except OperatorRequestError as exc:
            self.say(self.style.bad(f"/compact failed: {exc.message}"))
            return
        except OperatorClientError as exc:
            self.say(self.style.bad(f"/compact failed: {exc}"))
            return
        self.say(self.style.good("Compacted.") if compacted
                 else "Nothing to compact yet: the conversation is short.")

    async def decide(self, command: str, rest: str) -> None:
        approval_id, _, note = rest.partition(" ")
        if not approval_id:
            word = "note" if command == "/approve" else "reason"
            self.say(self.style.bad(f"Usage: {command} ID [{word}]"))
            return
        if command == "/approve":
            result = await self.client.approve(approval_id, self.operator, note.strip())
        else:
            result = await self.client.deny(approval_id, self.operator, note.strip())
        self.say(f"Approval {result['id']}: {result['outcome']}.")


_LARGEST_FILE = 64 * 1024 * 1024
"""The largest file ``/image`` reads at all; the daemon refuses far smaller ones itself."""

_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
               (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))


def _media_type(data: bytes, name: str) -> str:
    """The picture's media type from its first bytes (a name can lie), else its name."""
    for signature, media_type in _SIGNATURES:
        if data.startswith(signature):
            return media_type
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


def _path_and_rest(text: str) -> tuple[str, str]:
    """A path (quoted when it holds spaces) and what follows it."""
    text = text.strip()
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        if end > 0:
            return text[1:end], text[end + 1:].strip()
    path, _, rest = text.partition(" ")
    return path, rest.strip()


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 80 else line[:79] + "…"


async def _read_lines(on_line: Callable[[str], Awaitable[None]], done: anyio.Event) -> None:
    """Reads stdin line by line without blocking the event loop; EOF (Ctrl-D) ends."""
    fd = sys.stdin.fileno()
    pending = b""
    while not done.is_set():
        await anyio.wait_readable(fd)
        chunk = os.read(fd, 65536)
        if not chunk:
            if pending:
                await on_line(pending.decode(errors="replace"))
            done.set()
            return
        pending += chunk
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            await on_line(line.decode(errors="replace"))
            if done.is_set():
                return


async def _chat(client: OperatorClient, args: argparse.Namespace) -> int:
    client.set_surface("chat")
    operator = args.operator or _login_name()
    health = await client.health()
    session = _Chat(client, args.desk, operator, sys.stdout)
    session.say(f"Connected to {await session.status_line()}")
    session.say(session.style.dim(
        "Type a message and press Enter (mid-turn it steers). /help for commands, /quit "
        "to leave."))
    async with anyio.create_task_group() as group:
        group.start_soon(session.follow, health.get("last_event_id"))

        async def on_line(line: str) -> None:
            await session.handle(line, group)

        group.start_soon(_read_lines, on_line, session.done)
        await session.done.wait()
        group.cancel_scope.cancel()
    session.say(session.style.dim("Bye; the desk keeps running."))
    return 0


def _login_name() -> str:
    try:
        name = getpass.getuser()
    except (KeyError, OSError):
        return "operator"
    cleaned = "".join(c for c in name if c.isalnum() or c in "._-@+ ")[:64]
    return cleaned or "operator"


def _run_chat(args: argparse.Namespace) -> int:
    return run_with_client(args, _chat)
