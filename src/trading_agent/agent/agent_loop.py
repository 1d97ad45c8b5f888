"""The agent loop: ask the model, run the tools it asks for, give it the results, repeat.

A turn ends when the model answers without asking for a tool, after ``maximum_rounds`` model
calls, or at the next safe point after :meth:`AgentLoop.request_stop`. One ``run_turn`` call
runs one turn: a steering message that arrives while the model writes its final answer waits
in the inbox, and its owner opens the next turn with it at once (see
:mod:`~trading_agent.agent.steering_inbox`).

Before a turn, at the compressor's flush mark: the silent memory-flush turn, then a
compaction (see :mod:`~trading_agent.agent.context_compressor`). Before every model call:
waiting steering messages are delivered, the window is compacted if it is past the hard
mark, and the request is built from the window **repaired** (every tool call answered, no
stray result: valid even after a crash or a cancelled turn), with very long tool results cut
and old images pruned. A context overflow is answered by compacting harder and replaying
(a few times).

Every step is published on the event bus; every message is appended to the conversation
(and so stored) as soon as it exists, and the conversation is valid to send at every await.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from trading_agent.agent.backend import (
    ModelBackend,
    ModelReply,
    ModelRequestSpec,
    Usage,
    desk_cache_key,
)
from trading_agent.agent.context_compressor import (
    ContextCompressor,
    context_tokens,
    overhead_tokens,
)
from trading_agent.agent.conversation import (
    IMAGE_TOKEN_COST,
    Conversation,
    Message,
    ToolUseBlock,
    repair,
)
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.events import (
    ContextCleared,
    ErrorEvent,
    Event,
    MemoryFlush,
    ModelRequest,
    OverflowRecovery,
    RetryScheduled,
    SteeringDelivered,
    TextDelta,
    ThinkingDelta,
    TurnEnded,
    TurnStarted,
    UsageReported,
)
from trading_agent.agent.fixed_part import FixedPart, answer_reserve, measure_fixed_part
from trading_agent.agent.hooks import HookRunner, ModelCallReport, Refuse
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.agent.pacing import pace
from trading_agent.agent.retry import RetryPolicy
from trading_agent.agent.sent_window import SentWindow
from trading_agent.agent.steering_inbox import Steering
from trading_agent.agent.tool_call_executor import ExecutedCall, ToolCallExecutor
from trading_agent.agent.trigger import Trigger
from trading_agent.agent.turn_runner import TurnResult, TurnState, new_turn_id
from trading_agent.errors import (
    BackendError,
    BackendUnavailableError,
    ContextOverflowError,
    TransientBackendError,
)

__all__ = ["AgentLoop"]

_OVERFLOW_REPLAYS = 3
"""How often one request is compacted harder and replayed after the server says it is too
long; then the turn fails (the desk tells the operator and goes on with the next trigger)."""


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
        hooks: Observe and intervene before each model request and tool call, after each
            tool result and model call (see :mod:`~trading_agent.agent.hooks`), in order.

    Attributes:
        backend: The model the loop asks.
        retry_policy: How transient model failures are retried (tests make it fast).
        hooks: The hooks, as given.
        total_usage: Tokens and cost of every model call the loop made.
        new_turn_id: Gives each turn its id (random by default; a backtest numbers its turns,
            so that what derives from them, such as client order ids, is the same on a
            re-run).
    """

    def __init__(
        self,
        desk_name: str,
        backend: ModelBackend,
        executor: ToolCallExecutor,
        event_bus: EventBus,
        maximum_rounds: int,
        compressor: ContextCompressor | None = None,
        steering_inbox: Steering | None = None,
        image_preparer: ImagePreparer | None = None,
        hooks: Sequence[object] = (),
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
        self.hooks = HookRunner(hooks, desk_name)
        self.total_usage = Usage()
        self.retry_policy = RetryPolicy()
        self.new_turn_id: Callable[[], str] = new_turn_id
        self._stop_requested = False
        self._stop_reason = ""
        self._sent_windows: weakref.WeakKeyDictionary[Conversation, SentWindow] = \
            weakref.WeakKeyDictionary()
        self._overhead_memo: tuple[object, int] = ((), 0)

    def tool_definitions(self) -> list[dict[str, Any]]:
        """The tools the model is offered on every call.

        Returns:
            One function-calling definition per registered tool.
        """
        return self._executor.tool_registry.definitions()

    async def fixed_part(self, conversation: Conversation) -> FixedPart:
        """The part of every request that cannot be compacted (system prompt, tool
        definitions, the answer's room), measured by the model's tokenizer where its
        backend has one, against the window.

        Args:
            conversation: Whose system prompt.

        Returns:
            The numbers.
        """
        return await measure_fixed_part(
            conversation.system_prompt, self.tool_definitions(),
            window=self.backend.context_window, reserve=answer_reserve(self.backend),
            count=getattr(self.backend, "count_tokens", None))

    def message_max_chars(self, conversation: Conversation | None = None) -> int | None:
        """The most characters of one message the model is sent (longer ones are cut in
        the middle, in what is sent only), at the conversation's token scale; None without
        a compressor (nothing is cut)."""
        if self._compressor is None:
            return None
        scale = conversation.token_scale if conversation is not None else 1.0
        return self._compressor.max_message_chars(scale)

    def request_stop(self, reason: str = "the daemon is shutting down") -> None:
        """Asks a running turn to end at its next safe point (after the tool round in flight).

        Args:
            reason: Why, for the turn's final text ("Stopped at a safe point: REASON.").
        """
        self._stop_requested = True
        self._stop_reason = reason

    async def run_turn(self, conversation: Conversation, trigger: Trigger) -> TurnResult:
        """Runs one turn for a trigger, appending everything to the conversation.

        Operator messages waiting in the steering inbox are delivered before each model
        call; one that arrives while the model writes its final answer stays there, for its
        owner to open the next turn with (``message.to_trigger(after_answer=True)``, see
        :mod:`trading_agent.agent.steering_inbox`).

        Args:
            conversation: The desk's conversation, which grows by this turn's messages.
            trigger: The reason for the turn.

        Returns:
            How the turn ended, with the model's final text.

        Raises:
            BackendUnavailableError: The model could not be reached, even after retries.
            ContextOverflowError: The prompt was still too long after compacting.
            BackendError: The model refused the request for another reason.
        """
        self._stop_requested = False
        self._stop_reason = ""
        await pace()  # 500 desks triggered at once take their turns in slices of the loop
        await self._compact_if_full(conversation, trigger)
        return await self._run_rounds(conversation, TurnState(trigger, id=self.new_turn_id()))

    async def compact(self, conversation: Conversation, trigger: Trigger) -> bool:
        """Flushes memory and compresses the conversation now (the ``/compact`` command).

        Args:
            conversation: The desk's conversation.
            trigger: The command that asked for it.

        Returns:
            True when the conversation was compressed; False when there is no compressor or
            nothing to compress.

        Raises:
            BackendUnavailableError: The model could not be reached.
        """
        if self._compressor is None or not self._compressor.can_compress(conversation):
            return False
        return await self._flush_and_compress(conversation, "command", trigger)

    # ------------------------------------------------------------------ one turn

    async def _run_rounds(self, conversation: Conversation, turn: TurnState) -> TurnResult:
        trigger = turn.trigger
        conversation.turn_id = turn.id
        self._publish(turn, TurnStarted(desk=self.desk_name, trigger_kind=trigger.kind,
                                        trigger_text=trigger.text, silent=turn.silent))
        await conversation.append(trigger.to_message())
        if trigger.after_answer:
            self._publish(turn, SteeringDelivered(
                desk=self.desk_name, text=trigger.text, queued_at=trigger.at, after_round=0,
                message_id=trigger.id, started_turn=True))
        while turn.rounds < self._round_limit(turn):
            await pace()  # the store's writes end for hundreds of desks at once
            await self._before_model_call(conversation, turn)
            try:
                reply = await self._ask_model(conversation, turn)
            except _Refused as refused:
                return self._finish(turn, f"The model was not asked: {refused.reason}",
                                    stopped=True)
            await conversation.append(Message(role="assistant", content=reply.content))
            await pace()
            if not reply.tool_calls:
                return self._finish(turn, reply.text)
            await self._run_tools(conversation, turn, reply.tool_calls)
            if self._stop_requested:
                return self._finish(turn, f"Stopped at a safe point: {self._stop_reason}.",
                                    stopped=True)
        return self._finish(turn, f"The turn was ended after {turn.rounds} model calls, the "
                                  "desk's round limit (maximum_rounds).", hit_round_limit=True)

    def _round_limit(self, turn: TurnState) -> int:
        if turn.silent and self._compressor is not None:
            return self._compressor.flush_max_rounds
        return self._maximum_rounds

    async def _before_model_call(self, conversation: Conversation, turn: TurnState) -> None:
        """Delivers steering, then compresses at once if the window is past its hard mark."""
        if turn.silent:
            return
        if self._steering_inbox is not None:
            for message in self._steering_inbox.take_all():
                await conversation.append(message.to_message())
                self._publish(turn, SteeringDelivered(
                    desk=self.desk_name, text=message.text, queued_at=message.queued_at,
                    after_round=turn.rounds, message_id=message.id, started_turn=False))
        compressor = self._compressor
        if compressor is None:
            return
        tokens = self._context_tokens(conversation)
        if compressor.is_overfull(tokens) and not self._clear(conversation, turn, tokens,
                                                             compressor.hard_threshold):
            await self._compress(conversation, turn, "mid_turn")

    async def _ask_model(self, conversation: Conversation, turn: TurnState) -> ModelReply:
        """One model call, with retries; a context overflow is answered by compacting harder
        and replaying, up to :data:`_OVERFLOW_REPLAYS` times."""
        turn.rounds += 1
        replays = 0
        while True:
            if replays:
                await pace()
            request, estimate, images = self._prepared_request(conversation)
            if self.hooks:
                decided = await self.hooks.before_request(request, turn.id, self._event_bus)
                if isinstance(decided, Refuse):
                    raise _Refused(decided.reason)
                request = decided
            sent_messages = len(conversation.messages)
            tokens = context_tokens(conversation, functools.partial(int, estimate))
            self._publish(turn, ModelRequest(
                desk=self.desk_name, round=turn.rounds, message_count=len(request.messages),
                tool_count=len(request.tools), estimated_tokens=tokens, image_count=images))
            started = time.monotonic()
            try:
                reply = await self._complete(request, turn, self._text_sink(turn))
            except ContextOverflowError as exc:
                if turn.silent:
                    raise
                # The server counts more tokens than estimated: learn that, so every budget
                # (what is kept, how long one message may be) shrinks for the replay.
                conversation.note_refused(self.backend.context_window, estimate)
                replays += 1
                if self._compressor is None or replays > _OVERFLOW_REPLAYS:
                    why = (f"still too long after compacting {_OVERFLOW_REPLAYS} times"
                           if self._compressor is not None
                           else "too long, and there is nothing left to compact")
                    raise self._fail(turn, ContextOverflowError(
                        f"the prompt is {why} ({self.backend.context_window}-token window): "
                        f"{exc.message}", status_code=exc.status_code,
                        model=exc.model)) from None
                await self._recover(conversation, turn, exc, replays, images)
                continue
            if reply.usage.input_tokens > 0:
                conversation.note_reported_usage(
                    reply.usage.input_tokens, sent_messages,
                    None if reply.usage.estimated else estimate)
            if self.hooks:
                await self.hooks.after_model_call(ModelCallReport(
                    desk=self.desk_name, turn=turn.id, round=turn.rounds, usage=reply.usage,
                    turn_usage=turn.usage, total_usage=self.total_usage,
                    elapsed=time.monotonic() - started), self._event_bus)
            return reply

    async def _complete(self, request: ModelRequestSpec, turn: TurnState | None,
                        on_text: Callable[[str], None] | None) -> ModelReply:
        """Sends one request, retrying transient failures; publishes retries and usage."""
        attempt = 0
        on_thinking = self._thinking_sink(turn) if on_text is not None else None
        while True:
            try:
                reply = await self.backend.complete(request, on_text, on_thinking)
                break
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
            except ContextOverflowError:
                raise
            except BackendError as exc:
                raise self._fail(turn, exc) from None
        usage = reply.usage
        self.total_usage = self.total_usage + usage
        if turn is not None:
            turn.usage = turn.usage + usage
        self._publish(turn, UsageReported(
            desk=self.desk_name, input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens, estimated=usage.estimated, cost=usage.cost,
            cached_input_tokens=usage.cached_input_tokens,
            context_tokens=usage.input_tokens + usage.output_tokens,
            context_window=self.backend.context_window))
        return reply

    async def _run_tools(self, conversation: Conversation, turn: TurnState,
                         calls: Sequence[ToolUseBlock]) -> None:
        """Runs a round's calls; even when cancelled, every call gets its result appended."""
        finished: dict[str, ExecutedCall] = {}
        try:
            executed = await self._executor_for(turn).execute(
                calls, self.desk_name, turn.id, self._event_bus, finished, self.hooks.hooks)
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

    def _executor_for(self, turn: TurnState) -> ToolCallExecutor:
        """The desk's executor; in the memory flush, one that runs only the memory tool."""
        if not turn.silent or self._compressor is None:
            return self._executor
        executor = self._executor
        return ToolCallExecutor(executor.tool_registry.subset([self._compressor.memory_tool]),
                                approval_gate=executor.approval_gate,
                                heartbeat_seconds=executor.heartbeat_seconds)

    # ------------------------------------------------------------------ what is sent

    async def prepare(self, conversation: Conversation) -> None:
        """Prepares what the conversation's next request sends (the sent window, its token
        estimates and, where the backend has ``prepare``, its wire encoding), so that a desk
        restored with a long history does not pay for all of it the moment it wakes (500
        desks woken at once paid it in one pass of the event loop)."""
        request = self._prepared_request(conversation)[0]
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            await prepare(request)

    def _prepared_request(self, conversation: Conversation) -> tuple[ModelRequestSpec, int,
                                                                      int]:
        """What one call sends (the window with old tool results cleared, repaired, long
        messages cut, old images pruned), its estimated tokens and its pictures.

        The window is prepared incrementally (:class:`SentWindow`): a call costs what was
        added since the last one, not the length of the history.
        """
        window = self._sent_windows.get(conversation)
        if window is None:
            window = self._sent_windows[conversation] = SentWindow(self._compressor,
                                                                   self._image_preparer)
        prepared = window.build(conversation)
        tools = self.tool_definitions()
        request = ModelRequestSpec(conversation.system_prompt, prepared.messages, tools,
                                   cache_key=desk_cache_key(self.desk_name))
        return request, self._overhead(conversation.system_prompt, tools) + prepared.tokens, \
            prepared.images

    def _overhead(self, system_prompt: str, tools: list[dict[str, Any]]) -> int:
        """The estimate of the system prompt and the tools (remembered: they rarely change)."""
        key = (system_prompt, tuple(map(id, tools)))
        if self._overhead_memo[0] != key:
            self._overhead_memo = (key, overhead_tokens(system_prompt, tools))
        return self._overhead_memo[1]

    def _context_tokens(self, conversation: Conversation) -> int:
        return context_tokens(conversation,
                              lambda: self._prepared_request(conversation)[1])

    # ------------------------------------------------------------------ compaction

    async def _compact_if_full(self, conversation: Conversation, trigger: Trigger) -> None:
        """Before a turn, at the flush mark: clear old tool results; when that is not
        enough, the memory flush, then the summary."""
        compressor = self._compressor
        if compressor is None:
            return
        tokens = self._context_tokens(conversation)
        if (compressor.is_full(tokens)
                and not self._clear(conversation, None, tokens, compressor.flush_threshold)
                and compressor.can_compress(conversation)):
            await self._flush_and_compress(conversation, "threshold", trigger)

    def _clear(self, conversation: Conversation, turn: TurnState | None, tokens: int,
               mark: float) -> bool:
        """Stubs old tool results in what is sent; True when that brought the window well
        below ``mark`` (a share of the window), so no summary is needed. Pictures are left
        to the image preparer: below the hard mark they are never the reason a summary
        runs."""
        compressor = self._compressor
        assert compressor is not None
        window = self.backend.context_window
        images = self._image_tokens(conversation)
        if tokens - images < mark * window and tokens < compressor.hard_threshold * window:
            return True  # only pictures are over the mark, and the request still fits
        # Enough or not is judged on the window measured again, as the next request will be
        # estimated, not on the compressor's count of what the stubs freed.
        compressor.clear(conversation)
        after = self._context_tokens(conversation)
        enough = after < mark * window  # measured as the next request will be
        if after < tokens:
            self._publish(turn, ContextCleared(
                desk=self.desk_name, tokens_before=tokens, tokens_after=after, enough=enough))
        return enough

    def _image_tokens(self, conversation: Conversation) -> int:
        """What the pictures sent with the next request count for (at most the preparer's
        ``keep`` of them)."""
        count = sum(m.image_count for m in conversation.window())
        sent = min(count, self._image_preparer.limits.keep)
        return int(sent * IMAGE_TOKEN_COST * conversation.token_scale)

    async def _flush_and_compress(self, conversation: Conversation, reason: str,
                                  trigger: Trigger) -> bool:
        compressor = self._compressor
        assert compressor is not None
        if compressor.should_flush(conversation, self._context_tokens(conversation),
                                   self._executor.tool_registry.names):
            await self._memory_flush(conversation, compressor)
        return await self._compress(conversation, None, reason, trigger=trigger)

    async def _memory_flush(self, conversation: Conversation,
                            compressor: ContextCompressor) -> None:
        """The silent turn in which the desk saves what it needs, on a scratch copy."""
        conversation.memory_flushed = True
        scratch = conversation.fork()
        first_new = len(scratch.messages)
        turn = TurnState(compressor.flush_trigger(), silent=True, id=self.new_turn_id())
        try:
            await self._run_rounds(scratch, turn)
        except ContextOverflowError:
            # No room left to flush; the summary still keeps the essentials.
            self._finish(turn, "The memory flush did not fit the model's window.")
        calls = sum(len(m.tool_uses) for m in scratch.messages[first_new:])
        self._publish(turn, MemoryFlush(desk=self.desk_name, tool_calls=calls,
                                        no_op=calls == 0))

    async def _compress(self, conversation: Conversation, turn: TurnState | None, reason: str,
                        keep_recent_tokens: int | None = None, *,
                        trigger: Trigger | None = None) -> bool:
        compressor = self._compressor
        assert compressor is not None
        return await compressor.compress(
            conversation, ask=lambda request: self._complete(request, turn, None),
            measure=lambda: self._context_tokens(conversation),
            events=self._event_bus if turn is None else self._event_bus.child(turn=turn.id),
            desk=self.desk_name, reason=reason, keep_recent_tokens=keep_recent_tokens,
            fixed_tokens=overhead_tokens(conversation.system_prompt, self.tool_definitions()),
            trigger=trigger or (turn.trigger if turn is not None else None))

    async def _recover(self, conversation: Conversation, turn: TurnState,
                       error: ContextOverflowError, replays: int, images: int) -> bool:
        """After a context overflow: a compaction with a recent budget halved per replay
        (the long messages are already cut shorter by the raised token scale). When nothing
        is old enough to summarize, what is left is what the model has not answered; its
        texts are cut shorter, its pictures are not: half of the ``images`` sent are, the
        oldest first (a window too small for the pictures must not refuse every turn)."""
        self._publish(turn, OverflowRecovery(desk=self.desk_name, message=error.message))
        if self._compressor is None:
            return False
        if await self._compress(conversation, turn, "overflow",
                                max(1, self._compressor.keep_recent_tokens >> replays)):
            return True
        if images == 0:
            return False
        conversation.picture_limit = images // 2
        return True

    # ------------------------------------------------------------------ events

    def _text_sink(self, turn: TurnState) -> Callable[[str], None] | None:
        if turn.silent:
            return None
        return lambda text: self._publish(turn, TextDelta(desk=self.desk_name, text=text))

    def _thinking_sink(self, turn: TurnState | None) -> Callable[[str], None] | None:
        if turn is None or turn.silent:
            return None
        return lambda text: self._publish(turn, ThinkingDelta(desk=self.desk_name, text=text))

    def _finish(self, turn: TurnState, text: str, *, hit_round_limit: bool = False,
                stopped: bool = False) -> TurnResult:
        usage = turn.usage
        self._publish(turn, TurnEnded(
            desk=self.desk_name, rounds=turn.rounds, hit_round_limit=hit_round_limit,
            final_text=text, input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
            cost=usage.cost, stopped=stopped, silent=turn.silent))
        return TurnResult(text, turn.rounds, hit_round_limit, usage, stopped, turn.id)

    def _fail(self, turn: TurnState | None, error: BackendError) -> BackendError:
        self._publish(turn, ErrorEvent(desk=self.desk_name, message=str(error),
                                       error_type=type(error).__name__))
        return error

    def _publish(self, turn: TurnState | None, event: Event) -> None:
        if turn is not None:
            object.__setattr__(event, "turn", turn.id)
        self._event_bus.publish(event)


class _Refused(Exception):
    """A hook refused the model request: the turn ends there."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _results_message(executed: Sequence[ExecutedCall]) -> Message:
    return Message(role="user", content=tuple(call.result for call in executed),
                   kind="tool_results")
