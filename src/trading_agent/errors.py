"""The project's exceptions, one tree.

::

    TradingAgentError
    ├── BackendError                     the model server failed
    │   ├── CacheMissError §             a strict backtest cache has no recorded answer
    │   ├── BackendUnavailableError      still failing after every retry
    │   ├── TransientBackendError        worth retrying (429, 5xx, timeout, dropped stream)
    │   └── ContextOverflowError         the prompt is longer than the model's window
    ├── ToolError                        a tool refuses; its message goes back to the model
    │   └── RiskLimitError               an order breaks a desk's risk limit
    ├── ExchangeError                    the exchange failed
    │   ├── ExchangeUnavailableError     network, timeout or rate limit, after retries
    │   └── OrderRejectedError           the exchange refused the order (funds, symbol...)
    ├── StoreError                       the store (SQLite or PostgreSQL) failed
    │   ├── StorageFullError             the disk (or database) holding the store is full
    │   └── FencedError ◊                this daemon no longer holds the desk: write refused
    ├── FleetError ◆                     the fleet's NATS failed
    │   ├── FleetUnavailableError ◆      NATS cannot be reached now
    │   └── DeskUnreachable ◆            no daemon answered for a desk
    ├── SealRefused ◈                    a fleet message unsealed, forged, stale or replayed
    ├── DeskUnreachableError ○           the daemon holding a desk could not be asked
    ├── UnknownOrderError ○              a desk has no open order of that id
    ├── CancelRefusedError ○             an operator's cancel of one order cannot be done
    ├── MessageNotKeptError ○            an operator's message may not have been kept
    ├── RetryRefusedError                an operator's retry cannot be done now (says why)
    ├── PinRefusedError ◇                a standing instruction cannot be pinned (says why)
    ├── UnknownPinError ◇                a desk has no pinned instruction of that id
    ├── ActionRefusedError ¶             a Telegram command cannot be done as asked (says why)
    │   └── NeedsRoleError ¶             what was asked needs a higher role than the command's
    ├── McpServerError ▲                 an MCP server could not be started, reached or read
    ├── ConfigError                      a configuration file or variable is wrong
    │   └── CacheFileError §             a backtest's response cache file is unreadable
    ├── ImageRejectedError ⁑             a picture an operator or tool sent cannot be used
    ├── ApprovalError †                  an approve or deny could not be applied
    │   ├── UnknownApprovalError †       no approval of that id (also a LookupError)
    │   └── ApprovalAlreadyResolvedError †  answered, timed out or cancelled already
    └── OperatorClientError ‡            the operator API could not be used
        ├── DaemonNotRunningError ‡      nothing listens where the daemon should
        └── OperatorRequestError ‡       the API refused a request (status, code)

Defined where they are raised, not here: ``†`` in :mod:`trading_agent.operator.approvals`, ``‡`` in
:mod:`trading_agent.operator.client`, ``§`` in :mod:`trading_agent.backtest.cache`, ``⁑`` in
:mod:`trading_agent.agent.image_preparer`, ``◊`` in :mod:`trading_agent.store.fencing`, ``◆``
in :mod:`trading_agent.fleet.bus`, ``◈`` in :mod:`trading_agent.fleet.sealing`, ``○`` in
:mod:`trading_agent.daemon.control`, ``▲`` in :mod:`trading_agent.tools.mcp`, ``◇`` in
:mod:`trading_agent.daemon.pins`, ``¶`` in :mod:`trading_agent.telegram.actions`.

Outside the tree on purpose: :class:`trading_agent.operator.api.ApiError` (an HTTP refusal
the operator API turns into its JSON answer, never seen outside it) and
:class:`trading_agent.daemon.control.UnknownDeskError` (a ``KeyError``: a lookup of a desk
name that does not exist).

Each error carries what a reader needs to act on it (desk, model, status code, limit).
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "ConfigError",
    "ContextOverflowError",
    "ExchangeError",
    "ExchangeUnavailableError",
    "OrderRejectedError",
    "RetryRefusedError",
    "RiskLimitError",
    "StorageFullError",
    "StoreError",
    "ToolError",
    "TradingAgentError",
    "TransientBackendError",
]


class TradingAgentError(Exception):
    """The root of every error this project raises on purpose."""


class BackendError(TradingAgentError):
    """The model server failed.

    Args:
        message: What went wrong, readable by an operator.
        status_code: The HTTP status, when there was one.
        model: The model that was asked.
    """

    def __init__(self, message: str, *, status_code: int | None = None, model: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.model = model

    def __str__(self) -> str:
        parts = [self.message]
        if self.status_code is not None:
            parts.append(f"(HTTP {self.status_code})")
        if self.model:
            parts.append(f"[model {self.model}]")
        return " ".join(parts)


class TransientBackendError(BackendError):
    """A failure worth retrying: rate limits, server errors, timeouts, broken streams.

    Args:
        message: What went wrong.
        status_code: The HTTP status, or None for a network failure.
        model: The model that was asked.
        retry_after: Seconds the server asked us to wait, when it said.
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        model: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status_code=status_code, model=model)
        self.retry_after = retry_after


class BackendUnavailableError(BackendError):
    """The model could not be reached, even after every retry."""


class ContextOverflowError(BackendError):
    """The server refused the prompt because it is longer than the model's window."""


class ToolError(TradingAgentError):
    """Raised by a tool to refuse; the message is what the model reads."""


class RiskLimitError(ToolError):
    """An order would break one of the desk's risk limits.

    Args:
        limit: The name of the limit, as in the config (``max_order_notional``).
        message: The limit and the numbers, readable by the model.
    """

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


class ExchangeError(TradingAgentError):
    """The exchange failed."""


class ExchangeUnavailableError(ExchangeError):
    """The exchange could not be reached (network, timeout, rate limit) after retries."""


class OrderRejectedError(ExchangeError):
    """The exchange refused an order or a symbol: funds, size, unknown market."""


class StoreError(TradingAgentError):
    """The store (SQLite or PostgreSQL) failed."""


class StorageFullError(StoreError):
    """The disk holding the store (or the database server's) is full: nothing more can be
    written until space is freed; what was stored before is intact.

    Args:
        message: What could not be written and where.
        location: Where space must be freed (the state directory, or the database).
    """

    def __init__(self, message: str, location: str) -> None:
        super().__init__(message)
        self.location = location


class RetryRefusedError(TradingAgentError):
    """An operator's retry cannot be done now; the message says why and what to do."""


class ConfigError(TradingAgentError):
    """A configuration file or variable is wrong.

    Args:
        message: Every problem, one a line, each naming the file, the key and what is allowed.
    """
