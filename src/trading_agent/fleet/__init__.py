"""A fleet: several daemons sharing the desks, their state on PostgreSQL, their messages on
NATS JetStream (:mod:`trading_agent.fleet.bus`)."""
