"""The trading layer's lasting state in the store: what
:class:`~trading_agent.trading.factory.TradingState` asks for, each part a component of its
own on the store's one writer."""

from __future__ import annotations

from trading_agent.store.desk_books import SqliteDeskBooks
from trading_agent.store.fencing import Fence
from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.protective_orders import SqliteProtectiveOrders
from trading_agent.store.risk_records import SqliteRiskRecords
from trading_agent.store.targets import StoreTarget

__all__ = ["TradingStateFile"]


class TradingStateFile:
    """The paper books, the order journal, the risk journal and the books of a desk in the
    store.

    Args:
        target: The state file (``store.database_path(state_dir)``), or the PostgreSQL
            store.
        fence: Checks before each write of ``desk`` that this daemon still holds it (the
            risk journal's writes are checked on the desk each record names).
        desk: The desk these parts are opened for.
    """

    def __init__(self, target: StoreTarget, fence: Fence | None = None,
                 desk: str | None = None) -> None:
        self.target = target
        self._fence = fence
        self._desk = desk

    async def paper_books(self, account: str) -> SqlitePaperBooks:
        """A paper account's books."""
        return await SqlitePaperBooks.open(self.target, account, fence=self._fence,
                                           desk=self._desk)

    async def order_journal(self) -> SqliteOrderJournal:
        """The live orders' journal."""
        return await SqliteOrderJournal.open(self.target, fence=self._fence, desk=self._desk)

    async def risk_records(self) -> SqliteRiskRecords:
        """The risk policies' memory."""
        return await SqliteRiskRecords.open(self.target, fence=self._fence)

    async def desk_books(self, desk: str) -> SqliteDeskBooks:
        """A desk's own books (its writes fenced on that desk)."""
        return await SqliteDeskBooks.open(self.target, desk, fence=self._fence)

    async def protective_orders(self, desk: str) -> SqliteProtectiveOrders:
        """A desk's protective orders (its writes fenced on that desk)."""
        return await SqliteProtectiveOrders.open(self.target, desk, fence=self._fence)

    def __repr__(self) -> str:
        return f"TradingStateFile({str(self.target)!r})"
