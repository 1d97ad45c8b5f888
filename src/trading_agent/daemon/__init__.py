"""The daemon: a supervisor running one task per desk, triggers, shutdown and systemd."""
