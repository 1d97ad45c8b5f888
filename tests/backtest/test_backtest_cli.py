"""``trading-agent backtest`` as a user runs it, against the scripted model on loopback.

Each run goes through the real command line, the real engine (the daemon's desk, tools, risk
and paper exchange), the response cache and the report writer. Bad input must exit non-zero
with a message that names the problem, and leave nothing in ``--out``.
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import pytest

from tests.backtest.trader import trading_responder
from tests.operator.command_line import CLI, cli_environment
from tests.scripted_server import ScriptedServer
from trading_agent.cli import main
from trading_agent.trading.config import PACKAGED_CANDLES

CONFIG = """
[daemon]
state_dir = "state"

[model]
provider = "openai"
base_url = "{url}"
model = "scripted-trader"
context_window = 32000
price_input_per_million = 1.0
price_output_per_million = 2.0

[desks.hourly]
system_prompt = "{prompt}"
symbols = ["BTC/USDT"]
maximum_rounds = 6
{extra}

[desks.hourly.triggers]
schedules = [{{ every = "1h", name = "hourly", message = "Hourly check." }}]
"""

SPAN = ["--from", "2023-01-05", "--to", "2023-01-05T06:00"]


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer(responder=trading_responder) as scripted:
        yield scripted


def write_config(path: Path, server: ScriptedServer, *, prompt: str = "You trade BTC/USDT.",
                 extra: str = "", more: str = "") -> Path:
    path.write_text(CONFIG.format(url=server.base_url, prompt=prompt, extra=extra) + more)
    return path


def backtest(config: Path, out: Path, cache: Path, *more: str) -> int:
    return main(["backtest", str(config), *SPAN, "--out", str(out), "--cache-dir", str(cache),
                 "--quiet", *more])


def test_a_backtest_writes_its_report_and_a_strict_rerun_replays_it_for_free(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    cache = tmp_path / "cache"

    assert backtest(config, tmp_path / "first", cache) == 0
    printed = capsys.readouterr().out
    asked = len(server.requests)
    report = json.loads((tmp_path / "first" / "report.json").read_text())
    for key in ("desk", "from", "to", "candles", "decisions", "model_calls", "cache_hits",
                "input_tokens", "output_tokens", "cost", "total_return",
                "buy_and_hold_return", "max_drawdown", "sharpe", "sortino", "trades",
                "open_trades", "fills", "win_rate", "realized_profit", "fees", "exposure"):
        assert key in report, key
    # Six hours of 5-minute candles; the schedule fires at 01:00 ... 06:00.
    assert (report["desk"], report["candles"], report["decisions"]) == ("hourly", 72, 6)
    assert report["model_calls"] == asked == 18 and report["cache_hits"] == 0
    # Buy, sell, buy, sell, buy filled at the next opens (the 06:00 sell still waits): two
    # round trips closed and one open, out of five fills.
    assert (report["fills"], report["trades"], report["open_trades"]) == (5, 2, 1)
    with (tmp_path / "first" / "fills.csv").open(newline="") as handle:
        fills = list(csv.DictReader(handle))
    assert list(fills[0]) == ["decided_at", "filled_at", "symbol", "side", "amount", "price",
                              "fee", "client_order_id", "reason"]
    assert [f["side"] for f in fills] == ["buy", "sell", "buy", "sell", "buy"]
    assert [f["decided_at"][11:16] for f in fills] == ["01:00", "02:00", "03:00", "04:00",
                                                       "05:00"]
    assert all(f["filled_at"] == f["decided_at"] for f in fills)  # the next candle's open
    assert fills[0]["reason"].startswith("Traded 0.01 at market")
    with (tmp_path / "first" / "trades.csv").open(newline="") as handle:
        trades = list(csv.DictReader(handle))
    assert list(trades[0]) == ["opened_at", "closed_at", "symbol", "side", "amount",
                               "entry_price", "exit_price", "profit", "profit_percent", "fees",
                               "exit_reason", "opened_turn", "closed_turn"]
    assert [(t["opened_turn"], t["closed_turn"], t["exit_reason"]) for t in trades] == [
        ("t000001", "t000002", "decision"), ("t000003", "t000004", "decision"),
        ("t000005", "", "open")]
    # Each closed one, by hand from its two fills: (exit - entry) x amount - both fees.
    profits = []
    for trade, (buy, sell) in zip(trades, [(fills[0], fills[1]), (fills[2], fills[3])],
                                  strict=False):
        assert (trade["opened_at"], trade["closed_at"]) == (buy["filled_at"],
                                                            sell["filled_at"])
        assert (trade["side"], trade["amount"]) == ("long", "0.01")
        assert (Decimal(trade["entry_price"]), Decimal(trade["exit_price"])) == (
            Decimal(buy["price"]), Decimal(sell["price"]))
        fees = Decimal(buy["fee"]) + Decimal(sell["fee"])
        assert Decimal(trade["fees"]) == fees
        profit = (Decimal(sell["price"]) - Decimal(buy["price"])) * Decimal("0.01") - fees
        assert Decimal(trade["profit"]) == profit
        profits.append(profit)
    still = trades[2]
    assert (still["opened_at"], still["closed_at"], still["exit_price"]) == (
        fills[4]["filled_at"], "", "")
    assert Decimal(still["profit"]) == -Decimal(fills[4]["fee"])  # its entry fee, so far
    assert report["win_rate"] == sum(p > 0 for p in profits) / 2
    assert report["realized_profit"] == pytest.approx(float(sum(profits)
                                                            - Decimal(fills[4]["fee"])))
    assert report["fees"] == pytest.approx(float(sum(Decimal(f["fee"]) for f in fills)))
    assert "hourly" in printed and "report.html" in printed

    assert backtest(config, tmp_path / "second", cache, "--cache", "strict") == 0
    again = json.loads((tmp_path / "second" / "report.json").read_text())
    assert len(server.requests) == asked  # not one request more
    assert (again["model_calls"], again["cache_hits"]) == (0, asked)
    same = {key: value for key, value in report.items() if key not in ("model_calls",
                                                                       "cache_hits")}
    assert {key: again[key] for key in same} == same
    for name in ("trades.csv", "fills.csv"):
        assert (tmp_path / "second" / name).read_bytes() == \
            (tmp_path / "first" / name).read_bytes(), name


def test_an_out_folder_that_is_not_empty_is_refused_unless_forced(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    assert backtest(config, out, tmp_path / "cache") == 2
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert server.requests == []

    assert backtest(config, out, tmp_path / "cache", "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["equity.png", "fills.csv", "report.html",
                                                     "report.json", "trades.csv"]


@pytest.mark.parametrize(("change", "more", "message"), [
    ("span", [], "outside"),
    ("desk", ["--desk", "nosuch"], "no desk named 'nosuch'; the desks are hourly"),
    ("live", [], "never reaches a live exchange"),
    ("timeframe", [], "timeframe"),
    ("gaps", [], ":4: a gap"),
    ("messages", [], "bad.txt:2:"),
    ("two desks", [], "choose with --desk NAME"),
    ("times", [], "--from"),
])
def test_bad_input_exits_2_with_a_clear_message_and_writes_nothing(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str],
        change: str, more: list[str], message: str) -> None:
    extra, tail, span = "", "", list(SPAN)
    if change == "span":
        span = ["--from", "2024-03-01", "--to", "2024-03-02"]
    elif change == "live":
        extra = '[desks.hourly.exchange]\nmode = "live"\n[desks.hourly.exchange.ccxt]\n' \
                'exchange_id = "binance"'
    elif change == "timeframe":
        extra = '[desks.hourly.exchange.replay]\ntimeframe = "7x"'
    elif change == "gaps":
        lines = PACKAGED_CANDLES.read_text().splitlines()
        gappy = tmp_path / "gappy.csv"
        gappy.write_text("\n".join([*lines[:3], *lines[5:2000]]) + "\n")
        more = ["--data", f"BTC/USDT={gappy}"]
    elif change == "messages":
        bad = tmp_path / "bad.txt"
        bad.write_text("2023-01-05T02:00 Hold.\nyesterday Sell everything.\n")
        more = ["--messages", str(bad)]
    elif change == "two desks":
        tail = '\n[desks.other]\nsystem_prompt = "x"\nsymbols = ["BTC/USDT"]\n'
    elif change == "times":
        span = ["--from", "2023-01-06", "--to", "2023-01-05"]
    config = write_config(tmp_path / "desk.toml", server, extra=extra, more=tail)
    out = tmp_path / "out"
    code = main(["backtest", str(config), *span, "--out", str(out), "--cache-dir",
                 str(tmp_path / "cache"), "--quiet", *more])

    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert not out.exists()
    assert server.requests == []


def _user_namespaces() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _user_namespaces(), reason="no user and mount namespaces (unshare "
                    "--user --map-root-user --mount): no small file system of the test's own")
def test_a_full_disk_under_out_is_one_clear_line_exit_1_and_nothing_written(
        tmp_path: Path, server: ScriptedServer) -> None:
    """The report is written onto a real 32 KiB tmpfs, mounted in a mount namespace of the
    command's own (no root needed): it fills up, and the command says so in one line."""
    config = write_config(tmp_path / "desk.toml", server)
    disk = tmp_path / "small-disk"
    disk.mkdir()
    out = disk / "report"
    script = ('mount -t tmpfs -o size=32k tmpfs "$0" || exit 99; "$@"; code=$?; '
              'echo "left on the disk: [$(ls -A "$0")]"; exit $code')
    command = [*CLI, "backtest", str(config), "--from", "2023-01-05", "--to",
               "2023-01-05T01:05", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
               "--quiet"]
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           script, str(disk), *command], capture_output=True, text=True,
                          timeout=120, check=False, env=cli_environment())

    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"backtest: cannot write the report to {out}: No space left "
                               "on device"), lines[0]
    assert "nothing was written there" in lines[0]
    assert done.stdout.strip().endswith("left on the disk: []"), done.stdout
    assert server.requests  # the run itself went through; only the report could not be kept


def test_a_corrupt_cache_file_is_named_and_nothing_is_written(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "hourly.jsonl").write_text('{"v": 1}\nnot json at all\n')

    assert backtest(config, tmp_path / "out", cache) == 2
    err = capsys.readouterr().err
    assert "hourly.jsonl" in err and "line" in err
    assert not (tmp_path / "out").exists()


def test_a_strict_run_without_a_recording_fails_and_says_to_record_first(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "desk.toml", server)

    assert backtest(config, tmp_path / "out", tmp_path / "cache", "--cache", "strict") == 1
    err = capsys.readouterr().err
    assert "--cache record" in err and "Nothing was written" in err
    assert not (tmp_path / "out").exists()
    assert server.requests == []


def test_an_edited_prompt_fails_a_strict_rerun_naming_what_changed(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    cache = tmp_path / "cache"
    assert backtest(write_config(tmp_path / "a.toml", server), tmp_path / "a", cache) == 0
    edited = write_config(tmp_path / "b.toml", server, prompt="You trade BTC/USDT, carefully.")

    assert backtest(edited, tmp_path / "b", cache, "--cache", "strict") == 1
    assert "system prompt" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_two_configs_compared_over_the_same_span_in_one_report(
        tmp_path: Path, server: ScriptedServer, capsys: pytest.CaptureFixture[str]) -> None:
    first = write_config(tmp_path / "calm.toml", server)
    second = write_config(tmp_path / "bold.toml", server, prompt="You trade BTC/USDT boldly.")
    out = tmp_path / "out"

    code = main(["backtest", "--compare", str(first), str(second), *SPAN, "--out", str(out),
                 "--cache-dir", str(tmp_path / "cache"), "--quiet"])

    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert [run["label"] for run in report["runs"]] == ["calm:hourly", "bold:hourly"]
    assert all(run["decisions"] == 6 for run in report["runs"])
    printed = capsys.readouterr().out
    assert "calm:hourly" in printed and "bold:hourly" in printed
