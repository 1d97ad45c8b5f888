"""Configuration models of the trading layer, embedded by the settings module in the TOML file.

Every model forbids unknown keys, so a typo in the config file is an error, not a silent
default. Secrets never appear here: a live exchange's credentials are named by the
environment variables that hold them (``api_key_env = "BINANCE_API_KEY"``).

Example TOML, as the settings module embeds it under a desk::

    [desks.alpha.exchange]
    mode = "paper"              # "live" is needed for real orders
    feed = "replay"             # where paper prices come from: "replay" or "ccxt"

    [desks.alpha.exchange.paper]
    starting_balances = { USDT = "10000" }
    taker_fee = "0.001"
    maker_fee = "0.0008"
    slippage_bps = "5"

    [desks.alpha.exchange.replay]
    speed = 60                  # 60x real time; 0 = as fast as the desks go

    [desks.alpha.risk]
    allowed_symbols = ["BTC/USDT"]
    max_order_notional = "10000"
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "PACKAGED_CANDLES",
    "CcxtExchangeConfig",
    "ExchangeConfig",
    "PaperExchangeConfig",
    "ProtectionsConfig",
    "ReplayConfig",
    "RiskLimits",
]

PACKAGED_CANDLES = Path(__file__).resolve().parent.parent / "data" / "BTC_USDT-5m.csv"
"""Real BTC/USDT 5-minute candles shipped with the package (see ``data/README.md``)."""


class RiskLimits(BaseModel):
    """A desk's risk limits, checked on every order before any exchange sees it.

    Attributes:
        allowed_symbols: The only markets the desk may trade (fail closed: others are refused).
        quote_currency: The currency notionals and losses are measured in.
        max_order_notional: The largest value of one order, in the quote currency.
        max_position_notional: The largest value held in one symbol, counting open orders.
        max_open_orders: How many orders may rest on the book at once.
        max_orders_per_hour: How many orders may be placed in any rolling hour.
        max_daily_loss: The drop of the desk's own equity (a live desk's by its books) since
            the start of the UTC day that halts new orders for the rest of that day.
        require_stop_loss: An order that opens or adds to a position must carry a
            ``stop_loss`` (one without is refused, saying so).
        max_loss_per_trade: The most one entry may lose at its stop: the distance from the
            entry price to the stop times the amount, in the quote currency; None for no
            such limit.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    allowed_symbols: list[str] = Field(default_factory=lambda: ["BTC/USDT"])
    quote_currency: str = "USDT"
    max_order_notional: Decimal = Field(default=Decimal("10000"), gt=0)
    max_position_notional: Decimal = Field(default=Decimal("25000"), gt=0)
    max_open_orders: int = Field(default=10, ge=0, le=100_000)
    max_orders_per_hour: int = Field(default=30, ge=0, le=1_000_000)
    max_daily_loss: Decimal = Field(default=Decimal("1000"), gt=0)
    require_stop_loss: bool = False
    max_loss_per_trade: Decimal | None = Field(default=None, gt=0)


class PaperExchangeConfig(BaseModel):
    """The simulated exchange.

    Attributes:
        starting_balances: Balances of a fresh account, by currency.
        taker_fee: The fee rate of market orders (and of limit orders that fill at once).
        maker_fee: The fee rate of resting limit orders when they fill.
        slippage_bps: How far from the price a market order fills, against the trader,
            in basis points.
        market_fill: Where a market order fills: ``last_price``, at once at the feed's
            latest price (the daemon's default); or ``next_open``, at the open of the next
            candle, the first price nobody knew when the order was decided (what a backtest
            uses: a decision at a candle's close cannot trade at that close).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    starting_balances: dict[str, Decimal] = Field(
        default_factory=lambda: {"USDT": Decimal("10000")})
    taker_fee: Decimal = Field(default=Decimal("0.001"), ge=0, lt=1)
    maker_fee: Decimal = Field(default=Decimal("0.0008"), ge=0, lt=1)
    slippage_bps: Decimal = Field(default=Decimal("5"), ge=0, lt=10000)
    market_fill: Literal["last_price", "next_open"] = "last_price"

    @field_validator("starting_balances")
    @classmethod
    def _non_negative(cls, value: dict[str, Decimal]) -> dict[str, Decimal]:
        negative = [currency for currency, amount in value.items() if amount < 0]
        if negative:
            raise ValueError(f"starting balances must not be negative: {', '.join(negative)}")
        return value


class CcxtExchangeConfig(BaseModel):
    """A real exchange through ccxt, for live orders or as a price feed.

    Attributes:
        exchange_id: Any ccxt exchange id (``binance``, ``kraken``...).
        sandbox: Use the exchange's testnet.
        api_key_env: The environment variable holding the API key.
        secret_env: The environment variable holding the API secret.
        password_env: The environment variable holding the passphrase, for exchanges that
            need one.
        options: Exchange-specific ccxt options (``defaultType`` and the like).
        api_urls: Replacements for entries of the client's ``urls['api']`` (a proxy, a
            regional endpoint, a local test server).
        client_settings: Other ccxt constructor settings (``hostname``, ``proxies``,
            ``timeout_on_exit``...); never credentials, which come from the environment, and
            never ``verbose``, which prints each request's API key header to stdout.
        timeout_seconds: How long one HTTP request may take.
        enable_rate_limit: Let ccxt space requests by the exchange's published rate limit.
        read_attempts: How many times a read is tried before it is reported as unavailable.
        backoff_seconds: The first wait between read attempts; it doubles each time.
        max_backoff_seconds: The longest wait between read attempts.
        lookup_attempts: How many times an order whose creation timed out is looked up by its
            client order id.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    exchange_id: str = "binance"
    sandbox: bool = False
    api_key_env: str | None = None
    secret_env: str | None = None
    password_env: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    api_urls: dict[str, str] = Field(default_factory=dict)
    client_settings: dict[str, Any] = Field(default_factory=dict)
    timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    enable_rate_limit: bool = True
    read_attempts: int = Field(default=4, ge=1, le=100)
    backoff_seconds: float = Field(default=0.5, ge=0, le=600)
    max_backoff_seconds: float = Field(default=8.0, ge=0, le=3600)
    lookup_attempts: int = Field(default=3, ge=1, le=100)

    @field_validator("client_settings")
    @classmethod
    def _no_credentials(cls, value: dict[str, Any]) -> dict[str, Any]:
        forbidden = sorted(set(value) & {"apiKey", "secret", "password", "uid", "privateKey",
                                         "walletAddress", "token"})
        if forbidden:
            raise ValueError(f"credentials ({', '.join(forbidden)}) come only from environment "
                             "variables: use api_key_env, secret_env and password_env")
        if "verbose" in value:
            raise ValueError("verbose is not allowed: ccxt would print every request's "
                             "headers, the API key among them, to stdout")
        return value


class ReplayConfig(BaseModel):
    """Historical candles played back as if they were live.

    Attributes:
        files: One CSV file per symbol (``timestamp_ms,open,high,low,close,volume``); the
            packaged BTC/USDT candles by default.
        timeframe: The candles' timeframe.
        speed: How many times faster than real time; 0 or None plays as fast as the
            subscribers read.
        start_offset: How many candles are already in the past when the replay starts
            (the history a desk sees at once).
        start: Start at the first candle opening at or after this time instead
            (overrides ``start_offset``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    files: dict[str, Path] = Field(default_factory=lambda: {"BTC/USDT": PACKAGED_CANDLES})
    timeframe: str = "5m"
    speed: float | None = Field(default=60.0, ge=0, le=1_000_000)
    start_offset: int = Field(default=288, ge=0, le=100_000_000)
    start: datetime | None = None

    @field_validator("files")
    @classmethod
    def _at_least_one(cls, value: dict[str, Path]) -> dict[str, Path]:
        if not value:
            raise ValueError("the replay needs at least one symbol's file")
        return value


class ExchangeConfig(BaseModel):
    """Which exchange a desk trades on.

    Attributes:
        mode: ``paper`` (the default) simulates orders; ``live`` sends them to the ccxt
            exchange. Nothing else can make a live order.
        feed: Where the paper exchange takes its prices: replayed candles or the ccxt
            exchange's public market data.
        paper: The simulated exchange.
        replay: The replayed candles.
        ccxt: The real exchange (needed in live mode and for the ccxt feed).
        max_account_notional: The most all desks on one account may hold together, in each
            desk's quote currency (their positions by their own books, at the marks); an
            order that would take the total past it is refused. Desks share an account when
            they trade live on the same exchange with the same key; a paper desk's account
            is its own. None: no cap beyond each desk's own limits.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["paper", "live"] = "paper"
    feed: Literal["replay", "ccxt"] = "replay"
    paper: PaperExchangeConfig = Field(default_factory=PaperExchangeConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    ccxt: CcxtExchangeConfig | None = None
    max_account_notional: Decimal | None = Field(default=None, gt=0)

    def account_key(self, desk: str) -> str:
        """Which account a desk on this config trades: desks with the same key share it
        (live on one exchange with one key); a paper desk's is its own."""
        if self.mode != "live" or self.ccxt is None:
            return f"paper {desk}"
        return f"{self.ccxt.exchange_id} sandbox={self.ccxt.sandbox} key={self.ccxt.api_key_env}"

    @model_validator(mode="after")
    def _ccxt_when_needed(self) -> ExchangeConfig:
        if self.ccxt is None and (self.mode == "live" or self.feed == "ccxt"):
            needs = "live mode" if self.mode == "live" else 'feed = "ccxt"'
            raise ValueError(f"{needs} needs an [exchange.ccxt] section")
        return self


class _Protection(BaseModel):
    """What every protection has: how far back it looks and how long it holds the desk in
    reduce-only once it trips (minutes, on the desk's clock)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lookback_minutes: float = Field(default=1440, gt=0, le=525_600)
    pause_minutes: float = Field(default=60, gt=0, le=525_600)


class MaxDrawdownConfig(_Protection):
    """``max_drawdown``: the desk's equity fell this far below its highest value within the
    lookback.

    Attributes:
        max_drawdown_percent: The fall, in percent of that high, that trips it.
    """

    max_drawdown_percent: Decimal = Field(gt=0, lt=100)


class StoplossGuardConfig(_Protection):
    """``stoploss_guard``: this many round trips closed by their stop loss within the
    lookback.

    Attributes:
        max_stops: How many stops trip it.
    """

    max_stops: int = Field(ge=1, le=10_000)


class CooldownAfterExitConfig(BaseModel):
    """``cooldown_after_exit``: after a round trip closes, no new exposure for a while (its
    lookback is its pause: only the last exit counts).

    Attributes:
        pause_minutes: How long after each exit.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    pause_minutes: float = Field(gt=0, le=525_600)


class FlipFlopGuardConfig(_Protection):
    """``flip_flop_guard``: the desk reversed its position (a round trip opened on the
    other side of the one before, in the same market) more than this many times within the
    lookback.

    Attributes:
        max_flips: Reversals allowed; one more trips it.
    """

    max_flips: int = Field(ge=0, le=10_000)


class ToolErrorGuardConfig(_Protection):
    """``tool_error_guard``: the desk's tool calls failed or were refused more than this many
    times within the lookback (refusals by reduce-only itself are not counted).

    Attributes:
        max_errors: Failed calls allowed; one more trips it.
    """

    max_errors: int = Field(ge=0, le=100_000)


class ProtectionsConfig(BaseModel):
    """A desk's protections (``[desks.<name>.protections]``): each, when set, puts the desk
    in reduce-only for its ``pause_minutes`` once it trips.

    Attributes:
        max_drawdown: Equity drawdown within the lookback.
        stoploss_guard: Stops hit within the lookback.
        cooldown_after_exit: A pause after every closed round trip.
        flip_flop_guard: Position reversals within the lookback.
        tool_error_guard: Failed or refused tool calls within the lookback.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_drawdown: MaxDrawdownConfig | None = None
    stoploss_guard: StoplossGuardConfig | None = None
    cooldown_after_exit: CooldownAfterExitConfig | None = None
    flip_flop_guard: FlipFlopGuardConfig | None = None
    tool_error_guard: ToolErrorGuardConfig | None = None
