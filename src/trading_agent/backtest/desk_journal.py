"""What a paper desk in the daemon keeps so that ``backtest --from-desk`` can replay its day.

A paper desk on a replay feed keeps two files in ``<state dir>/replay/`` (folder 0700,
files 0600), besides what the store keeps:

- ``<desk>.responses.jsonl``: every model request it sent and the answer, in the response
  cache's format (:class:`~trading_agent.backtest.cache.ResponseCache` as a recorder that
  always asks the model): the replay's strict cache.
- ``<desk>.journal.jsonl``: what drove the desk and what it did, one JSON object a line, in
  the order it happened, each with ``"v": 1``:

  - ``start``: the daemon opened the desk (``at``: the feed's time);
  - ``continued``: its first turn went on from a conversation an earlier run left in the
    store (``messages`` of them): such a run cannot be replayed from a new desk, so only a
    desk's first run (from a new state directory) is replayed;
  - ``trigger``: a turn starts for this trigger (its kind, text, source, merge count, id,
    pictures), at this feed time;
  - ``turn``: the loop made a turn id (a memory flush's too), in order;
  - ``answer``: the model answered in turn ``turn`` (its ``round``-th answer), at this feed
    time (a feed that stepped while the desk thought is stepped there by the replay);
  - ``steering``: operator messages delivered in turn ``turn`` after ``after_round`` model
    answers;
  - ``order``: an order the desk sent (after its risk checks); ``fill``: a fill its books
    counted.

The lines are written in the desk's own synchronous hooks, one unbuffered ``write`` of a
few hundred bytes each (to the page cache, never synced), so they are in the order things
happened; a hop to a worker thread would cost more than the write. Times are the feed's
replayed time, the clock the replay runs on. A line or answer that cannot be written is
logged and never fails the desk: its replay then names what it lacks.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from trading_agent.agent.backend import ModelBackend, ModelReply, ModelRequestSpec
from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.backtest.files import append_private, private_folder
from trading_agent.daemon.desk import Desk
from trading_agent.errors import ConfigError
from trading_agent.trading.books import BookFill
from trading_agent.trading.exchange import OrderRequest
from trading_agent.trading.factory import TradingVenue

__all__ = ["JOURNAL_VERSION", "DeskDay", "DeskJournal", "JournalLine", "fill_json",
           "journal_paths", "order_json", "read_journal", "steering_of",
           "trigger_of"]

JOURNAL_VERSION = 1

_log = structlog.get_logger(__name__)


def journal_paths(state_dir: Path, desk: str) -> tuple[Path, Path]:
    """The desk's journal and its recorded answers: ``(journal, responses)``."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", desk)
    folder = state_dir / "replay"
    return folder / f"{name}.journal.jsonl", folder / f"{name}.responses.jsonl"


def _iso(moment: datetime) -> str:
    return moment.isoformat()


def _trigger_json(trigger: Trigger) -> dict[str, Any]:
    return {"kind": trigger.kind, "text": trigger.text, "source": trigger.source,
            "merged": trigger.merged, "id": trigger.id, "at": trigger.at,
            "after_answer": trigger.after_answer,
            "images": [_image_json(image) for image in trigger.images]}


def _image_json(image: ImageBlock) -> dict[str, str]:
    return {"data": base64.b64encode(image.data).decode("ascii"),
            "media_type": image.media_type, "description": image.description}


def _image(data: Mapping[str, Any]) -> ImageBlock:
    return ImageBlock(base64.b64decode(data["data"]), data["media_type"], data["description"])


def trigger_of(data: Mapping[str, Any]) -> Trigger:
    """The trigger a ``trigger`` line holds, as the desk took it."""
    return Trigger(kind=data["kind"], text=data["text"], source=data["source"],
                   merged=data["merged"], id=data["id"], at=data["at"],
                   after_answer=data["after_answer"],
                   images=tuple(_image(image) for image in data["images"]))


def steering_of(data: Mapping[str, Any]) -> SteeringMessage:
    """An operator message a ``steering`` line holds."""
    return SteeringMessage(text=data["text"], source=data["source"], id=data["id"],
                           queued_at=data["queued_at"],
                           images=tuple(_image(image) for image in data["images"]))


def order_json(request: OrderRequest) -> dict[str, Any]:
    """An order as the journal (and the replay's comparison) spells it."""
    return {"symbol": request.symbol, "side": request.side, "type": request.type,
            "amount": str(request.amount),
            "price": None if request.price is None else str(request.price),
            "client_order_id": request.client_order_id, "turn": request.turn,
            "trigger": request.trigger,
            "trigger_price": (None if request.trigger_price is None
                              else str(request.trigger_price))}


def fill_json(fill: BookFill) -> dict[str, Any]:
    """A fill as the journal (and the replay's comparison) spells it."""
    return {"client_order_id": fill.client_order_id, "symbol": fill.symbol,
            "side": fill.side, "amount": str(fill.amount), "price": str(fill.price),
            "fee": str(fill.fee), "at": _iso(fill.at), "turn": fill.turn}


class DeskJournal:
    """Writes a paper desk's journal as the daemon runs it.

    Args:
        path: The journal file (its folder is made, 0700); when it cannot be opened, a
            warning is logged and nothing is kept.
        clock: The feed's time.
    """

    def __init__(self, path: Path, clock: Callable[[], datetime]) -> None:
        self.path = path
        self._clock = clock
        self._file: BinaryIO | None = None
        try:
            private_folder(path.parent)
            self._file = append_private(path)
        except OSError as exc:  # the desk runs; its day cannot be replayed
            _log.warning("desk_journal_unavailable", path=str(path), error=str(exc))
        self._turn: str | None = None
        self._answers = 0
        """The model's answers in the running turn so far."""
        self._desk: Desk | None = None

    def noted(self, model: ModelBackend, client: ModelBackend) -> ModelBackend:
        """The desk's model, each answer noted with the feed's time (give it to the desk).

        Args:
            model: What answers (the recorder around ``client``).
            client: The model client itself, whose extras (``count_tokens``, ``config``)
                the desk's checks still read, as without the journal.
        """
        return _NotedModel(model, self._answered, client)

    def _answered(self) -> None:
        self._answers += 1
        self._write({"kind": "answer", "turn": self._turn, "round": self._answers,
                     "at": _iso(self._clock())})

    def close(self) -> None:
        """Closes the file; later hooks write nothing."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def attach(self, desk: Desk, venue: TradingVenue) -> None:
        """Notes the desk's start, then its triggers, turn ids, steering, orders and fills.

        Args:
            desk: The desk, as :func:`~trading_agent.desks.building.build_desk` made it.
            venue: Its exchange.
        """
        self._write({"kind": "start", "at": _iso(self._clock())})
        self._desk = desk
        desk.on_turn_start.append(self._trigger)
        make_turn_id = desk.loop.new_turn_id

        def new_turn_id() -> str:
            turn = self._turn = make_turn_id()
            self._answers = 0
            self._write({"kind": "turn", "id": turn})
            return turn

        desk.loop.new_turn_id = new_turn_id

        def taken(messages: list[SteeringMessage]) -> None:
            self._write({"kind": "steering", "turn": self._turn,
                         "after_round": self._answers,
                         "messages": [{"text": m.text, "source": m.source, "id": m.id,
                                       "queued_at": m.queued_at,
                                       "images": [_image_json(i) for i in m.images]}
                                      for m in messages]})

        desk.mailbox.on_take = taken
        exchange = venue.exchange
        announce = exchange.on_fill

        def filled(fill: BookFill) -> object:
            self._write({"kind": "fill", "at": _iso(self._clock()), "fill": fill_json(fill)})
            return announce(fill) if announce is not None else None

        exchange.on_fill = filled
        keeper = exchange.before_order

        async def ordering(request: OrderRequest) -> None:
            if keeper is not None:
                await keeper(request)
            self._write({"kind": "order", "at": _iso(self._clock()),
                         "order": order_json(request)})

        exchange.before_order = ordering

    def _trigger(self, trigger: Trigger) -> None:
        desk, self._desk = self._desk, None
        if desk is not None and desk.conversation is not None and desk.conversation.messages:
            self._write({"kind": "continued", "messages": len(desk.conversation.messages)})
        self._write({"kind": "trigger", "at": _iso(self._clock()),
                     "trigger": _trigger_json(trigger)})

    def _write(self, line: dict[str, Any]) -> None:
        """Appends one line; a failure is logged once and ends the journal, never the desk's
        turn (its replay then says what it lacks)."""
        if self._file is None:
            return
        data = json.dumps({"v": JOURNAL_VERSION, **line}, ensure_ascii=True,
                          separators=(",", ":")) + "\n"
        try:
            self._file.write(data.encode("ascii"))
        except OSError as exc:
            _log.warning("desk_journal_stopped", path=str(self.path), error=str(exc))
            self.close()


class _NotedModel:
    """A model whose every answer is told to ``answered`` (the journal notes its time)."""

    def __init__(self, inner: ModelBackend, answered: Callable[[], None],
                 client: ModelBackend) -> None:
        self.inner = inner
        self.model = inner.model
        self.context_window = inner.context_window
        self._answered = answered
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)  # count_tokens, config...

    async def complete(self, request: ModelRequestSpec,
                       on_text: Callable[[str], None] | None = None,
                       on_thinking: Callable[[str], None] | None = None) -> ModelReply:
        reply = await self.inner.complete(request, on_text, on_thinking)
        self._answered()
        return reply


@dataclass(frozen=True)
class JournalLine:
    """One line of a desk's journal.

    Attributes:
        number: Its line number in the file.
        kind: ``start``, ``continued``, ``trigger``, ``turn``, ``answer``, ``steering``,
            ``order`` or ``fill``.
        at: The feed time it names (None for ``continued``, ``turn`` and ``steering``).
        data: The whole line.
    """

    number: int
    kind: str
    at: datetime | None
    data: Mapping[str, Any]


@dataclass
class DeskDay:
    """One uninterrupted run of a desk, as its journal tells it, up to the span's end.

    Attributes:
        started: The feed time the daemon opened the desk.
        lines: The lines after the start, up to the span's end.
        turn_ids: The turn ids the loop made, in order.
        steering: Operator messages delivered mid-turn, by (turn, answers before them).
        answered_at: The feed time of each model answer, by (turn, its number in the turn).
        later_runs: How many times the daemon started the desk again after this run (each
            went on from what the store kept, and is not replayed).
    """

    started: datetime
    later_runs: int = 0
    lines: list[JournalLine] = field(default_factory=list)
    turn_ids: list[str] = field(default_factory=list)
    steering: dict[tuple[str, int], list[SteeringMessage]] = field(default_factory=dict)
    answered_at: dict[tuple[str, int], datetime] = field(default_factory=dict)

    def triggers(self) -> list[JournalLine]:
        """The ``trigger`` lines whose turn ran, in order: a trigger the desk took as it was
        stopping (put back, never run) has no ``turn`` line before the next trigger."""
        ran: list[JournalLine] = []
        pending: JournalLine | None = None
        for line in self.lines:
            if line.kind == "trigger":
                pending = line
            elif line.kind == "turn" and pending is not None:
                ran.append(pending)
                pending = None
        return ran

    def of_kind(self, kind: str) -> list[Mapping[str, Any]]:
        """The payloads of the ``order`` or ``fill`` lines."""
        return [line.data[kind] for line in self.lines if line.kind == kind]


def read_journal(path: Path, desk: str, start: datetime, end: datetime) -> DeskDay:
    """The desk's first stored run, up to ``end`` (or the run's end, when the daemon
    started the desk again: a restart or a reload).

    Raises:
        ConfigError: No journal, an unreadable line, nothing stored in the span, or a first
            run that went on from a conversation the store kept from before.
    """
    try:
        raw = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise ConfigError(
            f"desk {desk!r}: nothing stored to replay ({path} does not exist): only a paper "
            "desk on a replay feed run by this version of the daemon keeps its day") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the desk's journal: {exc}") from None
    lines: list[JournalLine] = []
    for number, text in enumerate(raw, start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
            if data.get("v") != JOURNAL_VERSION:
                raise ValueError(f"version {data.get('v')!r}, not {JOURNAL_VERSION}")
            kind = data["kind"]
            at = datetime.fromisoformat(data["at"]) if "at" in data else None
        except (ValueError, KeyError, TypeError) as exc:
            if number == len(raw):
                break  # a crash's last line, cut off
            raise ConfigError(f"{path}:{number}: not a journal line ({exc})") from None
        lines.append(JournalLine(number, kind, at, data))
    # Only the desk's first run can be replayed from a new desk: each later one (after a
    # restart or a reload) goes on from the conversation and account the store kept.
    starts = [i for i, line in enumerate(lines) if line.kind == "start"]
    if not starts:
        raise ConfigError(f"desk {desk!r}: nothing stored to replay ({path} is empty)")
    begin = starts[0]
    started = lines[begin].at
    assert started is not None
    if started > end:
        raise ConfigError(
            f"desk {desk!r}: nothing stored from {start:%Y-%m-%d %H:%M} to "
            f"{end:%Y-%m-%d %H:%M} UTC (feed time); its journal begins at "
            f"{started:%Y-%m-%d %H:%M} UTC")
    day = DeskDay(started, later_runs=len(starts) - 1)
    for line in lines[begin + 1:]:
        if line.kind == "start" or (line.at is not None and line.at > end):
            break
        if line.kind == "continued":
            raise ConfigError(
                f"desk {desk!r}: its first stored run, from {started:%Y-%m-%d %H:%M} UTC (feed "
                f"time), went on from {line.data['messages']} messages an earlier run left in "
                "the store (from before the daemon kept journals): a replay starts from a new "
                "desk; start the desk in a new state directory to keep a replayable day")
        day.lines.append(line)
    turn = None
    for line in day.lines:
        if line.kind == "turn":
            turn = line.data["id"]
            day.turn_ids.append(turn)
        elif line.kind == "answer" and line.at is not None:
            day.answered_at[(str(line.data["turn"]), int(line.data["round"]))] = line.at
        elif line.kind == "steering":
            key = (str(line.data["turn"]), int(line.data["after_round"]))
            day.steering.setdefault(key, []).extend(
                steering_of(m) for m in line.data["messages"])
    if not any(line.kind == "trigger" and line.at is not None and line.at >= start
               for line in day.lines):
        raise ConfigError(
            f"desk {desk!r}: no turn stored from {start:%Y-%m-%d %H:%M} to "
            f"{end:%Y-%m-%d %H:%M} UTC (feed time)")
    return day

