"""Events as compact terminal lines, for ``trading-agent chat`` and ``trading-agent events``.

The desk's text streams as it is written; every other step is one short line (a tool call
and its arguments, its result's first line, an approval with the command that answers it).
:class:`EventPrinter` keeps track of whether the cursor sits in the middle of streamed text,
so a step line always starts on a line of its own.

Model and tool text is untrusted: a web page a tool fetched can hold escape sequences that
move the cursor (faking an "approved" line) or set the clipboard (OSC 52). Every string of an
event loses its C0 and C1 control characters but newline and tab before it is shown
(:func:`printable`); only this module's own styles write escape codes.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

__all__ = [
    "EventPrinter",
    "Style",
    "describe_event",
    "describe_kill_switch",
    "describe_reduce_only",
    "format_cache_share",
    "format_money",
    "format_table",
    "pin_lines",
    "printable",
]

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab and newline, DEL, and C1 controls (0x9b is a one-byte CSI)."""

_SURROGATES = re.compile("[\ud800-\udfff]")


def printable(text: str) -> str:
    """Untrusted text made safe for a terminal.

    Args:
        text: Model, tool or operator text.

    Returns:
        The text without control characters (newline and tab kept), and with any lone
        surrogate (half an emoji from a broken stream) shown as U+FFFD, which a UTF-8
        terminal can take.
    """
    return _SURROGATES.sub("\ufffd", _CONTROLS.sub("", text))


def _printable_data(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(k)): _printable_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_data(v) for v in value]
    return value


class Style:
    """ANSI styles, or none when the output is not a terminal (or ``NO_COLOR`` is set).

    Args:
        enabled: Whether to emit escape codes.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @classmethod
    def for_stream(cls, stream: TextIO) -> Style:
        """Styles when ``stream`` is a terminal and ``NO_COLOR`` is unset."""
        isatty = getattr(stream, "isatty", None)
        return cls(bool(isatty and isatty()) and "NO_COLOR" not in os.environ)

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled and text else text

    def dim(self, text: str) -> str:
        """Secondary detail."""
        return self._wrap("2", text)

    def bold(self, text: str) -> str:
        """Emphasis."""
        return self._wrap("1", text)

    def tool(self, text: str) -> str:
        """Tool calls and results."""
        return self._wrap("36", text)

    def warn(self, text: str) -> str:
        """Needs the operator's attention."""
        return self._wrap("1;33", text)

    def bad(self, text: str) -> str:
        """Errors and refusals."""
        return self._wrap("31", text)

    def good(self, text: str) -> str:
        """Success."""
        return self._wrap("32", text)


def format_money(value: Any) -> str:
    """``12,345.67``, or ``-`` when unknown."""
    if value is None:
        return "-"
    try:
        return f"{float(value):,.2f}"
    except (TypeError, ValueError):
        return str(value)


def format_cache_share(cached_tokens: Any, prompt_tokens: Any) -> str:
    """The share of prompt tokens served from the server's cache, as ``"82%"``.

    Args:
        cached_tokens: Prompt tokens served from cache.
        prompt_tokens: All prompt tokens (cached ones included).

    Returns:
        A whole percentage (``"<1%"`` for a little above none), or ``"-"`` when there were no
        prompt tokens.
    """
    cached = int(cached_tokens or 0) if isinstance(cached_tokens, int | float) else 0
    prompt = int(prompt_tokens or 0) if isinstance(prompt_tokens, int | float) else 0
    if prompt <= 0:
        return "-"
    share = 100 * min(cached, prompt) / prompt
    if 0 < share < 1:
        return "<1%"
    return f"{share:.0f}%"


def _cached_part(data: Mapping[str, Any]) -> str:
    """``", 82% of the prompt cached"`` for an event that reports cached tokens, else ``""``."""
    cached = data.get("cached_input_tokens")
    if not isinstance(cached, int) or cached <= 0:
        return ""
    return f", {format_cache_share(cached, data.get('input_tokens'))} of the prompt cached"


def _short(text: Any, width: int = 100) -> str:
    """One line, at most ``width`` characters, without control characters."""
    line = " ".join(printable(str(text)).split())
    return line if len(line) <= width else line[:width - 1] + "…"


def _arguments(raw: Any) -> str:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return _short(raw, 80)
    if isinstance(raw, dict):
        return _short(" ".join(f"{k}={json.dumps(v)}" for k, v in raw.items()), 80)
    return _short(raw, 80)


def describe_event(data: dict[str, Any], style: Style) -> str | None:
    """One event as a compact line (without the desk), or None for events not shown as lines
    (text deltas stream; usage and model requests are noise in a chat).

    Args:
        data: The event, as streamed.
        style: Colours.

    Returns:
        The line, or None.
    """
    kind = data.get("type", "")
    if kind == "turn_start":
        if data.get("silent"):
            return style.dim("▷ memory flush: the desk saves what it needs before compacting")
        source = data.get("trigger_kind", "")
        return style.dim(f"▶ turn ({source}): {_short(data.get('trigger_text', ''), 80)}")
    if kind == "tool_call":
        return style.tool(f"  → {data.get('name')} {_arguments(data.get('arguments', ''))}")
    if kind == "tool_result":
        mark = style.bad("✗") if data.get("is_error") else "←"
        images = f" [{data['image_count']} image(s)]" if data.get("image_count") else ""
        seconds = float(data.get("duration") or 0)
        first = str(data.get("text", "")).strip().splitlines() or [""]
        return style.tool(f"  {mark} {data.get('name')} {seconds:.2f}s{images}: "
                          f"{_short(first[0], 100)}")
    if kind == "tool_heartbeat":
        return style.dim(f"  … {data.get('name')} still running "
                         f"({float(data.get('elapsed') or 0):.0f} s)")
    if kind == "steering_delivered":
        return style.dim(f"  ✉ delivered to the desk after round {data.get('after_round')}: "
                         f"{_short(data.get('text', ''), 70)}")
    if kind == "approval_requested":
        approval = data.get("approval_id")
        notional = data.get("notional")
        value = f", notional {format_money(notional)}" if notional is not None else ""
        expires = max(0.0, float(data.get("expires_at") or 0) - time.time())
        return style.warn(
            f"⚠ APPROVAL {approval}: {data.get('tool')} {_arguments(data.get('arguments'))}"
            f" ({data.get('reason')}{value}) — /approve {approval} or /deny {approval} "
            f"[reason]; denied in {expires:.0f} s")
    if kind == "approval_resolved":
        outcome = data.get("outcome")
        who = f" by {data['operator']}" if data.get("operator") else ""
        note = f": {data['note']}" if data.get("note") else ""
        line = f"  approval {data.get('approval_id')} {outcome}{who}{note}"
        return style.good(line) if outcome == "approved" else style.bad(line)
    if kind == "turn_end":
        tokens = int(data.get("input_tokens") or 0) + int(data.get("output_tokens") or 0)
        cost = data.get("cost")
        price = f", ${cost:.4f}" if isinstance(cost, int | float) else ""
        how = " (round limit)" if data.get("hit_round_limit") else (
            " (stopped)" if data.get("stopped") else "")
        label = "memory flush done" if data.get("silent") else "turn end"
        return style.dim(f"■ {label}{how}: {data.get('rounds')} round(s), "
                         f"{tokens:,} tokens{price}{_cached_part(data)}")
    if kind == "retry":
        return style.warn(f"  ↻ model retry {data.get('attempt')} in "
                          f"{float(data.get('delay') or 0):.1f} s: {_short(data.get('reason'))}")
    if kind == "error":
        return style.bad(f"✗ {data.get('error_type')}: {_short(data.get('message'), 200)}")
    if kind == "turn_retried":
        return style.warn(f"↻ {data.get('by')} retried the last turn: its answer "
                          f"({data.get('dropped')} message(s)) left what the desk is sent; it "
                          f"runs again from {_short(data.get('trigger_text'), 120)!r}")
    if kind == "hook_failed":
        return style.warn(f"⚠ hook {data.get('hook')}.{data.get('method')} failed, left out: "
                          f"{_short(data.get('error'), 200)}")
    if kind == "compaction_start":
        return style.dim(f"⇣ compacting ({data.get('reason')}): "
                         f"{int(data.get('tokens_before') or 0):,} tokens")
    if kind == "compaction_end":
        return style.dim(f"⇣ compacted: {int(data.get('tokens_before') or 0):,} → "
                         f"{int(data.get('tokens_after') or 0):,} tokens, "
                         f"{data.get('messages_summarized')} message(s) summarized")
    if kind == "context_cleared":
        then = "" if data.get("enough") else "; not enough, summarizing next"
        return style.dim(f"⇣ old tool results cleared: {int(data.get('tokens_before') or 0):,}"
                         f" → {int(data.get('tokens_after') or 0):,} tokens{then}")
    if kind == "memory_flush":
        return style.dim(f"⇣ memory flush: {data.get('tool_calls')} note(s) saved")
    if kind == "overflow_recovery":
        return style.warn(f"  ⇣ the prompt overflowed the model's window; compacting: "
                          f"{_short(data.get('message'))}")
    if kind == "stream_reconnecting":
        return style.warn(f"(connection to the daemon lost: {_short(data.get('error'), 80)}; "
                          f"reconnecting in {float(data.get('retry_in') or 0):.1f} s)")
    if kind == "events_dropped":
        return style.warn(f"({data.get('count')} events were dropped for a slow reader)")
    return _describe_control(kind, data, style)


def _describe_control(kind: str, data: dict[str, Any], style: Style) -> str | None:
    """The operator's controls: kill switch, pause, cancel, spend caps, reload."""
    if kind == "kill_switch":
        line = f"⛔ {_short(data.get('text'), 300)}"
        return style.bad(line) if data.get("on") else style.good(line)
    if kind == "reduce_only":
        line = f"⇲ {_short(data.get('text'), 400)}"
        return style.warn(line) if data.get("on") else style.good(line)
    if kind == "model_switched":
        return style.warn(f"⇄ now on model {data.get('model')} (was {data.get('previous')}): "
                          f"{_short(data.get('reason'), 200)}")
    if kind == "desk_paused":
        until = data.get("until")
        when = (f" until {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(until))}"
                if isinstance(until, int | float) else " until resumed")
        return style.warn(f"⏸ paused by {data.get('by')}{when}: {_short(data.get('reason'), 200)}")
    if kind == "desk_resumed":
        waiting = int(data.get("waiting") or 0)
        return style.good(f"▶ resumed by {data.get('by')}"
                          + (f"; {waiting} trigger(s) waited" if waiting else ""))
    if kind == "turn_cancelled":
        how = "at once" if data.get("now") else "at its next safe point"
        return style.warn(f"✋ turn cancelled by {data.get('by')} ({how})")
    if kind == "order_filled":
        return style.good(f"✓ {_short(data.get('text'), 200)}")
    if kind == "pins_changed":
        return style.warn(f"⚑ {_short(data.get('text'), 300)}")
    if kind == "spend_alert":
        return style.warn(f"$ {_short(data.get('text'), 200)}")
    if kind == "storage":
        line = f"⛁ {_short(data.get('text'), 400)}"
        return style.bad(line) if data.get("full") else style.good(line)
    if kind == "config_reloaded":
        changes = [str(c) for c in data.get("changes") or []]
        if not data.get("ok"):
            return style.bad("config reload refused, nothing changed: "
                             + _short("; ".join(changes), 300))
        return style.good("config reloaded: " + (_short("; ".join(changes), 300)
                                                 if changes else "nothing changed"))
    if kind == "protection":
        return style.warn(f"⛨ {_short(data.get('text'), 300)}")
    if kind == "reconciliation":
        differences = [str(d) for d in data.get("differences") or []]
        return style.warn(f"⚖ the exchange differs from the journal ({len(differences)}): "
                          + _short("; ".join(differences), 300))
    return None


THINKING_SHOWN = 160
"""How much of a turn's thinking the chat shows before it folds the rest away."""


class EventPrinter:
    """Writes events to a terminal: text as it streams, steps as lines.

    Args:
        write: Where text goes (``sys.stdout.write``), flushed by the caller's ``flush``.
        flush: Flushes the output.
        style: Colours.
        show_desk: Prefix lines with the desk's name (several desks in one stream).
        verbose: Also show model requests and usage.
    """

    def __init__(self, write: Callable[[str], Any], flush: Callable[[], Any], style: Style,
                 *, show_desk: bool = False, verbose: bool = False) -> None:
        self._write = write
        self._flush = flush
        self.style = style
        self._show_desk = show_desk
        self._verbose = verbose
        self._mid_line = False
        self._streaming: tuple[str, str | None] | tuple[str, str | None, str] | None = None
        self._thought: dict[tuple[str, str | None], int] = {}
        """Characters of thinking shown per turn (the rest is folded away)."""

    def _prefix(self, data: dict[str, Any]) -> str:
        if not self._show_desk:
            return ""
        stamp = time.strftime("%H:%M:%S", time.localtime(float(data.get("at") or time.time())))
        return self.style.dim(f"{stamp} ") + self.style.bold(f"{data.get('desk', '?')}") + " "

    def _thinking(self, data: dict[str, Any]) -> None:
        """The model's reasoning, dimmed and folded: the first :data:`THINKING_SHOWN`
        characters of a turn's, then an ellipsis."""
        turn = (str(data.get("desk")), data.get("turn"))
        shown = self._thought.get(turn, 0)
        if shown > THINKING_SHOWN:
            return
        key = (*turn, "thinking")
        if self._streaming != key:
            if self._mid_line:
                self._write("\n")
            self._write(self._prefix(data) + self.style.dim("✻ thinking: "))
            self._streaming = key
        text = str(data.get("text", "")).replace("\r", " ").replace("\n", " ")
        room = THINKING_SHOWN - shown
        self._write(self.style.dim(text[:room] + (" …" if len(text) > room else "")))
        self._thought[turn] = shown + len(text) + (1 if len(text) > room else 0)
        self._mid_line = True
        self._flush()

    def line(self, text: str) -> None:
        """Writes a line of its own (after ending any streamed text)."""
        if self._mid_line:
            self._write("\n")
            self._mid_line = False
        self._streaming = None
        self._write(text + "\n")
        self._flush()

    def event(self, data: dict[str, Any]) -> None:
        """Shows one event (its text without control characters, see :func:`printable`)."""
        data = _printable_data(data)
        kind = data.get("type")
        if kind == "stream_open":
            return
        if kind == "thinking_delta":
            self._thinking(data)
            return
        if kind == "turn_end":
            self._thought.pop((str(data.get("desk")), data.get("turn")), None)
        if kind == "text_delta":
            key = (str(data.get("desk")), data.get("turn"))
            if self._streaming != key:
                if self._mid_line:
                    self._write("\n")
                if self._show_desk:
                    self._write(self._prefix(data) + self.style.bold("›") + " ")
                else:
                    self._write(self.style.bold(f"{data.get('desk')} ›") + " ")
                self._streaming = key
            text = str(data.get("text", ""))
            self._write(text)
            self._mid_line = True if not text else not text.endswith("\n")
            self._flush()
            return
        line = describe_event(data, self.style)
        if line is None and self._verbose:
            line = self.style.dim(_short(json.dumps(data), 160))
        if line is not None:
            self.line(self._prefix(data) + line)


def format_table(rows: list[list[str]], header: list[str], style: Style) -> str:
    """A plain aligned table: numbers right-aligned, text left-aligned.

    Args:
        rows: The cells, as text.
        header: The column names.
        style: Colours (the header is bold).

    Returns:
        The table, one line per row.
    """
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
              for i in range(len(header))]

    def numeric(column: int) -> bool:
        cells = [r[column] for r in rows if r[column] not in ("-", "")]
        return bool(cells) and all(c.replace(",", "").replace(".", "").replace("$", "")
                                   .lstrip("-").isdigit() for c in cells)

    right = [numeric(i) for i in range(len(header))]

    def render(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w)
                         for c, w, r in zip(cells, widths, right, strict=True)).rstrip()

    return "\n".join([style.bold(render(header)), *(render(r) for r in rows)])


def describe_kill_switch(result: dict[str, Any]) -> str:
    """The daemon's answer to a kill switch request, as lines for a person."""
    scope = result.get("scope")
    whose = "every desk" if scope == "*" else f"desk {scope}"
    lines: list[str] = []
    if result.get("on"):
        halt = result.get("halt") or {}
        lines.append(f"Kill switch ON for {whose}: {halt.get('text', '')}")
        lines.append("Every new order is refused before any exchange sees it, until "
                     "'trading-agent kill-switch off"
                     + ("'." if scope == "*" else f" --desk {scope}'."))
    else:
        was = result.get("was")
        lines.append(f"Kill switch off for {whose}" + (f" (it was {was['text']})."
                                                       if was else ": it was not on."))
        for halt in result.get("still_on", []):
            lines.append(f"  Still on: desk {halt['scope']}'s own switch, {halt['text']}; "
                         f"switch it off with --desk {halt['scope']}.")
    lines += [f"  {line}" for line in result.get("cancelled", [])]
    lines += [f"  {line}" for line in result.get("flattened", [])]
    lines += [f"  FAILED: {line}" for line in result.get("failed", [])]
    return printable("\n".join(lines))


def describe_reduce_only(result: dict[str, Any]) -> str:
    """The daemon's answer to a reduce-only request, as a line for a person."""
    desk = result.get("desk")
    if result.get("on"):
        state = result.get("state") or {}
        return printable(f"{desk} is in reduce-only: {state.get('text', '')}. Orders that "
                         "would open, grow or reverse a position are refused; orders that "
                         f"shrink one pass. Lift it with 'trading-agent reduce-only off {desk}'.")
    was = result.get("was")
    return printable(f"{desk} is no longer in reduce-only (it was {was['text']})." if was
                     else f"{desk} was not in reduce-only.")


def pin_lines(result: dict[str, Any]) -> list[str]:
    """A desk's standing instructions (the answer of ``GET .../pins``), a line each: id,
    who pinned it and when, the text; then the config's."""
    pins = result.get("pins") or []
    configured = result.get("configured") or []
    lines = [f"#{p['id']} by {p['by']} at {str(p['at'])[:19].replace('T', ' ')} UTC: "
             f"{p['text']}" for p in pins]
    lines += [f"(config) {text}" for text in configured]
    return lines or [f"{result.get('desk')} has no standing instructions."]
