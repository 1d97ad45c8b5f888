"""What the loop sends, kept from one model call to the next and extended, not rebuilt.

Before every model call the loop sends the conversation's window as it must be sent: old tool
results cleared, repaired (every call answered), long messages cut, old pictures pruned.
Between two compactions or clearings the window only grows by appends, so
:class:`SentWindow` keeps what it prepared last time and processes only the messages added
since (from the last point where no tool call waited for its results): a model call costs
what changed, not the length of the history. When only the token scale moved far enough to
change how long a message may be (the first calls after a restart, as the scale is
calibrated), only the messages long enough to be cut are cut again. The result is, message
for message, what
:func:`prepare_window` (the whole pipeline run from scratch) gives; a test holds them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trading_agent.agent.context_compressor import ContextCompressor
from trading_agent.agent.conversation import Conversation, Message, estimate_tokens, repair
from trading_agent.agent.image_preparer import ImagePreparer
from trading_agent.agent.shared_messages import SharedMessages

__all__ = ["Prepared", "SentWindow", "prepare_window"]


@dataclass(frozen=True)
class Prepared:
    """A window ready to send.

    Attributes:
        messages: The messages, as sent: the window's prepared list shared, not copied
            (:class:`SharedMessages`), unless old pictures were pruned from it.
        tokens: Their estimated tokens (characters / 4, a fixed cost per picture).
        images: The pictures among them.
    """

    messages: Sequence[Message]
    tokens: int
    images: int


def prepare_window(conversation: Conversation, compressor: ContextCompressor | None,
                   preparer: ImagePreparer) -> list[Message]:
    """The whole pipeline from scratch: clear, repair, cut, prune (the reference).

    Args:
        conversation: The conversation.
        compressor: Clears and cuts (None: nothing is).
        preparer: Prunes old pictures.

    Returns:
        The messages to send.
    """
    return preparer.prune(_process(conversation, compressor, conversation.window(),
                                   clearable=True), conversation.picture_limit)


def _process(conversation: Conversation, compressor: ContextCompressor | None,
             messages: Sequence[Message], *, clearable: bool) -> list[Message]:
    """Clear, repair and cut ``messages``: a run of the window that no tool call straddles
    (``clearable`` when it starts before the conversation's ``cleared_until``)."""
    return _trim(conversation, compressor, _repaired(conversation, compressor, messages,
                                                    clearable=clearable))


def _repaired(conversation: Conversation, compressor: ContextCompressor | None,
              messages: Sequence[Message], *, clearable: bool) -> list[Message]:
    """Clear and repair ``messages`` (:func:`_process` before the cut)."""
    processed = list(messages)
    if compressor is not None and clearable:
        processed = compressor.cleared(conversation, processed)
    return repair(processed)


def _trim(conversation: Conversation, compressor: ContextCompressor | None,
          messages: list[Message]) -> list[Message]:
    if compressor is None:
        return messages
    return compressor.trim(messages, conversation.token_scale)


class SentWindow:
    """One conversation's window as last prepared, extended on the next call.

    Args:
        compressor: Clears and cuts (None: nothing is).
        preparer: Prunes old pictures.
    """

    def __init__(self, compressor: ContextCompressor | None, preparer: ImagePreparer) -> None:
        self._compressor = compressor
        self._preparer = preparer
        self._key: tuple[object, ...] | None = None
        self._uncut: list[Message] = []
        """``_sent`` before long messages were cut."""
        self._long: list[int] = []
        """Positions in ``_sent`` of the messages a cut may shorten."""
        self._sources: list[Message] = []
        """The conversation's messages processed for good (up to a stable point)."""
        self._sent: list[Message] = []
        """What they (and the summary) are sent as, before pictures are pruned. Requests
        share it (:class:`SharedMessages`), so it only ever grows at its end: any other change
        is made on a new list."""
        self._tokens = 0
        self._pictures: list[int] = []
        """Positions in ``_sent`` of the messages holding pictures."""

    def build(self, conversation: Conversation) -> Prepared:
        """The window to send now.

        Args:
            conversation: The conversation (another one, such as a scratch fork, simply
                starts afresh).

        Returns:
            The messages as sent, their estimated tokens and their pictures.
        """
        compressor = self._compressor
        max_chars = (compressor.max_message_chars(conversation.token_scale)
                     if compressor is not None else 0)
        key = (id(conversation), conversation.summary, conversation.window_start,
               conversation.cleared_until, max_chars)
        # The window is conversation.messages from window_start: read in place, since a
        # slice would copy the whole history for each call.
        everything, offset = conversation.messages, conversation.window_start
        if not self._still_prefix(everything, offset):
            self._start(key, conversation)
        elif key != self._key:
            if self._key is not None and key[:-1] == self._key[:-1]:
                self._cut_again(key, conversation)  # only the token scale moved
            else:
                self._start(key, conversation)
        done = len(self._sources)
        added = everything[offset + done:]
        stable = done + _stable_end(added)
        until = conversation.cleared_until - offset
        if stable > done:
            self._add(conversation, _repaired(conversation, compressor, added[:stable - done],
                                              clearable=done < until))
            self._sources.extend(added[:stable - done])
        pending = _process(conversation, compressor, added[stable - done:],
                           clearable=stable < until)
        return self._pruned(pending, conversation.picture_limit)

    def _still_prefix(self, everything: list[Message], offset: int) -> bool:
        """Whether the messages processed are still the start of the window (``everything``
        from ``offset``).

        A window only changes at its end between compactions (an append; a replayed last
        message taken off and put back): the first and last processed ones are checked.
        """
        sources = self._sources
        if not sources:
            return True
        return (len(everything) - offset >= len(sources) and everything[offset] is sources[0]
                and everything[offset + len(sources) - 1] is sources[-1])

    def _start(self, key: tuple[object, ...], conversation: Conversation) -> None:
        self._key = key
        self._sources = []
        self._sent = []
        self._uncut = []
        self._long = []
        self._tokens = 0
        self._pictures = []
        if conversation.summary is not None:
            self._add(conversation, _repaired(conversation, self._compressor,
                                              [conversation.summary], clearable=False))

    def _cut_again(self, key: tuple[object, ...], conversation: Conversation) -> None:
        """The messages long enough to be cut, cut to the new length."""
        self._key = key
        # A new list: what the requests before this one sent shares the old one, which only
        # ever grows at its end (see SharedMessages).
        self._sent = list(self._sent)
        uncut = [self._uncut[position] for position in self._long]
        for position, cut in zip(self._long, _trim(conversation, self._compressor, uncut),
                                 strict=True):
            self._tokens += estimate_tokens(cut) - estimate_tokens(self._sent[position])
            self._sent[position] = cut

    def _add(self, conversation: Conversation, repaired: list[Message]) -> None:
        base = len(self._sent)
        processed = _trim(conversation, self._compressor, repaired)
        self._sent.extend(processed)
        self._uncut.extend(repaired)
        compressor = self._compressor
        if compressor is not None:
            self._long.extend(base + i for i, m in enumerate(repaired) if compressor.may_trim(m))
        self._tokens += sum(estimate_tokens(m) for m in processed)
        self._pictures.extend(base + i for i, m in enumerate(processed) if m.image_count)

    def _pruned(self, pending: list[Message], limit: int | None) -> Prepared:
        """The whole window with only the newest pictures kept (at most ``limit``, when
        the conversation has one)."""
        keep = self._preparer.kept(limit)
        sent = self._sent
        tokens = self._tokens + sum(estimate_tokens(m) for m in pending)
        base = len(sent)
        positions = [*self._pictures, *(base + i for i, m in enumerate(pending)
                                        if m.image_count)]
        images = sum((sent[p] if p < base else pending[p - base]).image_count
                     for p in positions)
        if images <= keep:
            return Prepared(SharedMessages(sent, base, pending), tokens, images)
        messages = [*sent, *pending]
        with_pictures = [messages[p] for p in positions]
        # Pruning depends only on the order of the messages holding pictures.
        for position, old, new in zip(positions, with_pictures,
                                      self._preparer.prune(with_pictures, keep), strict=True):
            if new is not old:
                messages[position] = new
                tokens += estimate_tokens(new) - estimate_tokens(old)
        return Prepared(messages, tokens, min(images, keep))


def _stable_end(messages: Sequence[Message]) -> int:
    """The length of the longest prefix that no tool call waiting for its results ends:
    repair treats what comes before and after such a point separately."""
    end = len(messages)
    while end > 0 and messages[end - 1].role == "assistant" and messages[end - 1].tool_uses:
        end -= 1
    return end
