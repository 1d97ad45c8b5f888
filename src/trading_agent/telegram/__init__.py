"""The Telegram channel: operators watch and steer desks from their phones.

- :mod:`~trading_agent.telegram.config`: ``TelegramSettings``, the ``[telegram]`` settings.
- :mod:`~trading_agent.telegram.commands`: every command, the role it needs and its audit
  action (the operator API's, from its one table).
- :mod:`~trading_agent.telegram.outbox`: what the bot sends, queued apart from the desks,
  waiting out rate limits and outages.
- :mod:`~trading_agent.telegram.bot`: the bot itself (python-telegram-bot, long polling).

Nothing is imported here, so the settings load without the Telegram library.
"""
