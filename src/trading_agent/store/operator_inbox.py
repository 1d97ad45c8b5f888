"""Operator messages, kept before the operator is told they were received (the
``operator_messages`` table), until they reach the desk's conversation: a message the daemon
acknowledged and then lost to a restart is queued again, with its own id.

A message counts as delivered once a conversation message of the same id is appended to the
desk's main conversation; the transcripts mark it (:func:`mark_delivered`) in the same
transaction as they store that message.
"""

from __future__ import annotations

import json

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.store.codec import ImageData, decode_content, encode_content, image_refs
from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration
from trading_agent.store.images import get_images, put_images

__all__ = ["MIGRATIONS", "TABLES", "SqliteOperatorInbox", "mark_delivered"]

TABLES = ("operator_messages",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
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
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""


def mark_delivered(connection: Connection, desk: str, message_id: str, at: float) -> None:
    """Inside a write, marks the desk's operator message of this id delivered (nothing when
    there is none, or it already was).

    Args:
        connection: The write's connection.
        desk: The desk.
        message_id: The id of the conversation message just stored.
        at: When (seconds since the epoch).
    """
    connection.execute(
        "UPDATE operator_messages SET delivered_at = ? "
        "WHERE id = ? AND desk = ? AND delivered_at IS NULL", (at, message_id, desk))


class SqliteOperatorInbox:
    """The operator messages in the store.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

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
            put_images(connection, images)
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
            images = get_images(connection, digests)
            messages = []
            for (message_id, text, source, _, queued_at), blocks in zip(rows, refs, strict=True):
                pictures = tuple(b for b in decode_content(blocks, images)
                                 if isinstance(b, ImageBlock))
                messages.append(SteeringMessage(text=text, source=source, images=pictures,
                                                queued_at=queued_at, id=message_id))
            return messages

        return await self._db.read(read)
