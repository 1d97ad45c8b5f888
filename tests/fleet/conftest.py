"""Fixtures of the fleet tests: the machine's NATS (JetStream on ``127.0.0.1:4222``) and a
prefix of subjects and streams of the test's own, its streams deleted afterwards; and a
PostgreSQL database of the test's own.

A test that needs NATS is skipped, saying so, when nothing listens on the port.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator

import anyio
import nats
import nats.errors
import pytest

from tests.postgres import fresh_database

NATS_URL = "nats://127.0.0.1:4222"

_NATS_ABSENT = "NATS is not running on 127.0.0.1:4222"


def _nats_listens() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 4222), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.fixture
def nats_url() -> str:
    """The machine's NATS with JetStream; the test is skipped when it is absent."""
    if not _nats_listens():
        pytest.skip(_NATS_ABSENT)
    return NATS_URL


@pytest.fixture
async def nats_prefix(nats_url: str) -> AsyncIterator[str]:
    """A prefix of subjects and streams no other test uses; every stream whose name starts
    with it is deleted when the test ends."""
    prefix = f"t{uuid.uuid4().hex[:16]}"
    yield prefix
    with anyio.CancelScope(shield=True), anyio.fail_after(10):
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                if info.config.name is not None and info.config.name.startswith(f"{prefix}_"):
                    await js.delete_stream(info.config.name)
        finally:
            await nc.close()


@pytest.fixture
def fleet_database() -> Iterator[str]:
    """A PostgreSQL database of the test's own, as the config's ``[store] url``; dropped
    (its connections closed) when the test ends. Skipped where PostgreSQL is absent."""
    with fresh_database() as target:
        yield target.url
