"""A live day, replayed: ``backtest --from-desk`` re-runs what a paper desk did in the daemon.

The desk is built as the daemon builds it (:func:`~trading_agent.desks.building.build_desk`),
on the paper exchange and the replay feed of its own config, and driven by what its journal
(:mod:`.desk_journal`) kept instead of by its own watcher and schedules:

- **The same feed, the same clock.** The feed opens where the daemon's opened (the same
  config); before each stored trigger it is stepped, candle by candle, to the feed time the
  live turn started at, and each step matches resting orders and keeps the books, as the
  daemon's watcher does. Triggers the replay's own watcher, schedules or protections would
  fire are dropped: the stored ones stand for them.
- **The same turns.** Each stored trigger (a tick, a candle, a schedule, an operator's
  message, a protection's notice...) opens a turn with the live turn's id; operator messages
  that came mid-turn are delivered after the same number of model answers of the same turn.
- **The same answers.** The model is the desk's recorded answers, through the response
  cache in strict mode: a request that differs from every recorded one is the first
  difference, named with the message that differs and both texts from where they part.

Then the orders the desk sent and the fills its books counted are compared with the stored
ones, in order. The outcome names the first difference, or says the replay matched.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.event_bus import EventBus
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.backtest.cache import CacheMissError, ResponseCache, sampling_of
from trading_agent.backtest.desk_journal import (
    DeskDay,
    fill_json,
    journal_paths,
    order_json,
    read_journal,
    trigger_of,
)
from trading_agent.backtest.engine import scratch_folder
from trading_agent.backtest.mcp_replay import McpReplay, recordings_path
from trading_agent.blocking import blocking_inline
from trading_agent.desks.building import DeskParts, ModelBackends, build_desk
from trading_agent.errors import BackendError, ConfigError
from trading_agent.settings import DeskSettings, Settings
from trading_agent.store.store import Store
from trading_agent.store.trading_state import TradingStateFile
from trading_agent.trading.books import BookFill
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.factory import TradingVenue, open_exchange
from trading_agent.trading.replay import ReplayFeed

__all__ = ["Difference", "ReplayOutcome", "ReplaySpec", "replay_desk", "replay_desk_day"]

BackendFactory = Callable[[DeskSettings, AsyncExitStack], Awaitable[ModelBackend]]


@dataclass(frozen=True)
class ReplaySpec:
    """What to replay.

    Attributes:
        settings: The daemon's settings (the config the desk ran on).
        desk: The desk.
        start: The span's start (feed time, aware).
        end: The span's end.
        state_dir: The daemon's state directory (where the journal is).
        environ: Where secrets are read from (the model's API key, to build its client).
        source: The config file, named in messages.
        ask_model: Ask the model again instead of the recorded answers (a test compares
            what reaches the model server); never on the command line.
    """

    settings: Settings
    desk: str
    start: datetime
    end: datetime
    state_dir: Path
    environ: Mapping[str, str] | None = None
    source: str = "the config"
    ask_model: bool = False


@dataclass(frozen=True)
class Difference:
    """The first place the replay parted from the live run.

    Attributes:
        what: ``request``, ``turn``, ``order``, ``fill`` or ``feed``.
        text: What differs, in one paragraph (for a request: which one, in which turn,
            which message, and both texts from where they part).
    """

    what: str
    text: str


@dataclass
class ReplayOutcome:
    """What the replay found.

    Attributes:
        desk: The desk.
        start: The span's start.
        end: The span's end.
        run_started: When (feed time) the live run the replay started from began.
        turns: Turns replayed (the span's and those before it in the same run).
        turns_in_span: Of those, the ones that started inside the span.
        requests: Model requests the replay made (each answered from the recording).
        orders: The orders, live and replayed.
        fills: The fills, live and replayed.
        difference: The first difference; None when the replay matched.
        later_runs: The desk's runs after the replayed one (not replayed).
    """

    desk: str
    start: datetime
    end: datetime
    run_started: datetime
    turns: int = 0
    turns_in_span: int = 0
    requests: int = 0
    orders: tuple[int, int] = (0, 0)
    fills: tuple[int, int] = (0, 0)
    difference: Difference | None = None
    later_runs: int = 0

    @property
    def matched(self) -> bool:
        """Whether every request, order and fill was the same."""
        return self.difference is None

    def summary(self) -> str:
        """The report's text, a few lines."""
        head = (f"{self.desk}: replayed {_count(self.turns, 'turn')} ({self.turns_in_span} from "
                f"{self.start:%Y-%m-%d %H:%M} to {self.end:%Y-%m-%d %H:%M} UTC, feed time; the "
                f"run began {self.run_started:%Y-%m-%d %H:%M}), "
                f"{_count(self.requests, 'model request')}, {_count(self.orders[1], 'order')} "
                f"and {_count(self.fills[1], 'fill')}")
        if self.later_runs:
            head += (f" (the daemon started the desk {_count(self.later_runs, 'more time')}, "
                     "each run going on from what the store kept: only its first run is "
                     "replayed)")
        if self.difference is None:
            return (f"{head}.\nMatched: every request was byte for byte what the desk sent "
                    f"live, and the orders ({self.orders[0]}) and fills ({self.fills[0]}) are "
                    f"the same.")
        return f"{head}.\nDIFFERS ({self.difference.what}): {self.difference.text}"

    def to_json(self) -> dict[str, Any]:
        """``replay.json``."""
        return {"desk": self.desk, "from": self.start.isoformat(), "to": self.end.isoformat(),
                "run_started": self.run_started.isoformat(), "turns": self.turns,
                "turns_in_span": self.turns_in_span, "requests": self.requests,
                "orders": {"live": self.orders[0], "replayed": self.orders[1]},
                "fills": {"live": self.fills[0], "replayed": self.fills[1]},
                "later_runs": self.later_runs, "matched": self.matched,
                "difference": (None if self.difference is None else
                               {"what": self.difference.what, "text": self.difference.text})}


def replay_desk(spec: ReplaySpec) -> DeskSettings:
    """The desk to replay, refused when unknown, live, or not on a replay feed.

    Raises:
        ConfigError: Why it cannot be replayed, in one line.
    """
    config = spec.settings.desks.get(spec.desk)
    if config is None:
        raise ConfigError(f"{spec.source}: no desk named {spec.desk!r}; the desks are "
                          f"{', '.join(spec.settings.desks) or 'none'}")
    if config.exchange.mode != "paper":
        raise ConfigError(
            f"{spec.source}: desks.{spec.desk}.exchange.mode is \"live\": only a paper desk's "
            "day can be replayed (a live exchange's fills cannot be simulated again)")
    if config.exchange.feed != "replay":
        raise ConfigError(
            f"{spec.source}: desks.{spec.desk}.exchange.feed is \"{config.exchange.feed}\": "
            "its prices came from the exchange as they happened; only a desk on a replay "
            "feed can be replayed")
    return config


async def replay_desk_day(spec: ReplaySpec, *,
                          backend_factory: BackendFactory | None = None) -> ReplayOutcome:
    """Replays the desk's stored day and compares it with what it did live.

    Args:
        spec: What to replay.
        backend_factory: Builds the desk's model (only asked with ``spec.ask_model``); the
            daemon's backends by default.

    Returns:
        What matched, or the first difference.

    Raises:
        ConfigError: The desk cannot be replayed, or nothing is stored for the span.
    """
    config = replay_desk(spec)
    journal, responses = journal_paths(spec.state_dir, spec.desk)
    day = read_journal(journal, spec.desk, spec.start, spec.end)
    if not spec.ask_model and not responses.exists():
        raise ConfigError(f"desk {spec.desk!r}: its recorded model answers ({responses}) are "
                          "missing")
    with blocking_inline():
        async with AsyncExitStack() as stack:
            replay = await _open(spec, config, day, responses, stack, backend_factory)
            return await replay.go()


async def _open(spec: ReplaySpec, config: DeskSettings, day: DeskDay, responses: Path,
                stack: AsyncExitStack, backend_factory: BackendFactory | None) -> _Replay:
    state = Path(stack.enter_context(tempfile.TemporaryDirectory(
        prefix="replay-", dir=scratch_folder())))
    database = state / "replay.sqlite3"
    feed = ReplayFeed.from_config(config.exchange.replay)
    store = await Store.open(database)
    stack.push_async_callback(store.close)
    venue = await stack.enter_async_context(open_exchange(
        config.exchange, state=TradingStateFile(database), account=spec.desk,
        symbols=config.symbols, risk_limits=config.risk, feed=feed,
        protections=config.protections))
    if backend_factory is None:
        backend = await ModelBackends(stack, spec.environ).get(config)
    else:
        backend = await backend_factory(config, stack)
    cache = ResponseCache(backend, responses, "off" if spec.ask_model else "strict",
                          sampling=sampling_of(backend))
    await cache.open()
    stack.push_async_callback(cache.aclose)
    steered = _Steered(cache, day.steering, day.answered_at)
    parts = await build_desk(spec.desk, config, venue, steered, stack=stack, database=database,
                             store=store, bus=EventBus(), approvals=None,
                             settings=spec.settings, sleep=_no_wait,
                             mcp_tools=McpReplay(recordings_path(responses)).register)
    return _Replay(spec, day, feed, venue, parts, cache, steered)


class _Steered:
    """The recorded answers, with the feed stepped to where the live feed was at each answer
    and the operator messages that came mid-turn put in the desk's mailbox after the same
    number of answers of the same turn as live (the loop delivers them before its next
    request, as it did then)."""

    def __init__(self, inner: ResponseCache,
                 steering: Mapping[tuple[str, int], Sequence[SteeringMessage]],
                 answered_at: Mapping[tuple[str, int], datetime]) -> None:
        self.inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self.steering = dict(steering)
        self.answered_at = dict(answered_at)
        self.put: Callable[[SteeringMessage], object] | None = None
        self.step_to: Callable[[datetime], Awaitable[bool]] | None = None
        self.turn: str | None = None
        self.answers = 0

    def new_turn(self, turn: str) -> None:
        self.turn, self.answers = turn, 0
        self._deliver()

    def _deliver(self) -> None:
        if self.turn is None or self.put is None:
            return
        for message in self.steering.pop((self.turn, self.answers), ()):
            self.put(message)

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        reply = await self.inner.complete(request, on_text, on_thinking)
        self.answers += 1
        # The live feed may have stepped while the model thought: the tools of this round
        # read it where it was when the answer came.
        moment = self.answered_at.get((self.turn or "", self.answers))
        if moment is not None and self.step_to is not None:
            await self.step_to(moment)
        self._deliver()
        return reply


class _Replay:
    """One replay's moving parts."""

    def __init__(self, spec: ReplaySpec, day: DeskDay, feed: ReplayFeed, venue: TradingVenue,
                 parts: DeskParts, cache: ResponseCache, steered: _Steered) -> None:
        self.spec = spec
        self.day = day
        self.feed = feed
        self.venue = venue
        self.parts = parts
        self.cache = cache
        self.outcome = ReplayOutcome(spec.desk, spec.start, spec.end, day.started,
                                     later_runs=day.later_runs)
        self.orders: list[dict[str, Any]] = []
        self.fills: list[dict[str, Any]] = []
        self.differences: list[Difference] = []
        self._turn_ids = list(day.turn_ids)
        self._turns_started = 0
        self._trigger_label = ""
        desk = parts.desk
        desk.loop.new_turn_id = self._next_turn_id
        steered.put = desk.mailbox.put_message
        steered.step_to = self._step_to
        self._steered = steered
        # The stored triggers stand for the ones the replay's own watcher would fire.
        parts.watcher.move_percent = None
        parts.watcher.candle_timeframes = []
        exchange = venue.exchange
        announce = exchange.on_fill
        keeper = exchange.before_order

        def filled(fill: BookFill) -> object:
            self.fills.append(fill_json(fill))
            return announce(fill) if announce is not None else None

        async def ordering(request: OrderRequest) -> None:
            if keeper is not None:
                await keeper(request)
            self.orders.append(order_json(request))

        exchange.on_fill = filled
        exchange.before_order = ordering

    def _next_turn_id(self) -> str:
        self._turns_started += 1
        if self._turn_ids:
            turn = self._turn_ids.pop(0)
        else:
            turn = f"replay-extra-{self._turns_started}"
            self.differences.append(Difference(
                "turn", f"the replay started turn {self._turns_started} "
                        f"({self._trigger_label}), which the live desk never did"))
        self._steered.new_turn(turn)
        return turn

    async def go(self) -> ReplayOutcome:
        desk = self.parts.desk
        outcome = self.outcome
        if self.feed.now() != self.day.started:
            outcome.difference = Difference(
                "feed", f"the desk's live run began at {self.day.started:%Y-%m-%d %H:%M} UTC "
                        f"(feed time), but its feed starts at {self.feed.now():%Y-%m-%d %H:%M}: "
                        "a reload rebuilt the desk while its replay ran, or its "
                        "[exchange.replay] settings changed; a replay starts where the feed "
                        "starts")
            return outcome
        await desk.run_pending()  # restores the (new) conversation
        for line in self.day.triggers():
            if self.differences:
                break
            assert line.at is not None
            trigger = trigger_of(line.data["trigger"])
            self._trigger_label = (f"{trigger.kind} trigger at {line.at:%Y-%m-%d %H:%M} UTC: "
                                   f"{_short(trigger.text)}")
            if not await self._step_to(line.at):
                break
            while desk.queue.take() is not None:
                pass  # fired by the replay's own protections: the stored ones stand for them
            outcome.turns += 1
            outcome.turns_in_span += line.at >= self.spec.start
            desk.queue.put(trigger)
            try:
                await desk.run_pending(max_failures=1)
            except CacheMissError as exc:
                self.differences.append(Difference(
                    "request", f"in turn {self._turns_started} ({self._trigger_label}), "
                               f"{exc}"))
                break
            except BackendError as exc:
                self.differences.append(Difference(
                    "request", f"in turn {self._turns_started} ({self._trigger_label}), the "
                               f"model failed: {exc}"))
                break
        if not self.differences:
            await self._step_to(self.spec.end, exact=False)
        outcome.requests = self.cache.requests
        live_orders = self.day.of_kind("order")
        live_fills = self.day.of_kind("fill")
        outcome.orders = (len(live_orders), len(self.orders))
        outcome.fills = (len(live_fills), len(self.fills))
        if not self.differences:
            self._compare("order", live_orders, self.orders)
        if not self.differences:
            self._compare("fill", live_fills, self.fills)
        if not self.differences and self._turn_ids:
            self.differences.append(Difference(
                "turn", f"the live desk ran {len(self._turn_ids)} more turn(s) in the span "
                        f"than the replay (the first with id {self._turn_ids[0]})"))
        outcome.difference = self.differences[0] if self.differences else None
        return outcome

    async def _step_to(self, moment: datetime, *, exact: bool = True) -> bool:
        """Steps the feed to ``moment``, each step keeping the books as the daemon does."""
        feed, watcher = self.feed, self.parts.watcher
        while feed.now() < moment:
            candles = feed.advance()
            if not candles:
                break
            await watcher.take_step(candles)
            while self.parts.desk.queue.take() is not None:
                pass  # the replay's own triggers: the stored ones stand for them
        if exact and feed.now() != moment:
            self.differences.append(Difference(
                "feed", f"the live feed was at {moment:%Y-%m-%d %H:%M} UTC, but the replay's "
                        f"is at {feed.now():%Y-%m-%d %H:%M} (in turn {self._turns_started}, "
                        f"{self._trigger_label}); the feed never steps back"))
            return False
        return True

    def _compare(self, what: str, live: Sequence[Mapping[str, Any]],
                 replayed: Sequence[Mapping[str, Any]]) -> None:
        for index, (then, now) in enumerate(zip(live, replayed, strict=False), start=1):
            if dict(then) != dict(now):
                fields = [key for key in sorted(set(then) | set(now))
                          if then.get(key) != now.get(key)]
                changes = ", ".join(f"{key} live {then.get(key)!r}, replayed {now.get(key)!r}"
                                    for key in fields)
                self.differences.append(Difference(
                    what, f"{what} {index} ({then.get('client_order_id')}) differs: {changes}"))
                return
        if len(live) != len(replayed):
            more, side = ((live, "live desk") if len(live) > len(replayed)
                          else (replayed, "replay"))
            extra = more[min(len(live), len(replayed))]
            self.differences.append(Difference(
                what, f"the {side} has {len(more) - min(len(live), len(replayed))} more "
                      f"{what}(s): the first is {json.dumps(dict(extra))}"))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _short(text: str, limit: int = 60) -> str:
    line = text.replace("\n", " ")
    return f'"{line[:limit]}…"' if len(line) > limit else f'"{line}"'


async def _no_wait(seconds: float) -> None:
    """A failed turn is not retried after a wait: the replay's clock does not move."""
    await anyio.lowlevel.checkpoint()

