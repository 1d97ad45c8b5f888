"""The desk runtime: the supervisor running one task per desk, each desk with its mailbox,
triggers, schedules and spend caps, the desk control protocol the operator side talks to,
and the one-daemon lock. It imports none of the services above it (the application layer,
the operator API, the fleet, telemetry): they come in as protocols it owns or parameters."""
