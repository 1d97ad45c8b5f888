"""Which role each route of the operator API needs, and what its audit calls it.

Every route is in :data:`ROUTE_ROLES`; :func:`~trading_agent.operator.api.create_app`
refuses to build a route that is not, so none is ever served unguarded. Some requests need
more than their route does, decided by what they ask (the handlers check these):

- ``POST /api/desks/{desk}/resume`` of a desk a spend cap paused, and ``reduce_only``
  ``{"on": false}`` of a desk a spend cap put in reduce-only: lifting a spend cap, ``owner``;
- ``POST /api/kill-switch`` with ``flatten``: ``owner`` (as the switch itself is).
"""

from __future__ import annotations

from trading_agent.operator.config import Role

__all__ = ["ROUTE_ROLES", "RouteRule"]

RouteRule = tuple[Role | None, str | None]
"""The role a route needs (None: anyone the listener lets in; the page itself, which holds
no secret), and the action its audit records (None: a read, not recorded)."""

ROUTE_ROLES: dict[tuple[str, str], RouteRule] = {
    ("GET", "/"): (None, None),
    ("GET", "/api/health"): ("viewer", None),
    ("GET", "/api/me"): ("viewer", None),
    ("POST", "/api/stream-ticket"): ("viewer", None),
    ("GET", "/api/desks"): ("viewer", None),
    ("GET", "/api/desks/{desk}"): ("viewer", None),
    ("GET", "/api/desks/{desk}/transcript"): ("viewer", None),
    ("GET", "/api/desks/{desk}/equity"): ("viewer", None),
    ("GET", "/api/desks/{desk}/positions"): ("viewer", None),
    ("GET", "/api/desks/{desk}/orders"): ("viewer", None),
    ("GET", "/api/desks/{desk}/trades"): ("viewer", None),
    ("GET", "/api/desks/{desk}/profit"): ("viewer", None),
    ("GET", "/api/approvals"): ("viewer", None),
    ("GET", "/api/kill-switch"): ("viewer", None),
    ("GET", "/api/events"): ("viewer", None),
    ("GET", "/api/audit"): ("viewer", None),
    ("GET", "/api/desks/{desk}/pins"): ("viewer", None),
    ("GET", "/metrics"): ("viewer", None),
    ("POST", "/api/desks/{desk}/messages"): ("trader", "send"),
    ("POST", "/api/desks/{desk}/compact"): ("trader", "compact"),
    ("POST", "/api/desks/{desk}/pause"): ("trader", "pause"),
    ("POST", "/api/desks/{desk}/resume"): ("trader", "resume"),
    ("POST", "/api/desks/{desk}/reduce_only"): ("trader", "reduce-only"),
    ("POST", "/api/desks/{desk}/cancel"): ("trader", "cancel"),
    ("POST", "/api/desks/{desk}/retry"): ("trader", "retry"),
    ("POST", "/api/desks/{desk}/pins"): ("trader", "pin"),
    ("DELETE", "/api/desks/{desk}/pins/{pin_id}"): ("trader", "unpin"),
    ("POST", "/api/desks/{desk}/orders/{order_id}/cancel"): ("trader", "cancel-order"),
    ("POST", "/api/approvals/{approval_id}/approve"): ("trader", "approve"),
    ("POST", "/api/approvals/{approval_id}/deny"): ("trader", "deny"),
    ("POST", "/api/kill-switch"): ("owner", "kill-switch"),
    ("POST", "/api/reload"): ("owner", "reload"),
}
"""``(method, path template)`` -> the role it needs and its audit action. ``/static/*``
(the page's own files, no data) is served to anyone the listener lets in."""
