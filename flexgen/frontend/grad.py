"""Derivatives of a score_mod for the backward kernels, printed like the mod itself.

With ``z = score_mod(s)`` the backward needs ``dz/ds`` (every call) and
``dz / d buffer[i]`` for each captured tensor that requires grad. Both come from
sympy (``flexgen.frontend.expr.derivative``) on the canonical expression; the
mod and its derivatives are printed together (``print_joint``), so what they
share is computed once. A derivative that does not exist (the score through a
floor, a learned value used as an index) is a ``GradientError`` naming the mod
and the offending sub-expression in the mod's own terms.

The result is plain data: the restart index (``flexgen.codegen.index``) keeps
it under the mod's traced program, so a warm process's first backward of a
known mod imports neither sympy nor the printer (both are imported on a miss).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..codegen.snippet import Address, Snippet
from ..codegen.spec import BufferSig
from ..errors import GradientError
from .lowering import lower
from .trace import TracedMod


@dataclass(frozen=True)
class Scatter:
    """One load of a captured tensor whose gradient the dQ kernel accumulates."""
    buffer: str            # the loaded buffer ("sbuf0")
    grad_name: str         # its float32 gradient buffer ("sbuf0_grad")
    index_text: str        # the index, for the kernel's comment
    partial: str           # code of d mod / d (this load), after the mod's statements
    partial_const: bool    # that derivative is a finite constant: no NaN guard
    reduce_q: bool         # the index ignores q_idx: sum the tile over its rows first
    reduce_kv: bool        # the index ignores kv_idx: sum over its columns first
    reduce_diag: bool      # the index reads q_idx - kv_idx only: sum each tile diagonal first
    address: Address       # where the load read, as an offset into the gradient buffer
                           # (with reduce_diag, in terms of ``diag_d`` = q_idx - kv_idx)


@dataclass(frozen=True)
class _Part:
    """One kernel's printed mod: statements computing z and its derivatives, then the codes."""
    snippet: Snippet | None             # the statements; ``result`` is z = score_mod(score)
    score_grad: str | None              # d z / d score after the statements (None: it is 1)


@dataclass(frozen=True)
class LoweredGrad:
    """What the two kernels need of a score_mod's derivatives."""
    dq: _Part                           # z, d z / d score and d z / d each scattered load
    dkdv: _Part                         # z and d z / d score
    score_grad_const: bool
    scatters: tuple
    grad_buffers: tuple


_GRADS: dict = {}


def _const(e) -> bool:
    return bool(e.is_number) and bool(e.is_finite)


def user_text(e) -> str:
    """sympy text in the mod's own terms: ``captured0[h, q_idx]``, ``(x).to(torch.int32)``."""
    from sympy.printing.str import StrPrinter

    class UserText(StrPrinter):
        def _print_Function(self, e):
            name = e.func.__name__
            if name.startswith("sbuf") and name[4:].isdigit():
                return f"captured{name[4:]}[{', '.join(self._print(a) for a in e.args)}]"
            if name == "Trunc":
                return f"({self._print(e.args[0])}).to(torch.int32)"
            if name == "Sigmoid":
                return f"sigmoid({self._print(e.args[0])})"
            return super()._print_Function(e)

    return UserText().doprint(e)


def _describe(traced: TracedMod, what: str, err, fix: str) -> GradientError:
    names = "; ".join(f"captured{i} is the tensor of shape {list(t.shape)}"
                      for i, t in enumerate(traced.buffers)
                      if re.search(rf"\bsbuf{i}\b", str(err.part)))
    where = f"`{user_text(err.part)}`" + (f", where {names}" if names else "")
    return GradientError(f"score_mod '{traced.name}': the gradient with respect to {what} cannot "
                         f"be computed: {err.reason} ({where}). Fix: {fix}")


def lower_grad(traced: TracedMod | None, grad_slots: tuple, proven: tuple = ()) -> LoweredGrad:
    """Derivatives of ``traced`` (a score_mod, or None) w.r.t. the score and the buffers in ``grad_slots``.

    Raises ``GradientError`` naming the mod when a derivative does not exist
    or cannot be printed. Memoized per traced graph, set of slots and ``proven`` (the
    loads the mod's snippets read without checks: ``bounds_check.proven_loads``; the
    gradients' scatters keep their checks).
    """
    if traced is None:
        return LoweredGrad(_Part(None, None), _Part(None, None), True, (), ())
    key = (traced.signature, grad_slots, proven)
    hit = _GRADS.get(key)
    if hit is not None:
        return hit
    from ..codegen import index
    # The graph names the buffers' dtypes and ranks, all the result depends on besides the slots.
    index_key = f"{traced.graph}\n{list(grad_slots)}" + (f"\nproven {list(proven)}" if proven else "")
    found = index.get("grad", index_key)
    hit = None if found is None else _from_record(found)
    if hit is None:
        hit = _lower_grad(traced, grad_slots, proven)
        index.put("grad", index_key, _record(hit))
    if len(_GRADS) >= 4096:
        _GRADS.clear()
    _GRADS[key] = hit
    return hit


def _lower_grad(traced: TracedMod, grad_slots: tuple, proven: tuple = ()) -> LoweredGrad:
    """The full path: sympy's derivatives, printed."""
    import sympy

    from ..codegen.printer import print_address, print_joint
    from .expr import INDEX_SYMBOLS, SCORE, NotDifferentiable, derivative, load_applications
    lowered = lower(traced)
    expr = lowered.expr
    name = traced.name
    try:
        d_score = derivative(expr, SCORE)
    except NotDifferentiable as err:
        raise _describe(traced, "the score", err,
                        "keep floor / ceil / sign / integer casts off the score's path, or run "
                        "without gradients (torch.no_grad(), or inputs that do not require grad)") from None
    loads, partials = [], []
    names = {f"sbuf{i}": i for i in grad_slots}
    for app in load_applications(expr, names):
        slot = names[app.func.__name__]
        shape = list(traced.buffers[slot].shape)
        try:
            d = derivative(expr, app)
        except NotDifferentiable as err:
            raise _describe(traced, f"captured{slot} (shape {shape}, requires_grad=True)", err,
                            "index with integer positions only and keep the loaded value off "
                            "floor / ceil / sign / integer casts, or pass the tensor "
                            ".detach()-ed if it should not be trained") from None
        if d != 0:
            loads.append(app)
            partials.append(d)
    score_grad_expr = None if d_score == 1 else d_score

    def joint(exprs):
        try:
            return print_joint(exprs, "s_", frozenset(proven))
        except RuntimeError as err:   # the printer met a node it has no Triton form for
            raise GradientError(f"score_mod '{name}': its derivative cannot be turned into kernel "
                                f"code ({err}). Fix: rewrite the mod with the functions listed in "
                                "the flexgen.frontend.trace module docstring, or run without gradients") from None

    head = [expr] + ([score_grad_expr] if score_grad_expr is not None else [])
    dkdv = joint(head)
    dq = joint(head + partials)
    extra = dq.results[len(head):]
    scatters = []
    q_idx, kv_idx = INDEX_SYMBOLS["q_idx"], INDEX_SYMBOLS["kv_idx"]
    # q_idx - kv_idx of a tile diagonal (the template binds ``diag_d``).
    diagonal_symbol = sympy.Symbol("diag_d", integer=True)
    for n, (app, d, code) in enumerate(zip(loads, partials, extra)):
        grad_name = f"{app.func.__name__}_grad"
        free = app.free_symbols
        # Every element of a tile diagonal adds to one address when the index reads q_idx - kv_idx
        # only: the kernel sums the diagonals first (one atomic per diagonal, not per element;
        # same-address atomics serialize, and a relative bias sends a whole diagonal to one).
        on_diagonal = app.subs(q_idx, kv_idx + diagonal_symbol)
        diagonal = q_idx in free and kv_idx in free and kv_idx not in on_diagonal.free_symbols
        scatters.append(Scatter(
            buffer=app.func.__name__, grad_name=grad_name,
            index_text=", ".join(str(a) for a in app.args), partial=code, partial_const=_const(d),
            reduce_q=q_idx not in free, reduce_kv=kv_idx not in free, reduce_diag=diagonal,
            address=print_address(on_diagonal if diagonal else app, grad_name, f"g{n}_")))
    grad_buffers = tuple(BufferSig(f"sbuf{i}_grad", traced.buffers[i].dim(), "float32")
                         for i in grad_slots)
    return LoweredGrad(
        dq=_Part(dq.snippet(0), _score_grad(dq, score_grad_expr)),
        dkdv=_Part(dkdv.snippet(0), _score_grad(dkdv, score_grad_expr)),
        score_grad_const=score_grad_expr is None or _const(score_grad_expr),
        scatters=tuple(scatters), grad_buffers=grad_buffers)


def _snippet_record(s: Snippet | None):
    return None if s is None else [list(s.lines), s.result, s.kind, None if s.free is None else list(s.free)]


def _snippet_of(r) -> Snippet | None:
    return None if r is None else Snippet(tuple(r[0]), r[1], r[2], None if r[3] is None else tuple(r[3]))


def _record(g: LoweredGrad) -> dict:
    """What the restart index keeps of a LoweredGrad (JSON)."""
    return dict(
        parts=[[_snippet_record(p.snippet), p.score_grad] for p in (g.dq, g.dkdv)],
        score_grad_const=g.score_grad_const,
        scatters=[[s.buffer, s.grad_name, s.index_text, s.partial, s.partial_const, s.reduce_q,
                   s.reduce_kv, s.reduce_diag, list(s.address.lines), s.address.offset,
                   s.address.in_bounds]
                  for s in g.scatters],
        grad_buffers=[[b.name, b.ndim, b.dtype] for b in g.grad_buffers])


def _from_record(r: dict) -> LoweredGrad | None:
    try:
        dq, dkdv = (_Part(_snippet_of(snippet), score_grad) for snippet, score_grad in r["parts"])
        scatters = tuple(Scatter(*fields[:8], Address(tuple(fields[8]), fields[9], fields[10]))
                         for fields in r["scatters"])
        return LoweredGrad(dq, dkdv, bool(r["score_grad_const"]), scatters,
                           tuple(BufferSig(n, int(d), t) for n, d, t in r["grad_buffers"]))
    except (KeyError, TypeError, ValueError):
        return None          # an entry of another layout: compute it again


def _score_grad(joint, score_grad_expr) -> str | None:
    """The code of d mod / d score in ``joint`` (its second value), as float32."""
    if score_grad_expr is None:
        return None
    if _const(score_grad_expr):
        # A number (score * 2 gives 2): a float literal, since a Python int has no .to().
        return repr(float(score_grad_expr))
    from ..codegen.printer import cast
    return cast(joint.results[1], joint.kinds[1], "float")


def clear_memos() -> None:
    _GRADS.clear()
