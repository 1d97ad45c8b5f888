"""The agent loop: ask the model, run the tools it asks for, give it the results, repeat.

One run is one turn. It ends when the model answers without asking for a tool, after
``maximum_rounds`` model calls, or at the next safe point after :meth:`AgentLoop.request_stop`.
Every step is published on the event bus; every message is appended to the conversation
(and so stored) as soon as it exists, and the conversation is valid to send at every await.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.context_compressor import ContextCompressor, context_tokens
from trading_agent.agent.conversation import Conversation, Message, ToolUseBlock, repair
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    ErrorEvent,
    Event,
    ModelRequest,
    OverflowRecovery,
    RetryScheduled,
    SteeringDelivered,
    TextDelta,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.agent.retry import RetryPolicy
from trading_agent.agent.steering_inbox import SteeringInbox
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult, TurnState
from trading_agent.errors import (
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    TransientBackendError,
)

__all__ = ["AgentLoop"]


class AgentLoop:
    """Runs turns for one desk against one backend.

    Args:
        desk_name: The desk the loop runs for, used to tag its events.
        backend: The model to ask.
        executor: What runs the model's tool calls.
        event_bus: Where every step is published.
        maximum_rounds: The most model calls one turn may make.
        compressor: Compresses the conversation when it gets too full; None lets it grow.
        steering_inbox: Mid-turn operator messages, added after each tool round; None for a
            loop that cannot be steered (a subagent).
        image_preparer: Prunes old pictures from what is sent; None for a default one.

    Attributes:
        backend: The model the loop asks.
        retry_policy: How transient model failures are retried (tests make it fast).
    """

    def __init__(
        self,
        desk_name: str,
        backend: ModelBackend,
        executor: ToolCallExecutor,
        event_bus: EventBus,
        maximum_rounds: int,
        compressor: ContextCompressor | None = None,
        steering_inbox: SteeringInbox | None = None,
        image_preparer: ImagePreparer | None = None,
    ) -> None:
        if maximum_rounds < 1:
            raise ValueError("maximum_rounds must be at least 1")
        self.desk_name = desk_name
        self.backend = backend
        self._executor = executor
        self._event_bus = event_bus
        self._maximum_rounds = maximum_rounds
        self._compressor = compressor
        self._steering_inbox = steering_inbox
        self._image_preparer = image_preparer or ImagePreparer()
        self.retry_policy = RetryPolicy()
        self._stop_requested = False

    def tool_definitions(self) -> list[dict[str, Any]]:
        """The tools the model is offered on every call.

        Returns:
            One function-calling definition per registered tool.
        """
        return self._executor.tool_registry.definitions()

    def request_stop(self) -> None:
        """Asks a running turn to end at its next safe point (after the tool round in flight)."""
        self._stop_requested = True

    async def run_turn(self, conversation: Conversation, trigger: Trigger) -> TurnResult:
        """Runs one turn for a trigger, appending everything to the conversation.

        Args:
            conversation: The desk's conversation, which grows by this turn's messages.
            trigger: The reason for the turn.

        Returns:
            How the turn ended, with the model's final text.

        Raises:
            BackendUnavailableError: The model could not be reached, even after retries.
            BackendError: The model refused the request for another reason.
        """
        self._stop_requested = False
        if self._compressor is not None and self._compressor.is_full(conversation):
            await self._flush_and_compress(conversation, trigger, "threshold")
        return await self._run_rounds(conversation, TurnState(trigger))

    async def compact(self, conversation: Conversation, trigger: Trigger) -> bool:
        """Flushes memory and compresses the conversation now (the ``/compact`` command).

        Args:
            conversation: The desk's conversation.
            trigger: The command's trigger, used to tag events.

        Returns:
            True when the conversation was compressed; False when there is no compressor or
            nothing to compress.

        Raises:
            BackendUnavailableError: The model could not be reached.
        """
        if self._compressor is None or not self._compressor.can_compress(conversation):
            return False
        return await self._flush_and_compress(conversation, trigger, "command")

    async def _run_rounds(self, conversation: Conversation, turn: TurnState) -> TurnResult:
        self._publish(turn, TurnStarted(desk=self.desk_name, trigger_kind=turn.trigger.kind,
                                        trigger_text=turn.trigger.text))
        await conversation.append(turn.trigger.to_message())
        while turn.rounds < self._maximum_rounds:
            if turn.rounds:
                await self._between_rounds(conversation, turn)
            reply = await self._ask_model(conversation, turn)
            await conversation.append(Message(role="assistant", content=reply.content))
            if not reply.tool_calls:
                return self._finish(turn, reply.text)
            await self._run_tools(conversation, turn, reply.tool_calls)
            if self._stop_requested:
                return self._finish(turn, "Stopped at a safe point: the daemon is shutting "
                                          "down.", stopped=True)
        return self._finish(turn, f"The turn was ended after {turn.rounds} model calls, the "
                                  "desk's round limit (maximum_rounds).", hit_round_limit=True)

    async def _between_rounds(self, conversation: Conversation, turn: TurnState) -> None:
        """Delivers steering, then compresses at once if the window is past its hard mark."""
        if self._steering_inbox is not None and not turn.silent:
            for message in self._steering_inbox.take_all():
                await conversation.append(message.to_message())
                self._publish(turn, SteeringDelivered(
                    desk=self.desk_name, text=message.text, queued_at=message.queued_at,
                    after_round=turn.rounds))
        compressor = self._compressor
        if compressor is not None and compressor.is_overfull(conversation):
            await compressor.compress(conversation, self.backend, self._event_bus.child(
                turn=turn.id), self.desk_name, "mid_turn")

    async def _ask_model(self, conversation: Conversation, turn: TurnState) -> ModelReply:
        """One model call, with retries and one compaction-and-replay on a context overflow."""
        attempt, recovered = 0, False
        turn.rounds += 1
        while True:
            request = self._request_for(conversation)
            self._publish(turn, ModelRequest(
                desk=self.desk_name, round=turn.rounds, message_count=len(request.messages),
                tool_count=len(request.tools), image_count=sum(
                    m.image_count for m in request.messages),
                estimated_tokens=self._estimate(conversation)))
            try:
                reply = await self.backend.complete(request, self._text_sink(turn))
            except TransientBackendError as exc:
                attempt += 1
                if attempt > self.retry_policy.max_retries:
                    raise self._fail(turn, BackendUnavailableError(
                        f"the model is unavailable after {attempt} attempts: {exc.message}",
                        status_code=exc.status_code, model=exc.model)) from exc
                delay = self.retry_policy.delay(attempt, exc)
                self._publish(turn, RetryScheduled(
                    desk=self.desk_name, attempt=attempt, delay=delay, reason=exc.message,
                    status_code=exc.status_code))
                await self.retry_policy.sleep(delay)
                continue
            except ContextOverflowError as exc:
                if recovered or self._compressor is None:
                    raise self._fail(turn, exc) from None
                recovered = True
                self._publish(turn, OverflowRecovery(desk=self.desk_name, message=exc.message))
                await self._compressor.compress(conversation, self.backend, self._event_bus.child(
                    turn=turn.id), self.desk_name, "overflow")
                continue
            except BackendError as exc:
                raise self._fail(turn, exc) from None
            self._record_usage(conversation, turn, reply)
            return reply

    async def _run_tools(self, conversation: Conversation, turn: TurnState,
                         calls: Sequence[ToolUseBlock]) -> None:
        """Runs a round's calls; even when cancelled, every call gets its result appended."""
        finished: dict[str, ExecutedCall] = {}
        try:
            executed = await self._executor.execute(
                calls, self.desk_name, turn.id, self._event_bus, finished)
        except BaseException:
            with anyio.CancelScope(shield=True):
                partial = repair([Message(role="assistant", content=tuple(calls)),
                                  _results_message([finished[c.id] for c in calls
                                                    if c.id in finished])])
                await conversation.append(partial[1])
            raise
        await conversation.append(_results_message(executed))
        for call in executed:
            if call.usage is not None:
                turn.usage = turn.usage + call.usage

    def _request_for(self, conversation: Conversation) -> ModelRequestSpec:
        messages = self._image_preparer.prune(repair(conversation.window()))
        return ModelRequestSpec(conversation.system_prompt, messages, self.tool_definitions())

    def _estimate(self, conversation: Conversation) -> int:
        return context_tokens(conversation)

    def _text_sink(self, turn: TurnState) -> Any:
        if turn.silent:
            return None
        return lambda text: self._publish(turn, TextDelta(desk=self.desk_name, text=text))

    def _record_usage(self, conversation: Conversation, turn: TurnState,
                      reply: ModelReply) -> None:
        usage = reply.usage
        turn.usage = turn.usage + usage
        conversation.note_reported_usage(usage.input_tokens + usage.output_tokens,
                                          len(conversation.messages))
        self._publish(turn, UsageReported(
            desk=self.desk_name, input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens, estimated=usage.estimated, cost=usage.cost,
            context_tokens=usage.input_tokens + usage.output_tokens,
            context_window=self.backend.context_window))

    def _finish(self, turn: TurnState, text: str, *, hit_round_limit: bool = False,
                stopped: bool = False) -> TurnResult:
        usage = turn.usage
        self._publish(turn, TurnEnded(
            desk=self.desk_name, rounds=turn.rounds, hit_round_limit=hit_round_limit,
            final_text=text, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
            cost=usage.cost, stopped=stopped))
        return TurnResult(text, turn.rounds, hit_round_limit, usage, stopped, turn.id)

    def _fail(self, turn: TurnState, error: BackendError) -> BackendError:
        self._publish(turn, ErrorEvent(desk=self.desk_name, message=str(error),
                                       error_type=type(error).__name__))
        return error

    def _publish(self, turn: TurnState, event: Event) -> None:
        object.__setattr__(event, "turn", turn.id)
        self._event_bus.publish(event)

    async def _flush_and_compress(self, conversation: Conversation, trigger: Trigger,
                                  reason: str) -> bool:
        """The silent memory-flush turn, then the summary (see ContextCompressor)."""
        compressor = self._compressor
        assert compressor is not None
        flush = compressor.flush_trigger(trigger)
        if flush is not None:
            saved_stop, self._stop_requested = self._stop_requested, False
            result = await self._run_rounds(conversation, TurnState(flush, silent=True))
            self._stop_requested = saved_stop
            compressor.flush_done(self._event_bus, self.desk_name, result)
        return await compressor.compress(conversation, self.backend, self._event_bus,
                                         self.desk_name, reason)


def _results_message(executed: Sequence[ExecutedCall]) -> Message:
    return Message(role="user", content=tuple(call.result for call in executed),
                   kind="tool_results")
