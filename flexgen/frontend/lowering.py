"""From a traced mod to what a kernel template needs, memoized.

``lower`` runs sympy (canonical form) and the printer once per lowered form: the
traced program without the mod's name, a score_mod's float constants that are data
(a soft-cap's cap, a computed slope) standing as parameters
(``flexgen.frontend.program.lowered_form``). A later call with the same form, even
with other captured tensors of the same dtype and rank or another cap, is a dict
lookup and the values written into the printed snippet (``_bind``). What the planner
reads of the result (the snippet, the buffer signatures and a few facts about the
expression) is plain data: a new process finds it by the form's text in the restart
index (``flexgen.codegen.index``) or among the forms flexgen ships
(``flexgen.frontend.seeds``), without importing sympy. The sympy expression itself
(``LoweredMod.expr``, with the constants' values) is rebuilt on first use, for the
callers that analyse it further (gradients, context parallelism, index checks of
captured tensors).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

from ..codegen.snippet import Snippet
from ..codegen.spec import BufferSig
from ..frontend.program import lowered_form
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
    # Its captured-tensor reads with integer-affine indices as plain data
    # (``flexgen.frontend.bounds_check.index_table``): checked and proven without sympy.
    # None: some index takes the sympy path.
    index_table: tuple | None = None
    graph: str = ""             # the traced program it came from
    prefix: str = ""            # "s", "m", "d" or "f": names its buffers
    # A score_mod ``score + c + a * q_idx + k * kv_idx``: (k, a, c(anchor)) as Snippets
    # (``flexgen.frontend.terms``), which softmax kernels take as key steps per score and a
    # row term in the row statistics; None for any other mod.
    terms: tuple | None = None

    @functools.cached_property
    def expr(self):
        """The canonical sympy expression (imports sympy)."""
        from ..frontend.expr import to_sympy
        return to_sympy(TracedMod.from_graph(self.graph, ()), self.prefix)


_LOWERED: dict = {}       # program text -> LoweredMod
_FORMS: dict = {}         # prefix and lowered form (``lowered_form``) -> its LoweredMod


def lower(traced: TracedMod) -> LoweredMod:
    """Canonical expression, snippet and buffer signatures of ``traced``."""
    hit = _LOWERED.get(traced.signature)
    if hit is None:
        prefix = PREFIX[traced.kind]
        form, values = lowered_form(traced.graph, parameters=traced.kind != "mask_mod")
        lowered = _lower_form(traced, form, prefix)
        if lowered is VALUE_DEPENDENT:
            form, values = lowered_form(traced.graph, parameters=False)
            lowered = _lower_form(traced, form, prefix)
        hit = _bind(lowered, values, traced.graph)
        if len(_LOWERED) >= 4096:        # mods made per call: stay bounded
            _LOWERED.clear()
        _LOWERED[traced.signature] = hit
    return hit


# A form whose parameters the lowering needs the values of (``expr.ValueDependent``).
VALUE_DEPENDENT = "value dependent"


def _lower_form(traced: TracedMod, form: str, prefix: str):
    """The lowered form, from the memo, the restart index, the forms shipped with flexgen.mods
    (``flexgen.frontend.seeds``) or sympy, in that order: only the last imports sympy.
    ``VALUE_DEPENDENT`` for a form that has to be lowered with its constants."""
    key = f"{prefix}\n{form}"
    hit = _FORMS.get(key)
    if hit is None:
        from ..codegen import index
        from . import seeds
        found = index.get("lowered", key) or seeds.get(key)
        hit = None if found is None else _from_record(found, form, prefix)
        if hit is None:
            from .expr import ValueDependent
            try:
                with collector.paused():
                    hit = _lower(TracedMod(traced.kind, traced.name, form, traced.buffers), prefix)
            except ValueDependent:
                hit = VALUE_DEPENDENT
            index.put("lowered", key, _record(hit))
        if len(_FORMS) >= 4096:
            _FORMS.clear()
        _FORMS[key] = hit
    return hit


_PARAMETER = re.compile(r"_flexgen_param_(\d+)")


def _bind(form: LoweredMod, values: tuple, graph: str) -> LoweredMod:
    """The lowered form with its parameters' values written in: the mod ``graph`` lowers to."""
    def text(code: str) -> str:
        return _PARAMETER.sub(lambda m: _literal(values[int(m.group(1))]), code)

    def bind(snippet: Snippet) -> Snippet:
        return Snippet(tuple(text(line) for line in snippet.lines), text(snippet.result),
                       snippet.kind, snippet.free)

    snippet, terms = form.snippet, form.terms
    if values:
        snippet = bind(snippet)
        terms = None if terms is None else tuple(bind(t) for t in terms)
    canonical = f"{form.canonical} with {list(values)}" if values else form.canonical
    bound = dataclasses.replace(form, canonical=canonical, snippet=snippet, graph=graph, terms=terms)
    if not values and "expr" in form.__dict__:
        bound.__dict__["expr"] = form.__dict__["expr"]   # the same expression (names aside)
    return bound


def _literal(value: float) -> str:
    """A finite float as the printer writes a number (``repr``), parenthesized when negative."""
    return repr(value) if value > 0 else f"({value!r})"


def _lower(traced: TracedMod, prefix: str) -> LoweredMod:
    """The full path: sympy's canonical form, printed."""
    import sympy

    from ..codegen.printer import print_snippet
    from ..frontend.bounds_check import index_table
    from ..frontend.expr import canonical_text, free_indices, to_sympy
    from ..masks import bounds, ranges
    from ..runtime.tuning import transcendental
    from .terms import print_terms
    expr = to_sympy(traced, prefix)
    snippet = print_snippet(expr, f"{prefix}_")
    buffers = tuple(BufferSig(f"{prefix}buf{i}", t.dim(), str(t.dtype).replace("torch.", ""))
                    for i, t in enumerate(traced.buffers))
    mask = traced.kind == "mask_mod"
    lowered = LoweredMod(canonical_text(expr), snippet, buffers, is_true=expr is sympy.true,
                         free=free_indices(expr), transcendental=transcendental(expr),
                         kv_range=ranges.kv_range(expr) if mask else None,
                         bounds=bounds.compile_flags(expr, buffers) if mask else None,
                         index_table=index_table(expr), graph=traced.graph, prefix=prefix,
                         terms=print_terms(expr) if traced.kind == "score_mod" else None)
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
        found = index.get("proven", key) or _shipped_proven(lowered, proven)
        try:
            hit = Snippet.from_record(found)
        except (KeyError, TypeError, ValueError):
            from ..codegen.printer import print_snippet
            hit = print_snippet(lowered.expr, f"{lowered.prefix}_", frozenset(proven))
            index.put("proven", key, hit.record())
        if len(_PROVEN) >= 4096:
            _PROVEN.clear()
        _PROVEN[key] = hit
    return hit


def _shipped_proven(lowered: LoweredMod, proven: tuple) -> dict | None:
    """The printed snippet with ``proven`` loads that flexgen ships for ``lowered``'s form, if any
    (``flexgen.frontend.seeds``: every position read proven, for forms without parameters)."""
    from . import seeds
    form, values = lowered_form(lowered.graph, parameters=lowered.prefix != "m")
    shipped = None if values else seeds.get(f"{lowered.prefix}\n{form}")
    return None if not isinstance(shipped, dict) else (shipped.get("proven") or {}).get(" ".join(proven))


def _record(m) -> dict:
    """What the restart index keeps of a lowered mod (JSON)."""
    if m is VALUE_DEPENDENT:
        return dict(value_dependent=True)
    return dict(canonical=m.canonical, lines=list(m.snippet.lines), result=m.snippet.result,
                kind=m.snippet.kind, buffers=[[b.name, b.ndim, b.dtype] for b in m.buffers],
                is_true=m.is_true, free=sorted(m.free), transcendental=m.transcendental,
                kv_range=None if m.kv_range is None else list(m.kv_range), bounds=m.bounds,
                index_table=m.index_table,
                terms=None if m.terms is None else [t.record() for t in m.terms])


def _from_record(r: dict, graph: str, prefix: str):
    if r.get("value_dependent") is True:
        return VALUE_DEPENDENT
    try:
        return LoweredMod(
            r["canonical"], Snippet(tuple(r["lines"]), r["result"], r["kind"], tuple(sorted(r["free"]))),
            tuple(BufferSig(n, int(d), t) for n, d, t in r["buffers"]), is_true=bool(r["is_true"]),
            free=frozenset(r["free"]), transcendental=bool(r["transcendental"]),
            kv_range=None if r["kv_range"] is None else tuple(r["kv_range"]),
            bounds=_frozen(r["bounds"]), index_table=_frozen(r.get("index_table")), graph=graph,
            prefix=prefix, terms=None if r["terms"] is None else tuple(Snippet.from_record(t) for t in r["terms"]))
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
    _FORMS.clear()
    _PROVEN.clear()
