"""Hooks: a caller observes the loop, and intervenes, without subclassing it.

A hook is any object with some of these methods (each optional, sync or async); the loop
calls them in the order the hooks were given:

- ``before_request(request, turn_id)`` before each model request: return a changed
  :class:`~trading_agent.agent.backend.ModelRequestSpec`, a :class:`Refuse` (the turn ends
  there, saying why, and the conversation stays valid), or None to send it as it is;
- ``before_tool_call(call, arguments, context)`` before each tool call, once its arguments
  are valid: return a :class:`Refuse` (the model reads the reason as the call's result),
  changed arguments (a dict or the tool's arguments model; checked like the model's), or
  None to let it run;
- ``after_tool_result(call, result, context)`` once a call has its result: return a changed
  :class:`~trading_agent.agent.conversation.ToolResultBlock` (or just its text), or None;
- ``after_model_call(report)`` after each model call, with a :class:`ModelCallReport`: the
  call's usage, the turn's, the loop's running total and the seconds it took.

A hook that raises, or returns something else, is reported (a ``hook_failed`` event) and
left out of that step: it never fails a turn. The approval gate of dangerous tools is one
such hook (:class:`~trading_agent.agent.tool_call_executor.ApprovalHook`), always the last
before a call, so that it sees the arguments the other hooks left; unlike the others it
fails closed.

Example::

    class NoShorts:
        def before_tool_call(self, call, arguments, context):
            if call.name == "place_order" and arguments.side == "sell":
                return Refuse("this desk does not sell today")

    loop = AgentLoop("alpha", backend, executor, bus, 20, hooks=[NoShorts()])
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from trading_agent.agent.backend import ModelRequestSpec, Usage
from trading_agent.agent.conversation import TextBlock, ToolResultBlock, ToolUseBlock
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import HookFailed
from trading_agent.agent.tool_registry import Tool, ToolContext

__all__ = ["HookRunner", "ModelCallReport", "Refuse"]


@dataclass(frozen=True)
class Refuse:
    """A hook's no: the model request is not sent, or the tool call not run.

    Attributes:
        reason: Why, for the operator (a request) or the model (a tool call).
        limit: The risk limit that refused a call, when one did (the approval gate's
            precheck), for the call's event.
    """

    reason: str
    limit: str | None = None


@dataclass(frozen=True)
class ModelCallReport:
    """What ``after_model_call`` is told.

    Attributes:
        desk: The desk.
        turn: The turn's id.
        round: The model call's number in the turn.
        usage: This call's tokens and cost.
        turn_usage: The turn's so far, this call included.
        total_usage: The loop's since it was made.
        elapsed: Seconds the call took, retries included.
    """

    desk: str
    turn: str
    round: int
    usage: Usage
    turn_usage: Usage
    total_usage: Usage
    elapsed: float


class HookRunner:
    """Calls the hooks' methods in order, reporting the ones that fail.

    Args:
        hooks: The hooks.
        desk: The desk, for the failure events.
    """

    def __init__(self, hooks: Sequence[object], desk: str) -> None:
        self.hooks = tuple(hooks)
        self._desk = desk

    def __bool__(self) -> bool:
        return bool(self.hooks)

    async def before_request(self, request: ModelRequestSpec, turn: str,
                             events: EventBus) -> ModelRequestSpec | Refuse:
        """The request to send, as the hooks changed it; or the first refusal."""
        for hook in self._having("before_request"):
            answer = await self._call(hook, "before_request", events, turn, request, turn)
            if isinstance(answer, Refuse):
                return answer
            if isinstance(answer, ModelRequestSpec):
                request = answer
            elif answer is not _FAILED and answer is not None:
                self._report(hook, "before_request", events, turn,
                             f"returned {type(answer).__name__}, not a ModelRequestSpec, a "
                             "Refuse or None")
        return request

    async def before_tool_call(self, tool: Tool, call: ToolUseBlock, arguments: BaseModel,
                               context: ToolContext) -> BaseModel | Refuse:
        """The arguments to run the call with, as the hooks changed them; or the first
        refusal."""
        for hook in self._having("before_tool_call"):
            answer = await self._call(hook, "before_tool_call", context.events, context.turn,
                                      call, arguments, context)
            if isinstance(answer, Refuse):
                return answer
            if answer is None or answer is _FAILED:
                continue
            try:
                arguments = tool.arguments.model_validate(
                    answer.model_dump() if isinstance(answer, BaseModel) else answer)
            except ValidationError as exc:
                self._report(hook, "before_tool_call", context.events, context.turn,
                             f"changed the arguments of {call.name} to invalid ones: "
                             f"{exc.error_count()} error(s): {exc.errors()[0]['msg']}")
        return arguments

    async def after_tool_result(self, call: ToolUseBlock, result: ToolResultBlock,
                                context: ToolContext) -> ToolResultBlock:
        """The result the model reads, as the hooks changed it."""
        for hook in self._having("after_tool_result"):
            answer = await self._call(hook, "after_tool_result", context.events, context.turn,
                                      call, result, context)
            if isinstance(answer, str):
                answer = ToolResultBlock(result.tool_use_id, (TextBlock(answer),),
                                         result.is_error)
            if isinstance(answer, ToolResultBlock):
                if answer.tool_use_id != result.tool_use_id:
                    self._report(hook, "after_tool_result", context.events, context.turn,
                                 "returned the result of another call")
                    continue
                result = answer
            elif answer is not None and answer is not _FAILED:
                self._report(hook, "after_tool_result", context.events, context.turn,
                             f"returned {type(answer).__name__}, not a ToolResultBlock, a "
                             "text or None")
        return result

    async def after_model_call(self, report: ModelCallReport, events: EventBus) -> None:
        """Tells every hook about a finished model call."""
        for hook in self._having("after_model_call"):
            await self._call(hook, "after_model_call", events, report.turn, report)

    def _having(self, method: str) -> list[object]:
        return [hook for hook in self.hooks if callable(getattr(hook, method, None))]

    async def _call(self, hook: object, method: str, events: EventBus, turn: str,
                    *arguments: Any) -> Any:
        try:
            answer = getattr(hook, method)(*arguments)
            if inspect.isawaitable(answer):
                answer = await answer
        except Exception as exc:
            self._report(hook, method, events, turn, f"{type(exc).__name__}: {exc}")
            return _FAILED
        return answer

    def _report(self, hook: object, method: str, events: EventBus, turn: str,
                error: str) -> None:
        event = HookFailed(desk=self._desk, hook=type(hook).__name__, method=method,
                           error=error)
        object.__setattr__(event, "turn", turn)
        events.publish(event)


_FAILED = object()
"""What a failed hook's call stands for: it is left out of the step."""
