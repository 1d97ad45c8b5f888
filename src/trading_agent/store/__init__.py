"""The daemon's SQLite store: conversations, events, operator messages, schedules, usage.

See :mod:`trading_agent.store.store` for how the daemon uses it, and
:mod:`trading_agent.store.database` for why it commits with ``synchronous=FULL``.
"""

from trading_agent.store.store import (
    DATABASE_NAME,
    DEFAULT_SKIPPED_EVENTS,
    INTERRUPTED_NOTICE,
    DailyUsage,
    DeskConversationStore,
    Store,
    SubagentOrigin,
    database_path,
)

__all__ = [
    "DATABASE_NAME",
    "DEFAULT_SKIPPED_EVENTS",
    "INTERRUPTED_NOTICE",
    "DailyUsage",
    "DeskConversationStore",
    "Store",
    "SubagentOrigin",
    "database_path",
]
