"""The terminal printer shows model and tool text, never its terminal control codes."""

from __future__ import annotations

import io
import re

import pytest

from trading_agent.operator.render import EventPrinter, Style, describe_event

FAKE_LINE = "ok\x1b[1A\x1b[2K  approval a1 approved\x07"
CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07done"
C1 = "x\x9b2Jy\x90z\x7f"


def _printed(*events: dict[str, object]) -> str:
    out = io.StringIO()
    printer = EventPrinter(out.write, out.flush, Style(False), verbose=True)
    for event in events:
        printer.event(event)
    return out.getvalue()


def _controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f]


@pytest.mark.parametrize("text", [FAKE_LINE, CLIPBOARD, C1, "a\rb"])
def test_streamed_text_loses_its_control_codes(text: str) -> None:
    shown = _printed({"type": "text_delta", "desk": "alpha", "turn": "t", "text": text})
    assert _controls(shown) == []
    assert "\n" in _printed({"type": "text_delta", "desk": "alpha", "turn": "t",
                             "text": "line\nnext\tcol"})


@pytest.mark.parametrize("event", [
    {"type": "tool_result", "desk": "alpha", "name": "get_news", "text": FAKE_LINE},
    {"type": "tool_result", "desk": "alpha", "name": "x\x1b[2Kget", "text": "fine"},
    {"type": "tool_call", "desk": "alpha", "name": "get", "arguments": {"q": CLIPBOARD}},
    {"type": "error", "desk": "alpha", "error_type": "E\x1b[31m", "message": C1},
    {"type": "approval_resolved", "desk": "alpha", "approval_id": "a1", "outcome": "denied",
     "operator": "bob\x1b[1A", "note": CLIPBOARD},
    {"type": "something_new", "desk": "alpha", "text": CLIPBOARD},  # verbose: raw JSON
    {"type": "pins_changed", "desk": "alpha", "text": f"ann pinned #1: {FAKE_LINE}"},
])
def test_step_lines_lose_their_control_codes(event: dict[str, object]) -> None:
    shown = _printed(event)
    assert shown.strip()
    assert _controls(shown) == []


def test_a_lone_surrogate_prints_as_a_replacement_character() -> None:
    shown = _printed({"type": "text_delta", "desk": "alpha", "turn": "t", "text": "a\ud83d"})
    shown.encode("utf-8")  # a terminal (UTF-8) can take it
    assert "a\ufffd" in shown


def test_styles_still_colour_a_line() -> None:
    line = describe_event({"type": "error", "error_type": "E", "message": "boom"}, Style(True))
    assert line is not None and line.startswith("\x1b[31m")


def test_a_clearing_says_what_it_freed_and_whether_a_summary_follows() -> None:
    enough = describe_event({"type": "context_cleared", "tokens_before": 5600,
                             "tokens_after": 2100, "enough": True}, Style(False))
    short = describe_event({"type": "context_cleared", "tokens_before": 5600,
                            "tokens_after": 5100, "enough": False}, Style(False))
    assert enough == "⇣ old tool results cleared: 5,600 → 2,100 tokens"
    assert short == ("⇣ old tool results cleared: 5,600 → 5,100 tokens; not enough, "
                     "summarizing next")


def test_thinking_is_dimmed_and_folded_after_a_few_lines_then_the_answer_follows() -> None:
    out = io.StringIO()
    printer = EventPrinter(out.write, out.flush, Style(True))
    thought = "The move is small and the book is thin, so waiting is better. " * 6
    for piece in (thought[:100], thought[100:250], thought[250:]):
        printer.event({"type": "thinking_delta", "desk": "alpha", "turn": "t1", "text": piece})
    printer.event({"type": "text_delta", "desk": "alpha", "turn": "t1", "text": "No trade."})

    thinking, answer = out.getvalue().split("\n")
    assert thinking.startswith("\x1b[2m✻ thinking: ")  # dim
    plain = re.sub(r"\x1b\[[0-9;]*m", "", thinking)
    assert plain.endswith(" …") and len(plain) < len(thought)
    assert plain.removeprefix("✻ thinking: ").removesuffix(" …") == thought[:160].strip()
    assert re.sub(r"\x1b\[[0-9;]*m", "", answer) == "alpha › No trade."


def test_a_failed_hook_is_a_warning_line() -> None:
    line = describe_event({"type": "hook_failed", "hook": "Budget", "method": "before_request",
                           "error": "RuntimeError: down"}, Style(False))

    assert line == "⚠ hook Budget.before_request failed, left out: RuntimeError: down"


def test_a_protection_that_fired_is_a_warning_line() -> None:
    text = ("alpha: the BTC/USDT stop-loss at 16,500.00 closed 0.01 BTC at 16,450.00 (filled on "
            "the exchange); the trade's profit -2.93 USDT.")
    line = describe_event({"type": "protection", "what": "fired", "text": text},
                          Style(False))

    assert line == f"⛨ {text}"


def test_a_pin_changed_reads_as_one_line_naming_who_and_what() -> None:
    line = describe_event({"type": "pins_changed", "desk": "alpha", "action": "pinned",
                           "text": "ann pinned #3: Hold small. (1 pin)"}, Style(False))
    assert line == "⚑ ann pinned #3: Hold small. (1 pin)"
