"""Seals on the fleet's messages: only a daemon holding the fleet's key is obeyed.

Anyone who reaches the NATS server can publish on the fleet's subjects, join the
``holders`` queue group, or send a message again that it saw. So every control request,
every answer to one, every inbox message, every event and every release announcement carries
a seal in the header ``Trading-Agent-Seal``::

    v1.<unix time, ms>.<nonce, 32 hex>.<HMAC-SHA256, 64 hex>

The MAC, made with the fleet's shared key (``[fleet] key_env``), covers the subject, the
``Nats-Msg-Id`` of a kept message or the reply subject of a request (empty for others), the
time, the nonce and the payload, each
length-prefixed, so none can be moved, swapped or stretched into another. A receiver
refuses a seal that is missing or malformed, a MAC that does not match, a time too far from
its own clock (more than ``window`` seconds off), and, for what travels on core NATS
(requests, answers, releases), a nonce it has seen within the window: a message seen once
cannot be sent again. What JetStream keeps (inbox messages, events) is delivered again by
design, so there the time is compared with the time the server stored the message, not with
now, and a copy sent again is dropped by the stream's duplicate window (the message id is
sealed, so a copy under another id fails the MAC).

Each kind of refusal is logged at most once a minute per kind (with how many were refused
since), so a flood of forgeries cannot flood the log. The key never appears in a log, an
error or a repr.

Errors::

    TradingAgentError
    └── SealRefused     a message failed its seal or a check of its body (``reason`` says
                        which)
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from trading_agent.errors import TradingAgentError
from trading_agent.fleet.config import MIN_KEY_BYTES

__all__ = ["MIN_KEY_BYTES", "SEAL_HEADER", "RefusalLog", "SealRefused", "Sealer"]

_log = structlog.get_logger(__name__)

SEAL_HEADER = "Trading-Agent-Seal"
"""The header that carries a message's seal."""


_SEAL = re.compile(r"^v1\.(\d{1,16})\.([0-9a-f]{32})\.([0-9a-f]{64})$")
_MAX_NONCES = 200_000
"""Nonces remembered at most (the oldest forgotten first); only sealed messages, which need
the key, are remembered, so this bounds the fleet's own traffic in a window."""


class SealRefused(TradingAgentError):
    """A message failed its seal.

    Args:
        reason: Which check failed: ``missing``, ``malformed``, ``bad_mac``, ``stale``,
            ``replayed``, or a check of the body (``desk_mismatch``, ``bad_field``).
        detail: What a reader needs (never the key, never the payload).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"refused ({reason})" + (f": {detail}" if detail else ""))
        self.reason = reason
        self.detail = detail


class Sealer:
    """Seals and checks messages with the fleet's key.

    Args:
        key: The fleet's shared key, at least :data:`MIN_KEY_BYTES` bytes.
        window: Seconds a live message's seal may be off from the receiver's clock; a nonce
            is remembered about this long.
        stored_window: Seconds a kept message's seal may be off from the time its stream
            stored it (the stream's duplicate window, within which a copy is dropped);
            ``window`` by default.
        clock: The time, in seconds since the epoch (injectable for tests).

    Raises:
        ValueError: The key is too short (the message gives its length, never the key).
    """

    def __init__(self, key: bytes, *, window: float = 60.0, stored_window: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the fleet key is {len(key)} bytes; at least {MIN_KEY_BYTES} "
                             f"are needed")
        self._key = key
        self.window = window
        self.stored_window = window if stored_window is None else stored_window
        self._clock = clock
        self._nonces: dict[str, float] = {}  # nonce -> when it may be forgotten

    def __repr__(self) -> str:
        return f"Sealer(window={self.window:g})"  # never the key

    def seal(self, subject: str, payload: bytes, bound: str = "") -> str:
        """The seal of a message about to be published.

        Args:
            subject: The subject it is published on.
            payload: Its bytes.
            bound: What else the seal binds: its ``Nats-Msg-Id`` (a kept message), or the
                subject its answer goes to (a request).

        Returns:
            The header's value.
        """
        stamp = str(int(self._clock() * 1000))
        nonce = secrets.token_hex(16)
        return f"v1.{stamp}.{nonce}.{self._mac(subject, bound, stamp, nonce, payload)}"

    def check(self, subject: str, payload: bytes, seal: str | None, bound: str = "",
              *, stored_at: float | None = None) -> None:
        """Checks a message received.

        Args:
            subject: The subject it came on.
            payload: Its bytes.
            seal: Its ``Trading-Agent-Seal`` header, None when it had none.
            bound: Its ``Nats-Msg-Id``, or a request's reply subject ("" when none).
            stored_at: For a message a stream kept: when the server stored it (the seal's
                time is compared with it, and the nonce is not remembered, since the stream
                delivers it again by design). None: a live message, compared with now and
                refused when its nonce was seen.

        Raises:
            SealRefused: It fails a check.
        """
        if not seal:
            raise SealRefused("missing", f"no {SEAL_HEADER} header")
        found = _SEAL.match(seal)
        if found is None:
            raise SealRefused("malformed", f"{SEAL_HEADER} is not v1.TIME.NONCE.MAC")
        stamp, nonce, mac = found.groups()
        expected = self._mac(subject, bound, stamp, nonce, payload)
        if not hmac.compare_digest(expected, mac):
            raise SealRefused("bad_mac", "not sealed with this fleet's key")
        now = self._clock()
        sent = int(stamp) / 1000
        against, window = (now, self.window) if stored_at is None \
            else (stored_at, self.stored_window)
        if abs(against - sent) > window:
            raise SealRefused("stale", f"sealed {against - sent:.0f} s before "
                                       f"{'now' if stored_at is None else 'its storing'}; "
                                       f"allowed: within {window:g} s")
        if stored_at is None:
            self._forget(now)
            if nonce in self._nonces:
                raise SealRefused("replayed", "this message was received before")
            self._nonces[nonce] = sent + 2 * self.window
            while len(self._nonces) > _MAX_NONCES:
                del self._nonces[next(iter(self._nonces))]

    def _mac(self, subject: str, bound: str, stamp: str, nonce: str, payload: bytes) -> str:
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (b"trading-agent seal v1", subject.encode(), bound.encode(),
                     stamp.encode(), nonce.encode(), payload):
            digest.update(len(part).to_bytes(8, "big"))
            digest.update(part)
        return digest.hexdigest()

    def _forget(self, now: float) -> None:
        """Drops the nonces whose seals are past the window (their messages are refused as
        stale anyway)."""
        while self._nonces:
            oldest = next(iter(self._nonces))
            if self._nonces[oldest] > now:
                return
            del self._nonces[oldest]


@dataclass
class RefusalLog:
    """Logs refused messages, each kind at most once per ``every`` seconds.

    Args:
        every: Seconds between two lines of one kind.
        clock: A monotonic clock (injectable for tests).
    """

    every: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _last: dict[str, float] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)

    def refused(self, what: str, subject: str, exc: SealRefused) -> bool:
        """Notes a refusal; logs it unless its kind was logged within ``every`` seconds.

        Args:
            what: What was refused (``control request``, ``inbox message``, ``event``...).
            subject: Where it came.
            exc: Why.

        Returns:
            Whether a line was logged.
        """
        kind = f"{what}:{exc.reason}"
        self._since[kind] = self._since.get(kind, 0) + 1
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            return False
        self._last[kind] = now
        count = self._since.pop(kind)
        _log.warning("fleet_message_refused", what=what, reason=exc.reason, subject=subject,
                     detail=exc.detail, refused=count,
                     note=f"logged at most once per {self.every:g} s per kind")
        return True
