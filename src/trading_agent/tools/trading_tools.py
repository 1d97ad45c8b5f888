"""One call that gives a desk all its trading tools."""

from __future__ import annotations

from collections.abc import Sequence

from trading_agent.agent.tool_registry import ToolRegistry
from trading_agent.tools.account import register_account_tools, register_record_tool
from trading_agent.tools.charts import register_chart_tool
from trading_agent.tools.market import register_market_tools
from trading_agent.tools.memory import register_memory_tools
from trading_agent.tools.memory_store import DeskMemory
from trading_agent.tools.orders import register_order_tools
from trading_agent.trading.desk_books import DeskBooks
from trading_agent.trading.exchange import Exchange
from trading_agent.trading.protection_keeper import ProtectionKeeper
from trading_agent.trading.risk import RiskPolicy

__all__ = ["register_trading_tools"]


def register_trading_tools(registry: ToolRegistry, *, exchange: Exchange,
                           risk_policy: RiskPolicy, symbols: Sequence[str],
                           memory: DeskMemory | None = None,
                           books: DeskBooks | None = None,
                           protection: ProtectionKeeper | None = None) -> ToolRegistry:
    """Registers a desk's trading tools (and its memory tools, given a memory).

    Args:
        registry: The desk's registry.
        exchange: The desk's exchange.
        risk_policy: The desk's risk policy, on the same exchange; every order goes through it.
        symbols: The desk's symbols; the first is the default of the market tools.
        memory: The desk's notes, for ``remember`` and ``recall``.
        books: The desk's books, for ``get_trade_record``.
        protection: The desk's protection keeper, for ``stop_loss``/``take_profit`` and
            ``set_protection``.

    Returns:
        The registry, for chaining.

    Raises:
        ValueError: The risk policy guards another exchange, or a tool name is taken.
    """
    if risk_policy.exchange is not exchange:
        raise ValueError("the risk policy must guard the desk's own exchange")
    register_market_tools(registry, exchange=exchange, symbols=symbols)
    register_chart_tool(registry, exchange=exchange, symbols=symbols)
    register_account_tools(registry, exchange=exchange,
                           quote_currency=risk_policy.limits.quote_currency,
                           protection=protection)
    register_order_tools(registry, exchange=exchange, risk_policy=risk_policy, symbols=symbols,
                         protection=protection)
    if books is not None:
        register_record_tool(registry, books=books)
    if memory is not None:
        register_memory_tools(registry, memory)
    return registry
