"""A desk's MCP tools in a backtest: recorded answers replayed, no server ever started.

An MCP server answers about *now* (today's news, a live quote): asked during a backtest, it
would hand the desk the future, and it may act in the world. So a backtest never starts or
contacts one. What it can do is replay answers recorded beside the response cache, in
``<cache dir>/<desk>.mcp.jsonl``, one JSON object a line:

- a tool: ``{"server": "news", "tool": "search", "description": "...", "parameters":
  {JSON schema}}``; the desk is offered it as the daemon names it, ``news__search``;
- an answer: ``{"server": "news", "tool": "search", "arguments": {...}, "result": "text",
  "is_error": false}``.

A call whose arguments (compared as JSON, keys in any order) have a recorded answer gets it;
any other call is refused in the tool result, saying why, so the model reads the reason and
the turn goes on. A server with no recorded tool offers none, and the report says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from trading_agent.agent.tool_registry import Tool, ToolContext, ToolHandler, ToolRegistry
from trading_agent.errors import ConfigError, ToolError
from trading_agent.tools.config import McpServerConfig

__all__ = ["McpReplay", "recordings_path"]


def recordings_path(cache_file: Path) -> Path:
    """Where a desk's MCP recordings are, beside its response cache file
    (``alpha.jsonl`` → ``alpha.mcp.jsonl``)."""
    return cache_file.with_suffix(".mcp.jsonl")


class _RecordedArguments(BaseModel):
    """Any object; the model is shown the recorded schema."""

    model_config = ConfigDict(extra="allow")

    schema_shown: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The recorded schema (a copy: the registry edits what it gets)."""
        copied: dict[str, Any] = json.loads(json.dumps(cls.schema_shown))
        return copied


@dataclass
class McpReplay:
    """The recorded MCP tools and answers of one desk.

    Args:
        path: The recordings file; a missing file records nothing.

    Raises:
        ConfigError: A line is not a recording.
    """

    path: Path
    tools: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    answers: dict[tuple[str, str, str], tuple[str, bool]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    """One sentence per server whose tools were not offered."""

    def __post_init__(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{self.path}: cannot read the MCP recordings: {exc}") from None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                server, tool = str(entry["server"]), str(entry["tool"])
                if "arguments" in entry:
                    self.answers[(server, tool, _canonical(entry["arguments"]))] = (
                        str(entry["result"]), bool(entry.get("is_error", False)))
                else:
                    self.tools[(server, tool)] = {
                        "description": str(entry.get("description") or f"The {tool} tool"),
                        "parameters": dict(entry.get("parameters")
                                           or {"type": "object", "properties": {}})}
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(f"{self.path}:{number}: not an MCP recording ({exc}); a "
                                  "line is a tool (server, tool, description, parameters) or "
                                  "an answer (server, tool, arguments, result)") from None

    async def register(self, server: McpServerConfig, registry: ToolRegistry) -> None:
        """Registers the recorded tools of ``server`` (those its config allows)."""
        offered = [(tool, spec) for (name, tool), spec in sorted(self.tools.items())
                   if name == server.name and (server.tools is None or tool in server.tools)]
        if not offered:
            self.notices.append(
                f"MCP server {server.name}: no tool of it is recorded in {self.path}, so the "
                "desk was offered none of its tools (a backtest never starts an MCP server)")
            return
        for tool, spec in offered:
            name = f"{server.name}__{tool}"
            arguments = type(f"{name}_arguments", (_RecordedArguments,),
                             {"schema_shown": spec["parameters"]})
            registry.add(Tool(name=name,
                              description=f"{spec['description']} (MCP server {server.name})",
                              arguments=arguments, handler=self._handler(server.name, tool)))

    def _handler(self, server: str, tool: str) -> ToolHandler:
        async def call(arguments: BaseModel, context: ToolContext) -> str:
            given = dict(arguments.model_extra or {})
            answer = self.answers.get((server, tool, _canonical(given)))
            if answer is None:
                raise ToolError(
                    f"{server}__{tool} was not run: a backtest never starts or contacts the MCP "
                    f"server {server!r} (it would answer about today, not the simulated "
                    "time), and no answer to this call is recorded in the response cache; "
                    "decide without it.")
            text, is_error = answer
            if is_error:
                raise ToolError(text)
            return text

        return call


def _canonical(arguments: Any) -> str:
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
