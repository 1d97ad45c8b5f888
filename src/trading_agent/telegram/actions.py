"""What each command does, and the text the operator reads back.

Each command asks the running daemon (:class:`~trading_agent.daemon.control.DeskControl`) what
the operator API's route of the same name asks, with the same checks (a desk a spend cap
paused needs an owner to resume it), and answers in a few short lines a phone shows well.
Roles are checked before any of this runs (:mod:`.bot`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trading_agent.daemon.control import DeskControl
from trading_agent.daemon.pins import PinControl, PinRefusedError, UnknownPinError
from trading_agent.daemon.spend import SPEND_CAP
from trading_agent.errors import ConfigError, TradingAgentError
from trading_agent.operator.identity import Operator, allows
from trading_agent.operator.render import (
    describe_kill_switch,
    describe_reduce_only,
    format_money,
    pin_lines,
    printable,
)
from trading_agent.telegram.commands import COMMANDS

__all__ = ["ActionRefusedError", "Asked", "DeskActions", "NeedsRoleError", "profit_text"]

_MAX_ROWS = 15
"""The most rows (trades, days) one answer lists."""


class ActionRefusedError(TradingAgentError):
    """The command cannot be done as asked (an unknown desk, a bad argument); the message
    says why, for the operator."""


class NeedsRoleError(ActionRefusedError):
    """What was asked needs more than the command's role (lifting a spend cap).

    Args:
        needed: The role it needs.
        what: What needs it.
    """

    def __init__(self, needed: str, what: str) -> None:
        super().__init__(f"{what} needs the {needed} role")
        self.needed = needed


@dataclass(frozen=True)
class Asked:
    """One command as an operator sent it.

    Attributes:
        operator: Who sent it.
        name: The command, without its slash.
        arguments: The words after it.
        desk: The chat's desk.
    """

    operator: Operator
    name: str
    arguments: str
    desk: str


def _known(control: DeskControl, desk: str) -> str:
    if desk not in control.desk_names():
        raise ActionRefusedError(f"there is no desk {desk!r}; the desks: "
                                 f"{', '.join(control.desk_names())}")
    return desk


def _money(value: Any) -> str:
    return "-" if value is None else format_money(value)


class DeskActions:
    """The commands' work over the running daemon.

    Args:
        control: The running daemon.
    """

    def __init__(self, control: DeskControl) -> None:
        self._control = control

    async def run(self, asked: Asked) -> str:
        """Does a command.

        Args:
            asked: The command.

        Returns:
            The answer's text.

        Raises:
            ActionRefusedError: It cannot be done as asked (the text says why).
            TradingAgentError: The daemon could not do it.
        """
        handler = getattr(self, f"_{asked.name}")
        text: str = await handler(asked)
        return printable(text)

    # ------------------------------------------------------------------ reads

    async def _desks(self, asked: Asked) -> str:
        lines = []
        for name in self._control.desk_names():
            status = await self._control.desk_status(name)
            mark = "→ " if name == asked.desk else "  "
            lines.append(f"{mark}{name}: {status.state}, {status.mode}, equity "
                         f"{_money(status.equity)}"
                         + (f", {status.pending_approvals} waiting for approval"
                            if status.pending_approvals else ""))
        return "\n".join(lines) + "\n(→ this chat's desk; /desk NAME to switch)"

    async def _status(self, asked: Asked) -> str:
        desk = _known(self._control, asked.arguments.strip() or asked.desk)
        s = await self._control.desk_status(desk)
        lines = [f"{desk}: {s.state} ({s.mode}, model {s.model})",
                 f"Equity {_money(s.equity)}; realized today {_money(s.realized_today)}; "
                 f"unrealized {_money(s.unrealized)}",
                 f"Open orders {s.open_orders}; waiting for approval {s.pending_approvals}; "
                 f"tokens today {s.tokens_today:,}"]
        if s.paused_reason:
            lines.append(f"Paused: {s.paused_reason}")
        if s.kill_switch:
            lines.append(f"Kill switch: {s.kill_switch}")
        if s.reduce_only:
            lines.append(f"Reduce-only: {s.reduce_only.get('text', '')}")
        if s.last_turn_text:
            lines.append(f"Last answer: {s.last_turn_text.strip()[:300]}")
        return "\n".join(lines)

    async def _desk(self, asked: Asked) -> str:
        name = asked.arguments.strip()
        if not name:
            return (f"This chat talks to {asked.desk}. Switch with /desk NAME; the desks: "
                    f"{', '.join(self._control.desk_names())}")
        _known(self._control, name)
        return f"This chat now talks to {name}."

    async def _positions(self, asked: Asked) -> str:
        answer = await self._control.books(asked.desk, "positions")
        if not answer.get("books"):
            return f"{asked.desk} keeps no books."
        lines = [f"{p['symbol']} {p['side']} {p['amount']} at {p['entry_price']}, mark "
                 f"{p['mark'] or '-'}, unrealized {_money(p['unrealized'])}"
                 for p in answer["positions"]]
        return f"{asked.desk} positions:\n" + ("\n".join(lines) or "No open positions.")

    async def _trades(self, asked: Asked) -> str:
        answer = await self._control.books(asked.desk, "trades")
        if not answer.get("books"):
            return f"{asked.desk} keeps no books."
        trades = answer["trades"][-_MAX_ROWS:]
        lines = [f"#{t['id']} {t['symbol']} {t['side']} {t['amount']} at {t['entry_price']}"
                 + (" (open)" if t["open"] else
                    f" → {t['exit_price']}, profit {_money(t['profit'])}")
                 for t in trades]
        return f"{asked.desk} trades:\n" + ("\n".join(lines) or "No trades.")

    async def _profit(self, asked: Asked) -> str:
        period = asked.arguments.strip().lower() or "daily"
        if period not in ("daily", "weekly"):
            raise ActionRefusedError("/profit takes daily or weekly")
        answer = await self._control.books(asked.desk, "profit", period=period)
        return profit_text(answer, period)

    async def _balance(self, asked: Asked) -> str:
        s = await self._control.desk_status(asked.desk)
        return (f"{asked.desk} ({s.mode}): equity {_money(s.equity)}; realized today "
                f"{_money(s.realized_today)}; unrealized {_money(s.unrealized)}; open orders "
                f"{s.open_orders}")

    async def _pins(self, asked: Asked) -> str:
        return "\n".join(pin_lines(await self._pin_control().pinned(asked.desk)))

    async def _help(self, asked: Asked) -> str:
        role = asked.operator.role
        lines = [f"You are {asked.operator.name}, a {role}. This chat talks to {asked.desk}.",
                 "Plain text goes to the desk (it steers a running turn)."
                 if allows(role, "trader") else "", ""]
        for command in COMMANDS:
            if allows(role, command.role):
                usage = f" {command.usage}" if command.usage else ""
                lines.append(f"/{command.name}{usage}: {command.description}")
        return "\n".join(lines).replace("\n\n\n", "\n\n")

    # ------------------------------------------------------------------ actions

    async def _pause(self, asked: Asked) -> str:
        reason = asked.arguments.strip() or "no reason given"
        paused = await self._control.pause(asked.desk, asked.operator.name, reason)
        return f"{asked.desk} paused: no turns until /resume." if paused else \
            f"{asked.desk} was paused already."

    async def _resume(self, asked: Asked) -> str:
        before = await self._control.desk_status(asked.desk)
        if (before.paused_reason.startswith(f"paused by {SPEND_CAP} ")
                and not allows(asked.operator.role, "owner")):
            raise NeedsRoleError("owner", "resuming a desk a spend cap paused (lifting the cap)")
        waiting = await self._control.resume(asked.desk, asked.operator.name)
        if waiting is None:
            return f"{asked.desk} was not paused."
        return f"{asked.desk} resumed ({waiting} trigger{'s' if waiting != 1 else ''} waited)."

    async def _cancel(self, asked: Asked) -> str:
        if self._control.cancel_turn(asked.desk, asked.operator.name):
            return f"{asked.desk}'s turn ends at its next safe point."
        return f"{asked.desk} has no turn running."

    async def _retry(self, asked: Asked) -> str:
        dropped = await self._control.retry(asked.desk, asked.operator.name)
        return (f"{asked.desk} runs its last turn again ({dropped} message"
                f"{'s' if dropped != 1 else ''} of its last answer left what it is sent).")

    async def _compact(self, asked: Asked) -> str:
        compacted = await self._control.compact(asked.desk)
        return f"{asked.desk} compacted." if compacted else f"{asked.desk}: nothing to compact."

    async def _reduce_only(self, asked: Asked) -> str:
        word = asked.arguments.strip().lower()
        if word not in ("on", "off"):
            s = await self._control.desk_status(asked.desk)
            state = s.reduce_only.get("text", "on") if s.reduce_only else "off"
            return f"{asked.desk} reduce-only: {state}. /reduce_only on|off"
        if word == "off":
            held = (await self._control.desk_status(asked.desk)).reduce_only
            if (held is not None and held.get("by") == SPEND_CAP
                    and not allows(asked.operator.role, "owner")):
                raise NeedsRoleError("owner", "lifting reduce-only a spend cap set")
        result = await self._control.set_reduce_only(word == "on", desk=asked.desk,
                                                     by=asked.operator.name,
                                                     reason="from Telegram")
        return describe_reduce_only(result)

    async def _kill(self, asked: Asked) -> str:
        words = asked.arguments.split(maxsplit=1)
        scope: str | None = asked.desk
        if words and words[0].lower() == "all":
            scope = None
            words = words[1].split(maxsplit=1) if len(words) > 1 else []
        if not words or words[0].lower() not in ("on", "off"):
            halts = self._control.kill_switch_halts()
            return ("\n".join(f"Kill switch on for {h.get('scope')}: {h.get('text')}"
                              for h in halts) or "No kill switch is on.") + \
                "\n/kill [all] on|off [REASON]"
        on = words[0].lower() == "on"
        reason = (words[1] if len(words) > 1 else "").strip() or f"from Telegram by " \
            f"{asked.operator.name}"
        result = await self._control.set_kill_switch(on, desk=scope, by=asked.operator.name,
                                                     reason=reason if on else "")
        return describe_kill_switch(result).replace("'trading-agent kill-switch off'",
                                                    "/kill off")

    async def _reload(self, asked: Asked) -> str:
        try:
            changes = await self._control.reload(asked.operator.name)
        except ConfigError as exc:
            raise ActionRefusedError(f"nothing changed: {exc}") from None
        return "Reloaded.\n" + ("\n".join(changes) or "Nothing changed.")

    async def _pin(self, asked: Asked) -> str:
        text = asked.arguments.strip()
        if not text:
            raise ActionRefusedError("/pin TEXT: the instruction to pin")
        try:
            result = await self._pin_control().pin(asked.desk, text, asked.operator.name)
        except PinRefusedError as exc:
            raise ActionRefusedError(str(exc)) from None
        pin = result.get("pin") or {}
        return f"Pinned #{pin.get('id')} to {asked.desk}: {pin.get('text', text)}"

    async def _unpin(self, asked: Asked) -> str:
        word = asked.arguments.strip().lstrip("#")
        if not word.isdigit():
            raise ActionRefusedError("/unpin ID: the number /pins shows")
        try:
            await self._pin_control().unpin(asked.desk, int(word), asked.operator.name)
        except UnknownPinError as exc:
            raise ActionRefusedError(str(exc)) from None
        return f"Unpinned #{word} from {asked.desk}."

    def _pin_control(self) -> PinControl:
        if not isinstance(self._control, PinControl):
            raise ActionRefusedError("standing instructions are not kept by a daemon of a "
                                     "fleet yet; pin on a daemon that runs alone")
        return self._control


def profit_text(answer: Mapping[str, Any], period: str = "daily") -> str:
    """A desk's profit (``books(desk, "profit")``) as a few lines.

    Args:
        answer: The books' answer.
        period: ``daily`` or ``weekly`` rows.

    Returns:
        The lines.
    """
    desk = answer.get("desk", "")
    if not answer.get("books"):
        return f"{desk} keeps no books."
    s = answer["summary"]
    rate = s.get("win_rate")
    lines = [f"{desk} profit: realized today {_money(s['realized_today'])}, in total "
             f"{_money(s['realized_total'])}; unrealized {_money(s['unrealized'])}; fees "
             f"{_money(s['fees_total'])}",
             f"Closed trades {s['trades_closed']} (won {s['wins']}"
             + (f", {rate:.0%}" if isinstance(rate, int | float) else "")
             + f"); open {s['open_trades']}"]
    rows: Sequence[Mapping[str, Any]] = answer.get("rows", [])[-_MAX_ROWS:]
    for row in rows:
        lines.append(f"{'week of ' if period == 'weekly' else ''}{row['day']}: "
                     f"{_money(row['realized'])} (fees {_money(row['fees'])}, "
                     f"{row['fills']} fills)")
    return "\n".join(lines)

