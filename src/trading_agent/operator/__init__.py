"""The operator side: how people watch and steer a running daemon.

- :mod:`~trading_agent.operator.config`: ``OperatorConfig``, the ``[operator]`` settings.
- :mod:`~trading_agent.operator.server`: ``serve_operator_api``, run in the daemon's task group.
- :mod:`~trading_agent.operator.api`: the HTTP routes (desks, messages, ``/compact``,
  approvals, transcripts, the event stream) and the web page's files.
- :mod:`~trading_agent.operator.event_stream`: the ring of recent events behind resumable
  streams.
- :mod:`~trading_agent.operator.approvals`: ``ApprovalBook``, the gate that holds dangerous
  tool calls for a person; :mod:`~trading_agent.operator.events` its events.
- :mod:`~trading_agent.operator.equity`: equity samples for the web page's chart.
- :mod:`~trading_agent.operator.client`, :mod:`~trading_agent.operator.cli`,
  :mod:`~trading_agent.operator.render`: the ``desks``, ``chat`` and ``events`` commands.

Nothing is imported here, so the CLI loads only what a command needs.
"""
