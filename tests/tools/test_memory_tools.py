"""``remember`` and ``recall``: notes by key, by search word, latest first, kept on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from trading_agent.errors import ToolError
from trading_agent.store.memory_notes import SqliteMemory
from trading_agent.tools import DeskMemory

from .conftest import Desk


async def test_remember_then_recall_by_key(desk: Desk) -> None:
    saved = await desk.text("remember", key="btc-plan", text="Buy dips to 16,600; stop 16,450.")
    recalled = await desk.text("recall", key="btc-plan")

    assert saved == "Saved note 'btc-plan' (32 characters)."
    assert recalled == ("Note 'btc-plan' (saved 2023-01-03 17:45 UTC):\n"
                        "Buy dips to 16,600; stop 16,450.")


async def test_saving_a_key_again_keeps_the_newest(desk: Desk) -> None:
    await desk.text("remember", key="btc-plan", text="first idea")
    desk.feed.advance(12)
    updated = await desk.text("remember", key="btc-plan", text="second idea")

    assert updated == ("Updated note 'btc-plan' (11 characters); it replaced the version of "
                       "2023-01-03 17:45 UTC.")
    assert (await desk.text("recall", key="btc-plan")).endswith("\nsecond idea")


async def test_recall_searches_names_and_texts(desk: Desk) -> None:
    await desk.text("remember", key="lessons", text="Fees eat small scalps; trade less.")
    await desk.text("remember", key="btc-levels", text="Support 16,600, resistance 16,800.")
    await desk.text("remember", key="eth", text="Not trading it: 100% not allowed.")

    found = await desk.text("recall", search="SUPPORT")
    by_name = await desk.text("recall", search="btc")
    literal = await desk.text("recall", search="100%")
    nothing = await desk.text("recall", search="moon")

    assert found.splitlines() == [
        "Notes mentioning 'SUPPORT', newest first:",
        "- btc-levels (2023-01-03 17:45 UTC): Support 16,600, resistance 16,800."]
    assert "btc-levels" in by_name and "lessons" not in by_name
    assert literal.count("\n- ") == 1 and "- eth " in literal
    assert nothing == "No note mentions 'moon'."


async def test_recall_without_arguments_lists_the_latest(desk: Desk) -> None:
    assert await desk.text("recall") == "No notes yet. Save one with remember."
    for minute, key in enumerate(["a", "b", "c"]):
        desk.feed.advance(minute + 1)
        await desk.text("remember", key=key, text=f"note {key}")

    listed = await desk.text("recall", limit=2)

    assert listed.splitlines() == ["Latest notes, newest first:",
                                   "- c (2023-01-03 18:15 UTC): note c",
                                   "- b (2023-01-03 18:00 UTC): note b"]


async def test_an_unknown_key_is_a_refusal_that_names_the_known_ones(desk: Desk) -> None:
    await desk.text("remember", key="lessons", text="x")

    with pytest.raises(ToolError, match=r"No note named 'plan'\. Recent keys: lessons\."):
        await desk.call("recall", key="plan")


async def test_notes_survive_a_restart_and_desks_do_not_share_them(tmp_path: Path) -> None:
    path = tmp_path / "notes.sqlite3"
    alpha = await SqliteMemory.open(path, "alpha")
    await alpha.remember("plan", "hold")
    await alpha.close()

    alpha = await SqliteMemory.open(path, "alpha")
    beta = await SqliteMemory.open(path, "beta")
    try:
        kept = await alpha.recall("plan")
        other = await beta.recall("plan")
        keys = await alpha.keys()
    finally:
        await alpha.close()
        await beta.close()

    assert kept is not None and kept.text == "hold"
    assert other is None
    assert keys == ["plan"]
    assert isinstance(alpha, DeskMemory)
