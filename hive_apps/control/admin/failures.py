"""Turn Serve's deployment failure text into a reason a user can act on.

Serve reports a replica that failed to start as a long message with the whole
remote traceback; the line that matters (the engine's own exception) is at the
end, so cutting the text to a length from the front loses it. The reason puts
that line first and keeps as much of the rest as fits.
"""

from __future__ import annotations

import re

_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)\s*$")


def root_cause(message: str) -> str | None:
    """The last 'SomeError: text' line of a traceback, if there is one."""
    for line in reversed(message.splitlines()):
        m = _EXCEPTION_LINE.match(line)
        if m:
            return m.group(1).strip()
    return None


def failure_reason(message: str, limit: int = 2000) -> str:
    """The root cause first, then the full text cut to fit within `limit` characters."""
    cause = root_cause(message)
    if cause is None:
        return message[:limit]
    cause = cause[:limit]
    rest = limit - len(cause) - len(" | details: ")
    return cause if rest <= 0 else f"{cause} | details: {message[:rest]}"
