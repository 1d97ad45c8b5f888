"""Pictures, once each, by the SHA-256 of their bytes (the ``images`` table).

A message or an operator's message refers to a picture by its digest (see
:mod:`~trading_agent.store.codec`); the bytes are stored here once, however often the same
chart is sent. :func:`put_images` and :func:`get_images` run inside the writes and reads of
the families that refer to pictures (transcripts, the operator inbox).
"""

from __future__ import annotations

from collections.abc import Collection

from trading_agent.store.codec import ImageData
from trading_agent.store.connection import Connection
from trading_agent.store.database import Database, Migration

__all__ = ["MIGRATIONS", "TABLES", "SqliteImages", "get_images", "put_images"]

TABLES = ("images",)
"""The tables this module owns."""

MIGRATIONS: tuple[Migration, ...] = ((1, (
    # Pictures, once each, by the SHA-256 of their bytes.
    """CREATE TABLE images (
            sha256 TEXT PRIMARY KEY,
            media_type TEXT NOT NULL,
            data BLOB NOT NULL)""",
)),)
"""Its part of the store's numbered migrations (see :mod:`~trading_agent.store.schema`)."""

_IN_CHUNK = 500
"""The most values bound in one ``IN (...)`` (SQLite allows 999 by default)."""


def put_images(connection: Connection, images: dict[str, ImageData]) -> None:
    """Inside a write, stores pictures not stored yet.

    Args:
        connection: The write's connection.
        images: Media type and bytes, by SHA-256.
    """
    connection.executemany(
        "INSERT INTO images (sha256, media_type, data) VALUES (?, ?, ?) "
        "ON CONFLICT DO NOTHING",
        [(digest, media_type, data) for digest, (media_type, data) in images.items()])


def get_images(connection: Connection, digests: Collection[str]) -> dict[str, ImageData]:
    """Inside a read, the stored pictures among ``digests``.

    Args:
        connection: The read's connection.
        digests: The SHA-256 wanted.

    Returns:
        Media type and bytes, by SHA-256 (an unknown digest is left out).
    """
    found: dict[str, ImageData] = {}
    wanted = sorted(digests)
    for start in range(0, len(wanted), _IN_CHUNK):
        chunk = wanted[start:start + _IN_CHUNK]
        marks = ",".join("?" * len(chunk))
        for digest, media_type, data in connection.execute(
                f"SELECT sha256, media_type, data FROM images WHERE sha256 IN ({marks})", chunk):
            found[digest] = (media_type, bytes(data))
    return found


class SqliteImages:
    """The stored pictures, for an operator to fetch by reference.

    Args:
        database: The open store, its schema applied.
    """

    def __init__(self, database: Database) -> None:
        self._db = database

    async def image(self, sha256: str) -> ImageData | None:
        """A stored picture's media type and bytes, or None when unknown."""
        found = await self._db.read(lambda connection: get_images(connection, [sha256]))
        return found.get(sha256)
