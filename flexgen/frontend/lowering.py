"""From a traced mod to what a kernel template needs, memoized.

``lower`` runs sympy (canonical form) and the printer once per distinct
traced graph; a later call with the same graph, even with other captured
tensors of the same dtype and rank, is a dict lookup.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..codegen.printer import Snippet, print_snippet
from ..frontend.expr import canonical_text, to_sympy
from ..codegen.spec import BufferSig
from ..frontend.trace import TracedMod

PREFIX = {"score_mod": "s", "mask_mod": "m", "decay_mod": "d", "feature_map": "f"}


@dataclass(frozen=True)
class LoweredMod:
    expr: sympy.Basic           # canonical sympy form
    canonical: str              # its stable text
    snippet: Snippet            # Triton statements computing it
    buffers: tuple              # BufferSig per captured tensor, in slot order

    @property
    def is_true(self) -> bool:
        """A mask that keeps everything (noop_mask and its spellings)."""
        return self.expr is sympy.true


_LOWERED: dict = {}


def lower(traced: TracedMod) -> LoweredMod:
    """Canonical expression, snippet and buffer signatures of ``traced``."""
    hit = _LOWERED.get(traced.signature)
    if hit is None:
        prefix = PREFIX[traced.kind]
        expr = to_sympy(traced, prefix)
        snippet = print_snippet(expr, f"{prefix}_")
        buffers = tuple(BufferSig(f"{prefix}buf{i}", t.dim(), str(t.dtype).replace("torch.", ""))
                        for i, t in enumerate(traced.buffers))
        if len(_LOWERED) >= 4096:        # mods made per call: stay bounded
            _LOWERED.clear()
        hit = _LOWERED[traced.signature] = LoweredMod(expr, canonical_text(expr), snippet, buffers)
    return hit


def buffer_map(traced: TracedMod) -> dict:
    """sympy function name -> captured tensor, for the bounds evaluator."""
    prefix = PREFIX[traced.kind]
    return {f"{prefix}buf{i}": t for i, t in enumerate(traced.buffers)}


def clear_memos() -> None:
    _LOWERED.clear()
