"""Prompt caching seen from outside, on a real daemon (``trading-agent run``) whose model is
the scripted server: each desk's requests carry its own ``prompt_cache_key`` and keep their
prefix from one request to the next, and the share of prompt tokens the server served from
cache shows in ``trading-agent desks`` and in chat's ``/status``."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.operator.daemon_process import running_daemon
from tests.scripted_server import RecordedRequest, Reply, ScriptedServer, ToolCall
from trading_agent.operator.client import OperatorClient

CLI = [sys.executable, "-m", "trading_agent.cli"]

pytestmark = pytest.mark.slow


async def _cli(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TRADING_AGENT_SOCKET", "STATE_DIRECTORY")}
    environment["NO_COLOR"] = "1"
    with anyio.fail_after(20):
        result = await anyio.run_process([*CLI, *args], input=stdin, check=False,
                                         env=environment)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def _usage_today(client: OperatorClient, desk: str, prompt_tokens: int) -> dict[str, Any]:
    """The desk's status once the store has counted ``prompt_tokens`` prompt tokens."""
    with anyio.fail_after(10):
        while True:
            status = await client.desk(desk)
            if status.get("prompt_tokens_today") == prompt_tokens:
                return status
            await anyio.sleep(0.05)


def _desk_of(request: RecordedRequest) -> str:
    system = request.messages[0]["content"]
    return "alpha" if system.startswith("You are alpha") else "beta"


async def test_each_desk_keeps_its_prefix_and_key_and_shows_its_cache_share(
        scripted_server: ScriptedServer, state_dir: Path) -> None:
    scripted_server.add(
        # alpha, turn 1: a tool round, then the answer.
        Reply(tool_calls=[ToolCall("get_ticker", {"symbol": "BTC/USDT"})],
              usage=(3000, 20), cached_tokens=0),
        Reply("BTC is flat.", usage=(3200, 10), cached_tokens=2944),
        # beta, one turn: nothing cached.
        Reply("Nothing to do.", usage=(3000, 10), cached_tokens=0),
        # alpha, turn 2.
        Reply("Still flat.", usage=(3400, 10), cached_tokens=3200),
    )
    async with running_daemon(state_dir, scripted_server.base_url) as daemon:
        async with OperatorClient(socket_path=daemon.socket_path, timeout=10) as client:
            await client.send_message("alpha", "How is BTC?")
            await _usage_today(client, "alpha", 6200)
            await client.send_message("beta", "Anything?")
            await _usage_today(client, "beta", 3000)
            await client.send_message("alpha", "And now?")
            alpha = await _usage_today(client, "alpha", 9600)

        assert (alpha["cached_tokens_today"], alpha["cache_share_today"]) == (
            6144, pytest.approx(6144 / 9600))
        code, out, err = await _cli("desks", "--socket", str(daemon.socket_path))
        assert code == 0, err
        lines = out.splitlines()
        column = lines[0].index("CACHED")  # the column's cells start where its name does

        def cached(desk: str) -> str:
            return next(x for x in lines if x.startswith(desk))[column:].split()[0]

        # 6,144 of alpha's 9,600 prompt tokens came from the cache; none of beta's.
        assert (cached("alpha"), cached("beta")) == ("64%", "0%")
        code, out, err = await _cli("desks", "--json", "--socket", str(daemon.socket_path))
        beta = next(d for d in json.loads(out) if d["name"] == "beta")
        assert (beta["prompt_tokens_today"], beta["cached_tokens_today"],
                beta["cache_share_today"]) == (3000, 0, 0.0)

        code, out, err = await _cli("chat", "alpha", "--socket", str(daemon.socket_path),
                                    stdin=b"/status\n/quit\n")
        assert code == 0, err
        status_lines = [line for line in out.splitlines() if "tokens today" in line]
        assert len(status_lines) == 2  # on connecting, and for /status
        assert all("64% of the prompt cached" in line for line in status_lines)

    requests = scripted_server.requests
    assert [_desk_of(r) for r in requests] == ["alpha", "alpha", "beta", "alpha"]
    # One backend serves both desks (same model config); the key comes with each request.
    assert [r.json["prompt_cache_key"] for r in requests] == [
        "trading-agent:alpha", "trading-agent:alpha", "trading-agent:beta",
        "trading-agent:alpha"]
    # Nothing that changes per turn is in the prefix: alpha's system prompt and tools are the
    # same bytes in every request, and each request begins with the whole previous one.
    alpha_bodies = [r.body for r in requests if _desk_of(r) == "alpha"]
    for earlier, later in itertools.pairwise(alpha_bodies):
        assert earlier.endswith(b"]}")
        assert later.startswith(earlier[:-2] + b","), (earlier[-300:], later[:len(earlier)])
    assert len({json.dumps(r.json["tools"]) for r in requests}) == 1
    scripted_server.assert_complete()
