"""trading-agent: a daemon that runs several LLM trading desks at once.

The folders are the parts: ``agent`` (the loop), ``backends`` (model servers), ``trading``
(exchanges and risk), ``tools`` (what a desk can call), ``store`` (SQLite), ``daemon``
(supervisor, desks, triggers), ``operator`` (API, CLI client, web page).
"""

__version__ = "0.1.0"
