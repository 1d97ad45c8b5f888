"""Operations telemetry built on the event bus: OpenTelemetry traces and webhooks.

Both are bus subscribers, like the store and the logs, so the agent core knows nothing of
them: :mod:`~trading_agent.telemetry.traces` (GenAI spans over OTLP, nothing without an
endpoint) and :mod:`~trading_agent.telemetry.webhooks` (signed POSTs of chosen events).
Their settings are in :mod:`~trading_agent.telemetry.config`, which imports nothing else of
this package, so the settings can embed them cheaply.
"""
