"""Building a desk's exchange, price feed and risk policy from the config.

Only ``mode = "live"`` builds an exchange that can send real orders. In paper mode (the
default) orders go to the :class:`~trading_agent.trading.paper.PaperExchange`, whose prices
come from replayed candles or, with ``feed = "ccxt"``, from a real exchange opened for market
data only (its credentials are not even read).

Example::

    async with open_exchange(config.exchange, state=TradingStateFile(database),
                             account="alpha", risk_limits=config.risk) as venue:
        async with anyio.create_task_group() as group:
            if isinstance(venue.feed, ReplayFeed):
                await group.start(venue.feed.run)
            ...  # venue.exchange, venue.risk, venue.feed.subscribe()

Desks on the same feed config can share one feed (a replay parses its files and holds every
candle; a ccxt feed holds a client): :class:`SharedFeeds` opens one per distinct config, and
``open_exchange(..., feed=...)`` trades on it. Whoever opened a shared feed runs it (one
``ReplayFeed.run`` for all its desks) and closes it.

What must outlive the process (the paper books, the order journal, the risk journal) is
kept by the store; the venue reaches it through :class:`TradingState`, which the caller
gives (the store's ``TradingStateFile``).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol

import anyio
import structlog

from trading_agent.blocking import import_module
from trading_agent.trading.booked_exchange import BookedExchange
from trading_agent.trading.books import BookFill, DeskBookRecords
from trading_agent.trading.config import ExchangeConfig, ProtectionsConfig, RiskLimits
from trading_agent.trading.desk_books import DeskBooks
from trading_agent.trading.exchange import Exchange, Fill
from trading_agent.trading.feed import PriceFeed
from trading_agent.trading.kill_switch import KillSwitch
from trading_agent.trading.ledger import PaperBooks
from trading_agent.trading.order_journal import OrderJournal
from trading_agent.trading.paper import PaperExchange
from trading_agent.trading.protection import (
    PROTECTION_KINDS,
    ProtectionRecords,
    unheld_notice,
)
from trading_agent.trading.protection_keeper import ProtectionKeeper, SimulatedFills
from trading_agent.trading.protections import ProtectionGuard, protections_from
from trading_agent.trading.reduce_only import ReduceOnlyStates
from trading_agent.trading.replay import ReplayFeed
from trading_agent.trading.risk import AccountCap, RiskPolicy
from trading_agent.trading.risk_journal import RiskJournal, RiskRecords
from trading_agent.trading.timing import Sleep
from trading_agent.trading.valuation import Valuation, value_account

if TYPE_CHECKING:  # ccxt takes a second to import: only a live venue loads it
    from trading_agent.trading.reconciliation import ReconciliationReport

_log = structlog.get_logger(__name__)

__all__ = ["SharedFeeds", "TradingState", "TradingVenue", "open_exchange", "open_feed",
           "order_seconds"]


class TradingState(Protocol):
    """Where a venue's lasting state is kept; each part is closed by the venue that opened
    it."""

    async def paper_books(self, account: str) -> PaperBooks:
        """A paper account's books."""
        ...

    async def order_journal(self) -> OrderJournal:
        """The live orders' journal."""
        ...

    async def risk_records(self) -> RiskRecords:
        """The risk policies' memory."""
        ...

    async def desk_books(self, desk: str) -> DeskBookRecords:
        """A desk's own books."""
        ...

    async def protective_orders(self, desk: str) -> ProtectionRecords:
        """A desk's protective orders."""
        ...


@dataclass(frozen=True)
class TradingVenue:
    """What a desk trades with.

    Attributes:
        mode: ``paper`` or ``live``.
        exchange: Where orders go: the desk's view of its exchange, which keeps its books
            (:class:`~trading_agent.trading.booked_exchange.BookedExchange`).
        feed: Prices, candles and the clock (a replay's clock is replayed time); subscribe
            to it for tick triggers.
        risk: The desk's risk policy on ``exchange``, when limits were given.
        books: The desk's own books (positions, trades, profit), read with the marks.
        matcher: Matches the resting orders this venue simulates (a paper exchange's
            :meth:`~trading_agent.trading.paper.PaperExchange.sync`); None when the venue
            holds its orders itself (a live exchange fills them on its own).
        reconciler: Compares a live exchange with its order journal (see
            :func:`~trading_agent.trading.reconciliation.reconcile`); None when there is
            nothing to compare (paper, or no journal).
        protection: Keeps the stops and targets of the desk's positions (simulated on
            paper, on the exchange or watched by the daemon on a live venue).
    """

    mode: Literal["paper", "live"]
    exchange: BookedExchange
    feed: PriceFeed
    risk: RiskPolicy | None
    books: DeskBooks
    matcher: Callable[[], Awaitable[list[Fill]]] | None = field(default=None, repr=False)
    reconciler: Callable[[], Awaitable[ReconciliationReport]] | None = field(
        default=None, repr=False)
    protection: ProtectionKeeper | None = field(default=None, repr=False)

    async def match_resting_orders(self) -> list[BookFill]:
        """Matches the resting orders this venue simulates against the candles completed
        since the last match (paper), keeps the desk's protection (fires what the candles
        or the price reached, places what the exchange should hold), then looks at the
        desk's orders that may still fill and counts what did in its books; called on each
        new candle of its feed.

        Returns:
            The fills the desk's books counted since the last call, oldest first.
        """
        if self.matcher is not None:
            await self.matcher()
        fills = await self.exchange.refresh()
        if self.protection is not None:
            # After the books counted the entries that filled: their protection starts.
            await self.protection.step()
            fills.extend(self.exchange.take_fresh())
        return fills

    async def reconcile(self) -> ReconciliationReport | None:
        """Compares the exchange with what this venue's journal says it sent, before a
        desk's first turn.

        Returns:
            What was found; None when the venue keeps no journal to compare (paper).
        """
        report = None if self.reconciler is None else await self.reconciler()
        if self.protection is not None:
            # What fired while the daemon was down is booked now (and told by the keeper).
            await self.protection.step()
        return report

    async def count_fills_while_away(self) -> list[BookFill]:
        """Counts in the desk's books what its orders filled while the daemon was down,
        each order looked up by its exchange id or, never answered, by its client order id
        (a live venue; paper orders fill only on candles the feed replays). Call it for
        every desk of an account before any of them is reconciled, so the reconciliation
        explains the balances by every desk's fills.

        Returns:
            The fills counted.
        """
        if self.mode != "live":
            return []
        return await self.exchange.refresh(on_start=True)

    async def equity(self, currency: str) -> Valuation:
        """The desk's own equity in ``currency``: a live desk's by its books (its account
        may hold other desks' coins and the user's), a paper desk's its account's value
        (the account is its alone). The daily loss, the ``desks`` view, the equity chart
        and the metrics all read this."""
        if self.mode == "live":
            return await self.books.equity(currency)
        return await value_account(self.exchange, currency)


@asynccontextmanager
async def open_exchange(
    config: ExchangeConfig,
    *,
    state: TradingState,
    account: str = "default",
    symbols: Sequence[str] | None = None,
    risk_limits: RiskLimits | None = None,
    environ: Mapping[str, str] | None = None,
    sleep: Sleep = anyio.sleep,
    feed: PriceFeed | None = None,
    kill_switch: KillSwitch | None = None,
    account_peers: Sequence[str] = (),
    reduce_only: ReduceOnlyStates | None = None,
    protections: ProtectionsConfig | None = None,
) -> AsyncIterator[TradingVenue]:
    """Opens a desk's exchange and feed (and risk policy), and closes them on exit.

    Args:
        config: The exchange config.
        state: Where the paper books, the order journal and the risk journal are kept
            (desks share it; each is one ``account``).
        account: The desk's name.
        symbols: The symbols a ccxt feed carries (the replay's own come from its files);
            the risk limits' allowed symbols by default.
        risk_limits: The desk's limits; when given, ``venue.risk`` enforces them.
        environ: Where live credentials are read from (the process environment).
        sleep: How retries and the replay wait (tests pass a fake).
        feed: A feed to trade on instead of opening one (from :class:`SharedFeeds`); the
            caller runs and closes it. A live exchange still sends its orders to ccxt.
        kill_switch: The daemon's kill switch, which the risk policy obeys; None for one of
            the desk's own, in memory.
        account_peers: The other desks trading the same account (the same
            :meth:`~trading_agent.trading.config.ExchangeConfig.account_key`), whose books
            the account-wide cap adds to this desk's.
        reduce_only: The daemon's reduce-only states, which the risk policy obeys; None for
            the desk's own, in memory.
        protections: The desk's protections (``[desks.<name>.protections]``).

    Raises:
        ConfigError: A file, an exchange id or a credential is wrong.
        ExchangeUnavailableError: The ccxt exchange's markets could not be loaded.
    """
    wanted = _wanted_symbols(symbols, risk_limits)
    async with AsyncExitStack() as stack:
        exchange: Exchange
        matcher: Callable[[], Awaitable[list[Fill]]] | None = None
        reconciler: Callable[[], Awaitable[ReconciliationReport]] | None = None
        if config.mode == "live":
            # Imported here: ccxt takes a second to import (off the loop), and paper desks
            # on a replay never need it.
            await import_module("trading_agent.trading.ccxt_exchange")
            from trading_agent.trading.ccxt_exchange import CcxtExchange
            from trading_agent.trading.ccxt_feed import CcxtPriceFeed
            from trading_agent.trading.reconciliation import reconcile
            assert config.ccxt is not None  # ExchangeConfig validates this
            journal = await state.order_journal()
            stack.push_async_callback(journal.close)
            live = await CcxtExchange.open(config.ccxt, allow_orders=True, journal=journal,
                                           environ=environ, sleep=sleep)
            stack.push_async_callback(live.close)
            exchange = live
            if live.order_journal is not None:
                reconciler = functools.partial(
                    reconcile, live,
                    explained=functools.partial(_fills_since, state, account, account_peers))
            if feed is None:
                feed = CcxtPriceFeed(live, wanted, sleep=sleep)
                stack.push_async_callback(feed.close)
        elif feed is None:
            feed = await stack.enter_async_context(open_feed(config, symbols=wanted, sleep=sleep))
        records = await state.desk_books(account)
        stack.push_async_callback(records.close)
        protective = await state.protective_orders(account)
        stack.push_async_callback(protective.close)
        if config.mode == "paper":
            paper = await PaperExchange.open(config.paper, feed,
                                             await state.paper_books(account))
            stack.push_async_callback(paper.close)
            booked = BookedExchange(paper, records)
            # A paper account is the desk's alone: what it holds is the desk's.
            await booked.adopt_holdings(await paper.fetch_positions())
            matcher = paper.sync  # resting paper orders fill only when matched on a candle
            keeper = ProtectionKeeper(booked, protective, simulated=SimulatedFills(
                paper.execute_at, feed))
        else:
            booked = BookedExchange(exchange, records)
            can_hold = getattr(exchange, "holds_protection", None)
            keeper = ProtectionKeeper(booked, protective, can_hold=can_hold)
            notice = unheld_notice(exchange.name, [
                kind for kind in PROTECTION_KINDS if can_hold is not None and can_hold(kind)])
            if notice is not None:
                _log.warning("protection_watched_by_daemon", desk=account, text=notice)
        books = DeskBooks(records, booked)
        risk = None
        if risk_limits is not None:
            risk_journal = await RiskJournal.restore(await state.risk_records(), account,
                                                     booked.now())
            stack.push_async_callback(risk_journal.close)
            cap = None
            if config.max_account_notional is not None:
                peers = []
                for peer in account_peers:
                    peer_records = await state.desk_books(peer)  # read only
                    stack.push_async_callback(peer_records.close)
                    peers.append(DeskBooks(peer_records, booked))
                cap = AccountCap(config.max_account_notional, peers)
            quote = risk_limits.quote_currency

            async def equity() -> Decimal | None:
                # The desk's own equity, as its daily loss reads it (TradingVenue.equity).
                valuation = await (books.equity(quote) if config.mode == "live"
                                   else value_account(booked, quote))
                return None if valuation.unpriced else valuation.total

            guard = ProtectionGuard(account, protections_from(protections),
                                    reduce_only or ReduceOnlyStates.in_memory(), records,
                                    booked.now, equity, quote)
            risk = RiskPolicy(risk_limits, booked, journal=risk_journal,
                              order_seconds=order_seconds(config), kill_switch=kill_switch,
                              account_cap=cap,
                              equity=books.equity if config.mode == "live" else None,
                              protections=guard)
        yield TradingVenue(config.mode, booked, feed, risk, books, matcher, reconciler,
                           keeper)


async def _fills_since(state: TradingState, desk: str, peers: Sequence[str],
                       since: datetime) -> list[BookFill]:
    """Every fill the books of the desks on one account counted after ``since`` (what
    explains the account's balance changes on start), oldest first."""
    fills: list[BookFill] = []
    for name in (desk, *peers):
        records = await state.desk_books(name)
        try:
            fills.extend(await records.fills(since))
        finally:
            await records.close()
    return sorted(fills, key=lambda fill: fill.at)


@asynccontextmanager
async def open_feed(config: ExchangeConfig, *, symbols: Sequence[str] = ("BTC/USDT",),
                    sleep: Sleep = anyio.sleep) -> AsyncIterator[PriceFeed]:
    """Opens the price feed a paper exchange on ``config`` trades on, and closes it on exit.

    Args:
        config: The exchange config: ``feed`` says replay or ccxt.
        symbols: The symbols a ccxt feed carries (a replay's come from its files).
        sleep: How a replay and a ccxt feed's retries wait.

    Raises:
        ConfigError: A replay file or the exchange id is wrong.
        ExchangeUnavailableError: The ccxt exchange's markets could not be loaded.
    """
    async with AsyncExitStack() as stack:
        feed: PriceFeed
        if config.feed == "ccxt":
            await import_module("trading_agent.trading.ccxt_exchange")  # off the loop
            from trading_agent.trading.ccxt_exchange import CcxtExchange
            from trading_agent.trading.ccxt_feed import CcxtPriceFeed

            assert config.ccxt is not None  # ExchangeConfig validates this
            # Market data only: without allow_orders the credentials are not even read.
            source = await CcxtExchange.open(config.ccxt, sleep=sleep)
            stack.push_async_callback(source.close)
            feed = CcxtPriceFeed(source, list(symbols), sleep=sleep)
        else:
            feed = ReplayFeed.from_config(config.replay, sleep=sleep)
        stack.push_async_callback(feed.close)
        yield feed


class SharedFeeds:
    """One price feed per distinct feed config, shared by the paper desks that name it.

    A replay is keyed by its ``replay`` section (its files, speed and start), so desks on
    the same one see the same candles at the same replayed time; a ccxt feed by its
    ``ccxt`` section and symbols. Live desks get None: they take their prices from their
    own exchange. Use it as an async context manager; it closes every feed it opened.

    Args:
        sleep: How the feeds wait (tests pass a fake).
    """

    def __init__(self, *, sleep: Sleep = anyio.sleep) -> None:
        self._sleep = sleep
        self._stack = AsyncExitStack()
        self._feeds: dict[str, PriceFeed] = {}

    @property
    def feeds(self) -> list[PriceFeed]:
        """The feeds opened so far, in the order they were first asked for."""
        return list(self._feeds.values())

    async def get(self, config: ExchangeConfig, *, symbols: Sequence[str] | None = None,
                  risk_limits: RiskLimits | None = None) -> PriceFeed | None:
        """The feed a desk on ``config`` trades on, opened on first use; None in live mode.

        Args:
            config: The desk's exchange config.
            symbols: The desk's symbols (what a ccxt feed carries), as for
                :func:`open_exchange`.
            risk_limits: The desk's limits (their allowed symbols when ``symbols`` is None).

        Raises:
            ConfigError: A replay file or the exchange id is wrong.
            ExchangeUnavailableError: The ccxt exchange's markets could not be loaded.
        """
        if config.mode == "live":
            return None
        wanted = _wanted_symbols(symbols, risk_limits)
        if config.feed == "ccxt":
            assert config.ccxt is not None
            key = f"ccxt {config.ccxt.model_dump_json()} {sorted(wanted)}"
        else:
            key = f"replay {config.replay.model_dump_json()}"
        feed = self._feeds.get(key)
        if feed is None:
            feed = await self._stack.enter_async_context(
                open_feed(config, symbols=wanted, sleep=self._sleep))
            self._feeds[key] = feed
        return feed

    async def aclose(self) -> None:
        """Closes every feed opened."""
        self._feeds.clear()
        await self._stack.aclose()

    async def __aenter__(self) -> SharedFeeds:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self.aclose()


def _wanted_symbols(symbols: Sequence[str] | None, risk_limits: RiskLimits | None) -> list[str]:
    """The symbols a desk's ccxt feed carries: its own, else those its limits allow."""
    return list(symbols or (risk_limits.allowed_symbols if risk_limits else ["BTC/USDT"]))


def order_seconds(config: ExchangeConfig) -> float:
    """How long placing one order may take on ``config``'s exchange, lost answers included.

    A live order is one request, then up to ``lookup_attempts`` lookups by client order id,
    each after a backoff; ten seconds more cover the journal's writes and ccxt's throttling.
    A paper order only writes SQLite.
    """
    if config.mode != "live" or config.ccxt is None:
        return 30.0
    ccxt = config.ccxt
    backoff: float = sum(min(ccxt.max_backoff_seconds, ccxt.backoff_seconds * 2 ** attempt)
                  for attempt in range(ccxt.lookup_attempts))
    request: float = ccxt.timeout_seconds
    return request * (1 + ccxt.lookup_attempts) + backoff + 10.0
