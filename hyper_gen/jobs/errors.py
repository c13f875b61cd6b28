"""The errors a product part raises for its caller to print as one line, not as a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


class Interrupted(Exception):
    """Ctrl-C: printed as one line (saying how to resume, where there is something to resume)."""
