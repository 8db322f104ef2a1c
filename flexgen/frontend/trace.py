"""Trace a score_mod / mask_mod into a small program text and the tensors it captured.

The mod is called once with ``Proxy`` objects in place of the score and the
indices. Every operation on a proxy appends one line to a straight-line
program (``graph``, a str); the value the mod returns is its last line.
Captured tensors that the mod indexes (``bias[h, q_idx]``) or uses as numbers
(a 0-d tensor) become numbered buffers: their values are kernel arguments,
only their dtype and rank enter the program. A captured tensor indexed with fewer
positions than it has dims is a ``View``: reduced over the rest on the host
(``x[b].sum(-1)``), or, combined with traced values, a ``Row`` of up to
``ROW_LIMIT`` elements unrolled into the program (``(means[q_idx] - means[kv_idx])
.pow(2).sum(-1)``, ``torch.dot``, ``(ids[b] == kv_idx).any()``), as torch's
compiled kernels unroll small reductions.

The text is the mod's identity everywhere downstream: the cache keys, the
custom ops' arguments (``flexgen.runtime.ops``: a str survives ``torch.export``
and is cheap to hash) and the sympy conversion (``parse`` turns it back into
``Node`` objects). Tracing is plain Python over plain objects, so torch.compile
(dynamo) traces it inline: a mod defined inside a compiled function, whose
closure holds tensors of the graph, is traced there and its tensors become
inputs of the op, exactly as in eager mode.

The lines are separated by ``LINE_END`` (";"), never a newline: torch.compile prints an
op's str arguments unquoted in comments of the code it generates (inductor's FX-graph
comments), where a newline would end the comment.

Every line carries the dtype torch would give the same computation, collapsed
to three kinds the kernel computes in: ``b`` (bool), ``i`` (int32) and ``f``
(float32). The program's lines::

    var <kind> <name>              score, b, h, q_idx, kv_idx, t or x
    const <kind> <value>           a Python number
    load <kind> <slot> %i %j ...   captured buffer ``slot`` at the given indices
    <op> <kind> %a [%b [%c]]       an operation on earlier lines
    maxof / minof <kind> %a %b ... the largest / smallest of a row's elements
    buffer <slot> <dtype> <ndim>   (last lines) each captured tensor's signature
    program <kind> <name>          (first line) "score_mod", "mask_mod", "decay_mod" or "feature_map", the mod's name

This module holds the entry points (``trace``, ``trace_cached``) and re-exports the rest:
``program`` (the text, ``TracedMod``, ``parse``), ``proxy`` (``Proxy``, ``View``, ``Row``),
``builders`` (one line per operation), ``rows`` (row shapes, captured-tensor indexing),
``torch_functions`` (the table of torch functions a mod may call) and ``memo`` (the eager
memo's identity checks).
"""
from __future__ import annotations

import inspect
import os
import traceback

import torch

from ..errors import TraceError, reported
from .memo import (_RECENT, _SHAPES, RECENT_MAX, _checks, _unchanged, recall_shape, remember_shape,
                   shape_of)
# Re-exported: the rest of flexgen and the tests import these from here.
from .program import (  # noqa: F401
    ARGS, BINARY, COMPARISONS, DECAY_ARGS, DTYPE_NAMES, DTYPE_OF_KIND, FEATURE_ARGS, FLOAT_ARGS,
    KIND_OF_DTYPE, LINE_END, MASK_ARGS, SCORE_ARGS, UNARY, _MEMO_MAX, _PARSED, Node, TracedMod, parse)
from .proxy import ROW_LIMIT, Proxy, Row, View, _Tracer  # noqa: F401
from .builders import _METHODS, _operand, _proxy  # noqa: F401
from .torch_functions import _FUNCTIONS, _TraceMode  # noqa: F401


# ---------------------------------------------------------------------------- entry points

def _check_arity(mod, kind: str, names: tuple) -> None:
    if torch.compiler.is_compiling():
        return                        # (a wrong arity fails on the call itself)
    try:
        sig = inspect.signature(mod)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*names)
    except TypeError:
        name = getattr(mod, "__name__", type(mod).__name__)
        raise TraceError(
            f"{kind} '{name}': expected a function of {len(names)} arguments "
            f"({', '.join(names)}), got one with signature {sig}. "
            f"Fix: define it as def {name}({', '.join(names)}): ...") from None


def _autograd_function(exc) -> str | None:
    """The name of the torch.autograd.Function whose apply() raised ``exc``, if one did."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename.endswith(os.path.join("autograd", "function.py")):
            cls = frame.f_locals.get("cls")
            return getattr(cls, "__name__", "?")
    return None


def trace(mod, kind: str) -> TracedMod:
    """Trace ``mod`` into a ``TracedMod``; ``kind`` ("score_mod", "mask_mod", "decay_mod" or
    "feature_map") names its arguments (``ARGS``)."""
    if not callable(mod):
        raise reported(TraceError(f"{kind}: expected a callable, got {type(mod).__name__} ({mod!r}). "
                         f"Fix: pass a function, or None for no {kind}"))
    names = ARGS[kind]
    _check_arity(mod, kind, names)
    tracer = _Tracer(mod, kind)
    proxies = [_proxy(tracer, f"var {'f' if n in FLOAT_ARGS else 'i'} {n}",
                      "f" if n in FLOAT_ARGS else "i") for n in names]
    try:
        with _TraceMode(tracer):
            result = mod(*proxies)
    except TraceError:
        raise
    except Exception as exc:  # the mod itself failed on our proxies
        if torch.compiler.is_compiling():
            raise             # (dynamo reports the mod's own exception, and where it happened)
        function = _autograd_function(exc)
        if function is not None:
            raise reported(TraceError(
                f"{kind} '{tracer.name}': the torch.autograd.Function '{function}' is applied to "
                "traced values; flexgen derives the gradient from the mod's own operations and "
                "cannot keep a custom backward. Fix: write the Function's forward computation "
                "directly in the mod (flexgen differentiates it)")) from exc
        raise reported(TraceError(
            f"{kind} '{tracer.name}': calling it with traced values raised "
            f"{type(exc).__name__}: {exc}. Fix: use only arithmetic, comparisons, "
            "torch.where and elementwise torch functions on the arguments")) from exc
    if isinstance(result, View):
        result._not_a_value()
    if isinstance(result, torch.Tensor) and not isinstance(result, Proxy) and result.dim() != 0:
        raise tracer.fail(f"it returned a tensor of shape {list(result.shape)}",
                          "return an expression of the arguments")
    root = _operand(tracer, result)
    if kind == "mask_mod" and root._kind != "b":
        raise reported(TraceError(
            f"mask_mod '{tracer.name}': expected it to return a bool (a comparison or a "
            f"combination of comparisons), got a value of dtype {root.dtype}. "
            "Fix: return a comparison such as q_idx >= kv_idx"))
    if kind == "score_mod" and root._kind == "b":
        raise reported(TraceError(
            f"score_mod '{tracer.name}': expected it to return a number (the new score), got a "
            "bool. Fix: to mask positions use a mask_mod, or torch.where(cond, score, -float('inf'))"))
    if kind in ("decay_mod", "feature_map") and root._kind == "b":
        what = "the log-decay g <= 0" if kind == "decay_mod" else "the feature phi(x)"
        fix = ("return a float such as -slopes[h] or gates[b, h, t]" if kind == "decay_mod"
               else "return a float expression of x, e.g. torch.where(x > 0, x + 1, torch.exp(x))")
        raise reported(TraceError(f"{kind} '{tracer.name}': expected it to return a number ({what}), "
                                  f"got a bool. Fix: {fix}"))
    lines = tracer.lines + [f"root {root._kind} %{root._node}"]
    for slot, t in enumerate(tracer.buffers):
        lines.append(f"buffer {slot} {DTYPE_NAMES[t.dtype]} {t.dim()}")
    return TracedMod(kind, tracer.name, LINE_END.join(lines), tuple(tracer.buffers), tracer.derived)


def trace_cached(mod, kind: str) -> TracedMod:
    """``trace(mod, kind)``, reusing the last trace while nothing the mod reads has changed, or
    a trace of a mod of the same shape (``memo.shape_of``) over this one's tensors."""
    if torch.compiler.is_compiling():
        return trace(mod, kind)
    recent = _RECENT.get(id(mod))
    if recent is not None and recent[0] is mod and recent[1] == kind and _unchanged(recent[2]):
        return recent[3]
    checks: list = []
    pinned = _checks(mod, checks)
    shape = shape_of(mod, checks) if pinned else None
    traced = None if shape is None else recall_shape(kind, shape)
    if traced is None:
        traced = trace(mod, kind)
        if traced.derived:
            return traced
        if shape is not None:
            remember_shape(kind, shape, traced)
    if pinned:
        if len(_RECENT) >= RECENT_MAX:
            _RECENT.clear()
        # The entry holds the mod, so its id is not reused while the entry lives.
        _RECENT[id(mod)] = (mod, kind, tuple(checks), traced)
    return traced


def clear_memos() -> None:
    """Forget every memoized trace and parsed program (``flexgen.clear_caches``)."""
    _RECENT.clear()
    _SHAPES.clear()
    _PARSED.clear()
