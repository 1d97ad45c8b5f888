"""One response cache file shared by several runs at once (``--jobs``): each appends under
the file lock after taking what the others appended, so the file stays whole and any later
run replays every answer of all of them."""

from __future__ import annotations

import json
from pathlib import Path

import anyio

from tests.backtest.test_cache import backend, cache_file, desk_script, play
from tests.scripted_server import ScriptedServer
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.backtest.cache import ResponseCache

__all__ = ["backend", "cache_file"]  # the fixtures, used by name

OTHER = "You are the desk beta. Trade BTC/USDT carefully."


async def test_two_runs_recording_into_one_file_at_once_both_replay_later(
        scripted_server: ScriptedServer, backend: OpenAICompatibleBackend,
        cache_file: Path) -> None:
    scripted_server.add(*desk_script(), *desk_script())
    first = ResponseCache(backend, cache_file)
    second = ResponseCache(backend, cache_file)
    # Both load the (empty) file before either writes, as two worker processes would.
    await first.open()
    await second.open()
    try:
        played_first = await play(first)
        played_second = await play(second, system=OTHER)
    finally:
        await first.aclose()
        await second.aclose()
    scripted_server.assert_complete()
    assert first.model_calls == 4 and second.model_calls == 4

    text = await anyio.Path(cache_file).read_text()
    lines = [json.loads(line) for line in text.splitlines()]
    # The second run took the first's lines in before appending: the tool list both send is
    # written once, and each answer's base is an earlier answer of the file.
    hashes = [line["hash"] for line in lines if line["kind"] != "answer"]
    assert len(hashes) == len(set(hashes))
    answers = [line for line in lines if line["kind"] == "answer"]
    assert len(answers) == 8
    assert all(a["base"] is None or 0 <= a["base"] < index for index, a in enumerate(answers))

    async with ResponseCache(backend, cache_file, "strict") as replay:
        again_first = await play(replay)
        again_second = await play(replay, system=OTHER)
    assert (replay.model_calls, replay.cache_hits) == (0, 8)
    assert again_first.replies == played_first.replies
    assert again_second.replies == played_second.replies
    assert len(scripted_server.requests) == 8
