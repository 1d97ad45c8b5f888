"""Backtests: a desk run over history through its real loop, tools, risk and paper exchange.

- :mod:`~trading_agent.backtest.record`: what a run produced (the equity curve, trades,
  decisions, model usage), the one input of the figures and the report.
- :mod:`~trading_agent.backtest.candles`: historical candles from CSV files, checked.
- :mod:`~trading_agent.backtest.fetch`: ``trading-agent data fetch``, candles from an exchange
  into the local cache.
- :mod:`~trading_agent.backtest.cache`: the response cache, a model backend wrapper that
  makes a re-run free and deterministic.
- :mod:`~trading_agent.backtest.engine`: the run itself, on one simulated clock.
- :mod:`~trading_agent.backtest.metrics` and :mod:`~trading_agent.backtest.report`: the
  figures (pure functions of the record) and ``report.json``, ``trades.csv``,
  ``report.html``.
"""
