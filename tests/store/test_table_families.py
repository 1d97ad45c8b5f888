"""The store split by table family still reads the files the one-class store wrote: the
same ``store`` component, the same versions, the same tables, every row readable."""

from __future__ import annotations

import re
import sqlite3
from datetime import UTC, date, datetime
from pathlib import Path

from trading_agent.agent.conversation import ImageBlock, TextBlock, ToolResultBlock, ToolUseBlock
from trading_agent.store import Store, StoreTarget, database_path
from trading_agent.store.schema import COMPONENT, MIGRATIONS, TABLES

OLD_STATE = Path(__file__).parent / "data" / "state_store_v6.sql"
"""Written by the store before the split (see the file's first lines)."""

PNG = b"\x89PNG\r\n\x1a\n" + b"chart" * 4
T = 1_750_000_000.0


def _old_state_file(tmp_path: Path) -> Path:
    path = database_path(tmp_path / "state")
    path.parent.mkdir(parents=True)
    with sqlite3.connect(path) as db:
        db.executescript(OLD_STATE.read_text())
    return path


def _schema(path: Path) -> dict[str, str]:
    with sqlite3.connect(path) as db:
        return {name: re.sub(r"\s+", " ", sql) for name, sql in db.execute(
            "SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%'")}


def _migrations(path: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT component, version FROM schema_migrations "
                          "ORDER BY component, version").fetchall()


async def test_a_state_file_written_before_the_split_opens_and_reads_back(
        tmp_path: Path) -> None:
    path = _old_state_file(tmp_path)
    before = _migrations(path)
    async with await Store.open(path, clock=lambda: T + 10) as store:
        conversation = await store.transcripts.restore_conversation("alpha", "sys")
        # m4 was retracted by an operator: the desk is sent the first three.
        assert [m.id for m in conversation.messages] == ["m1", "m2", "m3"]
        call = conversation.messages[1].content[1]
        assert call == ToolUseBlock(id="call_1", name="get_ticker",
                                    arguments='{"symbol": "BTC/USDT"}')
        result = conversation.messages[2].content[0]
        assert isinstance(result, ToolResultBlock)
        assert result.content == (TextBlock("last 64000"),
                                  ImageBlock(PNG, description="1h chart"))
        page = await store.transcripts.transcript("alpha")
        assert [(row["id"], row["retracted"]) for row in page] == [
            ("m1", False), ("m2", False), ("m3", False), ("m4", True)]
        assert await store.transcripts.turn_end("alpha", "turn-1") == "answered"
        assert await store.held_calls.held_calls("alpha", "turn-1") == {"call_1": "approved"}
        assert await store.held_calls.approval_desk("appr-1") == "alpha"
        [waiting] = await store.inbox.undelivered_operator_messages("alpha")
        assert (waiting.id, waiting.text, waiting.images) == (
            "op-1", "buy less", (ImageBlock(PNG, description="chart"),))
        [event] = await store.events.events_since(0)
        assert (event["id"], event["type"], event["input_tokens"]) == (7, "usage", 100)
        assert await store.events.last_event_id() == 7
        usage = await store.usage.usage_on("alpha", date(2025, 6, 15))
        assert (usage.requests, usage.input_tokens, usage.cached_input_tokens, usage.cost) == (
            1, 100, 40, 0.5)
        assert await store.schedules.schedule_last_fired("alpha") == {
            "hourly": datetime.fromtimestamp(T, UTC)}
        hold = await store.holds.desk_hold("alpha")
        assert hold is not None and (hold.by, hold.reason, hold.until) == ("ops", "lunch", T + 60)
        assert await store.spend.spend_resumes(date(2025, 6, 15)) == {"alpha"}
        assert await store.equity.equity_samples("alpha") == [(T, 10_000.0)]
    # Nothing was migrated again: the component and its versions are the old ones.
    assert _migrations(path) == before == [(COMPONENT, version) for version in range(1, 7)]


async def test_a_new_file_has_exactly_the_tables_the_old_store_made(tmp_path: Path) -> None:
    old = _schema(_old_state_file(tmp_path / "old"))
    new_path = database_path(tmp_path / "new")
    async with await Store.open(new_path):
        pass
    assert _schema(new_path) == old
    assert [version for version, _ in MIGRATIONS] == [1, 2, 3, 4, 5, 6]


def test_every_table_belongs_to_one_family(tmp_path: Path) -> None:
    old = _schema(_old_state_file(tmp_path))
    tables = {name for name, sql in old.items() if sql.startswith("CREATE TABLE")}
    assert sorted(TABLES) == sorted(tables - {"schema_migrations"})


async def test_the_families_migrate_on_postgresql_as_one_component(
        target: StoreTarget) -> None:
    async with await Store.open(target) as store, await Store.open(target) as again:
        await store.spend.record_spend_resume("alpha", date(2025, 6, 15))
        assert await again.spend.spend_resumes(date(2025, 6, 15)) == {"alpha"}
        versions = await store.database.read(lambda connection: [
            tuple(row) for row in connection.execute(
                "SELECT component, version FROM schema_migrations WHERE component = ? "
                "ORDER BY version", (COMPONENT,))])
    assert versions == [(COMPONENT, version) for version in range(1, 7)]
