"""Conversations (the ``messages``, ``compactions``, ``subagents``, ``retracted_messages``
and ``turn_ends`` tables): every message of every desk and of its subagents, written as it is
added to its conversation and restored after a restart.

Everything is appended as it happens and nothing is rewritten whole: a message is written
when it is added to its conversation (the operator's message before the model is called),
and a compaction adds a row naming the summary and the first message still sent verbatim.

How the daemon uses it::

    transcripts.set_call_outcomes("alpha", order_outcomes)  # real outcomes of cut-off calls
    conversation = await transcripts.restore_conversation("alpha", system_prompt)

A tool call the daemon never answered (a ``kill -9`` mid tool round) is answered on restore,
by :mod:`~trading_agent.store.recovery` from the plain facts kept here (the turn each message
was made in, how each turn ended) and the calls held for an operator's approval
(:mod:`~trading_agent.store.held_calls`). A resolver registered for the desk
(:meth:`SqliteTranscripts.set_call_outcomes`, e.g. the trading layer's ``OrderOutcomes``) may
look a call up and say what really happened; the store imports nothing of the trading layer.

A desk's main-conversation message marks the operator message of the same id delivered
(:func:`~trading_agent.store.operator_inbox.mark_delivered`), in the same transaction.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import structlog

from trading_agent.agent.conversation import Conversation, ConversationObserver, Message
from trading_agent.jsontext import json_loads
from trading_agent.store.codec import decode_content, encode_content, image_refs, public_blocks
from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.images import get_images, put_images
from trading_agent.store.operator_inbox import mark_delivered
from trading_agent.store.recovery import CallOutcomes, HeldCallFacts, TurnEnd, restore
from trading_agent.store.schedule_state import mark_fired

__all__ = ["MIGRATIONS", "TABLES", "DeskConversationStore", "SqliteTranscripts",
           "SubagentOrigin"]

TABLES = ("messages", "compactions", "subagents", "retracted_messages", "turn_ends")
"""The tables this module owns."""

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
    )),
)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""

_IMAGE_KEY = '"sha256"'
"""In the JSON text of every message that refers to a picture (and of the odd other one)."""

_log = structlog.get_logger(__name__)


class SubagentOrigin(Protocol):
    """Where a subagent comes from (``tools.delegate.SubagentLink`` has this shape; the
    store does not import the tools)."""

    @property
    def desk(self) -> str: ...
    @property
    def subagent_id(self) -> str: ...
    @property
    def parent_turn(self) -> str: ...
    @property
    def parent_call_id(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def tools(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class _StoredRow:
    seq: int
    desk: str
    message_id: str
    role: str
    kind: str
    blocks: list[dict[str, Any]]
    created_at: float
    subagent_id: str | None
    parent_call_id: str | None



class _CollectorPause:
    """Pauses Python's cyclic garbage collector while a restore decodes a transcript.

    Decoding a message makes some ten container objects (the parsed JSON, the blocks, the
    message), none of them garbage. With the collector running, every few hundred of them
    it walks the young objects, and each time the heap grows by a quarter it walks every
    object the process holds, finding nothing: restoring 100 desks of 1,000 messages spent
    some 40% of its CPU there (``bench/restart.py``). Paused for one desk's read (a few
    milliseconds), it runs once afterwards over what is left.

    Reads run in worker threads and the switch is the process's, so the callers are
    counted: the collector runs again when the last one is done, if it ran before the first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


_collector_paused = _CollectorPause()


def _row(values: Sequence[Any]) -> _StoredRow:
    seq, desk, message_id, role, kind, content, created_at, subagent_id, parent_call_id = values
    return _StoredRow(seq, desk, message_id, role, kind, json.loads(content), created_at,
                      subagent_id, parent_call_id)


_MESSAGE_COLUMNS = ("seq, desk, message_id, role, kind, content, created_at, subagent_id, "
                    "parent_call_id")


class SqliteTranscripts:
    """The desks' conversations in the store.

    Every write for a desk names it, so that a store opened with a fence refuses it once
    this daemon no longer holds the desk (see :mod:`~trading_agent.store.fencing`).

    Args:
        database: The open store, its schema applied.
        held_calls: The calls held for approval, which a restore reads.
        clock: Seconds since the epoch (injectable for tests).
    """

    def __init__(self, database: Database, held_calls: HeldCallFacts, *,
                 clock: Callable[[], float] = time.time) -> None:
        self._db = database
        self._held_calls = held_calls
        self._clock = clock
        self._call_outcomes: dict[str, CallOutcomes] = {}

    def observer(self, desk: str, *, subagent_id: str | None = None,
                 parent_call_id: str | None = None) -> DeskConversationStore:
        """The observer that stores a conversation of ``desk`` as it grows.

        Args:
            desk: The desk.
            subagent_id: For a subagent's conversation, its id.
            parent_call_id: For a subagent's conversation, the desk's ``delegate`` call.

        Returns:
            An observer to give the :class:`Conversation`.
        """
        return DeskConversationStore(self, desk, subagent_id=subagent_id,
                                     parent_call_id=parent_call_id)

    async def observer_for(self, link: SubagentOrigin) -> ConversationObserver:
        """Stores a subagent's conversation (``tools.delegate.SubagentTranscripts``).

        Args:
            link: Its ``SubagentLink``: desk, subagent id, parent turn and call, task, tools.

        Returns:
            The observer for the subagent's conversation.
        """
        started = self._clock()

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO subagents (subagent_id, desk, parent_turn, parent_call_id, task, "
                "tools, started_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (link.subagent_id, link.desk, link.parent_turn, link.parent_call_id, link.task,
                 json.dumps(list(link.tools)), started))

        await self._db.write(write, desk=link.desk)
        return self.observer(link.desk, subagent_id=link.subagent_id,
                             parent_call_id=link.parent_call_id)

    async def append_message(self, desk: str, message: Message, *,
                             subagent_id: str | None = None,
                             parent_call_id: str | None = None,
                             turn: str | None = None,
                             fired_schedule: tuple[str, datetime] | None = None) -> str:
        """Stores one message at the end of a desk's transcript.

        Idempotent on the message id: storing the same message again changes nothing. A
        desk's main-conversation message marks the operator message of the same id delivered,
        in the same transaction.

        Args:
            desk: The desk.
            message: The message.
            subagent_id: For a subagent's message, its id.
            parent_call_id: For a subagent's message, the desk's ``delegate`` call.
            turn: The turn it was made in (a fact recovery reads), if any.
            fired_schedule: For a schedule's trigger, the schedule's name and slot, recorded
                as fired in the same transaction: a crash leaves both or neither, so the slot
                neither fires again beside its stored turn nor is lost.

        Returns:
            The id it is stored under: the message's own, unless another message of the desk
            already holds that id with other content (a model reusing tool call ids makes
            such repairs), in which case a suffixed one.

        Raises:
            StoreError: The database failed.
        """
        content, images = encode_content(message.content)
        now = self._clock()

        def write(connection: Connection) -> str:
            put_images(connection, images)
            stored_id = message.id
            inserted = connection.execute(
                "INSERT INTO messages (desk, message_id, role, kind, content, created_at, "
                "subagent_id, parent_call_id, turn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (desk, stored_id, message.role, message.kind, content, message.created_at,
                 subagent_id, parent_call_id, turn)).rowcount
            if not inserted:
                existing = connection.execute(
                    "SELECT content, subagent_id FROM messages WHERE desk = ? AND message_id = ?",
                    (desk, stored_id)).fetchone()
                if existing is not None and (existing[0], existing[1]) == (content, subagent_id):
                    return stored_id
                stored_id = f"{message.id}~{uuid.uuid4().hex[:8]}"
                connection.execute(
                    "INSERT INTO messages (desk, message_id, role, kind, content, created_at, "
                    "subagent_id, parent_call_id, turn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (desk, stored_id, message.role, message.kind, content, message.created_at,
                     subagent_id, parent_call_id, turn))
            if subagent_id is None:
                mark_delivered(connection, desk, message.id, now)
            if fired_schedule is not None:
                mark_fired(connection, desk, *fired_schedule)
            return stored_id

        stored = await self._db.write(write, desk=desk)
        if stored != message.id:
            _log.warning("message_id_reused", desk=desk, message_id=message.id,
                         stored_id=stored)
        return stored

    async def has_message(self, desk: str, message_id: str) -> bool:
        """Whether a message of this id is stored for the desk (compacted away or not).

        Args:
            desk: The desk.
            message_id: The message's id.

        Returns:
            True when it is stored.

        Raises:
            StoreError: The database failed.
        """

        def read(connection: Connection) -> bool:
            return connection.execute(
                "SELECT 1 FROM messages WHERE desk = ? AND message_id = ? LIMIT 1",
                (desk, message_id)).fetchone() is not None

        return await self._db.read(read)

    async def record_compaction(self, desk: str, summary: Message, first_kept_id: str | None,
                                *, subagent_id: str | None = None) -> None:
        """Stores a compaction: ``summary`` stands for every message before ``first_kept_id``.

        Args:
            desk: The desk.
            summary: The summary message.
            first_kept_id: The stored id of the oldest message still sent verbatim, or None
                when every message was summarized.
            subagent_id: For a subagent's conversation, its id.

        Raises:
            StoreError: The database failed.
        """
        content, images = encode_content(summary.content)
        now = self._clock()

        def write(connection: Connection) -> None:
            put_images(connection, images)
            first_kept_seq: int | None = None
            if first_kept_id is not None:
                row = connection.execute(
                    "SELECT seq FROM messages WHERE desk = ? AND message_id = ?",
                    (desk, first_kept_id)).fetchone()
                if row is not None:
                    first_kept_seq = int(row[0])
                else:
                    # Unknown message: keep the whole previous window rather than lose any.
                    previous = connection.execute(
                        "SELECT first_kept_seq FROM compactions WHERE desk = ? AND "
                        + ("subagent_id IS NULL" if subagent_id is None else "subagent_id = ?")
                        + " ORDER BY id DESC LIMIT 1",
                        (desk,) if subagent_id is None else (desk, subagent_id)).fetchone()
                    first_kept_seq = int(previous[0]) if previous is not None else 0
            if first_kept_seq is None:
                first_kept_seq = int(connection.execute(
                    "SELECT COALESCE(MAX(seq), 0) + 1 FROM messages").fetchone()[0])
            connection.execute(
                "INSERT INTO compactions (desk, subagent_id, summary_id, summary, "
                "summary_created_at, first_kept_id, first_kept_seq, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (desk, subagent_id, summary.id, content, summary.created_at, first_kept_id,
                 first_kept_seq, now))

        await self._db.write(write, desk=desk)

    def set_call_outcomes(self, desk: str, outcomes: CallOutcomes | None) -> None:
        """Registers what looks up a desk's interrupted calls on restore (None removes it).

        Args:
            desk: The desk.
            outcomes: Called for each tool call a restore finds without its result; see
                :data:`CallOutcomes`.
        """
        if outcomes is None:
            self._call_outcomes.pop(desk, None)
        else:
            self._call_outcomes[desk] = outcomes

    async def restore_conversation(self, desk: str, system_prompt: str,
                                   reason: str | None = None, *,
                                   outcomes: CallOutcomes | None = None) -> Conversation:
        """A desk's conversation as it was: the latest summary and the messages after it, a
        cut-off turn repaired and followed by a notice (see :func:`recovery.restore
        <trading_agent.store.recovery.restore>`).

        Args:
            desk: The desk.
            system_prompt: The desk's system prompt.
            reason: Why the turn stopped, when the caller knows; None after a restart.
            outcomes: Says what became of each interrupted call; the registered one when
                None.

        Returns:
            The conversation, with the store as its observer.

        Raises:
            StoreError: The database failed, or a stored message cannot be decoded.
        """
        return await restore(self, self._held_calls, desk, system_prompt, reason,
                             outcomes=outcomes or self._call_outcomes.get(desk))

    async def restored_window(self, desk: str) -> tuple[Message | None, list[Message]]:
        """The desk's latest summary and the messages after it, an operator's retracted ones
        left out, oldest first.

        Raises:
            StoreError: The database failed, or a stored message cannot be decoded.
        """

        def read(connection: Connection) -> tuple[Message | None, list[Message]]:
            compaction = connection.execute(
                "SELECT summary_id, summary, summary_created_at, first_kept_seq FROM "
                "compactions WHERE desk = ? AND subagent_id IS NULL ORDER BY id DESC LIMIT 1",
                (desk,)).fetchone()
            first_seq = int(compaction[3]) if compaction is not None else 0
            with _collector_paused():
                rows = connection.execute(
                    "SELECT message_id, role, kind, content, created_at "
                    "FROM messages WHERE desk = ? AND subagent_id IS NULL AND seq >= ? "
                    "AND message_id NOT IN "
                    "(SELECT message_id FROM retracted_messages WHERE desk = ?) ORDER BY seq",
                    (desk, first_seq, desk)).fetchall()
                summary_blocks = json_loads(compaction[1]) if compaction is not None else []
                loaded = [json_loads(row[3]) for row in rows]
                digests = image_refs(summary_blocks)
                for row, blocks in zip(rows, loaded, strict=True):
                    if _IMAGE_KEY in row[3]:  # a test on the text spares walking the others
                        digests |= image_refs(blocks)
                images = get_images(connection, digests)
                summary = None
                if compaction is not None:
                    summary = Message(role="user", kind="summary", id=compaction[0],
                                      created_at=compaction[2],
                                      content=decode_content(summary_blocks, images))
                messages = [Message(role=role, kind=kind, id=message_id, created_at=created_at,
                                    content=decode_content(blocks, images))
                            for (message_id, role, kind, _, created_at), blocks
                            in zip(rows, loaded, strict=True)]
            return summary, messages

        return await self._db.read(read)

    # Plain facts for recovery: the turn of each message, how each turn ended.

    async def turn_of(self, desk: str, message_id: str) -> str | None:
        """The turn a message of the desk was made in; None when it was stored without one
        (made outside a turn, or stored before turns were)."""
        row = await self._db.read(lambda connection: connection.execute(
            "SELECT turn FROM messages WHERE desk = ? AND message_id = ?",
            (desk, message_id)).fetchone())
        return None if row is None or row[0] is None else str(row[0])

    async def turn_end(self, desk: str, turn: str) -> TurnEnd | None:
        """How the desk's turn ended (``answered``, ``round_limit``, ``stopped``,
        ``cut_off``), or None when it never did."""
        row = await self._db.read(lambda connection: connection.execute(
            "SELECT how FROM turn_ends WHERE desk = ? AND turn = ?", (desk, turn)).fetchone())
        return None if row is None else str(row[0])

    async def record_turn_end(self, desk: str, turn: str, how: TurnEnd) -> None:
        """Records how the desk's turn ended (the first word stays: a turn ends once)."""
        at = self._clock()
        await self._db.write(lambda connection: connection.execute(
            "INSERT INTO turn_ends (desk, turn, how, at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING", (desk, turn, how, at)), desk=desk)

    def now(self) -> float:
        """The store's clock (seconds since the epoch)."""
        return self._clock()

    async def transcript(self, desk: str, before_seq: int | None = None, limit: int = 50, *,
                         include_subagents: bool = True) -> list[dict[str, Any]]:
        """A page of a desk's stored messages, oldest first, as JSON-ready data.

        Images are given by reference (``sha256``, ``media_type``, ``description``, ``size``);
        fetch the bytes with :meth:`image`.

        Args:
            desk: The desk.
            before_seq: Only messages with a smaller ``seq`` (to page back); None for the newest.
            limit: The most messages.
            include_subagents: Also the messages of the desk's subagents (tagged with
                ``subagent`` and ``parent_call``).

        Returns:
            Each message as ``{seq, id, desk, role, kind, created_at, subagent, parent_call,
            text, content, retracted}``; ``retracted`` when an operator's retry took it out
            of what the desk is sent.
        """

        def read(connection: Connection) -> tuple[list[_StoredRow], set[str]]:
            query = f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE desk = ?"
            args: list[Any] = [desk]
            if not include_subagents:
                query += " AND subagent_id IS NULL"
            if before_seq is not None:
                query += " AND seq < ?"
                args.append(before_seq)
            query += " ORDER BY seq DESC LIMIT ?"
            args.append(max(0, limit))
            rows = [_row(values) for values in connection.execute(query, args)]
            ids = [row.message_id for row in rows]
            retracted = {values[0] for values in connection.execute(
                "SELECT message_id FROM retracted_messages WHERE desk = ? AND message_id IN "
                f"({', '.join('?' * len(ids))})", (desk, *ids))} if ids else set()
            return rows, retracted

        rows, retracted = await self._db.read(read)
        return [{**_public_message(row), "retracted": row.message_id in retracted}
                for row in reversed(rows)]

    async def retract_messages(self, desk: str, message_ids: Sequence[str], by: str) -> None:
        """Takes messages out of what the desk is sent from now on (an operator's retry):
        the transcript keeps them, marked ``retracted``; a restore leaves them out.

        Args:
            desk: The desk.
            message_ids: The messages.
            by: The operator.
        """
        at = self._clock()

        def write(connection: Connection) -> None:
            connection.executemany(
                "INSERT INTO retracted_messages (desk, message_id, by, at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [(desk, message_id, by, at) for message_id in message_ids])

        await self._db.write(write, desk=desk)


def _public_message(row: _StoredRow) -> dict[str, Any]:
    text = "\n".join(str(b["text"]) for b in row.blocks if b.get("type") == "text")
    return {"seq": row.seq, "id": row.message_id, "desk": row.desk, "role": row.role,
            "kind": row.kind, "created_at": row.created_at, "subagent": row.subagent_id,
            "parent_call": row.parent_call_id, "text": text,
            "content": public_blocks(row.blocks)}


class DeskConversationStore:
    """Stores one conversation of a desk as it grows (a ``ConversationObserver``).

    Args:
        store: The transcripts.
        desk: The desk.
        subagent_id: For a subagent's conversation, its id.
        parent_call_id: For a subagent's conversation, the desk's ``delegate`` call.
    """

    def __init__(self, store: SqliteTranscripts, desk: str, *, subagent_id: str | None = None,
                 parent_call_id: str | None = None) -> None:
        self.store = store
        self.desk = desk
        self.subagent_id = subagent_id
        self.parent_call_id = parent_call_id
        self._renamed: dict[str, str] = {}

    async def message_appended(self, conversation: Conversation, message: Message, *,
                               fired_schedule: tuple[str, datetime] | None = None) -> None:
        """Writes the message (before the conversation goes on); with ``fired_schedule``,
        the schedule's slot it opens a turn for, in the same transaction."""
        stored = await self.store.append_message(
            self.desk, message, subagent_id=self.subagent_id, parent_call_id=self.parent_call_id,
            turn=conversation.turn_id, fired_schedule=fired_schedule)
        if stored != message.id:
            self._renamed[message.id] = stored

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        """Writes the compaction."""
        if first_kept_id is not None:
            first_kept_id = self._renamed.get(first_kept_id, first_kept_id)
        await self.store.record_compaction(self.desk, summary, first_kept_id,
                                           subagent_id=self.subagent_id)
