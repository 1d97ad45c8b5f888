"""The trading layer's lasting state in the state file: what
:class:`~trading_agent.trading.factory.TradingState` asks for, each part a component of its
own on the file's one writer."""

from __future__ import annotations

from pathlib import Path

from trading_agent.store.order_journal import SqliteOrderJournal
from trading_agent.store.paper_books import SqlitePaperBooks
from trading_agent.store.risk_records import SqliteRiskRecords

__all__ = ["TradingStateFile"]


class TradingStateFile:
    """The paper books, the order journal and the risk journal of the desks on one file.

    Args:
        path: The state file (``store.database_path(state_dir)``).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = path

    async def paper_books(self, account: str) -> SqlitePaperBooks:
        """A paper account's books."""
        return await SqlitePaperBooks.open(self.path, account)

    async def order_journal(self) -> SqliteOrderJournal:
        """The live orders' journal."""
        return await SqliteOrderJournal.open(self.path)

    async def risk_records(self) -> SqliteRiskRecords:
        """The risk policies' memory."""
        return await SqliteRiskRecords.open(self.path)

    def __repr__(self) -> str:
        return f"TradingStateFile({str(self.path)!r})"
