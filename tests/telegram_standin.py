"""A Telegram Bot API stand-in on loopback, for the bot's tests.

:class:`BotApiStandIn` is a real HTTP server (aiohttp) answering ``/bot<TOKEN>/<method>`` in
the Bot API's own JSON shapes, as python-telegram-bot sends them (form fields, JSON-encoded
values; multipart for ``sendPhoto``). It records every call, keeps each chat's messages as
they stand after edits, and plays updates a test enqueues from a given user: a text or a
command (:meth:`BotApiStandIn.say`) or a button pressed (:meth:`BotApiStandIn.press`),
handed out by ``getUpdates`` long polls with their offsets. A test can make it answer 429
with ``retry_after`` (:meth:`BotApiStandIn.rate_limit`) or be down (:attr:`down`: every
connection is cut without an answer, as an unreachable server's would be).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from aiohttp import web

__all__ = ["BOT_ID", "BotApiStandIn", "Call", "User", "running_standin", "until"]

BOT_ID = 7000001
"""The bot's own user id."""


@dataclass(frozen=True)
class User:
    """A Telegram user (a private chat with the bot has the user's id)."""

    id: int
    first_name: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "is_bot": False, "first_name": self.first_name,
                "username": self.first_name.lower(), "language_code": "en"}


@dataclass
class Call:
    """One request the bot made.

    Attributes:
        method: The Bot API method (``sendMessage``...).
        params: Its parameters, JSON values decoded (a file as ``{"file": bytes}``).
        status: What the stand-in answered (0: the connection was cut).
        at: When it came (monotonic seconds).
    """

    method: str
    params: dict[str, Any]
    status: int = 200
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Message:
    chat_id: int
    message_id: int
    text: str
    reply_markup: dict[str, Any] | None
    silent: bool
    edits: int = 0
    photo: bytes | None = None


@dataclass
class _Fault:
    status: int
    body: dict[str, Any]
    methods: frozenset[str] | None
    times: int


async def until(condition: Callable[[], Any], what: str, within: float = 10.0) -> Any:
    """Polls ``condition`` until it is truthy; returns its value.

    Raises:
        AssertionError: It did not hold within ``within`` seconds (naming ``what``).
    """
    try:
        with anyio.fail_after(within):
            while True:
                value = condition()
                if value:
                    return value
                await anyio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


@dataclass
class BotApiStandIn:
    """The Bot API, for one bot token.

    Attributes:
        token: The token the bot must use (any other answers 401).
        calls: Every request, in order.
        down: Cut every connection without answering (Telegram unreachable).
        log: What happened, a line each, for a test's transcript.
    """

    token: str
    calls: list[Call] = field(default_factory=list)
    down: bool = False
    log: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    _updates: list[dict[str, Any]] = field(default_factory=list)
    _update_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _message_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _messages: dict[tuple[int, int], _Message] = field(default_factory=dict)
    _order: list[tuple[int, int]] = field(default_factory=list)
    _faults: list[_Fault] = field(default_factory=list)
    _news: asyncio.Event = field(default_factory=asyncio.Event)
    _commands: list[dict[str, Any]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ a test's side

    @property
    def base_url(self) -> str:
        """What ``[telegram] base_url`` names."""
        return f"http://127.0.0.1:{self.port}"

    def say(self, user: User, text: str) -> int:
        """Enqueues a message (a command when it starts with ``/``) from ``user`` in their
        private chat; returns the update's id."""
        message_id = next(self._message_ids)
        message: dict[str, Any] = {
            "message_id": message_id, "date": int(time.time()), "from": user.as_json(),
            "chat": {"id": user.id, "type": "private", "first_name": user.first_name},
            "text": text}
        if text.startswith("/"):
            length = len(text.split(" ", 1)[0])
            message["entities"] = [{"type": "bot_command", "offset": 0, "length": length}]
        self.names[user.id] = user.first_name
        self.log.append((user.first_name, text))
        return self._enqueue({"message": message})

    def press(self, user: User, chat_id: int, message_id: int, label: str) -> int:
        """Enqueues ``user`` pressing the inline button ``label`` under a message."""
        message = self._messages[(chat_id, message_id)]
        buttons = [b for row in (message.reply_markup or {}).get("inline_keyboard", [])
                   for b in row]
        [button] = [b for b in buttons if b["text"] == label]
        self.log.append((user.first_name, f"[presses {label} under message {message_id}]"))
        return self._enqueue({"callback_query": {
            "id": f"cb{next(self._update_ids)}", "from": user.as_json(),
            "chat_instance": str(chat_id), "data": button["callback_data"],
            "message": self._json(message)}})

    def rate_limit(self, retry_after: int, *, times: int = 1,
                   methods: tuple[str, ...] | None = None) -> None:
        """Answers the next ``times`` calls (of ``methods``, or any) 429 with
        ``retry_after``."""
        self._faults.append(_Fault(
            429, {"ok": False, "error_code": 429,
                  "description": f"Too Many Requests: retry after {retry_after}",
                  "parameters": {"retry_after": retry_after}},
            frozenset(methods) if methods else None, times))

    def set_down(self, down: bool) -> None:
        """Telegram unreachable (every connection cut) or back."""
        self.down = down
        self._wake()

    def messages(self, chat_id: int) -> list[_Message]:
        """The chat's messages from the bot, in the order sent, as they stand now."""
        return [self._messages[key] for key in self._order if key[0] == chat_id]

    def texts(self, chat_id: int) -> list[str]:
        """The text of each of the chat's messages from the bot, as it stands now."""
        return [m.text for m in self.messages(chat_id)]

    def methods(self, method: str, *, answered: bool = True) -> list[Call]:
        """The calls of one method (only those answered 200 by default)."""
        return [c for c in self.calls if c.method == method
                and (c.status == 200 or not answered)]

    def transcript(self) -> str:
        """What the operators sent and what the bot sent, in order, as Markdown lines."""
        lines = []
        for who, text in self.log:
            quoted = text.replace("\n", "\n    ")
            lines.append(f"- **{who}**: {quoted}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ the server

    def _enqueue(self, body: dict[str, Any]) -> int:
        update_id = next(self._update_ids)
        self._updates.append({"update_id": update_id, **body})
        self._wake()
        return update_id

    def _to(self, chat_id: int) -> str:
        return f"bot to {self.names.get(chat_id, chat_id)}"

    def _wake(self) -> None:
        self._news.set()
        self._news = asyncio.Event()

    def _json(self, message: _Message) -> dict[str, Any]:
        data: dict[str, Any] = {
            "message_id": message.message_id, "date": int(time.time()),
            "from": {"id": BOT_ID, "is_bot": True, "first_name": "Desk bot",
                     "username": "desk_bot"},
            "chat": {"id": message.chat_id, "type": "private", "first_name": "operator"}}
        if message.photo is not None:
            data["photo"] = [{"file_id": f"photo{message.message_id}",
                              "file_unique_id": f"u{message.message_id}",
                              "width": 100, "height": 100}]
            if message.text:
                data["caption"] = message.text
        else:
            data["text"] = message.text
        if message.reply_markup:
            data["reply_markup"] = message.reply_markup
        return data

    def _fault_for(self, method: str) -> _Fault | None:
        for fault in self._faults:
            if fault.times > 0 and (fault.methods is None or method in fault.methods):
                fault.times -= 1
                return fault
        return None

    async def _params(self, request: web.Request) -> dict[str, Any]:
        params: dict[str, Any] = {}
        if request.content_type == "application/json":
            params = dict(await request.json())
        elif request.can_read_body:
            form = await request.post()
            for key, value in form.items():
                if isinstance(value, web.FileField):
                    params[key] = {"file": value.file.read(), "filename": value.filename}
                    continue
                text = str(value)
                try:
                    params[key] = json.loads(text)
                except ValueError:
                    params[key] = text
        params.update({k: v for k, v in request.query.items() if k not in params})
        return params

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Answers one Bot API request."""
        method = request.match_info["method"]
        params = await self._params(request)
        call = Call(method, params)
        self.calls.append(call)
        if request.match_info["token"] != self.token:
            call.status = 401
            return web.json_response({"ok": False, "error_code": 401,
                                      "description": "Unauthorized"}, status=401)
        if self.down:
            return self._cut(request, call)
        fault = self._fault_for(method)
        if fault is not None:
            call.status = fault.status
            return web.json_response(fault.body, status=fault.status)
        answer = getattr(self, f"_{method}", None)
        if answer is None:
            call.status = 404
            return web.json_response({"ok": False, "error_code": 404,
                                      "description": "Not Found"}, status=404)
        result = await answer(params)
        if self.down:  # went down during a long poll
            return self._cut(request, call)
        if isinstance(result, web.StreamResponse):
            call.status = result.status
            return result
        return web.json_response({"ok": True, "result": result})

    def _cut(self, request: web.Request, call: Call) -> web.StreamResponse:
        call.status = 0
        assert request.transport is not None
        request.transport.abort()
        return web.Response(status=503)

    @staticmethod
    def _error(code: int, description: str) -> web.Response:
        return web.json_response({"ok": False, "error_code": code,
                                  "description": description}, status=code)

    # ------------------------------------------------------------------ methods

    async def _getMe(self, params: dict[str, Any]) -> Any:
        return {"id": BOT_ID, "is_bot": True, "first_name": "Desk bot", "username": "desk_bot",
                "can_join_groups": False, "can_read_all_group_messages": False,
                "supports_inline_queries": False}

    async def _deleteWebhook(self, params: dict[str, Any]) -> Any:
        return True

    async def _setMyCommands(self, params: dict[str, Any]) -> Any:
        self._commands = list(params.get("commands", []))
        return True

    async def _getMyCommands(self, params: dict[str, Any]) -> Any:
        return self._commands

    async def _getUpdates(self, params: dict[str, Any]) -> Any:
        offset = int(params.get("offset") or 0)
        timeout = float(params.get("timeout") or 0)
        if offset:
            self._updates = [u for u in self._updates if u["update_id"] >= offset]
        deadline = time.monotonic() + timeout
        while not self._updates and not self.down:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            news = self._news
            with anyio.move_on_after(left):
                await news.wait()
        return list(self._updates[:100])

    def _store(self, chat_id: int, text: str, params: dict[str, Any],
               photo: bytes | None = None) -> dict[str, Any]:
        message = _Message(chat_id, next(self._message_ids), text,
                           params.get("reply_markup") or None,
                           bool(params.get("disable_notification")), photo=photo)
        self._messages[(chat_id, message.message_id)] = message
        self._order.append((chat_id, message.message_id))
        buttons = [b["text"] for row in (message.reply_markup or {}).get("inline_keyboard", [])
                   for b in row]
        shown = text + (f"\n[{' | '.join(buttons)}]" if buttons else "")
        self.log.append((self._to(chat_id), shown if photo is None else f"[photo] {text}"))
        return self._json(message)

    async def _sendMessage(self, params: dict[str, Any]) -> Any:
        text = str(params.get("text", ""))
        if not text:
            return self._error(400, "Bad Request: message text is empty")
        if len(text) > 4096:
            return self._error(400, "Bad Request: message is too long")
        return self._store(int(params["chat_id"]), text, params)

    async def _sendPhoto(self, params: dict[str, Any]) -> Any:
        photo = params.get("photo")
        if not isinstance(photo, dict) or not photo.get("file"):
            return self._error(400, "Bad Request: there is no photo in the request")
        return self._store(int(params["chat_id"]), str(params.get("caption") or ""), params,
                           photo=photo["file"])

    async def _editMessageText(self, params: dict[str, Any]) -> Any:
        key = (int(params["chat_id"]), int(params["message_id"]))
        message = self._messages.get(key)
        if message is None:
            return self._error(400, "Bad Request: message to edit not found")
        text = str(params.get("text", ""))
        markup = params.get("reply_markup") or None
        if text == message.text and markup == message.reply_markup:
            return self._error(400, "Bad Request: message is not modified: specified new "
                                    "message content and reply markup are exactly the same "
                                    "as a current content and reply markup of the message")
        if len(text) > 4096:
            return self._error(400, "Bad Request: MESSAGE_TOO_LONG")
        message.text, message.reply_markup = text, markup
        message.edits += 1
        self.log.append((self._to(message.chat_id),
                         f"[edits message {message.message_id}] {text}"))
        return self._json(message)

    async def _editMessageReplyMarkup(self, params: dict[str, Any]) -> Any:
        key = (int(params["chat_id"]), int(params["message_id"]))
        message = self._messages.get(key)
        if message is None:
            return self._error(400, "Bad Request: message to edit not found")
        message.reply_markup = params.get("reply_markup") or None
        return self._json(message)

    async def _answerCallbackQuery(self, params: dict[str, Any]) -> Any:
        self.log.append(("bot", f"[answers the button press] {params.get('text', '')}"))
        return True


@asynccontextmanager
async def running_standin(token: str) -> AsyncIterator[BotApiStandIn]:
    """A started stand-in on ``127.0.0.1`` (a free port), stopped on exit."""
    standin = BotApiStandIn(token)
    app = web.Application()
    app.router.add_route("*", "/bot{token}/{method}", standin.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server = site._server
    assert server is not None
    standin.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield standin
    finally:
        standin.set_down(False)
        standin._wake()
        await runner.cleanup()
