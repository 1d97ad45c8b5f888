"""A real exchange through ``ccxt.async_support``: any ccxt exchange id, live or testnet.

- Credentials come only from the environment variables the config names; they appear in no
  message, log line or repr.
- Markets are loaded once, when the exchange is opened; the HTTP client is closed by
  :meth:`CcxtExchange.close`.
- Reads are retried with exponential backoff on network errors, timeouts and rate limits
  (``RequestTimeout``, ``RateLimitExceeded``, ``DDoSProtection``...), then reported as
  :class:`~trading_agent.errors.ExchangeUnavailableError`.
- Orders are never retried: each one's client order id is committed to the
  :class:`~trading_agent.trading.order_journal.OrderJournal` before it is sent, and when the
  answer is lost the order is looked up by that id, not sent again.
- Orders are refused unless the exchange was built with ``allow_orders=True``, which
  :func:`~trading_agent.trading.factory.open_exchange` does only in live mode.
- With a journal, each of our orders' status and the account's balances are noted as they
  are seen, for :mod:`~trading_agent.trading.reconciliation` on the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from decimal import Decimal, localcontext
from typing import Any, Literal, TypeVar, cast

import anyio
import ccxt
import ccxt.async_support as ccxt_async
import structlog

from trading_agent.errors import (
    ConfigError,
    ExchangeError,
    ExchangeUnavailableError,
    OrderRejectedError,
    StoreError,
)
from trading_agent.trading.ccxt_errors import is_transient, scrub, translate
from trading_agent.trading.config import CcxtExchangeConfig
from trading_agent.trading.exchange import (
    Balance,
    Candle,
    Market,
    Order,
    OrderBook,
    OrderRequest,
    OrderSide,
    OrderStatus,
    OrderType,
    Position,
    ProtectionKind,
    Ticker,
)
from trading_agent.trading.order_journal import OrderJournal
from trading_agent.trading.timing import Clock, Sleep, from_millis, to_millis, utc_now

__all__ = ["CcxtExchange", "protection_held_by"]

T = TypeVar("T")

_log = structlog.get_logger(__name__)

_STATUSES: dict[str, OrderStatus] = {
    "open": "open", "closed": "closed", "canceled": "canceled", "cancelled": "canceled",
    "expired": "expired", "rejected": "rejected",
}
_SPOT_QUOTES = ("USDT", "USDC", "USD", "FDUSD", "EUR", "BTC")
_LOST_AFTER = timedelta(minutes=10)
"""An order the exchange still does not know this long after it was sent was never placed."""


class _RedactingLogger(logging.LoggerAdapter[logging.Logger]):
    """ccxt's logger, with every secret scrubbed from each line.

    ccxt logs each request's headers at DEBUG, and they carry the API key.
    """

    def __init__(self, logger: logging.Logger, secrets: tuple[str, ...]) -> None:
        super().__init__(logger, {})
        self._secrets = secrets

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            text = str(msg) % args if args else str(msg)
            self.logger.log(level, scrub(text, self._secrets), **kwargs)


def _decimal(value: Any) -> Decimal | None:
    if value is None or value == "":
        return None
    return Decimal(str(value))


def _required_decimal(value: Any, what: str) -> Decimal:
    converted = _decimal(value)
    if converted is None:
        raise ExchangeError(f"the exchange's answer has no {what}")
    return converted


class CcxtExchange:
    """A ccxt exchange. Use :meth:`open`.

    Args:
        config: The exchange id, sandbox, credential variable names, retries.
        allow_orders: Whether orders may be created and canceled (live mode only); without
            it the exchange is a read-only source of market data.
        journal: The client order id journal (required with ``allow_orders``).
        environ: Where the credentials are read from (the process environment).
        sleep: How backoff waits (tests pass one that returns at once).
        clock: The clock (the wall clock).

    Raises:
        ConfigError: Unknown exchange id, no sandbox for it, or a credential variable unset.
    """

    def __init__(
        self,
        config: CcxtExchangeConfig,
        *,
        allow_orders: bool = False,
        journal: OrderJournal | None = None,
        environ: Mapping[str, str] | None = None,
        sleep: Sleep = anyio.sleep,
        clock: Clock = utc_now,
    ) -> None:
        if allow_orders and journal is None:
            raise ConfigError("a ccxt exchange that places orders needs an order journal")
        self._config = config
        self._allow_orders = allow_orders
        self._journal = journal
        self._sleep = sleep
        self._clock = clock
        self._name = config.exchange_id + (" testnet" if config.sandbox else "")
        credentials = self._credentials(environ if environ is not None else os.environ) \
            if allow_orders else {}
        self._secrets = tuple(v for v in credentials.values() if v)
        self._client = self._build_client(credentials)
        self._client.logger = _RedactingLogger(logging.getLogger("ccxt"), self._secrets)
        self._markets: dict[str, Market] = {}
        self._balances_noted: Mapping[str, Balance] | None = None

    def _credentials(self, environ: Mapping[str, str]) -> dict[str, str]:
        config = self._config
        wanted = {"apiKey": config.api_key_env, "secret": config.secret_env,
                  "password": config.password_env}
        if not config.api_key_env or not config.secret_env:
            raise ConfigError(f"exchange.ccxt ({config.exchange_id}): live orders need "
                              "api_key_env and secret_env naming environment variables")
        credentials: dict[str, str] = {}
        missing: list[str] = []
        for field_name, variable in wanted.items():
            if variable is None:
                continue
            value = environ.get(variable, "")
            if not value:
                missing.append(variable)
            credentials[field_name] = value
        if missing:
            raise ConfigError("\n".join(
                f"exchange.ccxt ({config.exchange_id}): the environment variable {name} is "
                "not set" for name in missing))
        return credentials

    def _build_client(self, credentials: Mapping[str, str]) -> Any:
        config = self._config
        client_class = getattr(ccxt_async, config.exchange_id, None)
        if config.exchange_id not in ccxt_async.exchanges or client_class is None:
            raise ConfigError(f"exchange.ccxt.exchange_id: ccxt has no exchange "
                              f"{config.exchange_id!r}")
        client = client_class({
            **config.client_settings,
            **credentials,
            # verbose prints every request, API key header included, to stdout.
            "verbose": False,
            "enableRateLimit": config.enable_rate_limit,
            "timeout": int(config.timeout_seconds * 1000),
            # Without a symbol, open orders cost more rate-limit weight; the risk policy
            # needs all of them anyway, so acknowledge it instead of failing.
            "options": {"warnOnFetchOpenOrdersWithoutSymbol": False, **config.options},
        })
        try:
            if config.sandbox:
                client.set_sandbox_mode(True)
            api = client.urls.get("api")
            for key, url in config.api_urls.items():
                if isinstance(api, dict):
                    api[key] = url
                else:
                    client.urls["api"] = url
        except ccxt.NotSupported as exc:
            raise ConfigError(f"exchange.ccxt.sandbox: {config.exchange_id} has no "
                              "testnet in ccxt") from exc
        return client

    @classmethod
    async def open(
        cls,
        config: CcxtExchangeConfig,
        *,
        allow_orders: bool = False,
        journal: OrderJournal | None = None,
        environ: Mapping[str, str] | None = None,
        sleep: Sleep = anyio.sleep,
        clock: Clock = utc_now,
    ) -> CcxtExchange:
        """Builds the client and loads the markets (once); closes the client if that fails.

        When orders are allowed, orders whose answer was lost before a restart are looked
        up by their client order id (best effort).

        Raises:
            ConfigError: See the class.
            ExchangeUnavailableError: The markets could not be loaded after retries.
            ExchangeError: The exchange refused.
        """
        exchange = cls(config, allow_orders=allow_orders, journal=journal, environ=environ,
                       sleep=sleep, clock=clock)
        try:
            await exchange._load_markets()
            if allow_orders:
                # Still unresolved if the exchange is down; the next open tries again.
                with contextlib.suppress(ExchangeUnavailableError):
                    await exchange.reconcile()
        except BaseException:
            await exchange.close()
            raise
        return exchange

    # -- plumbing ------------------------------------------------------------------------

    async def _read(self, action: str, call: Callable[[], Awaitable[T]]) -> T:
        """Runs a read, retrying transient failures with exponential backoff."""
        config = self._config
        for attempt in range(config.read_attempts):
            try:
                return await _contained(call)
            except ccxt.BaseError as exc:
                if not is_transient(exc):
                    raise self._translate(exc, action) from exc
                if attempt == config.read_attempts - 1:
                    raise self._translate(exc, action, attempts=config.read_attempts) from exc
            await self._sleep(min(config.max_backoff_seconds,
                                  config.backoff_seconds * 2 ** attempt))
        raise AssertionError("unreachable")  # pragma: no cover

    def _translate(self, exc: Exception, action: str, attempts: int = 1) -> ExchangeError:
        error = translate(exc, exchange=self._name, action=action, secrets=self._secrets,
                          exchange_id=self._config.exchange_id)
        if attempts > 1:
            return type(error)(f"{error} (after {attempts} attempts)")
        return error

    async def _load_markets(self) -> None:
        raw = await self._read("load markets", self._client.load_markets)
        mode = self._client.precisionMode
        self._markets = {symbol: self._market(market, mode) for symbol, market in raw.items()}

    @staticmethod
    def _market(raw: Mapping[str, Any], mode: int) -> Market:
        precision = raw.get("precision") or {}
        limits = raw.get("limits") or {}

        def step(value: Any) -> Decimal | None:
            if value is None:
                return None
            if mode == ccxt.TICK_SIZE:
                return Decimal(str(value))
            if mode == ccxt.DECIMAL_PLACES:
                return Decimal(1).scaleb(-int(value))
            return None

        return Market(
            symbol=raw["symbol"], base=raw["base"], quote=raw["quote"],
            amount_step=step(precision.get("amount")), price_step=step(precision.get("price")),
            min_amount=_decimal((limits.get("amount") or {}).get("min")),
            min_notional=_decimal((limits.get("cost") or {}).get("min")),
        )

    def _require_market(self, symbol: str) -> None:
        if symbol not in self._markets:
            raise OrderRejectedError(f"{self._name} has no market {symbol}")

    def _require_orders(self, action: str) -> None:
        if not self._allow_orders:
            raise ConfigError(f"{self._name} is open for market data only; {action} needs "
                              'mode = "live" in the exchange config')

    def _order(self, raw: Mapping[str, Any], request: OrderRequest | None = None) -> Order:
        side = raw.get("side") or (request.side if request else None)
        type_ = raw.get("type") or (request.type if request else None)
        fee = raw.get("fee") or {}
        amount = _decimal(raw.get("amount"))
        if amount is None and request is not None:
            amount = request.amount
        timestamp = raw.get("timestamp")
        return Order(
            id=str(raw["id"]),
            client_order_id=str(raw.get("clientOrderId")
                                or (request.client_order_id if request else "")),
            symbol=str(raw.get("symbol") or (request.symbol if request else "")),
            side=cast(OrderSide, side),
            type=cast(OrderType, type_ if type_ in ("market", "limit") else "limit"),
            amount=_required_decimal(amount, "order amount"),
            price=_decimal(raw.get("price")),
            status=_STATUSES.get(str(raw.get("status")), "open"),
            filled=_decimal(raw.get("filled")) or Decimal(0),
            average=_decimal(raw.get("average")),
            fee=_decimal(fee.get("cost")) or Decimal(0),
            fee_currency=fee.get("currency"),
            created_at=from_millis(timestamp) if timestamp else self._clock(),
            trigger_price=_decimal(raw.get("triggerPrice") or raw.get("stopPrice")) or (
                request.trigger_price if request else None),
        )

    # -- reads ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The exchange id, with `` testnet`` in sandbox mode."""
        return self._name

    def now(self) -> datetime:
        """The wall clock."""
        return self._clock()

    @property
    def order_journal(self) -> OrderJournal | None:
        """The client order id journal orders are written to (None for market data only)."""
        return self._journal

    async def markets(self) -> Mapping[str, Market]:
        """The markets loaded when the exchange was opened."""
        return self._markets

    def candle_offer(self, symbol: str) -> tuple[list[str], int | None]:
        """What candles the exchange serves through ccxt.

        Args:
            symbol: The market asked about.

        Returns:
            The timeframes offered (empty when it serves no candles), and the most candles
            one request answers for ``symbol`` when ccxt knows it (its ``features``).
        """
        client = self._client
        if not client.has.get("fetchOHLCV"):
            return [], None
        market: Any = client.markets.get(symbol) or {}
        section: Any = (client.features or {}).get(str(market.get("type") or "spot")) or {}
        if isinstance(section, dict) and ("linear" in section or "inverse" in section):
            section = section.get("inverse" if market.get("inverse") else "linear") or {}
        limit = ((section.get("fetchOHLCV") or {}).get("limit")
                 if isinstance(section, dict) else None)
        return (list(client.timeframes or {}),
                int(limit) if isinstance(limit, int) and limit > 0 else None)

    async def fetch_ticker(self, symbol: str) -> Ticker:
        """The exchange's ticker of ``symbol``."""
        self._require_market(symbol)
        raw = await self._read(f"fetch ticker {symbol}",
                               lambda: self._client.fetch_ticker(symbol))
        last = _decimal(raw.get("last")) or _decimal(raw.get("close"))
        percentage = _decimal(raw.get("percentage"))
        timestamp = raw.get("timestamp")
        return Ticker(
            symbol=symbol,
            last=_required_decimal(last, f"last price for {symbol}"),
            at=from_millis(timestamp) if timestamp else self._clock(),
            bid=_decimal(raw.get("bid")),
            ask=_decimal(raw.get("ask")),
            change_24h=None if percentage is None else percentage / 100,
            volume_24h=_decimal(raw.get("baseVolume")),
        )

    async def fetch_order_book(self, symbol: str, limit: int = 10) -> OrderBook:
        """The best ``limit`` levels of each side."""
        self._require_market(symbol)
        raw = await self._read(f"fetch order book {symbol}",
                               lambda: self._client.fetch_order_book(symbol, limit))

        def levels(side: Sequence[Sequence[Any]]) -> tuple[tuple[Decimal, Decimal], ...]:
            return tuple((Decimal(str(level[0])), Decimal(str(level[1])))
                         for level in side[:limit])

        timestamp = raw.get("timestamp")
        return OrderBook(symbol, levels(raw.get("bids") or []), levels(raw.get("asks") or []),
                         from_millis(timestamp) if timestamp else self._clock())

    async def fetch_candles(self, symbol: str, timeframe: str = "5m", limit: int = 100,
                            since: datetime | None = None) -> Sequence[Candle]:
        """OHLCV candles, oldest first; the last one may still be forming."""
        self._require_market(symbol)
        since_ms = None if since is None else to_millis(since)
        rows = await self._read(
            f"fetch {timeframe} candles {symbol}",
            lambda: self._client.fetch_ohlcv(symbol, timeframe, since_ms, limit))
        return [
            Candle(symbol, timeframe, from_millis(row[0]), *(Decimal(str(v)) for v in row[1:6]))
            for row in rows if all(v is not None for v in row[:6])
        ]

    async def fetch_balances(self) -> Mapping[str, Balance]:
        """Non-zero balances."""
        raw = await self._read("fetch balance", self._client.fetch_balance)
        free, used = raw.get("free") or {}, raw.get("used") or {}
        balances: dict[str, Balance] = {}
        for currency in sorted(set(free) | set(used)):
            balance = Balance(currency, _decimal(free.get(currency)) or Decimal(0),
                              _decimal(used.get(currency)) or Decimal(0))
            if balance.total:
                balances[currency] = balance
        await self._note_balances(balances)
        return balances

    async def fetch_positions(self, symbols: Sequence[str] | None = None) -> Sequence[Position]:
        """Contract positions from the exchange; spot holdings as long positions.

        A spot holding is reported against the requested symbol of its currency, or without
        symbols against the first of USDT, USDC, USD, FDUSD, EUR, BTC that has a market.
        """
        wanted = list(symbols) if symbols is not None else None
        contract = [s for s in wanted or [] if self._is_contract(s)]
        positions: list[Position] = []
        if contract:
            raw = await self._read("fetch positions",
                                   lambda: self._client.fetch_positions(contract))
            for item in raw:
                amount = _decimal(item.get("contracts")) or Decimal(0)
                size = _decimal(item.get("contractSize")) or Decimal(1)
                mark = _decimal(item.get("markPrice")) or _decimal(item.get("entryPrice"))
                if amount and mark is not None:
                    side: Literal["long", "short"] = (
                        "short" if item.get("side") == "short" else "long")
                    positions.append(Position(item["symbol"], side, amount * size, mark,
                                              _decimal(item.get("entryPrice"))))
        spot_symbols = None if wanted is None else [s for s in wanted if s not in contract]
        if spot_symbols == []:
            return positions
        for currency, balance in (await self.fetch_balances()).items():
            symbol = self._spot_symbol(currency, spot_symbols)
            if symbol is None:
                continue
            mark = (await self.fetch_ticker(symbol)).last
            positions.append(Position(symbol, "long", balance.total, mark))
        return positions

    def _is_contract(self, symbol: str) -> bool:
        market = self._client.markets.get(symbol) if self._client.markets else None
        return bool(market and market.get("contract"))

    def _spot_symbol(self, currency: str, symbols: Sequence[str] | None) -> str | None:
        if symbols is not None:
            return next((s for s in symbols if self._markets.get(s) is not None
                         and self._markets[s].base == currency), None)
        return next((f"{currency}/{quote}" for quote in _SPOT_QUOTES
                     if f"{currency}/{quote}" in self._markets), None)

    async def fetch_open_orders(self, symbol: str | None = None) -> Sequence[Order]:
        """Resting orders."""
        if symbol is not None:
            self._require_market(symbol)
        raw = await self._read("fetch open orders",
                               lambda: self._client.fetch_open_orders(symbol))
        return [self._order(item) for item in raw]

    async def fetch_order(self, order_id: str, symbol: str) -> Order:
        """An order by the exchange's id."""
        self._require_market(symbol)
        raw = await self._read(f"fetch order {order_id}",
                               lambda: self._client.fetch_order(order_id, symbol))
        return await self._noted(await self._with_fees(raw, self._order(raw)))

    async def fetch_order_by_client_id(self, client_order_id: str, symbol: str) -> Order:
        """An order by our client order id.

        Raises:
            OrderRejectedError: The exchange has no such order.
        """
        self._require_market(symbol)
        raw = await self._read(
            f"look up order {client_order_id}",
            lambda: self._client.fetch_order(None, symbol, {"clientOrderId": client_order_id}))
        return await self._noted(await self._with_fees(raw, self._order(raw)))

    async def _with_fees(self, raw: Mapping[str, Any], order: Order) -> Order:
        """An order with the fees its executions paid, when the exchange's answer to an order
        lookup leaves them out (Binance's does: only a new order's answer lists its fills).
        The desk's books count a fill's fee when they first count the fill, so a filled order
        is not reported without its fee where the executions can say it."""
        if order.filled <= 0 or (raw.get("fee") or {}).get("cost") is not None or not (
                self._client.has.get("fetchOrderTrades")):
            return order
        try:
            trades = await self._read(f"fetch the executions of order {order.id}",
                                      lambda: self._client.fetch_order_trades(order.id,
                                                                              order.symbol))
        except ExchangeError as exc:  # the order itself is known: never fail its lookup
            _log.warning("order_fees_unknown", exchange=self.name, order_id=order.id,
                         error=str(exc))
            return order
        fees: dict[str, Decimal] = {}
        for trade in trades:
            fee = trade.get("fee") or {}
            cost, currency = _decimal(fee.get("cost")), fee.get("currency")
            if cost is not None and currency:
                fees[str(currency)] = fees.get(str(currency), Decimal(0)) + cost
        if len(fees) != 1:  # none, or in several currencies: as the order said
            return order
        ((currency, cost),) = fees.items()
        return replace(order, fee=cost, fee_currency=currency)

    # -- orders --------------------------------------------------------------------------

    async def create_order(self, request: OrderRequest) -> Order:
        """Places an order once: journal first, then one request, then a lookup if unsure.

        Raises:
            ConfigError: The exchange is open for market data only.
            OrderRejectedError: The exchange refused the order (funds, size, symbol), or the
                client order id was used before and the exchange has no such order.
            ExchangeUnavailableError: No answer, and the lookup by client order id found
                nothing; the order was not sent again.
        """
        self._require_orders("placing an order")
        self._require_market(request.symbol)
        assert self._journal is not None
        action = (f"create {request.type} {request.side} {request.amount} {request.symbol}"
                  + (f" @ {request.price}" if request.price is not None else ""))
        known = await self._journal.get(request.client_order_id)
        if known is not None:
            return await self._resolve_known(request, known.state, known.exchange_order_id)
        await self._journal.record(request, self._name, self._clock())
        try:
            # Strings, not floats: ccxt's precision helpers take them as they are.
            raw = await _contained(lambda: self._client.create_order(
                request.symbol, request.type, request.side, str(request.amount),
                None if request.price is None else str(request.price),
                self._order_params(request)))
        except ccxt.OperationFailed as exc:
            # The answer is lost (timeout, dropped connection, exchange unsure): the order may
            # exist. Look it up; never send it again.
            return await self._find_after_lost_answer(request, exc, action)
        except ccxt.BaseError as exc:
            error = self._translate(exc, action)
            await self._journal.mark(request.client_order_id, "rejected", self._clock(),
                                     error=str(error))
            raise error from exc
        order = self._order(raw, request)
        await self._journal.mark(request.client_order_id, "placed", self._clock(),
                                 exchange_order_id=order.id)
        return await self._noted(order)

    @staticmethod
    def _order_params(request: OrderRequest) -> dict[str, str]:
        """ccxt's parameters of an order: its client order id, and for a protective order
        the unified ``stopLossPrice`` or ``takeProfitPrice`` (which ccxt turns into the
        venue's own stop order type: Binance spot's ``STOP_LOSS_LIMIT`` for a limit)."""
        params = {"clientOrderId": request.client_order_id}
        if request.trigger is not None and request.trigger_price is not None:
            key = "stopLossPrice" if request.trigger == "stop_loss" else "takeProfitPrice"
            params[key] = str(request.trigger_price)
        return params

    def holds_protection(self, kind: ProtectionKind) -> bool:
        """Whether the exchange can hold a protective order of ``kind`` (ccxt's ``has``
        flags); where it cannot, the daemon watches the price instead."""
        return _holds(self._client.has, kind)

    async def _find_after_lost_answer(self, request: OrderRequest, exc: Exception,
                                      action: str) -> Order:
        assert self._journal is not None
        config = self._config
        for attempt in range(config.lookup_attempts):
            await self._sleep(min(config.max_backoff_seconds,
                                  config.backoff_seconds * 2 ** attempt))
            # One request per lookup: this loop is the retry.
            try:
                raw = await _contained(lambda: self._client.fetch_order(
                    None, request.symbol, {"clientOrderId": request.client_order_id}))
            except ccxt.BaseError:
                continue
            order = self._order(raw, request)
            await self._journal.mark(request.client_order_id, "placed", self._clock(),
                                     exchange_order_id=order.id)
            return await self._noted(order)
        cause = self._translate(exc, action)
        message = (f"{cause}; no order with client id {request.client_order_id} was found "
                   f"afterwards. It was NOT sent again. Check the open orders before placing "
                   "it again.")
        await self._journal.mark(request.client_order_id, "unknown", self._clock(),
                                 error=message)
        raise ExchangeUnavailableError(message) from exc

    async def _resolve_known(self, request: OrderRequest, state: str,
                             exchange_order_id: str | None) -> Order:
        """An order whose client order id was used before: look it up, never resend."""
        if state == "placed" and exchange_order_id is not None:
            return await self.fetch_order(exchange_order_id, request.symbol)
        if state in ("sending", "unknown"):
            try:
                order = await self.fetch_order_by_client_id(request.client_order_id,
                                                            request.symbol)
            except OrderRejectedError:
                pass
            else:
                assert self._journal is not None
                await self._journal.mark(request.client_order_id, "placed", self._clock(),
                                         exchange_order_id=order.id)
                return order
        raise OrderRejectedError(f"client order id {request.client_order_id} was used before "
                                 f"({state}); an order is never sent twice. Use a new one.")

    async def unresolved_orders(self) -> list[OrderRequest]:
        """Orders sent whose fate is not known (journal ``sending`` or ``unknown``)."""
        if self._journal is None:
            return []
        return [intent.request for intent in await self._journal.unresolved(self._name)]

    async def reconcile(self) -> list[Order]:
        """Looks up orders whose answer was lost (in flight or before a restart) by client
        order id. One still not found ten minutes after it was sent is marked ``lost``.

        Returns:
            The orders found (now marked placed in the journal).
        """
        self._require_orders("reconciling orders")
        assert self._journal is not None
        found: list[Order] = []
        for intent in await self._journal.unresolved(self._name):
            try:
                order = await self.fetch_order_by_client_id(intent.request.client_order_id,
                                                            intent.request.symbol)
            except OrderRejectedError:
                now = self._clock()
                lost = now - intent.created_at >= _LOST_AFTER
                await self._journal.mark(intent.request.client_order_id,
                                         "lost" if lost else "unknown", now,
                                         error="not found at the exchange")
                continue
            await self._journal.mark(intent.request.client_order_id, "placed", self._clock(),
                                     exchange_order_id=order.id)
            found.append(order)
        return found

    async def cancel_order(self, order_id: str, symbol: str) -> Order:
        """Cancels an order; if the answer is lost, the order's status says what happened.

        Raises:
            ConfigError: The exchange is open for market data only.
            OrderRejectedError: No such open order.
            ExchangeUnavailableError: No answer, and the order still shows as open.
        """
        self._require_orders("canceling an order")
        self._require_market(symbol)
        action = f"cancel order {order_id}"
        try:
            raw = await _contained(lambda: self._client.cancel_order(order_id, symbol))
        except ccxt.NetworkError as exc:
            order = await self.fetch_order(order_id, symbol)
            if order.status != "open":
                return order
            raise ExchangeUnavailableError(
                f"{self._translate(exc, action)}; the order is still open") from exc
        except ccxt.BaseError as exc:
            raise self._translate(exc, action) from exc
        order = self._order(raw)
        return await self._noted(replace(order, status="canceled")
                                 if order.status == "open" else order)

    async def _noted(self, order: Order) -> Order:
        """``order``, its status noted in the journal (one of ours only) for the next
        reconciliation; a journal that fails to note it does not fail the call."""
        if self._journal is not None:
            try:
                await self._journal.note_status(order, self._clock())
            except StoreError as exc:
                _log.warning("order_status_not_noted", exchange=self._name, error=str(exc))
        return order

    async def _note_balances(self, balances: Mapping[str, Balance]) -> None:
        """Remembers the balances as last seen (orders enabled only; when they changed)."""
        if self._journal is None or not self._allow_orders or balances == self._balances_noted:
            return
        try:
            await self._journal.record_balances(self._name, balances, self._clock())
        except StoreError as exc:
            _log.warning("balances_not_noted", exchange=self._name, error=str(exc))
            return
        self._balances_noted = dict(balances)

    async def close(self) -> None:
        """Closes the HTTP client (idempotent)."""
        await self._client.close()

    def __repr__(self) -> str:
        orders = "orders enabled" if self._allow_orders else "market data only"
        return f"CcxtExchange({self._name!r}, {orders})"

    def scrub(self, message: str) -> str:
        """``message`` without this exchange's secrets or URL query strings."""
        return scrub(message, self._secrets)


async def _contained(call: Callable[[], Awaitable[T]]) -> T:
    """Awaits a ccxt call in a decimal context of its own. ccxt's precision helpers set the
    current context's rounding (half up) and trap underflow for good; left in the daemon's
    context, every amount formatted afterwards would round otherwise than before the first
    order, and a backtest's requests would differ from their recording."""
    with localcontext():
        return await call()


def _holds(has: Mapping[str, Any], kind: ProtectionKind) -> bool:
    if kind == "stop_loss":
        return bool(has.get("createStopLossOrder") or has.get("createStopOrder")
                    or has.get("createTriggerOrder"))
    return bool(has.get("createTakeProfitOrder") or has.get("createTriggerOrder"))


def protection_held_by(config: CcxtExchangeConfig) -> list[ProtectionKind]:
    """The protective orders the configured exchange can hold itself, by ccxt's ``has``
    flags (the config's ``client_settings.has`` over them), read without any request.

    Returns:
        ``stop_loss`` and ``take_profit``, or those of them it can hold; none for an
        exchange ccxt does not know.
    """
    client_class = getattr(ccxt, config.exchange_id, None)
    if config.exchange_id not in ccxt.exchanges or client_class is None:
        return []
    overrides = config.client_settings.get("has")
    client = client_class({"has": overrides} if isinstance(overrides, dict) else {})
    kinds: tuple[ProtectionKind, ...] = ("stop_loss", "take_profit")
    return [kind for kind in kinds if _holds(client.has, kind)]
