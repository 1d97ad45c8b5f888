"""Every kind of bad tool call comes back as a result the model reads; the round goes on."""

from __future__ import annotations

import anyio
import pytest
from pydantic import BaseModel, Field

from trading_agent.agent.conversation import ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ToolCallStarted, ToolHeartbeat, ToolResultReady
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor
from trading_agent.agent.tool_registry import Tool, ToolContext, ToolRegistry
from trading_agent.errors import ToolError


class PriceArguments(BaseModel):
    symbol: str = Field(description="Market symbol")
    depth: int = Field(default=5, ge=1, le=50)


class SleepArguments(BaseModel):
    seconds: float


def _registry() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(description="Last price of a market.")
    async def get_price(arguments: PriceArguments, context: ToolContext) -> str:
        if arguments.symbol == "BOOM/USDT":
            raise RuntimeError("exchange exploded")
        if arguments.symbol == "NOPE/USDT":
            raise ToolError("NOPE/USDT is not a market this desk trades")
        return f"{arguments.symbol} last 21000.50 (depth {arguments.depth})"

    @registry.tool(description="Sleeps.", timeout_seconds=0.3)
    async def nap(arguments: SleepArguments, context: ToolContext) -> str:
        await anyio.sleep(arguments.seconds)
        return "rested"

    return registry


async def _run(calls: list[ToolUseBlock], executor: ToolCallExecutor | None = None,
               bus: EventBus | None = None) -> list[ExecutedCall]:
    executor = executor or ToolCallExecutor(_registry())
    return await executor.execute(calls, "desk", "turn", bus or EventBus(), {})


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("get_price", '{"symbol": "BTC/USDT"', "not valid JSON"),
        ("get_price", '{"depth": 3}', "symbol: Field required"),
        ("get_price", '{"symbol": "BTC/USDT", "depth": 500}', "depth: Input should be less"),
        ("get_prices", "{}", "no tool named 'get_prices'. Available tools: get_price, nap"),
        ("get_price", '{"symbol": "BOOM/USDT"}', "get_price failed: RuntimeError: exchange"),
        ("get_price", '{"symbol": "NOPE/USDT"}', "Error: NOPE/USDT is not a market"),
        ("nap", '{"seconds": 5}', "did not finish within 0.3 s"),
    ],
)
async def test_bad_calls_become_readable_error_results(name: str, arguments: str,
                                                       expected: str) -> None:
    [executed] = await _run([ToolUseBlock(id="c1", name=name, arguments=arguments)])
    assert executed.result.is_error
    assert expected in executed.result.text
    assert executed.result.tool_use_id == "c1"


async def test_good_and_bad_calls_in_one_round_keep_their_order() -> None:
    calls = [
        ToolUseBlock(id="a", name="get_price", arguments="{oops"),
        ToolUseBlock(id="b", name="get_price", arguments='{"symbol": "ETH/USDT"}'),
    ]
    executed = await _run(calls)
    assert [e.result.tool_use_id for e in executed] == ["a", "b"]
    assert executed[0].result.is_error and not executed[1].result.is_error
    assert executed[1].result.text == "ETH/USDT last 21000.50 (depth 5)"


async def test_a_long_tool_publishes_heartbeats_then_its_result() -> None:
    bus = EventBus()
    executor = ToolCallExecutor(_registry(), heartbeat_seconds=0.05)
    with bus.subscribe("watcher") as watcher:
        await _run([ToolUseBlock(id="n", name="nap", arguments='{"seconds": 0.2}')],
                   executor, bus)
        kinds = []
        while (event := watcher.get_nowait()) is not None:
            kinds.append(type(event))
    assert kinds[0] is ToolCallStarted and kinds[-1] is ToolResultReady
    assert kinds.count(ToolHeartbeat) >= 2


def test_definitions_are_json_schema_from_the_argument_model() -> None:
    definition = _registry().get("get_price")
    assert definition is not None
    schema = definition.definition()["function"]
    assert schema["name"] == "get_price"
    assert schema["parameters"]["required"] == ["symbol"]
    assert schema["parameters"]["properties"]["depth"]["maximum"] == 50


async def test_a_failing_approval_gate_becomes_an_error_result_not_a_crash() -> None:
    class BrokenGate:
        async def review(self, tool: object, arguments: BaseModel,
                         context: ToolContext) -> str | None:
            raise RuntimeError("price lookup exploded")

    executor = ToolCallExecutor(_registry(), approval_gate=BrokenGate())
    results = await _run([ToolUseBlock(id="a", name="get_price", arguments='{"symbol": "X"}'),
                          ToolUseBlock(id="b", name="nap", arguments='{"seconds": 0}')],
                         executor)
    texts = [r.result.content[0].text for r in results]  # type: ignore[union-attr]
    assert all(r.result.is_error for r in results)
    assert texts[0] == ("Error: the approval gate failed: RuntimeError: price lookup exploded; "
                        "get_price was not run.")


# --------------------------------------------------------------------------- prechecks


class TransferArguments(BaseModel):
    amount: float


class RecordingGate:
    """An approval gate that lets every call run and remembers what it was asked."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def review(self, tool: Tool, arguments: BaseModel,
                     context: ToolContext) -> str | None:
        self.log.append(f"gate {tool.name} {context.call_id}")
        return None


def _checked_registry(log: list[str], timeout_seconds: float = 30.0) -> ToolRegistry:
    """``transfer`` (dangerous): its precheck refuses amounts over 100, fails on 13 and
    stalls on 7."""
    registry = ToolRegistry()

    async def check_transfer(arguments: TransferArguments, context: ToolContext) -> None:
        log.append(f"precheck {arguments.amount:g} {context.call_id}")
        if arguments.amount == 13:
            raise RuntimeError("limits unreadable")
        if arguments.amount == 7:
            await anyio.sleep(10)
        if arguments.amount > 100:
            raise ToolError(f"Refused: {arguments.amount:g} is over the limit of 100.")

    @registry.tool(description="Moves money.", dangerous=True, precheck=check_transfer,
                   timeout_seconds=timeout_seconds)
    async def transfer(arguments: TransferArguments, context: ToolContext) -> str:
        log.append(f"run {arguments.amount:g}")
        return f"moved {arguments.amount:g}"

    return registry


async def test_a_precheck_refusal_ends_the_call_before_the_gate_is_asked() -> None:
    log: list[str] = []
    executor = ToolCallExecutor(_checked_registry(log), approval_gate=RecordingGate(log))
    [executed] = await _run([ToolUseBlock(id="t1", name="transfer",
                                          arguments='{"amount": 250}')], executor)
    assert executed.result.is_error
    assert executed.result.text == "Error: Refused: 250 is over the limit of 100."
    assert log == ["precheck 250 t1"]  # neither the gate nor the tool was reached


async def test_a_call_its_precheck_passes_goes_to_the_gate_then_runs() -> None:
    log: list[str] = []
    executor = ToolCallExecutor(_checked_registry(log), approval_gate=RecordingGate(log))
    [executed] = await _run([ToolUseBlock(id="t1", name="transfer",
                                          arguments='{"amount": "40"}')], executor)
    assert not executed.result.is_error and executed.result.text == "moved 40"
    # The precheck got the validated arguments (a float, not the string sent).
    assert log == ["precheck 40 t1", "gate transfer t1", "run 40"]


@pytest.mark.parametrize(("amount", "expected"), [
    (13, "Error: the checks of transfer failed: RuntimeError: limits unreadable; transfer "
         "was not run."),
    (7, "Error: the checks of transfer did not finish within 0.2 s; transfer was not run."),
])
async def test_a_precheck_that_fails_or_stalls_fails_closed(amount: int, expected: str) -> None:
    log: list[str] = []
    executor = ToolCallExecutor(_checked_registry(log, timeout_seconds=0.2),
                                approval_gate=RecordingGate(log))
    [executed] = await _run([ToolUseBlock(id="t1", name="transfer",
                                          arguments=f'{{"amount": {amount}}}')], executor)
    assert executed.result.is_error and executed.result.text == expected
    assert log == [f"precheck {amount} t1"]


async def test_without_a_gate_there_is_nothing_to_spare_and_the_tool_decides() -> None:
    log: list[str] = []
    [executed] = await _run([ToolUseBlock(id="t1", name="transfer",
                                          arguments='{"amount": 250}')],
                            ToolCallExecutor(_checked_registry(log)))
    assert executed.result.text == "moved 250"  # this tool does not check by itself
    assert log == ["run 250"]
