"""The daemon's store: conversations, events, operator messages, schedules and usage.

Everything is appended as it happens and nothing is rewritten whole: a message is written
when it is added to its conversation (the operator's message before the model is called),
a compaction adds a row naming the summary and the first message still sent verbatim, and
events arrive in batches from an :class:`~trading_agent.agent.event_bus.EventBus`
subscription.

How the daemon uses it::

    store = await Store.open(database_path(settings.state_directory()))
    bus = EventBus(first_id=await store.last_event_id() + 1)
    group.start_soon(store.persist_events, bus.subscribe("store", max_buffer=50_000))
    store.set_call_outcomes("alpha", order_outcomes)  # real outcomes of cut-off calls
    conversation = await store.restore_conversation("alpha", system_prompt)  # stores itself
    for message in await store.undelivered_operator_messages("alpha"):
        ...  # queue it again, with the same id

A tool call the daemon never answered (a ``kill -9`` mid tool round) is answered on restore,
by :mod:`~trading_agent.store.recovery` from the plain facts kept here: the turn each message
was made in, how each turn ended, each call held for an operator's approval. A resolver
registered for the desk (:meth:`Store.set_call_outcomes`, e.g. the trading layer's
``OrderOutcomes``) may look a call up and say what really happened; the store imports
nothing of the trading layer.
"""

from __future__ import annotations

import gc
import json
import math
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import anyio
import structlog

from trading_agent.agent.conversation import (
    Conversation,
    ConversationObserver,
    ImageBlock,
    Message,
)
from trading_agent.agent.event_bus import Subscription
from trading_agent.agent.events import Event, UsageReported
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.errors import StoreError
from trading_agent.jsontext import json_loads, json_text
from trading_agent.store.codec import (
    ImageData,
    decode_content,
    encode_content,
    image_refs,
)
from trading_agent.store.connection import Connection
from trading_agent.store.database import Database
from trading_agent.store.fencing import Fence, FencedError
from trading_agent.store.recovery import (
    INTERRUPTED_NOTICE,
    LOOKED_UP_NOTE,
    CallOutcome,
    CallOutcomes,
    InterruptedCall,
    TurnEnd,
    restore,
)
from trading_agent.store.schema import COMPONENT, MIGRATIONS
from trading_agent.store.targets import PostgresTarget, StoreTarget

__all__ = [
    "DATABASE_NAME",
    "DEFAULT_SKIPPED_EVENTS",
    "INTERRUPTED_NOTICE",
    "LOOKED_UP_NOTE",
    "CallOutcome",
    "CallOutcomes",
    "DailyUsage",
    "DeskConversationStore",
    "InterruptedCall",
    "Store",
    "StoredHold",
    "SubagentOrigin",
    "database_path",
]

DATABASE_NAME = "trading-agent.sqlite3"
"""The file's name in the state directory; the trading layer opens the same file."""

DEFAULT_SKIPPED_EVENTS: frozenset[str] = frozenset({"text_delta", "thinking_delta",
                                                    "tool_heartbeat"})
"""Event types not stored by default: there are too many, and the messages keep their text."""

_IN_CHUNK = 500
"""The most values bound in one ``IN (...)`` (SQLite allows 999 by default)."""

_IMAGE_KEY = '"sha256"'
"""In the JSON text of every message that refers to a picture (and of the odd other one)."""

_log = structlog.get_logger(__name__)


def database_path(state_dir: Path | str) -> Path:
    """The SQLite file in a state directory.

    Args:
        state_dir: The daemon's state directory.

    Returns:
        ``state_dir / "trading-agent.sqlite3"``.
    """
    return Path(state_dir) / DATABASE_NAME


@dataclass(frozen=True)
class StoredHold:
    """A paused desk, as the store keeps it.

    Attributes:
        by: Who paused it.
        reason: Why.
        at: When (seconds since the epoch).
        until: When it resumes by itself, or None.
    """

    by: str
    reason: str
    at: float
    until: float | None = None


class HoldFields(Protocol):
    """What is stored of a pause (:class:`StoredHold`, or the daemon's own ``Hold``)."""

    @property
    def by(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def at(self) -> float: ...
    @property
    def until(self) -> float | None: ...


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
class DailyUsage:
    """A desk's model usage on one UTC day.

    Attributes:
        desk: The desk.
        day: The UTC day.
        requests: Model requests made (subagents' included).
        input_tokens: Prompt tokens, the cached ones included.
        output_tokens: Completion tokens.
        cost: Their cost, or None when no prices are configured.
        cached_input_tokens: The prompt tokens the server served from its prompt cache.
    """

    desk: str
    day: date
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None
    cached_input_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.input_tokens + self.output_tokens

    @property
    def cache_share(self) -> float | None:
        """The share of prompt tokens served from cache, or None when there were none."""
        if self.input_tokens <= 0:
            return None
        return min(self.cached_input_tokens, self.input_tokens) / self.input_tokens


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


def _utc_day(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).date().isoformat()


def _put_images(connection: Connection, images: dict[str, ImageData]) -> None:
    connection.executemany(
        "INSERT INTO images (sha256, media_type, data) VALUES (?, ?, ?) "
        "ON CONFLICT DO NOTHING",
        [(digest, media_type, data) for digest, (media_type, data) in images.items()])


def _get_images(connection: Connection, digests: Collection[str]) -> dict[str, ImageData]:
    found: dict[str, ImageData] = {}
    wanted = sorted(digests)
    for start in range(0, len(wanted), _IN_CHUNK):
        chunk = wanted[start:start + _IN_CHUNK]
        marks = ",".join("?" * len(chunk))
        for digest, media_type, data in connection.execute(
                f"SELECT sha256, media_type, data FROM images WHERE sha256 IN ({marks})", chunk):
            found[digest] = (media_type, bytes(data))
    return found


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


class Store:
    """The store of one daemon. Use :meth:`open` (or ``async with await open()``).

    Every write for a desk names it, so that a store opened with a fence refuses it once
    this daemon no longer holds the desk (see :mod:`~trading_agent.store.fencing`).

    Args:
        database: The open file.
        clock: Seconds since the epoch (injectable for tests).
        keeps_high_water: Keeps the highest event id stored, which a restarted daemon numbers
            on from (not in a fleet).
    """

    def __init__(self, database: Database, *, clock: Callable[[], float] = time.time,
                 keeps_high_water: bool = True) -> None:
        self._db = database
        self._clock = clock
        self._call_outcomes: dict[str, CallOutcomes] = {}
        self.events_not_stored = 0
        """Events :meth:`persist_events` dropped because the database refused them twice."""
        self._keeps_high_water = keeps_high_water

    @classmethod
    async def open(cls, target: StoreTarget, *, clock: Callable[[], float] = time.time,
                   fence: Fence | None = None) -> Store:
        """Opens (or creates) the store and brings its schema up to date.

        Args:
            target: The SQLite file (see :func:`database_path`; its folder is created), or
                the PostgreSQL database.
            clock: Seconds since the epoch.
            fence: Checks before each write for a desk that this daemon still holds it;
                None: nothing is fenced (one daemon).

        Raises:
            StoreError: The store cannot be opened or migrated.
        """
        # In a fleet each daemon numbers its events from a block of ids of its own: no high
        # water to keep, and one row every daemon wrote would make their event writes wait
        # on one another (and on a daemon stopped in the middle of a transaction).
        return cls(await Database.open(target, MIGRATIONS, COMPONENT, fence=fence),
                   clock=clock, keeps_high_water=fence is None)

    @property
    def target(self) -> Path | PostgresTarget:
        """The SQLite file, or the PostgreSQL database."""
        return self._db.target

    @property
    def path(self) -> Path:
        """The SQLite file.

        Raises:
            StoreError: The store is on PostgreSQL (see :attr:`target`).
        """
        return self._db.path

    async def close(self) -> None:
        """Closes the file once pending calls have finished (idempotent)."""
        await self._db.close()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # --- conversations ---------------------------------------------------------------------

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
                             turn: str | None = None) -> str:
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
            _put_images(connection, images)
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
                connection.execute(
                    "UPDATE operator_messages SET delivered_at = ? "
                    "WHERE id = ? AND desk = ? AND delivered_at IS NULL",
                    (now, message.id, desk))
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
            _put_images(connection, images)
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
        return await restore(self, desk, system_prompt, reason,
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
                images = _get_images(connection, digests)
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

    # --- turns: plain facts for recovery -----------------------------------------------------

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

    async def record_approval(self, desk: str, turn: str, call_id: str, approval_id: str,
                              outcome: str | None) -> None:
        """Records a call held for an operator's approval (``outcome`` None while it waits),
        then how its approval ended; stored before the call goes on or is refused."""
        at = self._clock()
        await self._db.write(lambda connection: connection.execute(
            "INSERT INTO held_calls (desk, turn, call_id, approval_id, outcome, at) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (desk, approval_id) DO UPDATE SET "
            "outcome = excluded.outcome, at = excluded.at",
            (desk, turn, call_id, approval_id, outcome, at)), desk=desk)

    async def held_calls(self, desk: str, turn: str) -> dict[str, str]:
        """The turn's calls held for an operator's approval: ``pending`` while they waited,
        else the outcome (the latest approval of a call wins)."""
        rows = await self._db.read(lambda connection: connection.execute(
            "SELECT call_id, outcome FROM held_calls WHERE desk = ? AND turn = ? "
            "ORDER BY rowid", (desk, turn)).fetchall())
        return {str(call_id): str(outcome or "pending") for call_id, outcome in rows}

    async def approval_desk(self, approval_id: str) -> str | None:
        """The desk whose call was held under an approval id, or None when none was (a
        fleet's operator may answer an approval on any daemon: this says which desk, and so
        which daemon, holds it)."""
        row = await self._db.read(lambda connection: connection.execute(
            "SELECT desk FROM held_calls WHERE approval_id = ? ORDER BY at DESC LIMIT 1",
            (approval_id,)).fetchone())
        return None if row is None else str(row[0])

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

    async def image(self, sha256: str) -> tuple[str, bytes] | None:
        """A stored picture's media type and bytes, or None when unknown."""
        found = await self._db.read(lambda connection: _get_images(connection, [sha256]))
        return found.get(sha256)

    # --- operator messages -----------------------------------------------------------------

    async def add_operator_message(self, desk: str, message: SteeringMessage) -> None:
        """Keeps an operator's message until it is delivered (call before acknowledging it).

        It counts as delivered once a message of the same id is appended to the desk's
        conversation (as the trigger of a turn, or as steering).

        Args:
            desk: The desk it is for.
            message: The message; its id is the one the conversation message must carry.

        Raises:
            StoreError: The database failed (do not acknowledge the message then).
        """
        images: dict[str, ImageData] = {}
        refs = []
        for image in message.images:
            content, found = encode_content((image,))
            images.update(found)
            refs.extend(json.loads(content))

        def write(connection: Connection) -> None:
            _put_images(connection, images)
            connection.execute(
                "INSERT INTO operator_messages (id, desk, text, source, images, queued_at) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (message.id, desk, message.text, message.source, json.dumps(refs),
                 message.queued_at))

        await self._db.write(write, desk=desk)

    async def has_operator_message(self, desk: str, message_id: str) -> bool:
        """Whether an operator's message of this id was kept for ``desk`` (a fleet's inbox
        may deliver a message again when the daemon that took it died before saying so).
        """
        return await self._db.read(lambda connection: connection.execute(
            "SELECT 1 FROM operator_messages WHERE desk = ? AND id = ?",
            (desk, message_id)).fetchone() is not None)

    async def undelivered_operator_messages(self, desk: str) -> list[SteeringMessage]:
        """The operator messages kept for ``desk`` that never reached its conversation.

        Queue each again with its own id (``Trigger(kind="operator", id=message.id, ...)`` or
        the steering inbox), so it is marked delivered when it is appended.

        Args:
            desk: The desk.

        Returns:
            The messages, oldest first.
        """

        def read(connection: Connection) -> list[SteeringMessage]:
            rows = connection.execute(
                "SELECT id, text, source, images, queued_at FROM operator_messages "
                "WHERE desk = ? AND delivered_at IS NULL ORDER BY queued_at, rowid",
                (desk,)).fetchall()
            refs = [json.loads(row[3]) for row in rows]
            digests: set[str] = set()
            for blocks in refs:
                digests |= image_refs(blocks)
            images = _get_images(connection, digests)
            messages = []
            for (message_id, text, source, _, queued_at), blocks in zip(rows, refs, strict=True):
                pictures = tuple(b for b in decode_content(blocks, images)
                                 if isinstance(b, ImageBlock))
                messages.append(SteeringMessage(text=text, source=source, images=pictures,
                                                queued_at=queued_at, id=message_id))
            return messages

        return await self._db.read(read)

    # --- events ----------------------------------------------------------------------------

    async def persist_events(self, subscription: Subscription, *,
                             skip: Collection[str] = DEFAULT_SKIPPED_EVENTS,
                             batch_size: int = 500, retry_after: float = 0.5,
                             sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        """Drains a bus subscription into the store, in batches, until it is closed.

        Close the subscription to end it: what is buffered is written first. Cancelling it
        loses what is still buffered. Usage events also add to the desks' daily usage.

        A batch the database refuses (a full disk, a lock held too long) is tried once more after
        ``retry_after`` seconds, then dropped and counted in :attr:`events_not_stored`: the
        event log is a record, and losing some of it must not stop the desks (an exception
        here would end the task group the daemon runs in). Any other error in writing a
        batch (a bug) is logged and handled the same way.

        Args:
            subscription: A subscription to the daemon's bus (give it a large buffer).
            skip: Event types not stored.
            batch_size: The most events written in one transaction.
            retry_after: Seconds to wait before the one retry of a failed batch.
            sleep: The sleep used for that wait (tests pass a fast one).
        """
        async for first in subscription:
            batch = [first]
            while len(batch) < batch_size:
                event = subscription.get_nowait()
                if event is None:
                    break
                batch.append(event)
            await self._append_batch(batch, skip, retry_after, sleep)

    async def _append_batch(self, batch: list[Event], skip: Collection[str],
                            retry_after: float,
                            sleep: Callable[[float], Awaitable[None]]) -> None:
        for attempt in (1, 2):
            try:
                await self.append_events(batch, skip=skip)
                return
            except StoreError as exc:
                _log.error("events_store_failed", error=str(exc), events=len(batch),
                           attempt=attempt)
            except Exception as exc:
                # A bug, not the database refusing: treated the same, since the event log must
                # never end the task group the daemon runs in.
                _log.exception("events_store_failed", error=repr(exc), events=len(batch),
                               attempt=attempt)
            if attempt == 1:
                await sleep(retry_after)
        self.events_not_stored += len(batch)
        _log.error("events_not_stored", count=len(batch), total=self.events_not_stored,
                   reason="the store refused them twice")

    async def append_events(self, events: Iterable[Event], *,
                            skip: Collection[str] = DEFAULT_SKIPPED_EVENTS) -> int:
        """Stores events (idempotent on their ids) and adds usage events to daily usage.

        The events (and usage) of a desk this daemon no longer holds are not stored, when
        the store has a fence; the others are.

        Args:
            events: Events as the bus published them (with their ids).
            skip: Event types not stored (they still count in the highest id seen).

        Returns:
            How many were stored.
        """
        rows: list[tuple[int, str, str | None, str, float, str]] = []
        usage: dict[tuple[str, str], list[float | None]] = defaultdict(
            lambda: [0, 0, 0, None, 0])
        highest = 0
        dropped = 0
        for event in events:
            if event.id <= 0:  # made by a subscription (a drop report), not by the bus
                dropped += int(getattr(event, "count", 0))
                continue
            highest = max(highest, event.id)
            if isinstance(event, UsageReported):
                totals = usage[(event.desk, _utc_day(event.at))]
                totals[0] = (totals[0] or 0) + 1
                totals[1] = (totals[1] or 0) + event.input_tokens
                totals[2] = (totals[2] or 0) + event.output_tokens
                if event.cost is not None:
                    totals[3] = (totals[3] or 0.0) + event.cost
                totals[4] = (totals[4] or 0) + event.cached_input_tokens
            if event.type in skip:
                continue
            rows.append((event.id, event.desk, event.turn, event.type, event.at,
                         json_text(event.to_dict(), default=str)))
        if dropped:
            _log.warning("events_not_stored", count=dropped,
                         reason="the store's subscription fell behind")
        if not rows and not usage and not highest:
            return 0

        def write(connection: Connection) -> tuple[int, dict[str, str]]:
            refused = self._refused_desks(connection, {row[1] for row in rows} | {
                desk for desk, _ in usage})
            stored = connection.executemany(
                "INSERT INTO events (id, desk, turn, type, at, data) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [row for row in rows if row[1] not in refused]).rowcount
            for (desk, day), (requests, input_tokens, output_tokens, cost,
                              cached_input_tokens) in usage.items():
                if desk not in refused:
                    _add_usage(connection, desk, day, int(requests or 0),
                               int(input_tokens or 0), int(output_tokens or 0), cost,
                               int(cached_input_tokens or 0))
            if highest and self._keeps_high_water:
                connection.execute(
                    "INSERT INTO store_meta (key, value) VALUES ('event_high_water', ?) "
                    "ON CONFLICT (key) DO UPDATE SET value = CASE "
                    "WHEN CAST(excluded.value AS BIGINT) > CAST(store_meta.value AS BIGINT) "
                    "THEN excluded.value ELSE store_meta.value END",
                    (str(highest),))
            return max(stored, 0), refused

        stored, refused = await self._db.write(write)
        for desk, reason in refused.items():
            _log.warning("events_not_stored", desk=desk, reason=reason,
                         count=sum(row[1] == desk for row in rows))
        return stored

    def _refused_desks(self, connection: Connection, desks: Collection[str]) -> dict[str, str]:
        """The desks among ``desks`` this daemon no longer holds, and why (the fence's
        word), checked inside a write that concerns them all."""
        refused: dict[str, str] = {}
        for desk in sorted(desks):
            try:
                self._db.check_fence(connection, desk)
            except FencedError as exc:
                refused[desk] = str(exc)
        return refused

    async def events_since(self, after_id: int, desk: str | None = None,
                           limit: int = 1000) -> list[dict[str, Any]]:
        """Stored events with an id above ``after_id``, oldest first (for a stream that
        reconnects).

        Args:
            after_id: The last id the reader has.
            desk: Only this desk's events; None for all.
            limit: The most events.

        Returns:
            Each event as its ``to_dict()`` data.
        """

        def read(connection: Connection) -> list[dict[str, Any]]:
            if desk is None:
                cursor = connection.execute(
                    "SELECT data FROM events WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
            else:
                cursor = connection.execute(
                    "SELECT data FROM events WHERE desk = ? AND id > ? ORDER BY id LIMIT ?",
                    (desk, after_id, limit))
            return [json.loads(row[0]) for row in cursor]

        return await self._db.read(read)

    async def last_event_id(self) -> int:
        """The highest event id the store has seen (stored or skipped); 0 when none.

        Start the bus at one more (``EventBus(first_id=...)``) so ids keep increasing across
        restarts, even past the ids of skipped text deltas an operator's stream already saw.
        """

        def read(connection: Connection) -> int:
            stored = connection.execute("SELECT COALESCE(MAX(id), 0) FROM events").fetchone()[0]
            meta = connection.execute(
                "SELECT value FROM store_meta WHERE key = 'event_high_water'").fetchone()
            return max(int(stored), int(meta[0]) if meta is not None else 0)

        return await self._db.read(read)

    # --- schedules -------------------------------------------------------------------------

    async def schedule_last_fired(self, desk: str) -> dict[str, datetime]:
        """The slot each of a desk's schedules last fired for, by schedule name (UTC)."""

        def read(connection: Connection) -> dict[str, datetime]:
            return {name: datetime.fromtimestamp(at, UTC) for name, at in connection.execute(
                "SELECT schedule, last_fired_at FROM schedule_state WHERE desk = ?", (desk,))}

        return await self._db.read(read)

    async def record_schedule_fired(self, desk: str, schedule: str, slot: datetime) -> None:
        """Remembers that a schedule fired for ``slot`` (call when the desk takes its turn).

        Args:
            desk: The desk.
            schedule: The schedule's name.
            slot: The slot it fired for (an aware datetime).
        """

        def write(connection: Connection) -> None:
            connection.execute(
                "INSERT INTO schedule_state (desk, schedule, last_fired_at) VALUES (?, ?, ?) "
                "ON CONFLICT (desk, schedule) DO UPDATE SET last_fired_at = excluded.last_fired_at",
                (desk, schedule, slot.timestamp()))

        await self._db.write(write, desk=desk)

    # --- holds -----------------------------------------------------------------------------

    async def desk_hold(self, desk: str) -> StoredHold | None:
        """Why a desk is paused, as last recorded, or None when it is not."""

        def read(connection: Connection) -> StoredHold | None:
            row = connection.execute("SELECT held_by, reason, held_at, until FROM desk_holds "
                                     "WHERE desk = ?", (desk,)).fetchone()
            return None if row is None else StoredHold(row[0], row[1], row[2], row[3])

        return await self._db.read(read)

    async def record_desk_hold(self, desk: str, hold: HoldFields | None) -> None:
        """Records that a desk is paused (``hold``) or no longer is (None); written before
        the pause is acknowledged."""

        def write(connection: Connection) -> None:
            if hold is None:
                connection.execute("DELETE FROM desk_holds WHERE desk = ?", (desk,))
            else:
                connection.execute(
                    "INSERT INTO desk_holds (desk, held_by, reason, held_at, until) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (desk) DO UPDATE SET "
                    "held_by = excluded.held_by, reason = excluded.reason, "
                    "held_at = excluded.held_at, until = excluded.until",
                    (desk, hold.by, hold.reason, hold.at, hold.until))

        await self._db.write(write, desk=desk)

    async def record_spend_resume(self, desk: str, day: date) -> None:
        """Records that an operator resumed a desk a spend cap had paused on ``day``."""

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO spend_resumes (desk, day) VALUES (?, ?) "
                               "ON CONFLICT DO NOTHING", (desk, day.isoformat()))

        await self._db.write(write, desk=desk)

    async def spend_resumes(self, day: date) -> set[str]:
        """The desks an operator resumed from a spend cap's pause on ``day``."""

        def read(connection: Connection) -> set[str]:
            return {desk for (desk,) in connection.execute(
                "SELECT desk FROM spend_resumes WHERE day = ?", (day.isoformat(),))}

        return await self._db.read(read)

    # --- equity ----------------------------------------------------------------------------

    async def record_equity_sample(self, desk: str, equity: float, at: float | None = None, *,
                                   keep: int = 3000) -> None:
        """Adds one sample of a desk's equity, keeping the desk's history bounded.

        Past ``keep`` samples, the newest half stays as it is and the older ones are thinned
        to one (the last) per equal stretch of time, at most ``keep // 4`` stretches over
        their span, the desk's first sample kept too. So at most ``keep`` rows hold the whole
        life of a desk: the recent curve in full, the older one evenly coarser as it grows.

        Args:
            desk: The desk.
            equity: Its account value in the quote currency.
            at: When, seconds since the epoch (now by default).
            keep: The most samples kept for the desk (at least 4); 3,000 by default, so the
                last day at one a minute stays whole.

        Raises:
            ValueError: ``equity`` is not a finite number, or ``keep`` is below 4.
        """
        if not math.isfinite(equity):
            raise ValueError(f"desk {desk}: an equity sample must be a finite number, not "
                             f"{equity!r}")
        if keep < 4:
            raise ValueError(f"keep must be at least 4, not {keep}")
        when = self._clock() if at is None else at

        def write(connection: Connection) -> None:
            connection.execute("INSERT INTO equity_samples (desk, at, equity) VALUES (?, ?, ?)",
                               (desk, when, float(equity)))
            (count,) = connection.execute(
                "SELECT COUNT(*) FROM equity_samples WHERE desk = ?", (desk,)).fetchone()
            if count <= keep:
                return
            older: list[tuple[int, float]] = connection.execute(
                "SELECT rowid, at FROM equity_samples WHERE desk = ? ORDER BY at, rowid "
                "LIMIT ?", (desk, count - keep // 2)).fetchall()
            # Stretches on a fixed grid (a power of two seconds wide): a kept sample stays
            # the last of its stretch as later passes widen them, so none is lost by chance.
            stretches, first, last = keep // 4, older[0][1], older[-1][1]
            width = 1.0
            while last // width - first // width + 1 > stretches:
                width *= 2
            last_of_stretch = {at // width: rowid for rowid, at in older}
            kept = {older[0][0], *last_of_stretch.values()}
            connection.executemany("DELETE FROM equity_samples WHERE rowid = ?",
                                   [(rowid,) for rowid, _ in older if rowid not in kept])

        await self._db.write(write, desk=desk)

    async def equity_samples(self, desk: str) -> list[tuple[float, float]]:
        """A desk's equity samples as ``(at, equity)``, oldest first."""

        def read(connection: Connection) -> list[tuple[float, float]]:
            return [(float(at), float(equity)) for at, equity in connection.execute(
                "SELECT at, equity FROM equity_samples WHERE desk = ? ORDER BY at, rowid",
                (desk,))]

        return await self._db.read(read)

    # --- usage -----------------------------------------------------------------------------

    async def add_usage(self, desk: str, *, input_tokens: int, output_tokens: int,
                        cost: float | None, at: float | None = None,
                        cached_input_tokens: int = 0) -> None:
        """Adds one model request's usage to the desk's day (usage events do it by
        themselves in :meth:`persist_events`; this is for requests without one).

        Args:
            desk: The desk.
            input_tokens: Prompt tokens, the cached ones included.
            output_tokens: Completion tokens.
            cost: Their cost, or None when unknown.
            at: When, seconds since the epoch (now by default).
            cached_input_tokens: The prompt tokens served from the server's cache.
        """
        day = _utc_day(self._clock() if at is None else at)
        await self._db.write(lambda connection: _add_usage(
            connection, desk, day, 1, input_tokens, output_tokens, cost, cached_input_tokens),
            desk=desk)

    async def usage_on(self, desk: str, day: date | None = None) -> DailyUsage:
        """A desk's usage on a UTC day (today by default)."""
        day = day if day is not None else datetime.fromtimestamp(self._clock(), UTC).date()

        def read(connection: Connection) -> DailyUsage:
            row = connection.execute(
                "SELECT requests, input_tokens, output_tokens, cost, cached_input_tokens "
                "FROM daily_usage WHERE desk = ? AND day = ?", (desk, day.isoformat())).fetchone()
            if row is None:
                return DailyUsage(desk, day)
            return DailyUsage(desk, day, int(row[0]), int(row[1]), int(row[2]), row[3],
                              int(row[4]))

        return await self._db.read(read)


def _add_usage(connection: Connection, desk: str, day: str, requests: int,
               input_tokens: int, output_tokens: int, cost: float | None,
               cached_input_tokens: int = 0) -> None:
    connection.execute(
        "INSERT INTO daily_usage (desk, day, requests, input_tokens, output_tokens, cost, "
        "cached_input_tokens) "
        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (desk, day) DO UPDATE SET "
        "requests = daily_usage.requests + excluded.requests, "
        "input_tokens = daily_usage.input_tokens + excluded.input_tokens, "
        "output_tokens = daily_usage.output_tokens + excluded.output_tokens, "
        "cost = CASE WHEN excluded.cost IS NULL THEN daily_usage.cost "
        "ELSE COALESCE(daily_usage.cost, 0) + excluded.cost END, "
        "cached_input_tokens = daily_usage.cached_input_tokens + excluded.cached_input_tokens",
        (desk, day, requests, input_tokens, output_tokens, cost, cached_input_tokens))


def _public_message(row: _StoredRow) -> dict[str, Any]:
    text = "\n".join(str(b["text"]) for b in row.blocks if b.get("type") == "text")
    return {"seq": row.seq, "id": row.message_id, "desk": row.desk, "role": row.role,
            "kind": row.kind, "created_at": row.created_at, "subagent": row.subagent_id,
            "parent_call": row.parent_call_id, "text": text, "content": row.blocks}


class DeskConversationStore:
    """Stores one conversation of a desk as it grows (a ``ConversationObserver``).

    Args:
        store: The store.
        desk: The desk.
        subagent_id: For a subagent's conversation, its id.
        parent_call_id: For a subagent's conversation, the desk's ``delegate`` call.
    """

    def __init__(self, store: Store, desk: str, *, subagent_id: str | None = None,
                 parent_call_id: str | None = None) -> None:
        self.store = store
        self.desk = desk
        self.subagent_id = subagent_id
        self.parent_call_id = parent_call_id
        self._renamed: dict[str, str] = {}

    async def message_appended(self, conversation: Conversation, message: Message) -> None:
        """Writes the message (before the conversation goes on)."""
        stored = await self.store.append_message(
            self.desk, message, subagent_id=self.subagent_id, parent_call_id=self.parent_call_id,
            turn=conversation.turn_id)
        if stored != message.id:
            self._renamed[message.id] = stored

    async def compacted(self, conversation: Conversation, summary: Message,
                        first_kept_id: str | None) -> None:
        """Writes the compaction."""
        if first_kept_id is not None:
            first_kept_id = self._renamed.get(first_kept_id, first_kept_id)
        await self.store.record_compaction(self.desk, summary, first_kept_id,
                                           subagent_id=self.subagent_id)
