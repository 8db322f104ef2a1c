"""Errors a user of flexgen can hit.

Every message names the argument (or the mod), what was expected, what was
given, and how to fix it. Internal failures are ordinary Python exceptions;
these are for user mistakes.
"""


class FlexgenError(Exception):
    """Base class of every error flexgen raises on bad user input."""


class TraceError(FlexgenError):
    """A score_mod / mask_mod uses something flexgen cannot turn into a kernel."""


class InputError(FlexgenError, ValueError):
    """A tensor or option passed to the API has the wrong shape, dtype or value."""


def expected(arg: str, want: str, got, fix: str) -> InputError:
    """Build the standard 'argument / expected / given / fix' message."""
    return InputError(f"{arg}: expected {want}, got {got}. Fix: {fix}")
