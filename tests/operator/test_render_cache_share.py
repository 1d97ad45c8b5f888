"""How the terminal shows the share of prompt tokens served from the model's cache."""

from __future__ import annotations

from typing import Any

import pytest

from trading_agent.agent.events import TurnEnded
from trading_agent.operator.render import Style, describe_event, format_cache_share


@pytest.mark.parametrize(("cached", "prompt", "shown"), [
    (6144, 9600, "64%"),
    (0, 3000, "0%"),
    (3, 9600, "<1%"),
    (9600, 9600, "100%"),
    (12_000, 9600, "100%"),  # a server that over-reports is capped at the prompt
    (0, 0, "-"),               # no prompt today: no share
    (None, None, "-"),         # a daemon from before cached tokens were counted
    ("x", 100, "0%"),
])
def test_the_share_is_a_whole_percentage(cached: Any, prompt: Any, shown: str) -> None:
    assert format_cache_share(cached, prompt) == shown


def test_a_turn_end_says_how_much_of_its_prompt_was_cached() -> None:
    event = TurnEnded(desk="alpha", turn="t1", rounds=2, hit_round_limit=False,
                      final_text="done", input_tokens=6200, output_tokens=30, cost=0.0123,
                      cached_input_tokens=2944).to_dict()

    line = describe_event(event, Style(False))

    assert line == ("■ turn end: 2 round(s), 6,230 tokens, $0.0123, 47% of the prompt cached")
    # Nothing cached (or an event from before cached tokens were counted): no mention.
    for quiet in ({**event, "cached_input_tokens": 0},
                  {k: v for k, v in event.items() if k != "cached_input_tokens"}):
        assert describe_event(quiet, Style(False)) == (
            "■ turn end: 2 round(s), 6,230 tokens, $0.0123")
