"""A small stand-in for Binance's spot REST API on 127.0.0.1, for ccxt to talk to.

ccxt's real request signing, HTTP client and response parsing run against it; only the far
side is ours. Responses are shaped like Binance's (the static ones are JSON files under
``fixtures/``). Signed endpoints check the API key header and the HMAC signature, so a test
also proves that credentials came through. Faults are scripted per endpoint:

- ``"disconnect"``: the connection is dropped before any answer.
- ``"hang"``: no answer until the server stops (the client times out).
- ``"hang_after_processing"``: the request takes effect (an order is created), then no answer.
- any key of ``fixtures/errors.json``: that Binance error response.

Balances move as an exchange moves them: a market order fills at once at the ticker's last
price, moving the base and the quote and paying the commission (0.1 %, in the quote); a limit
order reserves what it may spend (the quote of a buy, the base of a sell) as ``locked`` until
it is filled (:meth:`FakeBinance.fill`) or cancelled. An order the free balance cannot pay
for is refused with Binance's ``-2010`` (insufficient balance), and nothing moves.

Stop orders are Binance's own types: ``STOP_LOSS`` and ``TAKE_PROFIT`` (a market order once
triggered), ``STOP_LOSS_LIMIT`` and ``TAKE_PROFIT_LIMIT`` (a limit order once triggered), each
with its ``stopPrice``, accepted only where the symbol's ``orderTypes`` list them (BTCUSDT, like
the real one, has the two limit kinds). One rests as ``NEW``, its quantity locked like a
limit's, until :meth:`FakeBinance.set_price` moves the last price to it: a sell stop-loss
triggers at or below its stop price, a sell take-profit at or above it (a buy mirrors); a
triggered limit fills at once at the new price when that is at or better than its limit
price, else rests as a limit order.

By default ``/api/v3/klines`` answers the fixture's last ``limit`` candles whatever is asked.
After :meth:`FakeBinance.serve_history` it pages a longer history the way Binance does:
``startTime``, ``endTime`` and ``limit`` honoured, at most a page of candles per answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from collections import defaultdict, deque
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web

FIXTURES = Path(__file__).parent / "fixtures"
KLINE_INTERVALS = frozenset({"1s", "1m", "3m", "5m", "15m", "30m", "1h", "2h", "4h", "6h", "8h",
                             "12h", "1d", "3d", "1w", "1M"})
"""The intervals Binance's klines endpoint knows."""

COMMISSION = Decimal("0.001")
"""The commission rate of every fill (the account fixture's taker and maker rates)."""


def fixture(name: str) -> Any:
    """A JSON fixture by file name (without ``.json``)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


@dataclass
class Recorded:
    """One request the server received."""

    method: str
    path: str
    params: dict[str, str]
    api_key: str | None


class FakeBinance:
    """The fake exchange. ``await start()`` gives the base URL; ``await stop()`` at the end.

    Args:
        api_key: The API key signed requests must carry.
        secret: The secret their signatures are made with.
    """

    def __init__(self, api_key: str, secret: str) -> None:
        self.api_key = api_key
        self.secret = secret
        self.requests: list[Recorded] = []
        self.orders: dict[int, dict[str, Any]] = {}
        self.trades: dict[int, list[dict[str, Any]]] = {}
        """Each filled order's executions, as ``myTrades`` lists them."""
        self.klines: list[list[Any]] = fixture("klines")
        self.account: dict[str, Any] = fixture("account")
        self._faults: dict[tuple[str, str], deque[str]] = defaultdict(deque)
        self._errors = fixture("errors")
        self._release = asyncio.Event()
        self._history: dict[tuple[str, str], list[list[Any]]] | None = None
        self._history_page = 1000
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self.last_price: str = fixture("ticker_24hr")["lastPrice"]
        """The last price: the ticker's, and where market orders fill."""

    # -- test controls ---------------------------------------------------------------------

    def fail(self, method: str, path: str, *faults: str) -> None:
        """Scripts the next answers of ``method path`` (``/api/v3/order``) to be ``faults``."""
        for fault in faults:
            if fault not in ("disconnect", "hang", "hang_after_processing") \
                    and fault not in self._errors:
                raise ValueError(f"unknown fault {fault!r}")
            self._faults[(method, path)].append(fault)

    def count(self, method: str, path: str) -> int:
        """How many requests ``method path`` received."""
        return sum(1 for r in self.requests if r.method == method and r.path == path)

    def serve_history(self, klines: list[list[Any]], *, symbol: str = "BTCUSDT",
                      interval: str = "5m", page_limit: int = 1000) -> None:
        """Serves ``klines`` (Binance kline rows, oldest first) paged as Binance pages them.

        ``startTime`` and ``endTime`` bound the candles' open times, ``limit`` (500 when not
        given) is capped at ``page_limit``; an unknown symbol or interval gets Binance's error.
        Other symbols or intervals have no candles. The list is kept, not copied: a test may
        append to it (a candle closing) or cut a hole in it.

        Args:
            klines: The rows of ``symbol`` at ``interval``.
            symbol: The Binance symbol (``BTCUSDT``).
            interval: The Binance interval (``5m``).
            page_limit: The most candles one answer holds.
        """
        if self._history is None:
            self._history = {}
        self._history[(symbol, interval)] = klines
        self._history_page = page_limit

    def set_balance(self, asset: str, free: str, locked: str = "0.00000000") -> None:
        """Sets one asset's balance, as a deposit, a withdrawal or a trade elsewhere would."""
        balances = [b for b in self.account["balances"] if b["asset"] != asset]
        self.account = self.account | {
            "balances": [*balances, {"asset": asset, "free": free, "locked": locked}]}

    def balance(self, asset: str) -> tuple[Decimal, Decimal]:
        """One asset's ``free`` and ``locked`` balance (zero for an asset never held)."""
        for entry in self.account["balances"]:
            if entry["asset"] == asset:
                return Decimal(entry["free"]), Decimal(entry["locked"])
        return Decimal(0), Decimal(0)

    def place_directly(self, client_order_id: str, *, side: str = "BUY", quantity: str = "0.01",
                       price: str = "15000.00000000", symbol: str = "BTCUSDT") -> int:
        """Rests a limit order on the book that did not come through ccxt (a person on the
        exchange's site, another program); returns its order id."""
        order_id = 28_000 + len(self.orders) + 1
        self.orders[order_id] = fixture("order_template") | {
            "symbol": symbol, "orderId": order_id, "clientOrderId": client_order_id,
            "side": side, "type": "LIMIT", "origQty": quantity, "price": price}
        self._lock_for(self.orders[order_id])  # the balance it may spend is locked, unchecked
        return order_id

    def fill(self, order_id: int) -> None:
        """Fills a resting order in full at its price (while nobody watches): what it
        reserved is released and the balances move, commission paid in the quote."""
        order = self.orders[order_id]
        if order["status"] not in ("NEW", "PARTIALLY_FILLED"):
            raise ValueError(f"order {order_id} is {order['status']}, not resting")
        quantity, price = Decimal(order["origQty"]), Decimal(order["price"])
        rest = quantity - Decimal(order["executedQty"])
        self._unlock_rest(order)
        commission = self._settle(order["symbol"], order["side"], rest, price)
        order |= {"status": "FILLED", "executedQty": order["origQty"],
                  "cummulativeQuoteQty": _text(quantity * price)}
        execution = self._trade(order, order["price"], commission, maker=True)
        if rest != quantity:  # the last part of a partly filled order
            execution |= {"id": 100 + order_id * 10 + len(self.trades[order_id]),
                          "qty": _text(rest), "quoteQty": _text(rest * price)}
        self.trades[order_id] = [*self.trades.get(order_id, []), execution]

    def expire(self, order_id: int) -> None:
        """The exchange lets a resting order go (``EXPIRED``), freeing what it locked."""
        order = self.orders[order_id]
        self._unlock_rest(order)
        order["status"] = "EXPIRED"

    def fill_part(self, order_id: int, quantity: str) -> None:
        """Fills part of a resting order at its price, as Binance reports one: status
        ``PARTIALLY_FILLED``, ``executedQty`` grown, one more execution; the part filled
        is no longer locked (the rest still is)."""
        order = self.orders[order_id]
        if order["status"] not in ("NEW", "PARTIALLY_FILLED"):
            raise ValueError(f"order {order_id} is {order['status']}, not resting")
        part, price = Decimal(quantity), Decimal(order["price"])
        done = Decimal(order["executedQty"]) + part
        if done >= Decimal(order["origQty"]):
            raise ValueError("fill_part fills part of an order; use fill for the rest")
        asset, locked = self._reservation(order)
        self._move(asset, free=locked * part / Decimal(order["origQty"]),
                   locked=-locked * part / Decimal(order["origQty"]))
        commission = self._settle(order["symbol"], order["side"], part, price)
        order |= {"status": "PARTIALLY_FILLED", "executedQty": _text(done),
                  "cummulativeQuoteQty": _text(done * price)}
        execution = self._trade(order, order["price"], commission, maker=True)
        execution |= {"id": 100 + order_id * 10 + len(self.trades.get(order_id, [])),
                      "qty": _text(part), "quoteQty": _text(part * price)}
        self.trades.setdefault(order_id, []).append(execution)

    def set_price(self, price: str) -> list[int]:
        """Moves the last price (while nobody watches) and triggers the stop orders it
        reaches; returns the ids of the orders that filled."""
        self.last_price = price
        last = Decimal(price)
        filled = []
        for order_id, order in self.orders.items():
            if order["status"] != "NEW" or order["type"] not in _STOP_TYPES \
                    or order.get("triggered"):
                continue
            stop = Decimal(order["stopPrice"])
            falls = order["type"].startswith("STOP_LOSS") == (order["side"] == "SELL")
            if not (last <= stop if falls else last >= stop):
                continue
            order["triggered"] = True
            limit = Decimal(order["price"])
            marketable = not order["type"].endswith("_LIMIT") or (
                last >= limit if order["side"] == "SELL" else last <= limit)
            if marketable:
                self._unlock_for(order)
                quantity = Decimal(order["origQty"])
                commission = self._settle(order["symbol"], order["side"], quantity, last)
                order |= {"status": "FILLED", "executedQty": order["origQty"],
                          "cummulativeQuoteQty": _text(quantity * last)}
                self.trades[order_id] = [self._trade(order, _text(last), commission,
                                                     maker=False)]
                filled.append(order_id)
        return filled

    def forget(self, order_id: int) -> None:
        """Drops an order, as if the exchange never had it."""
        del self.orders[order_id]

    def api_urls(self) -> dict[str, str]:
        """``urls['api']`` entries that point ccxt's spot endpoints here."""
        return {"public": f"{self.base_url}/api/v3", "private": f"{self.base_url}/api/v3"}

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        return self.base_url

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- dispatch --------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.text() if request.method == "POST" else request.query_string
        params = dict(parse_qsl(raw, keep_blank_values=True))
        self.requests.append(Recorded(request.method, request.path, params,
                                      request.headers.get("X-MBX-APIKEY")))
        faults = self._faults[(request.method, request.path)]
        fault = faults.popleft() if faults else None
        if fault == "disconnect":
            assert request.transport is not None
            request.transport.close()
            raise ConnectionResetError("dropped on purpose")
        if fault == "hang":
            await self._release.wait()
            return web.json_response({})
        if fault is not None and fault != "hang_after_processing":
            error = self._errors[fault]
            if isinstance(error["body"], str):
                return web.Response(text=error["body"], status=error["status"],
                                    content_type="text/html")
            return web.json_response(error["body"], status=error["status"])
        routes = {
            ("GET", "/api/v3/exchangeInfo"): self._exchange_info,
            ("GET", "/api/v3/ticker/24hr"): self._ticker,
            ("GET", "/api/v3/klines"): self._klines,
            ("GET", "/api/v3/depth"): self._depth,
            ("GET", "/api/v3/account"): self._account,
            ("POST", "/api/v3/order"): self._create_order,
            ("GET", "/api/v3/order"): self._get_order,
            ("DELETE", "/api/v3/order"): self._cancel_order,
            ("GET", "/api/v3/openOrders"): self._open_orders,
            ("GET", "/api/v3/myTrades"): self._my_trades,
        }
        route = routes.get((request.method, request.path))
        if route is None:
            return web.json_response({"code": -1000, "msg": f"no route {request.path}"},
                                     status=404)
        if request.method != "GET" or request.path in ("/api/v3/account", "/api/v3/order",
                                                       "/api/v3/openOrders",
                                                       "/api/v3/myTrades"):
            denied = self._check_signature(request, raw)
            if denied is not None:
                return denied
        status, body = route(params)
        if fault == "hang_after_processing":
            await self._release.wait()
        return web.json_response(body, status=status)

    def _check_signature(self, request: web.Request, raw: str) -> web.Response | None:
        if request.headers.get("X-MBX-APIKEY") != self.api_key:
            return web.json_response({"code": -2014, "msg": "API-key format invalid."},
                                     status=401)
        payload, _, signature = raw.rpartition("&signature=")
        expected = hmac.new(self.secret.encode(), payload.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(signature, expected):
            return web.json_response({"code": -1022, "msg": "Signature for this request is "
                                      "not valid."}, status=400)
        return None

    # -- endpoints -------------------------------------------------------------------------

    def _exchange_info(self, params: dict[str, str]) -> tuple[int, Any]:
        return 200, fixture("exchange_info")

    def _ticker(self, params: dict[str, str]) -> tuple[int, Any]:
        if params.get("symbol") != "BTCUSDT":
            return 400, self._errors["bad_symbol"]["body"]
        ticker = fixture("ticker_24hr")
        if self.last_price != ticker["lastPrice"]:
            ticker |= {"lastPrice": self.last_price, "bidPrice": self.last_price,
                       "askPrice": self.last_price}
        return 200, ticker

    def _klines(self, params: dict[str, str]) -> tuple[int, Any]:
        if self._history is not None:
            return self._paged_klines(params, self._history)
        limit = int(params.get("limit", len(self.klines)))
        return 200, self.klines[-limit:]

    def _paged_klines(self, params: dict[str, str],
                      history: dict[tuple[str, str], list[list[Any]]]) -> tuple[int, Any]:
        symbol, interval = params.get("symbol", ""), params.get("interval", "")
        if symbol not in {s["symbol"] for s in fixture("exchange_info")["symbols"]}:
            return 400, self._errors["bad_symbol"]["body"]
        if interval not in KLINE_INTERVALS:
            return 400, {"code": -1120, "msg": "Invalid interval."}
        rows = history.get((symbol, interval), [])
        limit = min(int(params.get("limit", 500)), self._history_page)
        start, end = params.get("startTime"), params.get("endTime")
        chosen = [row for row in rows if (start is None or row[0] >= int(start))
                  and (end is None or row[0] <= int(end))]
        # Binance answers the oldest candles from startTime, else the newest up to endTime.
        return 200, chosen[:limit] if start is not None else chosen[-limit:]

    def _depth(self, params: dict[str, str]) -> tuple[int, Any]:
        return 200, fixture("depth")

    def _account(self, params: dict[str, str]) -> tuple[int, Any]:
        return 200, self.account

    # -- balances --------------------------------------------------------------------------

    @staticmethod
    def _assets(symbol: str) -> tuple[str, str]:
        """A symbol's base and quote assets, as the exchange info names them."""
        [market] = [m for m in fixture("exchange_info")["symbols"] if m["symbol"] == symbol]
        return market["baseAsset"], market["quoteAsset"]

    def _move(self, asset: str, free: Decimal = Decimal(0), locked: Decimal = Decimal(0)) -> None:
        held_free, held_locked = self.balance(asset)
        self.set_balance(asset, _text(held_free + free), _text(held_locked + locked))

    def _reservation(self, order: dict[str, Any]) -> tuple[str, Decimal]:
        """What a resting order locks: the quote a buy may spend, the base a sell gives."""
        base, quote = self._assets(order["symbol"])
        quantity = Decimal(order["origQty"])
        if order["side"] == "BUY":
            price = Decimal(order["price"]) or Decimal(order.get("stopPrice", "0"))
            return quote, quantity * price
        return base, quantity

    def _lock_for(self, order: dict[str, Any]) -> None:
        asset, amount = self._reservation(order)
        self._move(asset, free=-amount, locked=amount)

    def _unlock_rest(self, order: dict[str, Any]) -> None:
        """Frees what a resting order still locks (all of it, less its filled part)."""
        asset, amount = self._reservation(order)
        share = 1 - Decimal(order["executedQty"]) / Decimal(order["origQty"])
        self._move(asset, free=amount * share, locked=-amount * share)

    def _unlock_for(self, order: dict[str, Any]) -> None:
        asset, amount = self._reservation(order)
        self._move(asset, free=amount, locked=-amount)

    def _settle(self, symbol: str, side: str, quantity: Decimal, price: Decimal) -> Decimal:
        """Moves the free balances for a fill; returns the commission paid (in the quote)."""
        base, quote = self._assets(symbol)
        cost = quantity * price
        commission = cost * COMMISSION
        if side == "BUY":
            self._move(base, free=quantity)
            self._move(quote, free=-(cost + commission))
        else:
            self._move(base, free=-quantity)
            self._move(quote, free=cost - commission)
        return commission

    def _affordable(self, symbol: str, side: str, quantity: Decimal, price: Decimal) -> bool:
        """Whether the free balance pays for an order (a market buy's commission too)."""
        base, quote = self._assets(symbol)
        if side == "BUY":
            return self.balance(quote)[0] >= quantity * price * (1 + COMMISSION)
        return self.balance(base)[0] >= quantity

    # -- orders ----------------------------------------------------------------------------

    def _create_order(self, params: dict[str, str]) -> tuple[int, Any]:
        order_id = 28_000 + len(self.orders) + 1
        last = self.last_price
        [info] = [m for m in fixture("exchange_info")["symbols"]
                  if m["symbol"] == params["symbol"]]
        if params["type"] not in info["orderTypes"]:
            return 400, {"code": -1116, "msg": "Invalid orderType."}
        stop = params["type"] in _STOP_TYPES
        if stop and "stopPrice" not in params:
            return 400, {"code": -1102, "msg": "Mandatory parameter 'stopPrice' was not sent, "
                                               "was empty/null, or malformed."}
        order = fixture("order_template") | {
            "symbol": params["symbol"],
            "orderId": order_id,
            "clientOrderId": params["newClientOrderId"],
            "side": params["side"],
            "type": params["type"],
            "origQty": params["quantity"],
            "price": params.get("price", "0.00000000"),
            "timeInForce": params.get("timeInForce", "GTC"),
        }
        if stop:
            order["stopPrice"] = params["stopPrice"]
        quantity = Decimal(params["quantity"])
        market = params["type"] == "MARKET"
        price = Decimal(last) if market or Decimal(order["price"]) == 0 \
            else Decimal(order["price"])
        if not self._affordable(params["symbol"], params["side"], quantity, price):
            return 400, self._errors["insufficient_funds"]["body"]
        if market:
            commission = self._settle(params["symbol"], params["side"], quantity, price)
            self.trades[order_id] = [self._trade(order, last, commission, maker=False)]
            order |= {
                "status": "FILLED",
                "executedQty": params["quantity"],
                "cummulativeQuoteQty": _text(quantity * price),
                "fills": [{"price": last, "qty": params["quantity"],
                           "commission": _text(commission),
                           "commissionAsset": self._assets(params["symbol"])[1],
                           "tradeId": 100 + order_id}],
            }
        else:
            self._lock_for(order)
        self.orders[order_id] = order
        return 200, {k: v for k, v in order.items() if k != "triggered"}

    def _find(self, params: dict[str, str]) -> dict[str, Any] | None:
        if "orderId" in params:
            return self.orders.get(int(params["orderId"]))
        wanted = params.get("origClientOrderId")
        return next((o for o in self.orders.values() if o["clientOrderId"] == wanted), None)

    @staticmethod
    def _as_queried(order: dict[str, Any]) -> dict[str, Any]:
        """An order as ``GET /api/v3/order`` shows it (no fills, times named differently)."""
        shown = {k: v for k, v in order.items()
                 if k not in ("fills", "transactTime", "triggered")}
        return shown | {"time": order["transactTime"], "updateTime": order["transactTime"],
                        "isWorking": order["type"] not in _STOP_TYPES
                        or bool(order.get("triggered")),
                        "stopPrice": order.get("stopPrice", "0.00000000"),
                        "icebergQty": "0.00000000"}

    def _get_order(self, params: dict[str, str]) -> tuple[int, Any]:
        order = self._find(params)
        if order is None:
            return 400, self._errors["unknown_order"]["body"]
        return 200, self._as_queried(order)

    def _cancel_order(self, params: dict[str, str]) -> tuple[int, Any]:
        order = self._find(params)
        if order is None or order["status"] not in ("NEW", "PARTIALLY_FILLED"):
            return 400, {"code": -2011, "msg": "Unknown order sent."}
        order["status"] = "CANCELED"
        self._unlock_rest(order)
        canceled = {k: v for k, v in order.items() if k not in ("fills", "triggered")}
        return 200, canceled | {"origClientOrderId": order["clientOrderId"]}

    def _trade(self, order: dict[str, Any], price: str, commission: Decimal, *,
               maker: bool) -> dict[str, Any]:
        """One execution as ``GET /api/v3/myTrades`` lists it."""
        quantity = Decimal(order["origQty"])
        return {"symbol": order["symbol"], "id": 100 + int(order["orderId"]),
                "orderId": order["orderId"], "orderListId": -1, "price": price,
                "qty": order["origQty"], "quoteQty": _text(quantity * Decimal(price)),
                "commission": _text(commission),
                "commissionAsset": self._assets(order["symbol"])[1],
                "time": order["transactTime"], "isBuyer": order["side"] == "BUY",
                "isMaker": maker, "isBestMatch": True}

    def _my_trades(self, params: dict[str, str]) -> tuple[int, Any]:
        wanted = params.get("orderId")
        return 200, [trade for order_id, trades in self.trades.items()
                     if wanted is None or int(wanted) == order_id for trade in trades
                     if trade["symbol"] == params.get("symbol", trade["symbol"])]

    def _open_orders(self, params: dict[str, str]) -> tuple[int, Any]:
        return 200, [self._as_queried(o) for o in self.orders.values()
                     if o["status"] in ("NEW", "PARTIALLY_FILLED")
                     and params.get("symbol", o["symbol"]) == o["symbol"]]


_STOP_TYPES = frozenset({"STOP_LOSS", "STOP_LOSS_LIMIT", "TAKE_PROFIT", "TAKE_PROFIT_LIMIT"})
"""Binance's spot stop order types (each with a ``stopPrice``)."""


def _text(amount: Decimal) -> str:
    """An amount as Binance writes it: eight decimal places."""
    return f"{amount.quantize(Decimal('1e-8')):f}"
