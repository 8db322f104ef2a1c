"""From a traced mod to what a kernel template needs, memoized.

``lower`` runs sympy (canonical form) and the printer once per distinct
traced graph; a later call with the same graph, even with other captured
tensors of the same dtype and rank, is a dict lookup. What the planner reads of
the result (the snippet, the buffer signatures and a few facts about the
expression) is plain data: a new process finds it in the restart index
(``flexgen.codegen.index``) by the graph's text, without importing sympy. The
sympy expression itself (``LoweredMod.expr``) is rebuilt on first use, for the
callers that analyse it further (gradients, context parallelism, index checks of
captured tensors).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..codegen.snippet import Snippet
from ..codegen.spec import BufferSig
from ..frontend.trace import TracedMod
from ..runtime import collector

PREFIX = {"score_mod": "s", "mask_mod": "m", "decay_mod": "d", "feature_map": "f"}


@dataclass(frozen=True)
class LoweredMod:
    """A mod as kernels and the planner see it. Every field is plain data (the restart
    index stores it); ``expr`` is computed from ``graph`` when first asked for."""
    canonical: str              # the canonical sympy form's stable text
    snippet: Snippet            # Triton statements computing it
    buffers: tuple              # BufferSig per captured tensor, in slot order
    is_true: bool = False       # a mask that keeps everything (noop_mask and its spellings)
    free: frozenset = frozenset()       # names of the index symbols it reads (b, h, q_idx, ...)
    transcendental: bool = False        # a score_mod with tanh, exp, ... (its own tile row)
    # A mask_mod's bounds on kv_idx for a given q_idx (``flexgen.masks.ranges``), or None.
    kv_range: tuple | None = None
    # A mask_mod's block-bounds program (``flexgen.masks.bounds.compile_flags``): plain
    # tuples, so a warm process builds block masks without sympy. None for other mods.
    bounds: tuple | None = None
    graph: str = ""             # the traced program it came from
    prefix: str = ""            # "s", "m", "d" or "f": names its buffers

    @functools.cached_property
    def expr(self):
        """The canonical sympy expression (imports sympy)."""
        from ..frontend.expr import to_sympy
        return to_sympy(TracedMod.from_graph(self.graph, ()), self.prefix)


_LOWERED: dict = {}


def lower(traced: TracedMod) -> LoweredMod:
    """Canonical expression, snippet and buffer signatures of ``traced``."""
    hit = _LOWERED.get(traced.signature)
    if hit is None:
        from ..codegen import index
        prefix = PREFIX[traced.kind]
        key = f"{prefix}\n{traced.graph}"
        found = index.get("lowered", key)
        hit = None if found is None else _from_record(found, traced.graph, prefix)
        if hit is None:
            with collector.paused():
                hit = _lower(traced, prefix)
            index.put("lowered", key, _record(hit))
        if len(_LOWERED) >= 4096:        # mods made per call: stay bounded
            _LOWERED.clear()
        _LOWERED[traced.signature] = hit
    return hit


def _lower(traced: TracedMod, prefix: str) -> LoweredMod:
    """The full path: sympy's canonical form, printed."""
    import sympy

    from ..codegen.printer import print_snippet
    from ..frontend.expr import canonical_text, free_indices, to_sympy
    from ..masks import bounds, ranges
    from ..runtime.tuning import transcendental
    expr = to_sympy(traced, prefix)
    snippet = print_snippet(expr, f"{prefix}_")
    buffers = tuple(BufferSig(f"{prefix}buf{i}", t.dim(), str(t.dtype).replace("torch.", ""))
                    for i, t in enumerate(traced.buffers))
    mask = traced.kind == "mask_mod"
    lowered = LoweredMod(canonical_text(expr), snippet, buffers, is_true=expr is sympy.true,
                         free=free_indices(expr), transcendental=transcendental(expr),
                         kv_range=ranges.kv_range(expr) if mask else None,
                         bounds=bounds.compile_flags(expr, buffers) if mask else None,
                         graph=traced.graph, prefix=prefix)
    lowered.__dict__["expr"] = expr      # (the cached_property's slot: no second conversion)
    return lowered


_PROVEN: dict = {}


def proven_snippet(lowered: LoweredMod, proven: tuple) -> Snippet:
    """``lowered``'s snippet with the loads named in ``proven`` (the host proved them in bounds
    for a call: ``flexgen.frontend.bounds_check.proven_loads``) read without checks, at
    clamped positions; ``lowered.snippet`` itself for none. Memoized (and kept in the
    restart index, keyed by the program text and the loads)."""
    if not proven:
        return lowered.snippet
    key = f"{lowered.prefix}\n{lowered.graph}\nproven {list(proven)}"
    hit = _PROVEN.get(key)
    if hit is None:
        from ..codegen import index
        found = index.get("proven", key)
        try:
            hit = Snippet(tuple(found["lines"]), found["result"], found["kind"], tuple(found["free"]))
        except (KeyError, TypeError, ValueError):
            from ..codegen.printer import print_snippet
            hit = print_snippet(lowered.expr, f"{lowered.prefix}_", frozenset(proven))
            index.put("proven", key, dict(lines=list(hit.lines), result=hit.result, kind=hit.kind,
                                          free=list(hit.free)))
        if len(_PROVEN) >= 4096:
            _PROVEN.clear()
        _PROVEN[key] = hit
    return hit


def _record(m: LoweredMod) -> dict:
    """What the restart index keeps of a lowered mod (JSON)."""
    return dict(canonical=m.canonical, lines=list(m.snippet.lines), result=m.snippet.result,
                kind=m.snippet.kind, buffers=[[b.name, b.ndim, b.dtype] for b in m.buffers],
                is_true=m.is_true, free=sorted(m.free), transcendental=m.transcendental,
                kv_range=None if m.kv_range is None else list(m.kv_range), bounds=m.bounds)


def _from_record(r: dict, graph: str, prefix: str) -> LoweredMod | None:
    try:
        return LoweredMod(
            r["canonical"], Snippet(tuple(r["lines"]), r["result"], r["kind"], tuple(sorted(r["free"]))),
            tuple(BufferSig(n, int(d), t) for n, d, t in r["buffers"]), is_true=bool(r["is_true"]),
            free=frozenset(r["free"]), transcendental=bool(r["transcendental"]),
            kv_range=None if r["kv_range"] is None else tuple(r["kv_range"]),
            bounds=_frozen(r["bounds"]), graph=graph, prefix=prefix)
    except (KeyError, TypeError, ValueError):
        return None          # an entry of another layout: compute it again


def _frozen(value):
    """JSON lists back to the tuples they were (the bounds program is hashable data)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def buffer_map(traced: TracedMod) -> dict:
    """sympy function name -> captured tensor, for the bounds evaluator."""
    prefix = PREFIX[traced.kind]
    return {f"{prefix}buf{i}": t for i, t in enumerate(traced.buffers)}


def clear_memos() -> None:
    _LOWERED.clear()
    _PROVEN.clear()
