"""What a desk can call: market data, charts, balances, orders and its memory.

Each tool is a typed async function in a :class:`~trading_agent.agent.tool_registry.ToolRegistry`
(a pydantic model for its arguments). Results are compact text a model reads well, never raw
exchange JSON; exchange and risk refusals become :class:`~trading_agent.errors.ToolError`
messages. The daemon wires a desk with::

    registry = ToolRegistry()
    register_trading_tools(registry, exchange=venue.exchange, risk_policy=venue.risk,
                           symbols=["BTC/USDT"], memory=memory)

The modules: ``market`` (ticker, order book, candles), ``charts`` (``render_chart``),
``account`` (balances, positions), ``orders`` (place, cancel, status, open orders),
``memory`` (``remember``/``recall``) on ``memory_store`` (the notes' protocol; the store
keeps them), ``text`` (wording),
``trading_tools`` (all of them at once).

The names below are imported on first use, so that ``python -m trading_agent.tools.charts``
runs its module once and importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trading_agent.tools.charts import render_chart_png
    from trading_agent.tools.config import TRADING_TOOL_NAMES
    from trading_agent.tools.memory import register_memory_tools
    from trading_agent.tools.memory_store import DeskMemory, Note
    from trading_agent.tools.trading_tools import register_trading_tools

__all__ = [
    "TRADING_TOOL_NAMES",
    "DeskMemory",
    "Note",
    "register_memory_tools",
    "register_trading_tools",
    "render_chart_png",
]

_HOMES = {
    "TRADING_TOOL_NAMES": "config",
    "DeskMemory": "memory_store",
    "Note": "memory_store",
    "register_memory_tools": "memory",
    "register_trading_tools": "trading_tools",
    "render_chart_png": "charts",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
