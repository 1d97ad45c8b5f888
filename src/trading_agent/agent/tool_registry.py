"""Typed tools: a pydantic model describes a tool's arguments and gives its JSON schema.

A tool is an async function ``handler(arguments, context) -> ToolOutput | str``. It raises
:class:`~trading_agent.errors.ToolError` to refuse with a message the model reads.

A tool may also have a *precheck*, ``precheck(arguments, context) -> None``: a refusal that
can be known before the call does anything (an order that breaks a risk limit). The executor
runs it before it asks the approval gate, so nobody is asked to approve a call that would be
refused anyway; it raises :class:`~trading_agent.errors.ToolError` to end the call there.
It never replaces the handler's own check: the world may change while the gate waits.

Example::

    registry = ToolRegistry()

    class TickerArguments(BaseModel):
        symbol: str = Field(description="Market symbol, such as BTC/USDT")

    @registry.tool(description="Last price, bid and ask of a market.")
    async def get_ticker(arguments: TickerArguments, context: ToolContext) -> str:
        ...
"""

from __future__ import annotations

import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from trading_agent.agent.backend import Usage
from trading_agent.agent.conversation import ImageBlock

if TYPE_CHECKING:
    from trading_agent.agent.event_bus import EventBus
    from trading_agent.agent.image_preparer import ImagePreparer

__all__ = ["Tool", "ToolContext", "ToolHandler", "ToolOutput", "ToolPrecheck", "ToolRegistry"]


@dataclass(frozen=True)
class ToolContext:
    """Who a tool call acts for.

    Attributes:
        desk: The desk's name.
        turn: The turn's id.
        call_id: The tool call's id.
        events: The bus the desk publishes on (a subagent publishes its steps here).
        image_preparer: Sizes pictures to the desk's limits (the executor's own); a tool that
            runs a model itself (a subagent) hands it on. The executor sizes every picture a
            tool returns, so a tool need not.
    """

    desk: str
    turn: str
    call_id: str
    events: EventBus
    image_preparer: ImagePreparer | None = None


@dataclass(frozen=True)
class ToolOutput:
    """What a tool returns.

    Attributes:
        text: Compact text the model reads.
        images: Pictures (a chart) the model sees with the text; the executor sizes each to
            the desk's limits before the model or the store sees it.
        is_error: Whether this reports a failure.
        usage: Tokens the tool itself spent on a model (a subagent), added to the turn's.
        refused_limit: The risk limit that refused the call, when one did (for metrics).
    """

    text: str
    images: tuple[ImageBlock, ...] = ()
    is_error: bool = False
    usage: Usage | None = None
    refused_limit: str | None = None


ToolHandler = Callable[[Any, ToolContext], Awaitable[ToolOutput | str]]

ToolPrecheck = Callable[[Any, ToolContext], Awaitable[None]]
"""``(arguments, context) -> None``: raises :class:`~trading_agent.errors.ToolError` to refuse
a call before the approval gate is asked."""


@dataclass(frozen=True)
class Tool:
    """One tool the model may call.

    Attributes:
        name: The name the model calls it by.
        description: What it does, for the model.
        arguments: The pydantic model of its arguments.
        handler: The function that runs it.
        dangerous: Whether a call must pass the approval gate first (placing an order).
        timeout_seconds: How long a call may run before it is abandoned with an error (and,
            separately, how long its precheck may take).
        precheck: Refuses a call before the approval gate is asked (see the module
            docstring); None: the gate is asked at once.
    """

    name: str
    description: str
    arguments: type[BaseModel]
    handler: ToolHandler
    dangerous: bool = False
    timeout_seconds: float = 30.0
    precheck: ToolPrecheck | None = None
    _definition: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def definition(self) -> dict[str, Any]:
        """The OpenAI-style function-calling definition (computed once)."""
        if not self._definition:
            schema = self.arguments.model_json_schema()
            schema.pop("title", None)
            for prop in schema.get("properties", {}).values():
                if isinstance(prop, dict):
                    prop.pop("title", None)
            self._definition.update({
                "type": "function",
                "function": {
                    "name": self.name,
                    "description": self.description,
                    "parameters": schema,
                },
            })
        return self._definition


class ToolRegistry:
    """The tools a desk has, by name.

    Args:
        tools: Tools to start with.
    """

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> Tool:
        """Registers a tool.

        Raises:
            ValueError: A tool of that name is already registered.
        """
        if tool.name in self._tools:
            raise ValueError(f"a tool named {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def tool(
        self,
        *,
        description: str,
        name: str | None = None,
        dangerous: bool = False,
        timeout_seconds: float = 30.0,
        precheck: ToolPrecheck | None = None,
    ) -> Callable[[ToolHandler], ToolHandler]:
        """A decorator that registers an async function as a tool.

        The arguments model is the annotation of the function's first parameter.

        Args:
            description: What the tool does, for the model.
            name: The tool's name; the function's name by default.
            dangerous: Whether calls pass the approval gate.
            timeout_seconds: The call's time limit.
            precheck: Refuses a call before the approval gate is asked.
        """

        def register(handler: ToolHandler) -> ToolHandler:
            hints = typing.get_type_hints(handler)
            first = next(iter(hints.values()))
            if not (isinstance(first, type) and issubclass(first, BaseModel)):
                raise TypeError(f"{handler.__name__}: the first parameter must be annotated "
                                "with a pydantic model")
            self.add(Tool(name or handler.__name__, description, first, handler,
                          dangerous, timeout_seconds, precheck))
            return handler

        return register

    def remove(self, name: str) -> None:
        """Unregisters a tool (a stand-in replaced by the real one); absent names are
        ignored."""
        self._tools.pop(name, None)

    def get(self, name: str) -> Tool | None:
        """The tool called ``name``, or None."""
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        """The registered tools' names, in registration order."""
        return list(self._tools)

    def definitions(self) -> list[dict[str, Any]]:
        """One function-calling definition per tool."""
        return [tool.definition() for tool in self._tools.values()]

    def subset(self, names: Iterable[str]) -> ToolRegistry:
        """A registry holding only the named tools (unknown names are ignored)."""
        return ToolRegistry(self._tools[n] for n in names if n in self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)
