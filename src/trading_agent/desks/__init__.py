"""One desk built from its settings (:mod:`~trading_agent.desks.building`), with the hooks
its config names (:mod:`~trading_agent.desks.hooks`): what the daemon's application layer
and a backtest share, without the daemon's services."""
