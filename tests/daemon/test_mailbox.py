"""A desk's one mailbox: triggers and operator messages, one owner, each message once."""

from __future__ import annotations

from trading_agent.agent.steering_inbox import SteeringMessage
from trading_agent.agent.trigger import Trigger
from trading_agent.daemon.mailbox import Mailbox


def _taken(mailbox: Mailbox) -> list[Trigger]:
    triggers = []
    while (trigger := mailbox.triggers.take()) is not None:
        triggers.append(trigger)
    return triggers


def test_a_message_is_a_trigger_while_idle_and_waits_for_the_model_during_a_turn() -> None:
    mailbox = Mailbox()
    idle, busy = SteeringMessage("While idle."), SteeringMessage("During the turn.")

    mailbox.put_message(idle)
    mailbox.in_turn = True
    mailbox.put_message(busy)

    assert [(t.kind, t.text, t.after_answer) for t in _taken(mailbox)] == [
        ("operator", "While idle.", False)]
    assert mailbox.take_all() == [busy] and mailbox.take_all() == []


def test_messages_left_when_a_turn_ends_open_the_next_first_and_follow_it() -> None:
    mailbox = Mailbox()
    mailbox.triggers.put(Trigger(kind="tick", text="BTC +1%", source="BTC/USDT"))
    mailbox.in_turn = True
    first, second = SteeringMessage("Sell half."), SteeringMessage("Then the rest.")
    mailbox.put_message(first)
    mailbox.put_message(second)

    mailbox.turn_ended()

    assert not mailbox.in_turn
    opening, tick = _taken(mailbox)
    assert (opening.id, opening.after_answer, opening.kind) == (first.id, True, "operator")
    assert tick.kind == "tick"
    assert mailbox.take_all() == [second]  # delivered before the opened turn's first call


def test_each_message_is_taken_once_whichever_way_it_comes_until_a_restore() -> None:
    mailbox = Mailbox()
    message = SteeringMessage("Careful today.")

    assert mailbox.put_message(message)
    assert not mailbox.put_message(message)  # sent, and found undelivered by a restore
    assert len(_taken(mailbox)) == 1
    mailbox.forget()
    assert mailbox.put_message(message)


def test_after_a_failure_every_waiting_message_queues_a_turn_of_its_own() -> None:
    mailbox = Mailbox()
    mailbox.in_turn = True
    mailbox.put_message(SteeringMessage("One."))
    mailbox.put_message(SteeringMessage("Two."))

    mailbox.to_triggers()

    assert [t.text for t in _taken(mailbox)] == ["One.", "Two."]
    assert mailbox.take_all() == []


def test_the_mailbox_says_how_it_took_each_message_and_keeps_the_first_answer() -> None:
    mailbox = Mailbox()
    idle, busy = SteeringMessage("While idle."), SteeringMessage("During the turn.")

    mailbox.put_message(idle)
    mailbox.in_turn = True
    mailbox.put_message(busy)
    mailbox.put_message(idle)  # found again by a restore during the turn: still its turn

    assert mailbox.delivery(idle.id) == "turn"
    assert mailbox.delivery(busy.id) == "steering"
    assert mailbox.delivery(SteeringMessage("Never sent.").id) is None
