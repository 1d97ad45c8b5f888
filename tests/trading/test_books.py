"""A desk's accounting by average cost (trading/books.py): fills counted once from an order's
cumulative reports, the entry price, realized profit, fees in each currency and the round
trips; every figure is one a user can check by hand against the cash paid and received."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from trading_agent.trading.books import (
    FLATTEN_TURN,
    BookFill,
    BookOrder,
    BookPosition,
    RoundTrip,
    apply_fill,
    fill_from_order,
    fill_id_for,
)
from trading_agent.trading.exchange import Order, OrderSide, OrderStatus

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
D = Decimal


def _fill(side: OrderSide, amount: str, price: str, fee: str = "0",
          currency: str | None = "USDT", *, turn: str | None = "t1",
          at: datetime = T0, symbol: str = "BTC/USDT") -> BookFill:
    return BookFill(f"O-{side}-{amount}@{price}", "O", "cid", symbol, side, D(amount),
                    D(price), D(fee), currency, at, turn)


@dataclass
class Books:
    """Applies fills one after another as the store does, numbering round trips."""

    symbol: str = "BTC/USDT"
    position: BookPosition = field(init=False)
    trade: RoundTrip | None = None
    closed: list[RoundTrip] = field(default_factory=list)
    realized: list[Decimal] = field(default_factory=list)
    next_id: int = 1

    def __post_init__(self) -> None:
        self.position = BookPosition(self.symbol)

    def apply(self, fill: BookFill) -> None:
        effect = apply_fill(self.position, self.trade, fill)
        self.realized.append(effect.realized)
        self.position = effect.position
        self.trade = effect.updated
        if effect.closed is not None:
            self.closed.append(effect.closed)
            self.trade = None
        if effect.opened is not None:
            self.trade = replace(effect.opened, id=self.next_id)
            self.position = replace(self.position, trade_id=self.next_id)
            self.next_id += 1


def _order(filled: str, average: str | None, fee: str = "0", currency: str | None = "USDT",
           status: OrderStatus = "open") -> Order:
    return Order(id="O1", client_order_id="cid-1", symbol="BTC/USDT", side="buy",
                 type="limit", amount=D(1), price=D(110), status=status, filled=D(filled),
                 average=None if average is None else D(average), fee=D(fee),
                 fee_currency=currency, created_at=T0)


def _counted(counted: BookOrder, order: Order) -> BookOrder:
    """The order as the books hold it once ``order``'s report was counted."""
    assert order.average is not None
    return replace(counted, order_id=order.id, status=order.status, filled=order.filled,
                   cost=order.filled * order.average, fee=max(order.fee, counted.fee),
                   fee_currency=order.fee_currency or counted.fee_currency)


NOTED = BookOrder("cid-1", "BTC/USDT", "buy", "limit", D(1), D(110), "t1", T0)


def test_partial_fills_of_an_order_are_each_counted_once() -> None:
    first = _order("0.4", "100", "0.04")
    fill = fill_from_order(NOTED, first, T0)
    assert fill == BookFill("O1@0.4", "O1", "cid-1", "BTC/USDT", "buy", D("0.4"), D(100),
                            D("0.04"), "USDT", T0, "t1")
    counted = _counted(NOTED, first)
    assert fill_from_order(counted, first, T0 + timedelta(seconds=1)) is None  # seen again

    # 1 BTC at 101.2 on average, 0.4 of it at 100: the other 0.6 cost 61.2, at 102.
    second = _order("1", "101.2", "0.1012", status="closed")
    rest = fill_from_order(counted, second, T0 + timedelta(seconds=2))
    assert rest is not None
    assert (rest.fill_id, rest.amount, rest.price, rest.fee) == ("O1@1", D("0.6"), D(102),
                                                                 D("0.0612"))
    counted = _counted(counted, second)
    assert fill_from_order(counted, second, T0) is None
    assert fill_from_order(counted, first, T0) is None  # an older report counts nothing
    assert fill.amount + rest.amount == D(1)
    assert fill.amount * fill.price + rest.amount * rest.price == D("101.2")


def test_an_order_that_has_not_filled_gives_no_fill() -> None:
    assert fill_from_order(NOTED, _order("0", None, currency=None), T0) is None
    fill = fill_from_order(NOTED, _order("0.5", "100", "0", currency=None), T0)
    assert fill is not None and fill.fee == 0 and fill.fee_currency is None


def test_fill_ids_name_the_order_and_its_cumulative_fill() -> None:
    assert fill_id_for("O1", D("0.50")) == "O1@0.5"
    assert fill_id_for("O1", D("10.000")) == "O1@10"
    assert fill_id_for("O1", D("0.00000001")) == "O1@0.00000001"


def test_buys_average_the_entry_and_a_sell_realizes_against_it() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100"))
    books.apply(_fill("buy", "3", "120"))
    assert books.position.amount == 4 and books.position.entry_price == D(115)
    assert books.position.side == "long" and books.position.unrealized(D(125)) == D(40)
    assert books.trade is not None and books.trade.amount == 4 and books.trade.id == 1

    books.apply(_fill("sell", "1", "125"))  # +10 on the one sold
    assert books.realized[-1] == D(10)
    assert books.position.amount == 3 and books.position.entry_price == D(115)
    assert books.trade.exited == 1 and books.trade.exit_price == D(125)
    assert books.trade.profit == D(10) and books.trade.is_open

    books.apply(_fill("sell", "3", "105", turn="t2"))  # -30 on the three
    assert books.realized[-1] == D(-30)
    assert books.position == BookPosition("BTC/USDT", realized=D(-20))
    (trade,) = books.closed
    assert (trade.side, trade.amount, trade.entry_price, trade.exit_price, trade.exited) == (
        "long", D(4), D(115), D(110), D(4))
    assert trade.profit == D(-20) and trade.exit_reason == "decision"
    assert (trade.opened_turn, trade.closed_turn) == ("t1", "t2")
    # -20 over the 460 the four cost.
    assert trade.profit_percent.quantize(D("0.0001")) == D("-4.3478")
    assert books.trade is None


def test_quote_fees_are_taken_from_the_profit_of_the_round_trip() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100", "0.1", at=T0))
    books.apply(_fill("sell", "1", "110", "0.11", at=T0 + timedelta(hours=2)))
    paid, received = D("100") + D("0.1"), D("110") - D("0.11")
    (trade,) = books.closed
    assert trade.profit == received - paid == D("9.79")
    assert books.position.realized == D("9.79") and books.position.fees == D("0.21")
    assert trade.fees == D("0.21") and trade.profit_percent == D("9.79")
    assert trade.duration_seconds == 7200
    assert books.realized == [D("-0.1"), D("9.89")]


def test_a_base_fee_on_a_buy_holds_less_and_costs_its_worth() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100", "0.001", "BTC"))  # pays 100 USDT, gets 0.999 BTC
    assert books.position.amount == D("0.999") and books.position.entry_price == D(100)
    assert books.position.fees == D("0.1") and books.position.realized == D("-0.1")
    books.apply(_fill("sell", "0.999", "110"))  # receives 109.89 USDT
    assert books.position.amount == 0
    assert books.position.realized == D("109.89") - D("100") == D("9.89")
    assert books.closed[0].profit == D("9.89")


def test_a_base_fee_on_a_sell_gives_up_more_coins() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100"))  # pays 100
    # Sells 0.999 and pays 0.001 BTC: all of the 1 BTC is gone, 109.89 USDT received.
    books.apply(_fill("sell", "0.999", "110", "0.001", "BTC"))
    assert books.position.amount == 0
    assert books.position.realized == D("109.89") - D("100") == D("9.89")
    assert books.position.fees == D("0.11")
    assert books.closed[0].profit == D("9.89") and books.closed[0].exited == 1


def test_a_fee_in_a_third_currency_is_kept_apart_never_converted() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100", "0.05", "BNB"))
    books.apply(_fill("sell", "1", "110", "0.04", "BNB"))
    assert books.position.other_fees == {"BNB": D("0.09")}
    assert books.position.fees == 0 and books.position.realized == D(10)
    assert books.closed[0].profit == D(10) and books.closed[0].fees == 0


def test_a_reversal_closes_the_long_and_opens_a_short_sharing_the_fee() -> None:
    books = Books()
    books.apply(_fill("buy", "1", "100"))
    # Sells 3 at 110 for a fee of 0.33: one third closes the long, two thirds open a short.
    books.apply(_fill("sell", "3", "110", "0.33", turn="t2"))
    (closed,) = books.closed
    assert closed.exit_reason == "reversed" and closed.closed_turn == "t2"
    assert closed.profit == D(10) - D("0.11") and closed.fees == D("0.11")
    assert books.trade is not None and books.trade.id == 2
    assert (books.trade.side, books.trade.amount, books.trade.entry_price) == (
        "short", D(2), D(110))
    assert books.trade.profit == D("-0.22") and books.trade.opened_turn == "t2"
    assert books.position.amount == -2 and books.position.entry_price == D(110)
    assert books.position.side == "short" and books.position.trade_id == 2
    assert books.realized[-1] == D("9.89") - D("0.22")
    assert books.position.realized == D("9.67") and books.position.fees == D("0.33")
    assert books.position.unrealized(D(100)) == D(20)  # the short gains as the price falls


def test_a_short_round_trip_profit_and_percent() -> None:
    books = Books()
    books.apply(_fill("sell", "2", "50", "0.1"))
    books.apply(_fill("buy", "2", "45", "0.09", at=T0 + timedelta(minutes=5)))
    (trade,) = books.closed
    # Sold for 100 less 0.1, bought back for 90 plus 0.09.
    assert trade.side == "short"
    assert trade.profit == (D(100) - D("0.1")) - (D(90) + D("0.09")) == D("9.81")
    assert trade.profit_percent == D("9.81")  # over the 100 it was opened for
    assert trade.duration_seconds == 300


def test_a_flatten_closes_with_its_own_reason() -> None:
    books = Books()
    books.apply(_fill("buy", "2", "100"))
    books.apply(_fill("sell", "2", "90", turn=FLATTEN_TURN))
    (trade,) = books.closed
    assert trade.exit_reason == "flatten" and trade.closed_turn == FLATTEN_TURN
    assert trade.profit == D(-20) and trade.profit_percent == D(-10)


def test_a_partial_close_keeps_the_round_trip_open() -> None:
    books = Books()
    books.apply(_fill("buy", "2", "100"))
    books.apply(_fill("sell", "0.5", "120"))
    assert books.closed == [] and books.trade is not None
    assert books.trade.profit_percent == D(20)  # 10 on the 50 that was closed
    assert books.trade.duration_seconds is None
