"""Short-lived tickets that open the event stream and nothing else.

A browser's EventSource cannot send headers, so the web page cannot put its bearer token in
one; a token in a URL ends up in histories and proxies' logs. The page instead asks
``POST /api/stream-ticket`` (with its token in the header) for a ticket, valid
:data:`TICKET_SECONDS`, and opens ``/api/events?ticket=...``: a leaked URL opens the stream
for a minute at most, as the operator who asked, and nothing else.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from trading_agent.operator.identity import Operator

__all__ = ["TICKET_SECONDS", "StreamTickets"]

TICKET_SECONDS = 60.0
"""How long a ticket opens the stream (reconnections within it included)."""

_MAX_TICKETS = 10_000
"""Tickets held at once; the oldest are forgotten first beyond this."""


@dataclass
class StreamTickets:
    """The tickets handed out and not yet expired.

    Attributes:
        seconds: How long each is valid.
        clock: The time source (monotonic seconds), injectable for tests.
    """

    seconds: float = TICKET_SECONDS
    clock: Callable[[], float] = time.monotonic
    _tickets: dict[str, tuple[float, Operator]] = field(default_factory=dict, repr=False)

    def issue(self, operator: Operator) -> str:
        """A new ticket for ``operator``'s event stream."""
        now = self.clock()
        self._forget_expired(now)
        while len(self._tickets) >= _MAX_TICKETS:
            del self._tickets[next(iter(self._tickets))]
        ticket = secrets.token_urlsafe(24)
        self._tickets[ticket] = (now + self.seconds, operator)
        return ticket

    def redeem(self, ticket: str) -> Operator | None:
        """The operator a valid ticket was issued to, or None (unknown or expired)."""
        found = self._tickets.get(ticket)
        if found is None:
            return None
        expires, operator = found
        if self.clock() >= expires:
            del self._tickets[ticket]
            return None
        return operator

    def _forget_expired(self, now: float) -> None:
        for ticket in [t for t, (expires, _) in self._tickets.items() if expires <= now]:
            del self._tickets[ticket]
