"""The desk's memory tools: ``remember`` and ``recall``.

The context compressor's memory flush asks the model to save what matters with
``remember`` before older messages are summarized away; ``recall`` brings it back by key, by
a search word, or as a list of the latest notes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from trading_agent.agent.tool_registry import ToolContext, ToolRegistry
from trading_agent.errors import ToolError
from trading_agent.tools.memory_store import DeskMemory, Note

__all__ = ["RecallArguments", "RememberArguments", "register_memory_tools"]

_PREVIEW = 300


class RememberArguments(BaseModel):
    """A note to keep."""

    model_config = ConfigDict(extra="forbid")

    key: str = Field(min_length=1, max_length=100,
                     description="A short name, such as btc-plan or lessons")
    text: str = Field(min_length=1, max_length=4000, description="What to remember")


class RecallArguments(BaseModel):
    """What to recall."""

    model_config = ConfigDict(extra="forbid")

    key: str | None = Field(default=None, description="A note's exact name")
    search: str | None = Field(default=None, min_length=1,
                               description="A word to look for in names and texts")
    limit: int = Field(default=5, ge=1, le=20, description="How many notes at most")


def _line(note: Note) -> str:
    text = note.text if len(note.text) <= _PREVIEW else note.text[:_PREVIEW] + "…"
    return f"- {note.key} ({note.saved_at:%Y-%m-%d %H:%M} UTC): {text}"


def register_memory_tools(registry: ToolRegistry, memory: DeskMemory) -> None:
    """Registers ``remember`` and ``recall`` on a desk's memory.

    Args:
        registry: Where to register them.
        memory: The desk's notes.
    """

    @registry.tool(description="Save a note under a key, kept across turns, summaries and "
                               "restarts. Saving a key again replaces its text.")
    async def remember(arguments: RememberArguments, context: ToolContext) -> str:
        key = arguments.key.strip()
        previous = await memory.remember(key, arguments.text)
        if previous is None:
            return f"Saved note {key!r} ({len(arguments.text)} characters)."
        return (f"Updated note {key!r} ({len(arguments.text)} characters); it replaced the "
                f"version of {previous.saved_at:%Y-%m-%d %H:%M} UTC.")

    @registry.tool(description="Read notes: by key, by a search word, or with neither the "
                               "latest ones.")
    async def recall(arguments: RecallArguments, context: ToolContext) -> str:
        if arguments.key:
            note = await memory.recall(arguments.key.strip())
            if note is None:
                recent = await memory.recent(10)
                known = ", ".join(n.key for n in recent) or "none yet"
                raise ToolError(f"No note named {arguments.key!r}. Recent keys: {known}.")
            return (f"Note {note.key!r} (saved {note.saved_at:%Y-%m-%d %H:%M} UTC):\n"
                    f"{note.text}")
        if arguments.search:
            notes = await memory.search(arguments.search.strip(), arguments.limit)
            if not notes:
                return f"No note mentions {arguments.search!r}."
            return "\n".join([f"Notes mentioning {arguments.search!r}, newest first:",
                              *map(_line, notes)])
        notes = await memory.recent(arguments.limit)
        if not notes:
            return "No notes yet. Save one with remember."
        return "\n".join(["Latest notes, newest first:", *map(_line, notes)])
