"""The daemon's store: conversations, events, operator messages, schedules and usage, and
the trading layer's books and journals; in a SQLite file, or on PostgreSQL for a fleet.

See :mod:`trading_agent.store.store` for the table families and how the daemon opens them,
:mod:`trading_agent.store.database` for the one writer and its group commit,
:mod:`trading_agent.store.connection` for the SQL both engines speak, and
:mod:`trading_agent.store.fencing` for how a daemon that lost a desk is kept from writing.
"""

from trading_agent.store.connection import Connection
from trading_agent.store.fencing import Fence, FencedError
from trading_agent.store.recovery import INTERRUPTED_NOTICE
from trading_agent.store.store import DATABASE_NAME, Store, database_path
from trading_agent.store.targets import PostgresTarget, StoreTarget

__all__ = [
    "DATABASE_NAME",
    "INTERRUPTED_NOTICE",
    "Connection",
    "Fence",
    "FencedError",
    "PostgresTarget",
    "Store",
    "StoreTarget",
    "database_path",
]
