"""The application layer: the daemon's process, the one place that knows every part.

- :mod:`~trading_agent.app.running`: ``run_daemon`` (``trading-agent run``): signals, the
  banner, systemd, SIGHUP;
- :mod:`~trading_agent.app.services`: ``open_daemon``, the composition root: the store,
  the bus, the kill switch, the approval book, each desk (built by
  :mod:`trading_agent.desks`), the supervisor, spend caps, telemetry, the fleet and the
  operator API;
- :mod:`~trading_agent.app.reload`: ``reload`` and SIGHUP;
- :mod:`~trading_agent.app.event_loop`: the event loop the daemon runs on.

The desk runtime (:mod:`trading_agent.daemon`) never imports this package, nor the parts
it wires in (the operator API, the fleet, telemetry); only :mod:`trading_agent.cli` does.
"""
