"""Every command of the Telegram bot, the role it needs and its audit action.

A command does what one route of the operator API does, so its role and audit action are
that route's, read from :data:`~trading_agent.operator.route_roles.ROUTE_ROLES` (the one
table every surface asks): a viewer reads, a trader steers and decides, an owner holds the
kill switch and reload.
"""

from __future__ import annotations

from dataclasses import dataclass

from trading_agent.operator.config import Role
from trading_agent.operator.route_roles import ROUTE_ROLES

__all__ = ["APPROVE", "COMMANDS", "DENY", "SEND", "Command", "command_rule"]


@dataclass(frozen=True)
class Command:
    """One bot command.

    Attributes:
        name: What follows the slash.
        route: The operator API's route it does the work of: ``(method, path template)``.
        usage: Its arguments, as ``/help`` shows them.
        description: One line for ``/help`` and Telegram's command menu.
    """

    name: str
    route: tuple[str, str]
    usage: str
    description: str

    @property
    def role(self) -> Role:
        """The role it needs (its route's)."""
        return command_rule(self.route)[0]

    @property
    def action(self) -> str | None:
        """Its audit action (its route's); None for a read."""
        return command_rule(self.route)[1]


def command_rule(route: tuple[str, str]) -> tuple[Role, str | None]:
    """The role a route needs and its audit action.

    Args:
        route: ``(method, path template)`` of the operator API.

    Returns:
        The role (a route open to anyone still needs a viewer here) and the action.
    """
    role, action = ROUTE_ROLES[route]
    return role or "viewer", action


_DESKS = ("GET", "/api/desks")
_DESK = ("GET", "/api/desks/{desk}")

COMMANDS: tuple[Command, ...] = (
    Command("desks", _DESKS, "", "every desk's state"),
    Command("status", _DESK, "[DESK]", "one desk's status (this chat's desk by default)"),
    Command("desk", _DESK, "NAME", "talk to another desk in this chat"),
    Command("positions", ("GET", "/api/desks/{desk}/positions"), "", "open positions"),
    Command("trades", ("GET", "/api/desks/{desk}/trades"), "", "round trips"),
    Command("profit", ("GET", "/api/desks/{desk}/profit"), "[daily|weekly]",
            "profit, today and in total, by day"),
    Command("balance", _DESK, "", "equity, realized today, unrealized"),
    Command("pause", ("POST", "/api/desks/{desk}/pause"), "[REASON]", "no turns until resumed"),
    Command("resume", ("POST", "/api/desks/{desk}/resume"), "", "take turns again"),
    Command("cancel", ("POST", "/api/desks/{desk}/cancel"), "",
            "end the running turn at its next safe point"),
    Command("retry", ("POST", "/api/desks/{desk}/retry"), "", "run the last turn again"),
    Command("compact", ("POST", "/api/desks/{desk}/compact"), "",
            "compact the desk's conversation now"),
    Command("reduce_only", ("POST", "/api/desks/{desk}/reduce_only"), "[on|off]",
            "only shrink positions (on), or lift it (off)"),
    Command("kill", ("POST", "/api/kill-switch"), "[all] [on|off] [REASON]",
            "the desk's kill switch: refuse every new order"),
    Command("reload", ("POST", "/api/reload"), "", "read the config file again"),
    Command("pin", ("POST", "/api/desks/{desk}/pins"), "TEXT",
            "pin a standing instruction to the desk"),
    Command("pins", ("GET", "/api/desks/{desk}/pins"), "", "the desk's standing instructions"),
    Command("unpin", ("DELETE", "/api/desks/{desk}/pins/{pin_id}"), "ID",
            "take a standing instruction off"),
    Command("help", ("GET", "/api/me"), "", "what you may do here"),
)
"""Every command, in the order ``/help`` lists them."""

SEND = ("POST", "/api/desks/{desk}/messages")
"""Plain text: a message to the chat's desk (steering a running turn)."""

APPROVE = ("POST", "/api/approvals/{approval_id}/approve")
"""The approve button."""

DENY = ("POST", "/api/approvals/{approval_id}/deny")
"""The deny button."""
