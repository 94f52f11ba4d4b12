"""The address an `expertcache serve --port 0` child printed: its 'serving ... on http://HOST:PORT with'
line, read from the child's log; the serving tests and benchmarks/server_faults.py start servers this
way, so that servers started at once never race for a port chosen before they bind."""

from __future__ import annotations

import re

_SERVING = re.compile(r"^serving .* on (http://\S+) with ", re.MULTILINE)


def served_url(log: str) -> str | None:
    """The base URL of the first 'serving' line in `log`, or None before the server printed it."""
    m = _SERVING.search(log)
    return None if m is None else m.group(1)
