"""``--concurrency``: calls in flight bounded across processes (lock files), 429s waited out;
against the scripted server through the real OpenAI-compatible backend."""

from __future__ import annotations

from pathlib import Path

import anyio

from tests.backtest.test_cache import backend
from tests.scripted_server import Reply, ScriptedServer, rate_limited
from trading_agent.agent.backend import ModelRequestSpec
from trading_agent.agent.conversation import Message
from trading_agent.backends.openai_compatible import OpenAICompatibleBackend
from trading_agent.backtest.concurrency import BoundedModel, ModelSlots

__all__ = ["backend"]  # the fixture, used by name

DELAY = 0.3


def _request(number: int) -> ModelRequestSpec:
    return ModelRequestSpec("You trade.", [Message.user_text(f"tick {number}")], [])


async def test_no_more_calls_are_in_flight_than_the_slots(
        scripted_server: ScriptedServer, backend: OpenAICompatibleBackend,
        tmp_path: Path) -> None:
    scripted_server.add(*(Reply(f"answer {n}", delay=DELAY) for n in range(6)))
    # Two models on the same slots, as two worker processes would be.
    models = [BoundedModel(backend, ModelSlots(tmp_path / "slots", 2)) for _ in range(2)]
    async with anyio.create_task_group() as group:
        for number in range(6):
            group.start_soon(models[number % 2].complete, _request(number))
    scripted_server.assert_complete()
    arrivals = sorted(request.received_at for request in scripted_server.requests)
    # Each answer takes DELAY: at most two requests arrive within any stretch shorter.
    for index in range(2, len(arrivals)):
        assert arrivals[index] - arrivals[index - 2] >= DELAY * 0.8, arrivals


async def test_a_rate_limit_is_waited_out_and_asked_again(
        scripted_server: ScriptedServer, backend: OpenAICompatibleBackend,
        tmp_path: Path) -> None:
    scripted_server.add(rate_limited(retry_after=2), rate_limited(retry_after=None),
                        Reply("finally"))
    waited: list[float] = []

    async def sleep(seconds: float) -> None:
        waited.append(seconds)

    model = BoundedModel(backend, ModelSlots(tmp_path / "slots", 1), sleep=sleep)
    reply = await model.complete(_request(1))
    assert reply.text == "finally"
    assert waited == [2.0, 2.0]  # as the server asked; then the doubling backoff's second
    assert model.rate_limited == 2
    scripted_server.assert_complete()
