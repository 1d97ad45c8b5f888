"""The Telegram bot: operators' commands, messages and buttons, checked against their roles.

python-telegram-bot's :class:`~telegram.ext.Application` long-polls the Bot API
(``getUpdates``; no public address needed), at ``[telegram] base_url`` when set. Every update
goes through one place, :meth:`TelegramBot._operator`, as freqtrade's ``authorized_only``:

- a user who is not one of ``[[operator.operators]]`` (by ``telegram_user_id``) gets no
  answer at all, and is logged once (not once per message);
- a command is checked against the operator's role, from the same table as the operator
  API's routes (:mod:`.commands`); a refusal names the role needed;
- plain text goes to the chat's desk as the operator's message (steering a running turn),
  and the turn's answer streams back into the chat (:mod:`.watcher`);
- the approve and deny buttons decide the approval in the presser's name, a trader or more.

Every action is recorded in the audit with surface ``telegram``, refused ones included.
Everything the bot says goes through the :class:`~.outbox.Outbox`: a slow or unreachable
Telegram never holds a desk or a command up. Reaching Telegram at start is tried again and
again in the background: the daemon runs without it meanwhile.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import anyio
import structlog
from telegram.error import TelegramError
from telegram.ext import (
    Application,
    ApplicationBuilder,
    CallbackQueryHandler,
    ContextTypes,
    MessageHandler,
    filters,
)

from telegram import BotCommand, Update
from trading_agent.agent.event_bus import Subscription
from trading_agent.daemon.control import (
    DeskControl,
    MessageNotKeptError,
    UnknownDeskError,
    message_id_for,
)
from trading_agent.errors import TradingAgentError
from trading_agent.operator.approvals import (
    ApprovalAlreadyResolvedError,
    Approvals,
    Decision,
    UnknownApprovalError,
)
from trading_agent.operator.audit import AuditEntry, AuditLog, Outcome
from trading_agent.operator.config import OperatorConfig, Role
from trading_agent.operator.identity import Operator, allows
from trading_agent.telegram.actions import ActionRefusedError, Asked, DeskActions, NeedsRoleError
from trading_agent.telegram.commands import APPROVE, COMMANDS, DENY, SEND, command_rule
from trading_agent.telegram.config import TelegramSettings
from trading_agent.telegram.outbox import AnswerCallback, Outbox, SendMessage
from trading_agent.telegram.watcher import APPROVE_PREFIX, DENY_PREFIX, EventWatcher

__all__ = ["SURFACE", "TELEGRAM_API", "TelegramBot", "quiet_library_logs"]

_log = structlog.get_logger(__name__)

SURFACE = "telegram"
"""What the audit calls this surface."""

TELEGRAM_API = "https://api.telegram.org"
"""Telegram's Bot API, unless ``base_url`` names another."""

_FIRST_BACKOFF_SECONDS = 0.5
_MAX_BACKOFF_SECONDS = 60.0

_ACTIONS = {command.name: command for command in COMMANDS}


def quiet_library_logs() -> None:
    """Keeps python-telegram-bot's and httpx's request lines (each URL carries the token)
    out of the log: their warnings and errors pass, cleaned by the log's redactor."""
    for name in ("httpx", "telegram", "telegram.ext", "apscheduler"):
        logger = logging.getLogger(name)
        logger.setLevel(max(logger.level, logging.WARNING))


class TelegramBot:
    """The bot: polling, the operators' updates, and what it tells them.

    Args:
        settings: The ``[telegram]`` settings.
        operators: The operator settings (who is who, by ``telegram_user_id``).
        token: The bot's token (from ``token_env``).
        control: The running daemon.
        approvals: The daemon's approvals.
        audit: Where actions are recorded.
        subscription: The bus's events, subscribed before the desks run.
        sleep: How retries wait.
    """

    def __init__(self, settings: TelegramSettings, operators: OperatorConfig, token: str,
                 control: DeskControl, approvals: Approvals, audit: AuditLog,
                 subscription: Subscription, *,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self._settings = settings
        self._token = token
        self._control = control
        self._approvals = approvals
        self._audit = audit
        self._subscription = subscription
        self._sleep = sleep
        self._operators: dict[int, Operator] = {
            entry.telegram_user_id: Operator(entry.name, entry.role)
            for entry in operators.operators if entry.telegram_user_id is not None}
        self._strangers: set[int] = set()
        self._logged_errors: set[str] = set()
        self._desk_of: dict[int, str] = {}
        base = settings.base_url or TELEGRAM_API
        self.application: Application = (  # type: ignore[type-arg]
            ApplicationBuilder().token(token).base_url(f"{base}/bot")
            .base_file_url(f"{base}/file/bot").concurrent_updates(True)
            .get_updates_read_timeout(settings.poll_timeout_seconds + 10).build())
        self.application.add_handler(MessageHandler(filters.TEXT, self._on_text))
        self.application.add_handler(CallbackQueryHandler(self._on_button))
        self.application.add_error_handler(self._on_handler_error)
        self.outbox = Outbox(self.application.bot, token,
                             edit_interval=settings.edit_interval_seconds,
                             max_queued=settings.max_queued, sleep=sleep)
        self.watcher = EventWatcher(settings, control, self.outbox, list(self._operators))
        self.connected = anyio.Event()
        """Set once Telegram answered and polling started."""

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Runs the bot until cancelled: the sender, the event watcher, the daily summary and
        long polling (reached again and again while Telegram cannot be reached)."""
        quiet_library_logs()
        async with anyio.create_task_group() as group:
            group.start_soon(self._send_once_connected)
            group.start_soon(self.watcher.run, self._subscription)
            group.start_soon(self.watcher.daily_summaries)
            await self._poll()

    async def _send_once_connected(self) -> None:
        # What operators are told meanwhile waits in the outbox, bounded.
        await self.connected.wait()
        await self.outbox.run()

    async def _poll(self) -> None:
        application = self.application
        backoff = _FIRST_BACKOFF_SECONDS
        failing = False
        while True:
            try:
                await application.initialize()
                break
            except TelegramError as exc:
                if not failing:
                    failing = True
                    _log.warning("telegram_unreachable_at_start", error=self._clean(exc),
                                 note="trying again in the background; desks run meanwhile")
                await self._sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_SECONDS)
        try:
            await self._set_commands()
            await application.start()
            assert application.updater is not None
            await application.updater.start_polling(
                timeout=math.ceil(self._settings.poll_timeout_seconds),
                allowed_updates=["message", "callback_query"],
                error_callback=self._polling_failed, bootstrap_retries=-1)
            _log.info("telegram_connected", operators=len(self._operators),
                      bot=application.bot.username)
            self.connected.set()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                if application.updater is not None and application.updater.running:
                    await application.updater.stop()
                if application.running:
                    await application.stop()
                await application.shutdown()

    async def _set_commands(self) -> None:
        try:
            await self.application.bot.set_my_commands(
                [BotCommand(c.name, c.description) for c in COMMANDS])
        except TelegramError as exc:  # the menu is a nicety; commands work without it
            _log.warning("telegram_commands_not_set", error=self._clean(exc))

    def _polling_failed(self, exc: TelegramError) -> None:
        # Called on every failed poll: python-telegram-bot backs off and polls again.
        self._log_once("telegram_polling_failed", exc)

    def _log_once(self, what: str, exc: BaseException) -> None:
        key = f"{what}:{type(exc).__name__}"
        if key not in self._logged_errors:
            self._logged_errors.add(key)
            _log.warning(what, error=self._clean(exc),
                         note="polling again; logged once per kind of failure")

    async def _on_handler_error(self, update: object,
                                context: ContextTypes.DEFAULT_TYPE) -> None:
        error = context.error
        if error is not None:
            _log.error("telegram_update_failed", error=self._clean(error))

    def _clean(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        return text.replace(self._token, "[REDACTED]") if self._token else text

    # ------------------------------------------------------------------ who asks

    def _operator(self, update: Update) -> Operator | None:
        """The operator an update comes from; None (logged once per user) for anyone else."""
        user = update.effective_user
        if user is None:
            return None
        operator = self._operators.get(user.id)
        if operator is None and user.id not in self._strangers:
            self._strangers.add(user.id)
            _log.warning("telegram_stranger_ignored", user_id=user.id,
                         username=user.username or "",
                         note="not an operator (no [[operator.operators]] telegram_user_id); "
                              "no answer sent, and this user's messages are not logged again")
        return operator

    def _chat_desk(self, chat: int) -> str:
        desk = self._desk_of.get(chat, self._settings.default_desk)
        if desk not in self._control.desk_names():  # a reload removed it
            desk = self._settings.default_desk
        return desk

    async def _record(self, operator: Operator, action: str | None, desk: str,
                      outcome: Outcome, detail: str = "") -> None:
        if action is None:
            return
        entry = AuditEntry(at=datetime.now(UTC), who=operator.name, role=operator.role,
                           action=action, desk=desk, surface=SURFACE, outcome=outcome,
                           detail=detail[:500])
        try:
            await self._audit.record_action(entry)
        except Exception as exc:  # the action happened; its record failing is logged
            _log.error("operator_audit_not_kept", action=action, who=operator.name,
                       desk=desk, error=repr(exc))

    def _reply(self, chat: int, text: str) -> None:
        self.outbox.post(SendMessage(chat, text))

    @staticmethod
    def _refusal(operator: Operator, needed: Role | str, what: str) -> str:
        return f"{what} needs the {needed} role; you are a {operator.role}."

    # ------------------------------------------------------------------ updates

    async def _on_text(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        chat = update.effective_chat
        operator = self._operator(update)
        if operator is None or message is None or chat is None or message.text is None:
            return
        text = message.text
        if text.startswith("/"):
            word, _, arguments = text[1:].partition(" ")
            await self._command(operator, chat.id, word.partition("@")[0].lower(),
                                arguments.strip())
        else:
            await self._send(operator, chat.id, text, update.update_id)

    async def _command(self, operator: Operator, chat: int, name: str, arguments: str) -> None:
        command = _ACTIONS.get(name)
        if command is None:
            self._reply(chat, f"/{name} is not a command; /help lists them.")
            return
        desk = self._chat_desk(chat)
        audit_desk = "*" if name == "reload" else desk
        if not allows(operator.role, command.role):
            self._reply(chat, self._refusal(operator, command.role, f"/{name}"))
            await self._record(operator, command.action, audit_desk, "refused", "forbidden_role")
            return
        asked = Asked(operator, name, arguments, desk)
        try:
            answer = await DeskActions(self._control).run(asked)
        except NeedsRoleError as exc:
            self._reply(chat, f"{str(exc).capitalize()}; you are a {operator.role}.")
            await self._record(operator, command.action, audit_desk, "refused", "forbidden_role")
            return
        except (ActionRefusedError, UnknownDeskError) as exc:
            self._reply(chat, f"Refused: {exc}")
            await self._record(operator, command.action, audit_desk, "refused", str(exc))
            return
        except TradingAgentError as exc:
            self._reply(chat, f"/{name} failed: {exc}")
            await self._record(operator, command.action, audit_desk, "error", str(exc))
            return
        except Exception as exc:
            _log.exception("telegram_command_failed", command=name, error=repr(exc))
            self._reply(chat, f"/{name} failed; see the daemon's log.")
            await self._record(operator, command.action, audit_desk, "error", "internal_error")
            return
        if name == "desk" and arguments:
            self._desk_of[chat] = arguments.strip()
        self._reply(chat, answer)
        await self._record(operator, command.action, audit_desk, "ok")

    async def _send(self, operator: Operator, chat: int, text: str, update_id: int) -> None:
        needed, action = command_rule(SEND)
        desk = self._chat_desk(chat)
        if not allows(operator.role, needed):
            self._reply(chat, self._refusal(operator, needed, "Sending a message to a desk"))
            await self._record(operator, action, desk, "refused", "forbidden_role")
            return
        try:
            # Telegram may hand an update over twice (a poll answered but not confirmed):
            # its id keeps the message to one delivery.
            message_id = await self._control.send_message(
                desk, text, operator.name,
                message_id=message_id_for(desk, f"telegram:{update_id}"))
            delivery = self._control.message_delivery(desk, message_id)
        except MessageNotKeptError as exc:
            self._reply(chat, f"Not sent to {desk}: {exc}. Send it again.")
            await self._record(operator, action, desk, "error", str(exc))
            return
        except TradingAgentError as exc:
            self._reply(chat, f"Not sent to {desk}: {exc}")
            await self._record(operator, action, desk, "refused", str(exc))
            return
        self.watcher.follow(chat, desk, steering=delivery == "steering")
        await self._record(operator, action, desk, "ok", delivery)

    async def _on_button(self, update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        query = update.callback_query
        operator = self._operator(update)
        if operator is None or query is None or not query.data:
            return
        data = query.data
        decision: Decision
        if data.startswith(APPROVE_PREFIX):
            route, decision, approval_id = APPROVE, "approved", data[len(APPROVE_PREFIX):]
        elif data.startswith(DENY_PREFIX):
            route, decision, approval_id = DENY, "denied", data[len(DENY_PREFIX):]
        else:
            self.outbox.post(AnswerCallback(query.id, "This button is no longer in use."))
            return
        needed, action = command_rule(route)
        desk = await self._approval_desk(approval_id)
        if not allows(operator.role, needed):
            verb = "Approving" if decision == "approved" else "Denying"
            self.outbox.post(AnswerCallback(query.id, self._refusal(operator, needed, verb),
                                            alert=True))
            await self._record(operator, action, desk, "refused", "forbidden_role")
            return
        try:
            approval = await self._approvals.decide(approval_id, decision, operator.name)
        except ApprovalAlreadyResolvedError as exc:
            self.outbox.post(AnswerCallback(query.id, str(exc), alert=True))
            await self._record(operator, action, desk, "refused", "already_resolved")
            return
        except UnknownApprovalError:
            self.outbox.post(AnswerCallback(query.id, f"No approval {approval_id} (gone)."))
            await self._record(operator, action, desk, "refused", "unknown_approval")
            return
        outcome = str(approval.get("outcome", decision))
        self.outbox.post(AnswerCallback(query.id, f"{outcome.capitalize()}."))
        await self._record(operator, action, str(approval.get("desk", desk)), "ok", outcome)

    async def _approval_desk(self, approval_id: str) -> str:
        for approval in await self._approvals.listed():
            if approval.get("id") == approval_id:
                return str(approval.get("desk", ""))
        return ""

