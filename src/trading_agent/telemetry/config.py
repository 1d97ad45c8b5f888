"""The settings of the daemon's telemetry: OpenTelemetry traces and webhooks.

Two tables of the config file, embedded by :class:`~trading_agent.settings.Settings`::

    [telemetry]
    otlp_endpoint = "http://127.0.0.1:4318"   # none: no traces are set up at all
    otlp_headers_env = "OTLP_HEADERS"         # holds "authorization=Bearer abc,x-team=ops"
    service_name = "trading-agent"

    [[webhooks]]
    url = "https://hooks.example.com/trading"
    events = ["fill", "approval_requested", "kill_switch", "desk_paused", "error",
              "spend_alert"]
    secret_env = "TRADING_AGENT_WEBHOOK_SECRET"

Secrets never appear in the file: a key that needs one names the environment variable that
holds it, as everywhere else in the settings.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

__all__ = ["WEBHOOK_EVENTS", "TelemetrySettings", "WebhookEvent", "WebhookSettings"]

WebhookEvent = Literal["fill", "approval_requested", "kill_switch", "desk_paused", "error",
                       "spend_alert", "reduce_only", "storage", "pins_changed"]
"""What a webhook can ask for:

- ``fill``: an order filled (``place_order`` answered that it filled, or an ``order_filled``
  event);
- ``approval_requested``: a dangerous tool call waits for an operator;
- ``kill_switch``: a kill switch went on or off;
- ``desk_paused``: a desk stopped taking turns (an operator, or a spend cap);
- ``error``: a desk's turn or a service failed, or the model was unreachable;
- ``spend_alert``: a daily spend cap is 80% used, or used up;
- ``reduce_only``: a desk went into reduce-only (an operator, a protection, a spend cap) or
  out of it;
- ``storage``: the disk holding the store became full (nothing more is stored until space
  is freed), or writes got through again;
- ``pins_changed``: an operator pinned a standing instruction to a desk, or took one off
  (the event names who, the desk, the pin's id and its text).
"""

WEBHOOK_EVENTS: tuple[str, ...] = ("fill", "approval_requested", "kill_switch", "desk_paused",
                                   "error", "spend_alert", "reduce_only", "storage",
                                   "pins_changed")
"""Every :data:`WebhookEvent`, in a fixed order."""


def _no_bool(value: Any) -> Any:
    # pydantic would read ``true`` as 1; a number given as a boolean is a mistake.
    if isinstance(value, bool):
        raise ValueError("a number is needed, not true or false")
    return value


_Seconds = Annotated[float, BeforeValidator(_no_bool), Field(gt=0, le=300, allow_inf_nan=False)]


def _check_http_url(value: str, what: str, example: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        # The value is not repeated: a webhook URL's path may be a credential.
        raise ValueError(f"{what} must be an http:// or https:// URL with a host, such as "
                         f"{example}")
    return value


class _Strict(BaseModel):
    """A config table: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class TelemetrySettings(_Strict):
    """OpenTelemetry traces of every turn, model call and tool call (``[telemetry]``).

    Attributes:
        otlp_endpoint: The OTLP/HTTP collector, such as ``http://127.0.0.1:4318`` (spans go to
            ``/v1/traces`` under it; a URL already ending in ``/v1/traces`` is used as it
            is). None: no tracer is built and nothing is exported.
        otlp_headers_env: The environment variable holding headers for the collector, as
            ``key=value`` pairs separated by commas (the ``OTEL_EXPORTER_OTLP_HEADERS``
            format, values percent-encoded), such as an ``authorization`` token. None: none.
        service_name: The ``service.name`` of the spans' resource.
        export_timeout_seconds: How long one export to the collector may take.
    """

    otlp_endpoint: str | None = None
    otlp_headers_env: str | None = Field(default=None, min_length=1)
    service_name: str = Field(default="trading-agent", min_length=1)
    export_timeout_seconds: _Seconds = 10.0

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return _check_http_url(value, "the OTLP endpoint", "http://127.0.0.1:4318")

    def traces_url(self) -> str | None:
        """Where spans are posted: the endpoint with ``/v1/traces``; None without one."""
        if self.otlp_endpoint is None:
            return None
        endpoint = self.otlp_endpoint.rstrip("/")
        return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


class WebhookSettings(_Strict):
    """One URL the daemon POSTs chosen events to, signed (``[[webhooks]]``).

    Each delivery is a JSON body signed with HMAC-SHA256 (see
    :mod:`trading_agent.telemetry.webhooks`), retried with exponential backoff on a 5xx, a
    429, a timeout or a refused connection, at most ``max_attempts`` times in all.

    Attributes:
        url: Where to POST (http or https). Only its scheme and host are ever logged: the
            path of many webhook URLs is itself a credential.
        events: The events it wants (at least one).
        secret_env: The environment variable holding the signing secret; the daemon does
            not start when it is unset or empty.
        timeout_seconds: How long one attempt may take.
        max_attempts: Attempts per event, the first included; then it is logged and given up.
        first_backoff_seconds: The wait before the second attempt; it doubles per attempt,
            up to a minute.
        max_queued: Events waiting for this URL; past it new ones are dropped (counted and
            logged), so a slow receiver never holds a desk up nor grows without bound.
    """

    url: str
    events: list[WebhookEvent] = Field(min_length=1)
    secret_env: str = Field(min_length=1)
    timeout_seconds: _Seconds = 10.0
    max_attempts: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=20)] = 5
    first_backoff_seconds: _Seconds = 1.0
    max_queued: Annotated[int, BeforeValidator(_no_bool), Field(ge=1, le=100_000)] = 1000

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return _check_http_url(value, "a webhook URL", "https://hooks.example.com/trading")

    def target(self) -> str:
        """The URL's scheme and host (with its port), safe to log."""
        parts = urlsplit(self.url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}"
