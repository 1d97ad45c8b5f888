"""What a request or an inbox message from another daemon may say, checked as the operator
HTTP API checks the same fields.

A sealed message comes from a daemon of the fleet, but the holder still checks what it
carries before acting on it: the desk in the body must be the desk of the subject, and the
names and reasons stored with a pause, a switch or a message must be what the API would have
accepted (so a bug, or a daemon of another version, cannot write what no operator could).
"""

from __future__ import annotations

import re
from typing import Any

from trading_agent.fleet.sealing import SealRefused

__all__ = ["check_inbox_message", "check_request"]

_NAME = re.compile(r"^[\w .@+-]{1,64}$")
"""An operator's name or a message's source, as the API's bodies allow."""

_REASON_CHARS = 2000
"""The longest reason or note, as the API allows."""

_NAMED = ("by", "operator", "source")
_TEXTS = ("reason", "note")


def check_request(desk: str, request: dict[str, Any]) -> None:
    """Checks a control request for ``desk`` (the desk of its subject).

    Raises:
        SealRefused: A field is not what the API would accept (``bad_field``), or the body
            names another desk (``desk_mismatch``).
    """
    if "desk" in request and request["desk"] not in (None, desk):
        raise SealRefused("desk_mismatch", f"asked on desk {desk}'s subject about desk "
                                           f"{str(request['desk'])[:64]!r}")
    _check_fields(request)


def check_inbox_message(desk: str, message: dict[str, Any]) -> None:
    """Checks a message in ``desk``'s inbox (the desk of its subject).

    Raises:
        SealRefused: The body names another desk or none (``desk_mismatch``), or a field is
            not what the API would accept (``bad_field``).
    """
    if message.get("desk") != desk:
        raise SealRefused("desk_mismatch", f"in desk {desk}'s inbox, for desk "
                                           f"{str(message.get('desk'))[:64]!r}")
    if not isinstance(message.get("text", ""), str):
        raise SealRefused("bad_field", "text: not a string")
    _check_fields(message)


def _check_fields(body: dict[str, Any]) -> None:
    for key in _NAMED:
        if key in body and not (isinstance(body[key], str) and _NAME.match(body[key])):
            raise SealRefused("bad_field", f"{key}: 1 to 64 letters, digits, spaces or . @ + "
                                           f"- _ are allowed")
    for key in _TEXTS:
        if key in body and not (isinstance(body[key], str)
                                and len(body[key]) <= _REASON_CHARS):
            raise SealRefused("bad_field", f"{key}: a text of at most {_REASON_CHARS} "
                                           f"characters is allowed")
