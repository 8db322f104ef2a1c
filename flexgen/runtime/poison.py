"""Poisoned outputs: one switch that fills every output with NaN before a kernel writes it.

Set ``FLEXGEN_POISON=1`` (the tests do) and an element a kernel forgets to write
shows up as NaN instead of whatever the allocator left there. Read once at
import; ``ENABLED`` can be flipped at run time (a test that imports flexgen first).
"""
from __future__ import annotations

import os

ENABLED = os.environ.get("FLEXGEN_POISON") == "1"


def poison(*tensors) -> None:
    """Fill each tensor (None is skipped) with NaN when poisoning is on."""
    if ENABLED:
        for t in tensors:
            if t is not None:
                t.fill_(float("nan"))
