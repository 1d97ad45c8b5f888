"""The operator HTTP API: desks, chat, ``/compact``, approvals, transcripts, the event stream.

Routes (JSON in and out; every error is ``{"error": {"status", "code", "message"}}``):

==========  ====================================  ============================================
GET         /api/health                           daemon up; desks; newest event id
GET         /api/desks                            every desk's status, in config order
GET         /api/desks/{desk}                     one desk's status
POST        /api/desks/{desk}/messages            ``{"text", "source"?, "images"?}`` -> 202
                                                  ``{"id", "desk", "delivery": "steering" |
                                                  "turn"}`` (delivery: whether a turn was
                                                  running); ``images``: up to four
                                                  ``{"media_type", "data" (base64),
                                                  "name"?}``, each a PNG, JPEG, GIF or WebP;
                                                  ``"wait": true`` (and ``"timeout"`` s, 900
                                                  by default) -> 200 with ``"reply": {"ok",
                                                  "text", "error"}`` once the turn that read
                                                  it ended, or 504 ``no_reply``
POST        /api/desks/{desk}/compact             flush memory and compact now -> ``{"compacted"}``
GET         /api/desks/{desk}/transcript          ``?before=SEQ&limit=N`` (1..500, default 50)
GET         /api/desks/{desk}/equity              ``{"points": [[time, equity], ...]}``,
                                                  oldest first, kept across restarts; the
                                                  last is the status's equity now
GET         /api/desks/{desk}/positions           the desk's own open positions at the marks:
                                                  ``{"desk", "books", "positions": [{"symbol",
                                                  "side", "amount", "entry_price", "mark",
                                                  "unrealized", "notional", "realized",
                                                  "fees", "opened_at", "trade_id"}],
                                                  "markets": [{"symbol", "amount",
                                                  "realized", "fees"}]}``
GET         /api/desks/{desk}/orders              its open orders (``?all=1``: every one):
                                                  ``{"desk", "books", "orders":
                                                  [{"client_order_id", "order_id", "symbol",
                                                  "side", "type", "amount", "price",
                                                  "filled", "status", "turn", "noted_at",
                                                  "open"}]}``
POST        /api/desks/{desk}/orders/{id}/cancel  ``{"operator"?}``: cancels that open order
                                                  of the desk's books (exchange or client
                                                  order id) on its exchange -> ``{"desk",
                                                  "order"}``; 404 ``unknown_order`` naming
                                                  its open orders, 409 ``cannot_cancel``
                                                  (no books; not answered yet), 502
                                                  ``exchange_error``. The page asks first.
GET         /api/desks/{desk}/trades              round trips, oldest first; ``?since=
                                                  YYYY-MM-DD`` (closed on or after that UTC
                                                  day; open ones always), ``?open=1`` (only
                                                  open): ``{"desk", "books", "trades":
                                                  [{"id", "symbol", "side", "opened_at",
                                                  "closed_at", "amount", "entry_price",
                                                  "exit_price", "exited", "profit",
                                                  "profit_percent", "fees",
                                                  "duration_seconds", "exit_reason",
                                                  "opened_turn", "closed_turn", "open"}]}``
GET         /api/desks/{desk}/profit              ``?period=daily|weekly``, ``?since=
                                                  YYYY-MM-DD``: ``{"desk", "books",
                                                  "period", "summary": {"realized_today",
                                                  "realized_total", "unrealized",
                                                  "fees_total", "trades_closed", "wins",
                                                  "open_trades", "win_rate"}, "rows":
                                                  [{"day", "realized", "fees", "fills",
                                                  "trades_closed"}]}``; decimals are
                                                  strings, times ISO 8601 UTC; a desk
                                                  without books: empty, all zero
GET         /api/approvals                        pending approvals, ``?desk=`` to filter
POST        /api/approvals/{id}/approve           ``{"operator"?, "reason"?}`` -> the approval
POST        /api/approvals/{id}/deny              ``{"operator"?, "reason"?}`` -> the approval
POST        /api/desks/{desk}/pause               ``{"operator"?, "reason"?}``: no turns until
                                                  resumed -> ``changed`` and the status
POST        /api/desks/{desk}/resume              ``{"operator"?}`` -> ``changed``,
                                                  ``waiting`` (triggers that waited), status
POST        /api/desks/{desk}/cancel              ``{"operator"?, "now"?}``: ends the running
                                                  turn at a safe point (or at once)
POST        /api/desks/{desk}/retry               ``{"operator"?}``: runs the last turn again
                                                  from its trigger, its answer taken out of
                                                  what is sent (kept, marked) -> ``dropped``;
                                                  409 ``cannot_retry`` saying why not
GET         /api/desks/{desk}/pins                its standing instructions: ``{"desk",
                                                  "pins": [{"id", "desk", "text", "by",
                                                  "at"}], "configured": [text, ...]}``
POST        /api/desks/{desk}/pins                ``{"text", "operator"?}``: pins it; sent
                                                  verbatim in every request from the next
                                                  -> 201 ``{"pin", ...}``; 400
                                                  ``invalid_pin`` (empty, over 4,000
                                                  characters), ``pin_too_large`` (the
                                                  window cannot hold it, with the numbers)
DELETE      /api/desks/{desk}/pins/{id}           ``{"operator"?}``: takes it off ->
                                                  ``{"unpinned", ...}``; 404 ``unknown_pin``
GET         /api/kill-switch                      the switches that are on
POST        /api/kill-switch                      ``{"on", "desk"?, "operator"?, "reason",
                                                  "cancel_orders"?, "flatten"?}``; no desk:
                                                  every desk
POST        /api/reload                           ``{"operator"?}``: read the config file again
                                                  -> ``{"ok", "changes"}``; 400
                                                  ``config_invalid`` (nothing changed)
GET         /api/events                           server-sent events; ``?desk=``, ``?after=ID``
                                                  (or the ``Last-Event-ID`` header, which wins),
                                                  ``?tail=N`` (the last N held in memory),
                                                  ``?follow=0`` (end once caught up)
GET         /metrics                              Prometheus' text format (``trading_agent_*``,
                                                  see :mod:`.metrics`); on TCP the token in
                                                  the ``Authorization: Bearer`` header
GET         /api/me                               who the credential is: ``{"name", "role",
                                                  "surface"}``
POST        /api/stream-ticket                    ``{"ticket", "expires_in"}``: opens ``GET
                                                  /api/events?ticket=`` (and nothing else)
                                                  for 60 s (:mod:`.tickets`)
GET         /api/audit                            operators' actions, oldest first: ``?desk=``,
                                                  ``?since=`` (ISO 8601), ``?limit=`` (1..5000,
                                                  200): ``{"actions": [{"at", "who", "role",
                                                  "action", "desk", "surface", "outcome",
                                                  "detail"}]}`` (:mod:`.audit`)
GET         /  and  /static/*                     the web page
==========  ====================================  ============================================

Roles: every route needs one, from
:data:`~trading_agent.operator.route_roles.ROUTE_ROLES` (``viewer`` reads, ``trader`` steers
and decides, ``owner`` holds the kill switch, reload and the spend caps); a request above
the operator's role gets 403 ``forbidden_role`` with ``needed_role`` and changes nothing.
The name recorded for an action is the credential's (:mod:`.identity`): on TCP the token's
operator, on the Unix socket the OS user at the other end (its peer credentials; an owner).
A body's ``operator`` or ``source`` is accepted, so older clients keep working, and ignored.
Every action (each POST but the
ticket) is recorded in the audit once answered, with its outcome.

Statuses: 400 for a malformed, too deeply nested or non-object JSON body, an unknown field,
an empty message (without a picture) or one longer than ``max_message_chars``, text with an
unpaired surrogate escape, a picture that is not base64, not a picture or not a PNG, JPEG,
GIF or WebP, a bad query parameter or ``Last-Event-ID`` (ids are 0..2**63-1); 413 for a
picture over ``max_image_bytes`` (or too many pixels to open); 401 for a missing or
wrong token, a ``?token=`` anywhere, or a stream ticket that is unknown, expired or used
elsewhere than the event stream (TCP only); 403 ``forbidden_role`` above the role; 403
``cross_origin``
and 415 ``unsupported_media_type`` for a POST from another site's page or not in JSON (TCP
only, below); 400 ``reason_required`` for a kill switch switched on without a
reason; 400 ``invalid_parameter`` for a ``since`` that is not a date as YYYY-MM-DD, or
a ``period`` but daily or weekly; 404 for an unknown desk (naming the desks there are),
approval, order or route; 409 for an approval already answered; 503 when the model is
unavailable for ``/compact``; 507 ``storage_full`` when the disk holding the store is full
(nothing was stored; the message names where to free space); 500, still JSON, for a
failure of the daemon. A refused request never reaches a desk. The server itself answers
408 ``request_timeout`` to a connection that sends no complete headers in time and 503
``too_many_connections`` beyond the TCP listener's limit (:mod:`.server`).

Authentication: the Unix socket is guarded by its file mode (0600). On TCP every ``/api``
request (and ``/metrics``) needs an operator's token as ``Authorization: Bearer <token>``,
compared in constant time (:func:`hmac.compare_digest`) with every operator's; only ``GET
/api/events`` also takes a ticket as ``?ticket=``, because a browser's EventSource cannot
set headers. A token in a URL can end up in a proxy's or a browser's history, so none is
ever accepted there; a leaked stream URL opens that stream for a minute at most. The web
page takes the token from its URL fragment (``/#token=...``), which browsers never send to
servers. Every answer carries the page's security headers (``/static/`` included).

Requests from other sites (TCP): a page elsewhere can make a browser send a form or a
body-less request to this address, never a JSON body or an ``Authorization`` header without
a CORS preflight, which this API never grants. So every POST (any method but GET, HEAD and
OPTIONS) must carry its body as ``Content-Type: application/json`` (415 otherwise; a POST
with no body at all may leave the type out, as ``/compact`` does), and when it names an
``Origin``, that must be the address it was sent to, its ``Host`` (403 otherwise).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import json
import math
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

import anyio
import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from trading_agent.agent.conversation import ImageBlock
from trading_agent.agent.image_preparer import OPERATOR_MEDIA_TYPES, ImageRejectedError
from trading_agent.daemon.control import (
    CancelRefusedError,
    DeskControl,
    DeskUnreachableError,
    MessageNotKeptError,
    UnknownDeskError,
    UnknownOrderError,
    message_id_for,
)
from trading_agent.daemon.pins import MAX_PIN_CHARS, PinControl, PinRefusedError, UnknownPinError
from trading_agent.daemon.spend import SPEND_CAP
from trading_agent.errors import (
    BackendError,
    ConfigError,
    ExchangeError,
    RetryRefusedError,
    StorageFullError,
    TradingAgentError,
)
from trading_agent.jsontext import json_bytes
from trading_agent.logging_setup import redact_secrets
from trading_agent.operator.approvals import (
    ApprovalAlreadyResolvedError,
    Approvals,
    Decision,
    UnknownApprovalError,
)
from trading_agent.operator.audit import AuditEntry, AuditLog, MemoryAudit, Outcome
from trading_agent.operator.config import OperatorConfig, Role
from trading_agent.operator.equity import EquityHistory, EquitySamples
from trading_agent.operator.event_stream import STREAM_CURSOR_HEADER, EventHub, sse_frames
from trading_agent.operator.identity import Credentials, Operator, allows, socket_operator
from trading_agent.operator.metrics import METRICS_CONTENT_TYPE, DaemonMetrics
from trading_agent.operator.route_roles import ROUTE_ROLES
from trading_agent.operator.tickets import TICKET_SECONDS, StreamTickets

__all__ = ["SOCKET_PEER_KEY", "WEB_DIR", "ApiError", "OperatorService", "create_app",
           "json_response"]

_log = structlog.get_logger(__name__)

WEB_DIR = Path(__file__).parent / "web"

_LINGER_SECONDS = 0.02
"""How long a stream gathers events before a write: invisible to a person, and it turns a
busy daemon's many small writes into few large ones (see bench/event_fanout.py)."""

_MAX_ID = 2**63 - 1
"""The largest id or sequence number a query may name (SQLite's INTEGER)."""

MAX_IMAGES_PER_MESSAGE = 4
"""The most pictures one message may carry: the model is sent only the four newest."""

_LARGE_BODY = 1_000_000
"""A body this large is parsed in a worker thread (a picture's base64), not on the loop."""

_M = TypeVar("_M", bound=BaseModel)
_Handler = Callable[[Request], Awaitable[Response]]

_PAGE_HEADERS: dict[str, str] = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
}


_PAGE_HEADER_BYTES = tuple((name.lower().encode("latin-1"), value.encode("latin-1"))
                           for name, value in _PAGE_HEADERS.items())


class ApiError(Exception):
    """A request the API refuses, with the status and a message for the operator.

    Args:
        status: The HTTP status.
        code: A short machine-readable code (``unknown_desk``).
        message: What is wrong and what to do, for a person.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class RoleRequiredError(ApiError):
    """A request above the asking operator's role (403 ``forbidden_role``).

    Args:
        operator: Who asked.
        needed: The role it needs.
        what: What was asked, for the message.
    """

    def __init__(self, operator: Operator, needed: Role, what: str) -> None:
        super().__init__(403, "forbidden_role", f"{what} needs the {needed} role")
        self.operator = operator
        self.needed = needed
        self.what = what


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    """A JSON response (non-finite numbers become null rather than invalid JSON; a lone
    surrogate in stored model text is escaped rather than failing to encode)."""
    body = json_bytes(_finite(data), default=str)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _error(status: int, code: str, message: str,
           headers: dict[str, str] | None = None) -> Response:
    return json_response({"error": {"status": status, "code": code, "message": message}},
                         status, headers)


class OperatorService:
    """What the API's handlers share: the daemon, the approvals, the stream, the settings.

    Args:
        control: The running daemon.
        approvals: The daemon's approval book (in a fleet, every daemon's).
        config: The operator settings.
        equity_samples: Where the equity chart's samples are kept (the daemon's store, so
            the curve outlives a restart); in memory when None.
        audit: Where operator actions are recorded (the daemon's store); in memory when
            None.
        ticket_seconds: How long a stream ticket opens the event stream.
    """

    def __init__(self, control: DeskControl, approvals: Approvals,
                 config: OperatorConfig, *, equity_samples: EquitySamples | None = None,
                 audit: AuditLog | None = None,
                 ticket_seconds: float = TICKET_SECONDS) -> None:
        self.control = control
        self.approvals = approvals
        self.config = config
        self.audit: AuditLog = audit if audit is not None else MemoryAudit()
        self.tickets = StreamTickets(seconds=ticket_seconds)
        # A daemon of a fleet shows every daemon's events, from the fleet's stream.
        self.hub = EventHub(control.event_bus, config.event_buffer_size,
                            feed=getattr(control, "event_feed", None))
        self.equity = EquityHistory(control, config.equity_sample_seconds,
                                    samples=equity_samples,
                                    sampled=getattr(control, "desks_here", None))
        self.keepalive_seconds = 15.0
        self.linger_seconds = _LINGER_SECONDS

    def close(self) -> None:
        """Ends every open event stream and the equity sampling's (the server is stopping)."""
        self.hub.close()
        self.equity.close()


# --------------------------------------------------------------------------- request helpers


_REPLY_TIMEOUT_SECONDS = 900.0
"""How long ``"wait": true`` waits for the desk's answer by default."""


class _ImageBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    media_type: str = Field(max_length=100)
    data: str
    name: str = Field(default="", max_length=200)


_IDEMPOTENCY_KEY = r"^[A-Za-z0-9._:-]{1,128}$"
"""A client's idempotency key: what a UUID, a ULID or a timestamped id is made of."""


class _MessageBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    idempotency_key: str | None = Field(default=None, pattern=_IDEMPOTENCY_KEY)
    text: str
    source: str = Field(default="operator", min_length=1, max_length=64,
                        pattern=r"^[\w .@+-]+$")
    images: list[_ImageBody] = Field(default_factory=list, max_length=MAX_IMAGES_PER_MESSAGE)
    wait: bool = False
    timeout: float = Field(default=_REPLY_TIMEOUT_SECONDS, gt=0, le=86_400)


class _ControlBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    operator: str = Field(default="operator", min_length=1, max_length=64,
                          pattern=r"^[\w .@+-]+$")
    reason: str = Field(default="", max_length=2000)
    now: bool = False


class _ReduceOnlyBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    on: bool
    operator: str = Field(default="operator", min_length=1, max_length=64,
                          pattern=r"^[\w .@+-]+$")
    reason: str = Field(default="", max_length=2000)


class _KillSwitchBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    on: bool
    desk: str | None = Field(default=None, max_length=200)
    operator: str = Field(default="operator", min_length=1, max_length=64,
                          pattern=r"^[\w .@+-]+$")
    reason: str = Field(default="", max_length=2000)
    cancel_orders: bool = False
    flatten: bool = False


class _DecisionBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    operator: str = Field(default="operator", min_length=1, max_length=64,
                          pattern=r"^[\w .@+-]+$")
    reason: str = Field(default="", max_length=2000)


def _service(request: Request) -> OperatorService:
    service: OperatorService = request.app.state.service
    return service


_OPERATOR_KEY = "trading_agent.operator"
"""Where :class:`_Authorize` leaves the request's :class:`Operator` in the ASGI scope."""

SOCKET_PEER_KEY = "trading_agent.socket_peer"
"""Where the Unix socket's server leaves its connection's peer (an :class:`Operator` from
:func:`~trading_agent.operator.identity.peer_operator`) in the ASGI scope; a request on the
socket without it (an app served in-process) is the daemon's own user."""

_LISTENER_KEY = "trading_agent.listener"
"""Where it leaves the listener's kind (``socket`` or ``tcp``)."""

_AUDIT_DESK_KEY = "trading_agent.audit_desk"
"""Where a handler names the desk an action concerned, when its path does not."""

_ACTOR_KEY = "trading_agent.actor"
"""Where :func:`_actor` leaves the name it recorded, for the audit."""

_SURFACES = frozenset({"cli", "web", "chat"})
"""What a client may say it is (``X-Operator-Surface``), for the audit."""


def _operator(request: Request) -> Operator:
    operator: Operator | None = request.scope.get(_OPERATOR_KEY)
    return operator if operator is not None else socket_operator()


def _actor(request: Request) -> str:
    """The name recorded for the request's action: the credential's (on the Unix socket,
    the peer's OS user), never one the body gives."""
    name = _operator(request).name
    request.scope[_ACTOR_KEY] = name
    return name


def _require(request: Request, needed: Role, what: str) -> None:
    """Raises :class:`RoleRequiredError` unless the operator's role allows ``needed``."""
    operator = _operator(request)
    if not allows(operator.role, needed):
        raise RoleRequiredError(operator, needed, what)


def _audit_desk(request: Request, desk: str) -> None:
    request.scope[_AUDIT_DESK_KEY] = desk


def _surface(request: Request) -> str:
    listener = str(request.scope.get(_LISTENER_KEY, "socket"))
    declared = request.headers.get("x-operator-surface", "").strip().lower()
    return f"{declared}/{listener}" if declared in _SURFACES else listener


def _role_refusal(operator: Operator, needed: Role, what: str) -> Response:
    return _error_with(403, "forbidden_role",
                       f"{what} needs the {needed} role; {operator.name} is a {operator.role}",
                       needed_role=needed, role=operator.role)


def _desk(request: Request, name: str | None = None) -> str:
    desk = name if name is not None else request.path_params["desk"]
    names = list(_service(request).control.desk_names())
    if desk not in names:
        raise ApiError(404, "unknown_desk",
                       f"no desk named {desk!r}; desks: {', '.join(names) or 'none'}")
    return desk


async def _json_body(request: Request, model: type[_M], limit: int) -> _M:
    """Reads at most ``limit`` bytes of JSON object and validates it."""
    return _parsed(await _raw_body(request, limit), model)


async def _raw_body(request: Request, limit: int) -> bytes:
    """At most ``limit`` bytes of body."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(400, "body_too_large", f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parsed(raw: bytes, model: type[_M]) -> _M:
    """A JSON object validated by ``model``."""
    if raw.strip():
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, "malformed_json", f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "malformed_json", "the body's JSON is nested too deeply") \
                from None
    else:
        data = {}
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_body", "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {error['msg']}"
            for error in exc.errors(include_url=False))
        raise ApiError(400, "invalid_body", problems) from None


def _utf8_text(name: str, text: str) -> str:
    """Refuses text that cannot be stored: JSON may escape a lone surrogate (``\\ud800``),
    which no UTF-8 file, socket or SQLite column takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "invalid_text",
                       f"the {name} holds an unpaired surrogate escape (\\ud800-\\udfff), "
                       "which is not text") from None
    return text


def _bounded_int(name: str, text: str, minimum: int, maximum: int) -> int:
    # Digits only: int() would also take "1_000" and " 12 ", and long digit strings cost
    # quadratic time, so the length is checked first (2**63 has 19 digits).
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise ApiError(400, "invalid_parameter",
                       f"{name} must be an integer in {minimum}..{maximum}, not {text[:40]!r}")
    value = int(text)
    if value < minimum or value > maximum:
        raise ApiError(400, "invalid_parameter",
                       f"{name} must be in {minimum}..{maximum}, not {value}")
    return value


def _int_param(request: Request, name: str, *, default: int | None = None, minimum: int = 0,
               maximum: int = _MAX_ID) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return default
    return _bounded_int(name, text, minimum, maximum)


def _endpoint(handler: _Handler) -> _Handler:
    """Turns the errors a handler may meet into JSON error responses."""

    @functools.wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except RoleRequiredError as exc:
            return _role_refusal(exc.operator, exc.needed, exc.what)
        except ApiError as exc:
            return _error(exc.status, exc.code, exc.message)
        except UnknownDeskError as exc:
            return _error(404, "unknown_desk", str(exc.args[0] if exc.args else exc))
        except UnknownApprovalError as exc:
            return _error(404, "unknown_approval", str(exc))
        except ApprovalAlreadyResolvedError as exc:
            return _error(409, "already_resolved", str(exc))
        except RetryRefusedError as exc:
            return _error(409, "cannot_retry", f"nothing was retried: {exc}")
        except UnknownOrderError as exc:
            return _error(404, "unknown_order", str(exc))
        except CancelRefusedError as exc:
            return _error(409, "cannot_cancel", f"nothing was cancelled: {exc}")
        except ExchangeError as exc:
            return _error(502, "exchange_error", f"the exchange failed: {exc}")
        except DeskUnreachableError as exc:
            return _error(503, "desk_unreachable", str(exc))
        except BackendError as exc:
            return _error(503, "model_unavailable", str(exc))
        except ImageRejectedError as exc:
            return _error(413 if exc.too_large else 400, exc.code,
                          f"the picture was refused: {exc}")
        except StorageFullError as exc:
            # 507 Insufficient Storage: nothing was stored; the same request works once
            # space is freed where the message says.
            _log.error("operator_request_not_stored", path=request.url.path,
                       error=str(exc))
            return _error(507, "storage_full", str(exc))
        except TradingAgentError as exc:
            _log.warning("operator_request_failed", path=request.url.path, error=repr(exc))
            return _error(500, "daemon_error", str(exc))
        except Exception as exc:
            # A bug: the client gets JSON like every other error, the log gets the details.
            _log.exception("operator_request_crashed", path=request.url.path, error=repr(exc))
            return _error(500, "internal_error",
                          "the daemon failed to answer this request; see its log")

    return wrapper


# --------------------------------------------------------------------------- handlers


@_endpoint
async def _health(request: Request) -> Response:
    service = _service(request)
    return json_response({"status": "ok", "desks": list(service.control.desk_names()),
                          "last_event_id": service.hub.last_id,
                          "stream_dropped": service.hub.dropped_total})


async def _status_of(service: OperatorService, desk: str) -> dict[str, Any]:
    status = await service.control.desk_status(desk)
    data = status.model_dump(mode="json")
    # A desk another daemon of a fleet runs has its approvals there: its status says.
    data["pending_approvals"] = (status.pending_approvals
                                 or service.approvals.pending_count(desk))
    return data


@_endpoint
async def _list_desks(request: Request) -> Response:
    service = _service(request)
    names = list(service.control.desk_names())
    desks: list[dict[str, Any]] = [{} for _ in names]

    async def status(index: int, desk: str) -> None:
        desks[index] = await _status_of(service, desk)

    # At once: in a fleet each may be a question to another daemon.
    async with anyio.create_task_group() as group:
        for index, desk in enumerate(names):
            group.start_soon(status, index, desk)
    return json_response({"desks": desks})


@_endpoint
async def _get_desk(request: Request) -> Response:
    return json_response(await _status_of(_service(request), _desk(request)))


_OPERATOR_FRAME_CHARS = 64
"""What the desk adds around an operator's words (``[Message from NAME, a human operator]``)."""


@_endpoint
async def _post_message(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    limit = service.config.max_message_chars
    body = await _message_body(request, limit, service.config.max_image_bytes)
    _utf8_text("message", body.text)
    if not body.text.strip() and not body.images:
        raise ApiError(400, "empty_message", "the message is empty")
    if len(body.text) > limit:
        raise ApiError(400, "message_too_long",
                       f"the message is {len(body.text)} characters; the limit is {limit} "
                       "(operator.max_message_chars)")
    images = await _images(body, service.config.max_image_bytes, _actor(request))
    key = _idempotency_key(request, body)
    message_id = message_id_for(desk, key)
    try:
        message_id = await service.control.send_message(desk, body.text,
                                                        _actor(request), images,
                                                        message_id=message_id)
    except MessageNotKeptError as exc:
        return _not_kept(desk, message_id, key, exc)
    # The desk's mailbox decided how it took the message; asked with no await between.
    delivery = service.control.message_delivery(desk, message_id)
    answer: dict[str, Any] = {"id": message_id, "desk": desk, "delivery": delivery}
    shortened = _shortened(service.control, desk, body.text)
    if shortened is not None:
        answer["shortened"] = shortened
    if not body.wait:
        return json_response(answer, 202)
    # No await between the send and this: the desk cannot have read the message yet.
    with anyio.move_on_after(body.timeout):
        try:
            reply = await service.control.wait_for_reply(desk, message_id)
        except DeskUnreachableError as exc:  # kept: it is read, its answer not waited for
            return _error_with(503, "message_kept", f"the message ({message_id}) is kept and "
                               f"will be read once; its answer could not be waited for: "
                               f"{exc}. Do not send it again", kept=True, id=message_id,
                               idempotency_key=key)
        answer["reply"] = reply.model_dump()
        return json_response(answer, 200)
    raise ApiError(504, "no_reply", f"no answer within {body.timeout:g} s; the message "
                   f"({message_id}) was delivered and the desk will still answer it")


def _idempotency_key(request: Request, body: _MessageBody) -> str:
    """The client's idempotency key (the ``Idempotency-Key`` header or the body's
    ``idempotency_key``), or a new one the answer names when the message was not kept."""
    header = request.headers.get("idempotency-key")
    if header is not None and not re.match(_IDEMPOTENCY_KEY, header):
        raise ApiError(400, "invalid_parameter", "the Idempotency-Key header: 1 to 128 "
                       "letters, digits, '.', '_', ':' or '-'")
    if header is not None and body.idempotency_key not in (None, header):
        raise ApiError(400, "invalid_parameter", "the Idempotency-Key header and the body's "
                       "idempotency_key differ; send one")
    return header or body.idempotency_key or uuid.uuid4().hex


def _not_kept(desk: str, message_id: str, key: str, exc: MessageNotKeptError) -> Response:
    """503 saying the truth: not kept (send it again), or not known (sending it again with
    the same key is safe, as it is kept once)."""
    if exc.kept is False:
        return _error_with(503, "message_not_kept", f"the message to {desk} was not kept "
                           f"({exc}); send it again, with Idempotency-Key: {key}",
                           kept=False, id=message_id, idempotency_key=key)
    return _error_with(503, "message_not_confirmed", f"the message to {desk} may or may not "
                       f"have been kept ({exc}); sending it again with Idempotency-Key: {key} "
                       "is safe: it is kept and read once either way",
                       kept=None, id=message_id, idempotency_key=key)


def _error_with(status: int, code: str, message: str, **fields: Any) -> Response:
    return json_response({"error": {"status": status, "code": code, "message": message,
                                    **fields}}, status)


def _shortened(control: DeskControl, desk: str, text: str) -> dict[str, Any] | None:
    """Whether the desk's model reads the message whole; if not, what it reads and why."""
    limit = control.message_limit(desk)
    if limit is None or len(text) + _OPERATOR_FRAME_CHARS <= limit:
        return None
    return {"message_chars": len(text), "limit_chars": limit,
            "note": f"The message is {len(text):,} characters; this desk's model reads at most "
                    f"{limit:,} of one message (its context window), so the middle was cut in "
                    "what it is sent. The whole message is stored."}


async def _message_body(request: Request, max_chars: int, max_image_bytes: int) -> _MessageBody:
    """A message's body: room for the longest text and, when it carries pictures, for
    four of the largest."""
    # Room for the longest message however a client escapes it (an emoji sent as two
    # \uXXXX escapes is 12 bytes): the character limit is the one that counts.
    text_room = max_chars * 12 + 4096
    image_room = MAX_IMAGES_PER_MESSAGE * ((max_image_bytes + 2) // 3 * 4 + 1024)
    try:
        raw = await _raw_body(request, text_room + image_room)
    except ApiError as exc:
        raise ApiError(413, "body_too_large",
                       f"the request body is over {text_room + image_room:,} bytes: a message "
                       f"carries at most {MAX_IMAGES_PER_MESSAGE} pictures of at most "
                       f"{max_image_bytes:,} bytes each (operator.max_image_bytes)") from exc
    if len(raw) > text_room and b'"images"' not in raw:
        raise ApiError(400, "body_too_large", f"the request body is over {text_room} bytes")
    if len(raw) > _LARGE_BODY:
        return await anyio.to_thread.run_sync(_parsed, raw, _MessageBody)
    return _parsed(raw, _MessageBody)


async def _images(body: _MessageBody, max_bytes: int, source: str) -> list[ImageBlock]:
    """The message's pictures decoded, each checked for its declared type and its size
    (the desk then checks what it really is, and sizes it)."""
    blocks: list[ImageBlock] = []
    for index, image in enumerate(body.images):
        where = f"images[{index}]"
        if image.media_type not in OPERATOR_MEDIA_TYPES:
            raise ApiError(400, "unsupported_image",
                           f"{where}: media_type {image.media_type[:100]!r} is not accepted; "
                           f"send {', '.join(OPERATOR_MEDIA_TYPES)}")
        # Refused by its length before decoding: base64 holds 3 bytes in 4 characters.
        if len(image.data) // 4 * 3 > max_bytes + 2:
            raise ApiError(413, "image_too_large",
                           f"{where} is about {len(image.data) // 4 * 3:,} bytes; the limit is "
                           f"{max_bytes:,} bytes (operator.max_image_bytes)")
        try:
            data = await anyio.to_thread.run_sync(
                functools.partial(base64.b64decode, image.data, validate=True))
        except (binascii.Error, ValueError):
            raise ApiError(400, "not_an_image",
                           f"{where}.data is not base64 (send the file's bytes base64-encoded, "
                           "without a data: prefix)") from None
        if not data:
            raise ApiError(400, "not_an_image", f"{where}.data is empty")
        if len(data) > max_bytes:
            raise ApiError(413, "image_too_large",
                           f"{where} is {len(data):,} bytes; the limit is {max_bytes:,} bytes "
                           "(operator.max_image_bytes)")
        name = " ".join(_utf8_text(f"{where}.name", image.name).split())
        description = f"picture from {source}" + (f" ({name})" if name else "")
        blocks.append(ImageBlock(data, image.media_type, description))
    return blocks


@_endpoint
async def _compact(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    compacted = await service.control.compact(desk)
    return json_response({"desk": desk, "compacted": compacted})


@_endpoint
async def _pause(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    body = await _json_body(request, _ControlBody, 16_384)
    _utf8_text("reason", body.reason)
    paused = await service.control.pause(desk, _actor(request),
                                         body.reason.strip() or "no reason given")
    status = await service.control.desk_status(desk)
    return json_response({"desk": desk, "changed": paused, "status": status.model_dump()})


@_endpoint
async def _resume(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    await _json_body(request, _ControlBody, 16_384)  # checked; its operator is not used
    before = await service.control.desk_status(desk)
    if before.paused_reason.startswith(f"paused by {SPEND_CAP} "):
        _require(request, "owner", "resuming a desk a spend cap paused (lifting the cap)")
    waiting = await service.control.resume(desk, _actor(request))
    status = await service.control.desk_status(desk)
    return json_response({"desk": desk, "changed": waiting is not None,
                          "waiting": waiting or 0, "status": status.model_dump()})


@_endpoint
async def _cancel(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    body = await _json_body(request, _ControlBody, 16_384)
    cancelled = service.control.cancel_turn(desk, _actor(request), now=body.now)
    return json_response({"desk": desk, "cancelled": cancelled, "now": body.now})


@_endpoint
async def _retry(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    await _json_body(request, _ControlBody, 16_384)  # checked; its operator is not used
    dropped = await service.control.retry(desk, _actor(request))
    return json_response({"desk": desk, "retried": True, "dropped": dropped})


@_endpoint
async def _kill_switch(request: Request) -> Response:
    service = _service(request)
    body = await _json_body(request, _KillSwitchBody, 16_384)
    _utf8_text("reason", body.reason)
    if body.desk is not None:
        _desk(request, body.desk)
    _audit_desk(request, body.desk or "*")
    if body.on and not body.reason.strip():
        raise ApiError(400, "reason_required", "say why the kill switch goes on (reason): "
                       "every refused order quotes it")
    if not body.on and (body.cancel_orders or body.flatten):
        raise ApiError(400, "bad_request", "cancel_orders and flatten go with on: true")
    result = await service.control.set_kill_switch(
        body.on, desk=body.desk, by=_actor(request),
        reason=redact_secrets(body.reason.strip()),
        cancel_orders=body.cancel_orders, flatten=body.flatten)
    return json_response(result)


@_endpoint
async def _reduce_only(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    body = await _json_body(request, _ReduceOnlyBody, 16_384)
    _utf8_text("reason", body.reason)
    if not body.on:
        held = (await service.control.desk_status(desk)).reduce_only
        if held is not None and held.get("by") == SPEND_CAP:
            _require(request, "owner", "lifting reduce-only a spend cap set")
    result = await service.control.set_reduce_only(
        body.on, desk=desk, by=_actor(request),
        reason=redact_secrets(body.reason.strip()))
    status = await service.control.desk_status(desk)
    return json_response({**result, "status": status.model_dump()})


@_endpoint
async def _reload(request: Request) -> Response:
    service = _service(request)
    await _json_body(request, _ControlBody, 16_384)  # checked; its operator is not used
    try:
        changes = await service.control.reload(_actor(request))
    except ConfigError as exc:
        raise ApiError(400, "config_invalid", f"nothing changed: {exc}") from None
    return json_response({"ok": True, "changes": changes})


class _PinBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str = Field(max_length=MAX_PIN_CHARS * 2)
    operator: str = Field(default="operator", min_length=1, max_length=64,
                          pattern=r"^[\w .@+-]+$")


def _pin_control(service: OperatorService) -> PinControl:
    control = service.control
    if not isinstance(control, PinControl):
        raise ApiError(501, "not_supported", "standing instructions are not kept by a "
                       "daemon of a fleet yet; pin on a daemon that runs alone")
    return control


@_endpoint
async def _pins(request: Request) -> Response:
    desk = _desk(request)
    return json_response(await _pin_control(_service(request)).pinned(desk))


@_endpoint
async def _pin(request: Request) -> Response:
    control = _pin_control(_service(request))
    desk = _desk(request)
    body = await _json_body(request, _PinBody, 64_000)
    _utf8_text("text", body.text)
    _audit_desk(request, desk)
    by = _actor(request)
    try:
        return json_response(await control.pin(desk, redact_secrets(body.text), by), 201)
    except PinRefusedError as exc:
        raise ApiError(400, exc.code, str(exc)) from None


@_endpoint
async def _unpin(request: Request) -> Response:
    control = _pin_control(_service(request))
    desk = _desk(request)
    pin_id = _bounded_int("pin id", request.path_params["pin_id"], 1, _MAX_ID)
    await _json_body(request, _ControlBody, 16_384)  # checked; its operator is not used
    _audit_desk(request, desk)
    by = _actor(request)
    try:
        return json_response(await control.unpin(desk, pin_id, by))
    except UnknownPinError as exc:
        raise ApiError(404, "unknown_pin", str(exc)) from None


@_endpoint
async def _kill_switches(request: Request) -> Response:
    service = _service(request)
    return json_response({"halts": service.control.kill_switch_halts()})


@_endpoint
async def _transcript(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    before = _int_param(request, "before")
    limit = _int_param(request, "limit", default=50, minimum=1, maximum=500)
    assert limit is not None
    messages = await service.control.transcript(desk, before=before, limit=limit)
    return json_response({"desk": desk, "messages": messages})


@_endpoint
async def _equity(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    return json_response({"desk": desk, "points": await service.equity.curve(desk)})


_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _since_param(request: Request) -> date | None:
    """``?since=YYYY-MM-DD`` as a date (a UTC day), None when not given."""
    text = request.query_params.get("since")
    if not text:
        return None
    try:
        if not _DAY.match(text):
            raise ValueError(text)
        return date.fromisoformat(text)
    except ValueError:
        raise ApiError(400, "invalid_parameter",
                       f"since must be a date as YYYY-MM-DD (a UTC day), not {text[:40]!r}"
                       ) from None


def _flag_param(request: Request, name: str) -> bool:
    text = request.query_params.get(name, "0").lower()
    if text not in ("1", "true", "yes", "0", "false", "no", ""):
        raise ApiError(400, "invalid_parameter", f"{name} must be 1 or 0, not {text[:40]!r}")
    return text in ("1", "true", "yes")


@_endpoint
async def _positions(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    return json_response(await service.control.books(desk, "positions"))


@_endpoint
async def _orders(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    every = _flag_param(request, "all")
    return json_response(await service.control.books(desk, "orders", open_only=not every))


@_endpoint
async def _trades(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    since = _since_param(request)
    open_only = _flag_param(request, "open")
    return json_response(await service.control.books(desk, "trades", since=since,
                                                     open_only=open_only))


@_endpoint
async def _profit(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    since = _since_param(request)
    period = request.query_params.get("period") or "daily"
    if period not in ("daily", "weekly"):
        raise ApiError(400, "invalid_parameter",
                       f"period must be daily or weekly, not {period[:40]!r}")
    return json_response(await service.control.books(desk, "profit", since=since,
                                                     period=period))


@_endpoint
async def _cancel_order(request: Request) -> Response:
    service = _service(request)
    desk = _desk(request)
    order_id = request.path_params["order_id"]
    await _json_body(request, _DecisionBody, 16_384)  # checked; its operator is not used
    return json_response(await service.control.cancel_order(desk, order_id,
                                                             _actor(request)))


@_endpoint
async def _list_approvals(request: Request) -> Response:
    service = _service(request)
    desk_param = request.query_params.get("desk")
    desk = _desk(request, desk_param) if desk_param else None
    return json_response({"approvals": await service.approvals.listed(desk)})


@_endpoint
async def _approve(request: Request) -> Response:
    return await _decide(request, "approved")


@_endpoint
async def _deny(request: Request) -> Response:
    return await _decide(request, "denied")


async def _decide(request: Request, decision: Decision) -> Response:
    service = _service(request)
    approval_id = request.path_params["approval_id"]
    await service.approvals.check(approval_id)  # 404 before reading the body
    body = await _json_body(request, _DecisionBody, 16_384)
    _utf8_text("reason", body.reason)
    approval = await service.approvals.decide(approval_id, decision,
                                              _actor(request),
                                              redact_secrets(body.reason))
    if isinstance(approval.get("desk"), str):
        _audit_desk(request, approval["desk"])
    return json_response({"approval": approval})


@_endpoint
async def _events(request: Request) -> Response:
    service = _service(request)
    desk_param = request.query_params.get("desk")
    desk = _desk(request, desk_param) if desk_param else None
    follow_text = request.query_params.get("follow", "1").lower()
    if follow_text not in ("1", "true", "yes", "0", "false", "no"):
        raise ApiError(400, "invalid_parameter", "follow must be 1 or 0")
    follow = follow_text in ("1", "true", "yes")
    cursor: int | None
    last_event_id = request.headers.get("last-event-id")
    if last_event_id:
        # Checked here, before the 200: a bad id inside the stream could only cut it off.
        cursor = _bounded_int("Last-Event-ID", last_event_id, 0, _MAX_ID)
    else:
        cursor = _int_param(request, "after")
        if cursor is None:
            tail = _int_param(request, "tail", default=0, maximum=100_000)
            cursor = service.hub.tail_cursor(tail or 0, desk) if tail else None
    if cursor is None:
        # "From now" becomes an explicit position when there is one, and the client is told
        # it: a stream that drops before its first event then resumes here, missing nothing.
        cursor = service.hub.last_id
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if cursor is not None:
        headers[STREAM_CURSOR_HEADER] = str(cursor)
    frames = sse_frames(service.hub, service.control.events_since, cursor=cursor, desk=desk,
                        follow=follow, keepalive_seconds=service.keepalive_seconds,
                        linger_seconds=service.linger_seconds)
    return StreamingResponse(frames, media_type="text/event-stream", headers=headers)


@_endpoint
async def _metrics(request: Request) -> Response:
    metrics: DaemonMetrics = request.app.state.metrics
    return Response(await metrics.render(), media_type=METRICS_CONTENT_TYPE)


@_endpoint
async def _me(request: Request) -> Response:
    operator = _operator(request)
    return json_response({"name": operator.name, "role": operator.role,
                          "surface": _surface(request)})


@_endpoint
async def _stream_ticket(request: Request) -> Response:
    service = _service(request)
    ticket = service.tickets.issue(_operator(request))
    return json_response({"ticket": ticket, "expires_in": service.tickets.seconds})


@_endpoint
async def _audit(request: Request) -> Response:
    service = _service(request)
    desk = request.query_params.get("desk") or None
    since_text = request.query_params.get("since")
    since: datetime | None = None
    if since_text:
        try:
            since = datetime.fromisoformat(since_text)
        except ValueError:
            raise ApiError(400, "invalid_parameter", "since must be an ISO 8601 time such as "
                           f"2026-12-05T09:00:00+00:00, not {since_text[:40]!r}") from None
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
    limit = _int_param(request, "limit", default=200, minimum=1, maximum=5000)
    assert limit is not None
    entries = await service.audit.actions(desk=desk, since=since, limit=limit)
    return json_response({"actions": [entry.as_json() for entry in entries]})


def _guarded(handler: _Handler, needed: Role | None, action: str | None) -> _Handler:
    """``handler`` behind its route's role (403 ``forbidden_role`` naming the role needed),
    its outcome recorded in the audit when it is an action."""

    async def endpoint(request: Request) -> Response:
        operator = _operator(request)
        if needed is not None and not allows(operator.role, needed):
            response = _role_refusal(operator, needed, f"{request.method} {request.url.path}")
        else:
            response = await handler(request)
        if action is not None:
            await _record(request, operator, action, response)
        return response

    return endpoint


async def _record(request: Request, operator: Operator, action: str,
                  response: Response) -> None:
    status = response.status_code
    outcome: Outcome = "ok" if status < 400 else "refused" if status < 500 else "error"
    detail = str(status)
    body = getattr(response, "body", None)
    if status >= 400 and isinstance(body, bytes):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            detail += " " + str(json.loads(body)["error"]["code"])
    desk = str(request.scope.get(_AUDIT_DESK_KEY) or request.path_params.get("desk") or "")
    who = str(request.scope.get(_ACTOR_KEY) or operator.name)
    entry = AuditEntry(datetime.now(UTC), who, operator.role, action, desk,
                       _surface(request), outcome, detail)
    try:
        await _service(request).audit.record_action(entry)
    except Exception as exc:  # the action is done: its answer must still reach the client
        _log.error("operator_audit_not_kept", action=action, who=who, desk=desk,
                   error=repr(exc))


async def _index(request: Request) -> Response:
    return FileResponse(WEB_DIR / "index.html", headers=_PAGE_HEADERS)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    return _error(exc.status_code, code, message, dict(exc.headers or {}))


# --------------------------------------------------------------------------- authentication


_TICKET_ROUTE = ("GET", "/api/events")
"""The one request that may carry a credential in its URL, a stream ticket (``?ticket=``):
a browser's EventSource cannot send headers."""

_UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="trading-agent"'}


class _Authorize:
    """Decides who each request is (:class:`Operator`) and leaves it in the ASGI scope for
    the routes' roles (:func:`_guarded`); sets the page's security headers on every answer.

    The Unix socket's peer is an owner named after its OS user (:data:`SOCKET_PEER_KEY`,
    which the server sets per connection). On TCP every ``/api`` and
    ``/metrics`` request needs a bearer token (``Authorization: Bearer``) of a known
    operator, or, on ``GET /api/events`` alone, a stream ticket (``?ticket=``); a token in
    a URL (``?token=``) opens nothing (401 saying so).
    """

    def __init__(self, app: ASGIApp, credentials: Credentials | None,
                 tickets: StreamTickets) -> None:
        self._app = app
        self._credentials = credentials
        self._tickets = tickets
        self._socket_owner = socket_operator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        send = _with_page_headers(send)
        if self._credentials is None:
            scope[_LISTENER_KEY] = "socket"
            scope[_OPERATOR_KEY] = scope.get(SOCKET_PEER_KEY, self._socket_owner)
        else:
            scope[_LISTENER_KEY] = "tcp"
            path = scope["path"]
            if path.startswith("/api") or path == "/metrics":
                operator, refusal = self._identify(scope)
                if operator is None:
                    response = _error(401, "unauthorized", refusal, _UNAUTHORIZED)
                    await response(scope, receive, send)
                    return
                scope[_OPERATOR_KEY] = operator
            else:  # the page and its files: no data, anyone the listener lets in
                scope[_OPERATOR_KEY] = Operator("anonymous", "viewer")
        await self._app(scope, receive, send)

    def _identify(self, scope: Scope) -> tuple[Operator | None, str]:
        """The operator the request's credential names, or None and why it is refused."""
        assert self._credentials is not None
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if "token" in query:
            return None, ("a token never goes in a URL (?token=): send it as Authorization: "
                          "Bearer <token>; the event stream takes a ticket from POST "
                          "/api/stream-ticket as ?ticket=")
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    operator = self._credentials.identify(credentials.strip())
                    if operator is not None:
                        return operator, ""
                break
        tickets = query.get("ticket")
        if tickets:
            if (scope["method"], scope["path"]) != _TICKET_ROUTE:
                return None, "a stream ticket opens GET /api/events and nothing else"
            operator = self._tickets.redeem(tickets[-1])
            if operator is not None:
                return operator, ""
            return None, ("the stream ticket is unknown or expired (each is valid "
                          f"{self._tickets.seconds:g} s): ask POST /api/stream-ticket for "
                          "another")
        return None, ("a valid bearer token is required (Authorization: Bearer <token>; "
                      "the event stream also takes ?ticket= from POST /api/stream-ticket)")


def _with_page_headers(send: Send) -> Send:
    """``send`` that adds the page's security headers to every answer (the page, its
    ``/static/`` files and the API's JSON alike), leaving any the answer set itself."""

    async def sending(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            present = {name.lower() for name, _ in headers}
            for name, value in _PAGE_HEADER_BYTES:
                if name not in present:
                    headers.append((name, value))
            message = {**message, "headers": headers}
        await send(message)

    return sending


_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class _SameOriginJson:
    """Refuses a request that may change something (a POST; any method but GET, HEAD and
    OPTIONS) unless its body is JSON and, if it names an ``Origin``, it comes from the API's
    own (the TCP listener).

    A page on another site can make a browser send a form (URL-encoded, multipart, or
    ``text/plain``, which can spell a JSON object) or a body-less fetch, but never a JSON
    body without asking first (a CORS preflight, which this API never grants); and the
    browser names that page's origin in ``Origin``. So: 415 for a body not declared
    ``application/json`` (a POST with no body at all may leave the type out), 403 for a
    foreign ``Origin``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in _SAFE_METHODS:
            refusal = _cross_site_refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _cross_site_refusal(scope: Scope) -> Response | None:
    """A 403 for a foreign ``Origin``, a 415 for a body that is not JSON, or None."""
    headers: dict[bytes, list[bytes]] = {}
    for name, value in scope.get("headers", ()):
        headers.setdefault(name, []).append(value)
    origins = headers.get(b"origin", [])
    hosts = headers.get(b"host", [])
    if origins and not (len(hosts) == 1
                        and all(_same_origin(origin, hosts[0]) for origin in origins)):
        shown = origins[0].decode("latin-1")[:200]
        return _error(403, "cross_origin",
                      f"a request from {shown!r} may not change anything here: only this "
                      "API's own page may (Origin must match the Host it was sent to)")
    types = headers.get(b"content-type", [])
    lengths = headers.get(b"content-length", [])
    has_body = b"transfer-encoding" in headers or any(v.strip() != b"0" for v in lengths)
    if types or has_body:
        media = [t.partition(b";")[0].strip().lower() for t in types]
        if media != [b"application/json"]:
            given = types[0].decode("latin-1")[:100] if types else "none"
            return _error(415, "unsupported_media_type",
                          f"a request body must be JSON with Content-Type: application/json "
                          f"(this one's type: {given})")
    return None


def _same_origin(origin: bytes, host: bytes) -> bool:
    """Whether an ``Origin`` (``http://127.0.0.1:8765``) names the ``Host`` a request was
    sent to (``127.0.0.1:8765``); a default port may be written or left out."""
    scheme, separator, authority = origin.decode("latin-1").lower().partition("://")
    if not separator or scheme not in ("http", "https") or not authority:
        return False  # "null" (a sandboxed frame or a file) among others
    default = ":443" if scheme == "https" else ":80"
    return authority.removesuffix(default) == host.decode("latin-1").lower().removesuffix(
        default)


_ROUTES: tuple[tuple[str, str, _Handler], ...] = (
    ("GET", "/", lambda request: _index(request)),
    ("GET", "/api/health", _health),
    ("GET", "/api/me", _me),
    ("POST", "/api/stream-ticket", _stream_ticket),
    ("GET", "/api/desks", _list_desks),
    ("GET", "/api/desks/{desk}", _get_desk),
    ("POST", "/api/desks/{desk}/messages", _post_message),
    ("POST", "/api/desks/{desk}/compact", _compact),
    ("POST", "/api/desks/{desk}/pause", _pause),
    ("POST", "/api/desks/{desk}/resume", _resume),
    ("POST", "/api/desks/{desk}/reduce_only", _reduce_only),
    ("POST", "/api/desks/{desk}/cancel", _cancel),
    ("POST", "/api/desks/{desk}/retry", _retry),
    ("GET", "/api/desks/{desk}/pins", _pins),
    ("POST", "/api/desks/{desk}/pins", _pin),
    ("DELETE", "/api/desks/{desk}/pins/{pin_id}", _unpin),
    ("GET", "/api/kill-switch", _kill_switches),
    ("POST", "/api/kill-switch", _kill_switch),
    ("POST", "/api/reload", _reload),
    ("GET", "/api/desks/{desk}/transcript", _transcript),
    ("GET", "/api/desks/{desk}/equity", _equity),
    ("GET", "/api/desks/{desk}/positions", _positions),
    ("GET", "/api/desks/{desk}/orders", _orders),
    ("POST", "/api/desks/{desk}/orders/{order_id}/cancel", _cancel_order),
    ("GET", "/api/desks/{desk}/trades", _trades),
    ("GET", "/api/desks/{desk}/profit", _profit),
    ("GET", "/api/approvals", _list_approvals),
    ("POST", "/api/approvals/{approval_id}/approve", _approve),
    ("POST", "/api/approvals/{approval_id}/deny", _deny),
    ("GET", "/api/events", _events),
    ("GET", "/api/audit", _audit),
)
"""Every route but ``/metrics`` and ``/static``; each needs its entry in
:data:`~trading_agent.operator.route_roles.ROUTE_ROLES`."""


def create_app(service: OperatorService, *, credentials: Credentials | None = None,
               metrics: DaemonMetrics | None = None) -> ASGIApp:
    """The ASGI app for one listener.

    Args:
        service: The daemon, approvals, stream and settings the handlers use.
        credentials: The operators' bearer tokens (TCP): every ``/api`` request must carry
            one, and every POST must prove it is no cross-site one (JSON, its own
            ``Origin``); None for the Unix socket (its file mode lets in the machine's own
            user, an owner).
        metrics: The daemon's metrics, served at ``GET /metrics``; None for no such route.

    Returns:
        The app.

    Raises:
        ValueError: A route has no role in ``ROUTE_ROLES``, or TCP credentials hold none.
    """
    served = list(_ROUTES)
    if metrics is not None:
        served.append(("GET", "/metrics", _metrics))
    routes: list[Route | Mount] = []
    for method, path, handler in served:
        if (method, path) not in ROUTE_ROLES:
            raise ValueError(f"{method} {path} has no role in ROUTE_ROLES")
        needed, action = ROUTE_ROLES[(method, path)]
        routes.append(Route(path, _guarded(handler, needed, action), methods=[method]))
    routes.append(Mount("/static", StaticFiles(directory=WEB_DIR), name="static"))
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.service = service
    app.state.metrics = metrics
    if credentials is not None and not credentials.tokens:
        raise ValueError("a TCP listener without any token would let anyone in")
    inner: ASGIApp = app if credentials is None else _SameOriginJson(app)
    return _Authorize(inner, credentials, service.tickets)
