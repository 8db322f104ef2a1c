"""``Snippet``: a mod's printed Triton statements, as kernel specs hold them.

Its own module, free of sympy, so that a spec can be rebuilt from the restart
index (``flexgen.codegen.index``) in a process that never imports the printer.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Snippet:
    """Statements computing one value, ready to paste into a template."""
    lines: tuple        # "name = code" statements, in order
    result: str         # the expression holding the value after ``lines``
    kind: str           # "bool", "int" or "float"
