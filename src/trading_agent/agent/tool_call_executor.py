"""Runs the model's tool calls; every failure becomes a result the model reads.

Invalid JSON, arguments that fail validation, an unknown tool, a refusal by a tool's
precheck or by the approval gate, a tool that raises and a tool that outlives its timeout
each come back as an error result naming the problem, and the turn goes on. A tool never
crashes the loop.

A call goes: validate the arguments, ask the loop's hooks (which may refuse the call or
change its arguments, see :mod:`~trading_agent.agent.hooks`), then the approval gate, the
last hook (:class:`ApprovalHook`): it runs the tool's precheck (an order the risk limits
refuse is refused here, at once, and no operator is asked to approve it) and asks the gate
(which may wait for an operator). Then the handler runs, and checks again: what a precheck
passed may have changed while the gate waited. The hooks may change the result.

The calls of one round run concurrently (a subagent research task need not wait for
another); results come back in the order of the calls. Every picture a tool returns is sized
to the desk's limits by the executor's :class:`ImagePreparer` (in a worker thread) before the
result exists; one that cannot be used becomes a line saying why.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
from pydantic import BaseModel, ValidationError

from trading_agent.agent.backend import Usage
from trading_agent.agent.conversation import ImageBlock, TextBlock, ToolResultBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import ToolCallStarted, ToolHeartbeat, ToolResultReady
from trading_agent.agent.hooks import HookRunner, Refuse
from trading_agent.agent.image_preparer import ImagePreparer, ImageRejectedError
from trading_agent.agent.tool_registry import Tool, ToolContext, ToolOutput, ToolRegistry
from trading_agent.errors import RiskLimitError, ToolError

__all__ = ["ApprovalGate", "ApprovalHook", "ExecutedCall", "ToolCallExecutor"]


class ApprovalGate(Protocol):
    """Decides whether a tool call may run; dangerous calls may wait for a person."""

    async def review(self, tool: Tool, arguments: BaseModel, context: ToolContext) -> str | None:
        """Returns None to let the call run, or the reason it was refused (the model reads it)."""
        ...


class ApprovalHook:
    """The approval gate as a hook: the tool's precheck, then the gate's review.

    Unlike other hooks it fails closed: a precheck or a gate that fails refuses the call.

    Args:
        gate: Reviews every call.
        tool_registry: Where the calls' tools (and their prechecks) are found.
    """

    def __init__(self, gate: ApprovalGate, tool_registry: ToolRegistry) -> None:
        self.gate = gate
        self.tool_registry = tool_registry

    async def before_tool_call(self, call: ToolUseBlock, arguments: BaseModel,
                               context: ToolContext) -> Refuse | None:
        """None to let the call run, else the refusal the model reads."""
        tool = self.tool_registry.get(call.name)
        if tool is None:
            return Refuse(f"Error: there is no tool named {call.name!r}.")
        if tool.precheck is not None:
            prechecked = await _prechecked(tool, arguments, context)
            if prechecked is not None:
                return Refuse(prechecked.text, prechecked.refused_limit)
        try:
            refusal = await self.gate.review(tool, arguments, context)
        except Exception as exc:  # the gate failing must not fail the turn; fail closed
            return Refuse(f"Error: the approval gate failed: {type(exc).__name__}: {exc}; "
                          f"{call.name} was not run.")
        return None if refusal is None else Refuse(refusal)


def _never_ran(call: ToolUseBlock) -> ToolResultBlock:
    """The result of a call the turn was cut during its checks, before it ran."""
    return ToolResultBlock(tool_use_id=call.id, is_error=True, content=(TextBlock(
        f"Error: the turn was ended before the call to {call.name} ran (it was waiting for "
        "an operator's approval or another check), so it never ran and nothing was done. "
        "Make it again if it is still wanted."),))


@dataclass(frozen=True)
class ExecutedCall:
    """One finished call: its result block and any model tokens it spent (a subagent)."""

    result: ToolResultBlock
    usage: Usage | None = None


class ToolCallExecutor:
    """Runs tool calls from a registry.

    Args:
        tool_registry: The tools the model may call.
        approval_gate: Reviews every call before it runs, the last of the hooks (see
            :class:`ApprovalHook`); None lets all run.
        heartbeat_seconds: How often a heartbeat event is published while a call runs.
        image_preparer: Sizes the pictures tools return: the desk's, with its configured
            limits; None for one with the default limits.
    """

    def __init__(self, tool_registry: ToolRegistry, *, approval_gate: ApprovalGate | None = None,
                 heartbeat_seconds: float = 5.0,
                 image_preparer: ImagePreparer | None = None) -> None:
        self.tool_registry = tool_registry
        self.approval_gate = approval_gate
        self.heartbeat_seconds = heartbeat_seconds
        self.image_preparer = image_preparer or ImagePreparer()

    async def execute(self, calls: Sequence[ToolUseBlock], desk: str, turn: str,
                      events: EventBus, finished: dict[str, ExecutedCall],
                      hooks: Sequence[object] = ()) -> list[ExecutedCall]:
        """Runs the calls concurrently.

        Args:
            calls: The calls, in the model's order.
            desk: The desk, for events and tools.
            turn: The turn's id.
            events: Where steps are published.
            finished: Filled as each call finishes, so a cancelled round keeps what finished.
            hooks: The loop's hooks, asked before each call and shown each result (the
                approval gate comes after them).

        Returns:
            One executed call per call, in order.
        """
        runner = HookRunner(hooks, desk)
        gated = HookRunner([*hooks, ApprovalHook(self.approval_gate, self.tool_registry)], desk
                           ) if self.approval_gate is not None else runner
        async with anyio.create_task_group() as group:
            for call in calls:
                context = ToolContext(desk=desk, turn=turn, call_id=call.id, events=events,
                                      image_preparer=self.image_preparer)
                group.start_soon(self._run_one, call, context, finished, gated, runner)
        return [finished[call.id] for call in calls]

    async def _run_one(self, call: ToolUseBlock, context: ToolContext,
                       finished: dict[str, ExecutedCall], gated: HookRunner,
                       hooks: HookRunner) -> None:
        events = context.events
        events.publish(ToolCallStarted(desk=context.desk, turn=context.turn, call_id=call.id,
                                       name=call.name, arguments=call.arguments))
        started = time.monotonic()
        output = await self._output_of(call, context, gated, finished)
        images, refusals = await self._sized(output.images)
        text = "\n".join([output.text, *refusals])
        content: tuple[TextBlock | ImageBlock, ...] = (TextBlock(text), *images)
        result = ToolResultBlock(tool_use_id=call.id, content=content, is_error=output.is_error)
        if hooks:
            result = await hooks.after_tool_result(call, result, context)
            text = result.text
        finished[call.id] = ExecutedCall(result, output.usage)
        events.publish(ToolResultReady(
            desk=context.desk, turn=context.turn, call_id=call.id, name=call.name,
            text=text, is_error=result.is_error,
            image_count=sum(isinstance(b, ImageBlock) for b in result.content),
            duration=time.monotonic() - started, refused_limit=output.refused_limit))

    async def _sized(self, images: Sequence[ImageBlock]) -> tuple[list[ImageBlock], list[str]]:
        """The tool's pictures sized to the limits, and a line for each that could not be."""
        sized: list[ImageBlock] = []
        refusals: list[str] = []
        for image in images:
            try:
                sized.append(await self.image_preparer.prepare_async(image.data,
                                                                     image.description))
            except ImageRejectedError as exc:
                refusals.append(f"[picture not sent: {image.description}: {exc}]")
        return sized, refusals

    async def _output_of(self, call: ToolUseBlock, context: ToolContext,
                         hooks: HookRunner, finished: dict[str, ExecutedCall]) -> ToolOutput:
        tool = self.tool_registry.get(call.name)
        if tool is None:
            known = ", ".join(self.tool_registry.names) or "none"
            return _error(f"Error: there is no tool named {call.name!r}. Available tools: {known}.")
        try:
            raw = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return _error(f"Error: the arguments for {call.name} are not valid JSON ({exc.msg} "
                          f"at position {exc.pos}). Send a JSON object matching the schema.")
        try:
            arguments = tool.arguments.model_validate(raw)
        except ValidationError as exc:
            return _error(f"Error: invalid arguments for {call.name}: {_describe(exc)}")
        try:
            decided = await hooks.before_tool_call(tool, call, arguments, context)
        except BaseException:  # cancelled while a check held it (the approval gate)
            finished[call.id] = ExecutedCall(_never_ran(call))
            raise
        if isinstance(decided, Refuse):
            return ToolOutput(text=decided.reason, is_error=True, refused_limit=decided.limit)
        arguments = decided
        return await self._run_with_deadline(tool, arguments, context)

    async def _run_with_deadline(self, tool: Tool, arguments: BaseModel,
                                 context: ToolContext) -> ToolOutput:
        output: ToolOutput | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(self._heartbeat, tool.name, context)
            try:
                with anyio.fail_after(tool.timeout_seconds):
                    answer = await tool.handler(arguments, context)
                output = answer if isinstance(answer, ToolOutput) else ToolOutput(str(answer))
            except TimeoutError:
                output = _error(f"Error: {tool.name} did not finish within "
                                f"{tool.timeout_seconds:g} s and was abandoned; it may or may "
                                "not have taken effect.")
            except ToolError as exc:
                output = _refused(exc)
            except Exception as exc:
                output = _error(f"Error: {tool.name} failed: {type(exc).__name__}: {exc}")
            finally:
                group.cancel_scope.cancel()
        assert output is not None
        return output

    async def _heartbeat(self, name: str, context: ToolContext) -> None:
        started = time.monotonic()
        while True:
            await anyio.sleep(self.heartbeat_seconds)
            context.events.publish(ToolHeartbeat(
                desk=context.desk, turn=context.turn, call_id=context.call_id, name=name,
                elapsed=time.monotonic() - started))


async def _prechecked(tool: Tool, arguments: BaseModel, context: ToolContext) -> ToolOutput | None:
    """None when the tool's precheck lets the call go on, else the error result.

    Anything but a pass ends the call unrun (fail closed): a refusal reads as the tool's
    own would, a failure or a precheck slower than the tool's timeout says so.
    """
    assert tool.precheck is not None
    try:
        with anyio.fail_after(tool.timeout_seconds):
            await tool.precheck(arguments, context)
    except ToolError as exc:
        return _refused(exc)
    except TimeoutError:
        return _error(f"Error: the checks of {tool.name} did not finish within "
                      f"{tool.timeout_seconds:g} s; {tool.name} was not run.")
    except Exception as exc:
        return _error(f"Error: the checks of {tool.name} failed: {type(exc).__name__}: "
                      f"{exc}; {tool.name} was not run.")
    return None


def _error(text: str) -> ToolOutput:
    return ToolOutput(text=text, is_error=True)


def _refused(exc: ToolError) -> ToolOutput:
    """A tool's own refusal, in its words; a risk limit's is named too."""
    limit = exc.limit if isinstance(exc, RiskLimitError) else None
    return ToolOutput(text=f"Error: {exc}", is_error=True, refused_limit=limit)


def _describe(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors(include_url=False):
        where = ".".join(str(part) for part in error["loc"]) or "arguments"
        problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)
