"""The store's tables, as numbered migrations (a released migration is never edited).

The trading layer's parts (paper books, journals, notes) are components of their own in the
same database, with their own migrations; the names here never clash with theirs. Written
for SQLite; PostgreSQL runs them through
:func:`~trading_agent.store.postgres_engine.postgres_schema`.
"""

from __future__ import annotations

from trading_agent.store.database import Migration

__all__ = ["COMPONENT", "MIGRATIONS"]

COMPONENT = "store"
"""This schema's name in ``schema_migrations``."""

MIGRATIONS: tuple[Migration, ...] = (
    (1, (
        # Every message of every desk (and of its subagents), in the order it was made.
        # seq is global and increasing, hence increasing per desk too.
        """CREATE TABLE messages (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            desk TEXT NOT NULL,
            message_id TEXT NOT NULL,
            role TEXT NOT NULL,
            kind TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at REAL NOT NULL,
            subagent_id TEXT,
            parent_call_id TEXT,
            UNIQUE (desk, message_id))""",
        "CREATE INDEX messages_by_desk ON messages (desk, subagent_id, seq)",
        # Pictures, once each, by the SHA-256 of their bytes.
        """CREATE TABLE images (
            sha256 TEXT PRIMARY KEY,
            media_type TEXT NOT NULL,
            data BLOB NOT NULL)""",
        # Each compaction: the summary that stands for the messages before first_kept_seq.
        """CREATE TABLE compactions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            desk TEXT NOT NULL,
            subagent_id TEXT,
            summary_id TEXT NOT NULL,
            summary TEXT NOT NULL,
            summary_created_at REAL NOT NULL,
            first_kept_id TEXT,
            first_kept_seq INTEGER NOT NULL,
            created_at REAL NOT NULL)""",
        "CREATE INDEX compactions_by_desk ON compactions (desk, subagent_id, id)",
        # A subagent's origin: its parent turn and tool call, its task and tools.
        """CREATE TABLE subagents (
            subagent_id TEXT PRIMARY KEY,
            desk TEXT NOT NULL,
            parent_turn TEXT NOT NULL,
            parent_call_id TEXT NOT NULL,
            task TEXT NOT NULL,
            tools TEXT NOT NULL,
            started_at REAL NOT NULL)""",
        # Events, with the bus's ids (text deltas and heartbeats are left out by default).
        """CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            desk TEXT NOT NULL,
            turn TEXT,
            type TEXT NOT NULL,
            at REAL NOT NULL,
            data TEXT NOT NULL)""",
        "CREATE INDEX events_by_desk ON events (desk, id)",
        # Operator messages, kept before the operator is told they were received.
        """CREATE TABLE operator_messages (
            id TEXT PRIMARY KEY,
            desk TEXT NOT NULL,
            text TEXT NOT NULL,
            source TEXT NOT NULL,
            images TEXT NOT NULL,
            queued_at REAL NOT NULL,
            delivered_at REAL)""",
        "CREATE INDEX operator_messages_waiting ON operator_messages (desk, delivered_at)",
        # The slot each schedule last fired for.
        """CREATE TABLE schedule_state (
            desk TEXT NOT NULL,
            schedule TEXT NOT NULL,
            last_fired_at REAL NOT NULL,
            PRIMARY KEY (desk, schedule))""",
        # Tokens and cost per desk and UTC day (every model request, subagents' included).
        """CREATE TABLE daily_usage (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            requests INTEGER NOT NULL,
            input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            cost REAL,
            PRIMARY KEY (desk, day))""",
        # Small values the store keeps about itself (the highest event id the bus gave).
        """CREATE TABLE store_meta (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL)""",
    )),
    (2, (
        # The prompt tokens the model's server served from its prompt cache (part of
        # input_tokens, priced apart); days stored before this are 0, as nothing was known.
        "ALTER TABLE daily_usage ADD COLUMN cached_input_tokens INTEGER NOT NULL DEFAULT 0",
    )),
    (3, (
        # A desk an operator (or a spend cap) paused stays paused across a restart.
        """CREATE TABLE desk_holds (
            desk TEXT PRIMARY KEY,
            held_by TEXT NOT NULL,
            reason TEXT NOT NULL,
            held_at REAL NOT NULL,
            until REAL)""",
        # An operator resumed a desk a spend cap paused: no cap pauses it again that day.
        """CREATE TABLE spend_resumes (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            PRIMARY KEY (desk, day))""",
    )),
    (4, (
        # Each desk's equity over time, for the web page's chart: sampled on a timer and on
        # every fill, and thinned as it grows (Store.record_equity_sample keeps it bounded).
        """CREATE TABLE equity_samples (
            desk TEXT NOT NULL,
            at REAL NOT NULL,
            equity REAL NOT NULL)""",
        "CREATE INDEX equity_samples_by_desk ON equity_samples (desk, at)",
    )),
    (5, (
        # Messages an operator's /retry took out of what the desk is sent: kept in messages
        # (the transcript shows them, marked), left out when a conversation is restored.
        """CREATE TABLE retracted_messages (
            desk TEXT NOT NULL,
            message_id TEXT NOT NULL,
            by TEXT NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (desk, message_id))""",
    )),
    (6, (
        # Plain facts recovery reads (store/recovery.py), instead of event JSON. The turn each
        # message was made in (NULL for messages made outside a turn, and before version 6).
        "ALTER TABLE messages ADD COLUMN turn TEXT",
        # How each turn ended, once it returned: answered, round_limit, stopped; cut_off when
        # a restore found it cut off.
        """CREATE TABLE turn_ends (
            desk TEXT NOT NULL,
            turn TEXT NOT NULL,
            how TEXT NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (desk, turn))""",
        # Calls held for an operator's approval, and how that ended (NULL while waiting):
        # stored before the call went on or was refused.
        """CREATE TABLE held_calls (
            desk TEXT NOT NULL,
            turn TEXT NOT NULL,
            call_id TEXT NOT NULL,
            approval_id TEXT NOT NULL,
            outcome TEXT,
            at REAL NOT NULL,
            PRIMARY KEY (desk, approval_id))""",
        "CREATE INDEX held_calls_by_turn ON held_calls (desk, turn)",
    )),
)
