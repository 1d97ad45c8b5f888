"""The OS user the tests run as: the name the daemon records for an action on its Unix
socket, whatever name the request gives (the socket's operator is its peer's OS user)."""

from __future__ import annotations

import os
import pwd

__all__ = ["OS_USER"]

OS_USER = pwd.getpwuid(os.geteuid()).pw_name
"""The login name of the user running the tests (computed, never assumed to be root)."""
