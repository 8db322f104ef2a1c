"""Errors a user of flexgen can hit.

Every message names the argument (or the mod), what was expected, what was
given, and how to fix it. Internal failures are ordinary Python exceptions;
these are for user mistakes.
"""
import torch


class FlexgenError(Exception):
    """Base class of every error flexgen raises on bad user input."""


class TraceError(FlexgenError):
    """A score_mod / mask_mod uses something flexgen cannot turn into a kernel."""


class InputError(FlexgenError, ValueError):
    """A tensor or option passed to the API has the wrong shape, dtype or value."""


class GradientError(FlexgenError):
    """A score_mod cannot be differentiated (for the gradients that were asked for)."""


def expected(arg: str, want: str, got, fix: str) -> InputError:
    """Build the standard 'argument / expected / given / fix' message."""
    return InputError(f"{arg}: expected {want}, got {got}. Fix: {fix}")


def reported(error: FlexgenError) -> FlexgenError:
    """``error``, for the caller to ``raise``; while torch.compile traces, raised here instead.

    An exception raised inside code dynamo traces reaches the user as a bare
    "Observed exception"; one raised from a function dynamo calls at compile time
    (``assume_constant_result``) keeps its message and points at the user's line.
    Code that torch.compile may trace (the public functions, the tracer, option
    parsing) raises ``reported(...)``.
    """
    if torch.compiler.is_compiling():
        # (args[0]: the message; dynamo cannot call an exception's C-level __str__.)
        _raise_at_compile_time(type(error).__name__, error.args[0] if error.args else "")
    return error


def _raise_at_compile_time(kind: str, message: str):
    raise globals().get(kind, FlexgenError)(message)


# torch.compiler.assume_constant_result(fn) sets this attribute and nothing else (torch
# 2.11 to 2.13); set directly, it spares every `import flexgen` the import of dynamo (~2 s).
_raise_at_compile_time._dynamo_marked_constant = True
