"""Hooks a test desk's config names (``hooks = ["tests.desks.refusing_hooks:NoOrders"]``)."""

from __future__ import annotations

from typing import Any

from trading_agent.agent.hooks import Refuse

REFUSAL = "Refused by the desk's no-orders hook: this desk does not trade today."

NOT_A_FACTORY = 42
"""Named by a config to be refused: it cannot be called."""


class NoOrders:
    """Refuses every ``place_order``; lets everything else run."""

    def before_tool_call(self, call: Any, arguments: Any, context: Any) -> Refuse | None:
        return Refuse(REFUSAL) if call.name == "place_order" else None


def broken() -> object:
    """A factory that fails when the desk is built."""
    raise RuntimeError("the hook's database is down")
