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
"""
from __future__ import annotations

import inspect
import math
import operator
import os
import traceback
import types
from dataclasses import dataclass, field

import torch

from ..errors import TraceError, reported

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
# The linear-attention mods: a log-decay per (batch, query head, position) and an
# elementwise feature map of the query / key entries (flexgen.linear_attention).
DECAY_ARGS = ("b", "h", "t")
FEATURE_ARGS = ("x",)
ARGS = {"score_mod": SCORE_ARGS, "mask_mod": MASK_ARGS, "decay_mod": DECAY_ARGS,
        "feature_map": FEATURE_ARGS}
FLOAT_ARGS = ("score", "x")

DTYPE_OF_KIND = {"b": torch.bool, "i": torch.int32, "f": torch.float32}
# A captured tensor's dtype -> the kind its loads compute in.
KIND_OF_DTYPE = {
    torch.bool: "b", torch.int8: "i", torch.int16: "i", torch.int32: "i", torch.int64: "i",
    torch.uint8: "i", torch.float16: "f", torch.bfloat16: "f", torch.float32: "f", torch.float64: "f",
}
DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in KIND_OF_DTYPE}
_RANK = {"b": 0, "i": 1, "f": 2}

UNARY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "tan", "erf",
         "abs", "sign", "floor", "ceil", "neg", "not", "bitnot", "silu", "relu")
LINE_END = ";"      # between the program's lines (see the module docstring)
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "minimum", "maximum",
          "and", "or", "xor", "shl", "shr", "eq", "ne", "lt", "le", "gt", "ge")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


@dataclass(frozen=True)
class TracedMod:
    """A traced mod: its program text and the captured tensors, in slot order."""
    kind: str                  # "score_mod", "mask_mod", "decay_mod" or "feature_map"
    name: str                  # the mod's name, for messages
    graph: str                 # the program (see the module docstring)
    buffers: tuple             # captured tensors, in slot order
    derived: bool = False      # some buffer was computed while tracing (a reduction of a
                               # captured tensor), or a captured value was read into Python
                               # (.item()): the trace must not outlive this call

    @property
    def signature(self) -> str:
        """What a kernel depends on: the program, buffer signatures included."""
        return self.graph

    @classmethod
    def from_graph(cls, graph: str, buffers) -> "TracedMod":
        """The traced mod a program text and its captured tensors stand for (what ops carry)."""
        kind, name = parse(graph)[:2]
        return cls(kind, name, graph, tuple(buffers))


# ---------------------------------------------------------------------------- the tracer

class _Tracer:
    """Per-trace state: the program's lines and the captured buffers."""

    def __init__(self, mod, kind: str):
        self.kind = kind
        self.name = getattr(mod, "__name__", type(mod).__name__)
        # The name rides along for messages (a backward planned from the text alone names
        # the mod); kernels key on the lowered form, where it plays no part.
        self.lines = [f"program {kind} {''.join(self.name.replace(LINE_END, ' ').split()) or '?'}"]
        self.index = {}            # line -> its number (identical lines are one node)
        self.buffers = []
        self.derived = False

    def node(self, line: str) -> int:
        found = self.index.get(line)
        if found is None:
            found = len(self.lines)
            self.lines.append(line)
            self.index[line] = found
        return found

    def slot(self, t) -> int:
        for i, known in enumerate(self.buffers):
            if known is t:
                return i
        self.buffers.append(t)
        return len(self.buffers) - 1

    def fail(self, what: str, fix: str) -> TraceError:
        """The TraceError to raise (raised right here while torch.compile traces: ``reported``)."""
        return reported(TraceError(f"{self.kind} '{self.name}'{_user_location()}: {what}. Fix: {fix}"))


def _user_location() -> str:
    """' (file.py:12: `source line`)' for the innermost frame of user code (eager only)."""
    if torch.compiler.is_compiling():
        return ""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in inspect.stack(context=1)[2:]:
        path = os.path.abspath(frame.filename)
        if path.startswith(here + os.sep) and not path.startswith(os.path.join(here, "mods")):
            continue
        if path.startswith(torch_dir):
            continue
        line = (frame.code_context or [""])[0].strip()
        return f" ({os.path.basename(path)}:{frame.lineno}: `{line}`)"
    return ""


class _Operators:
    """Python's operators on traced values: one line each (``Proxy``), or one per element
    (``View`` and ``Row``: the builders map themselves over rows, see ``_elementwise``)."""

    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("sub", self, o)
    def __rsub__(self, o): return _binary("sub", o, self)
    def __mul__(self, o): return _binary("mul", self, o)
    def __rmul__(self, o): return _binary("mul", o, self)
    def __truediv__(self, o): return _binary("truediv", self, o)
    def __rtruediv__(self, o): return _binary("truediv", o, self)
    def __floordiv__(self, o): return _binary("floordiv", self, o)
    def __rfloordiv__(self, o): return _binary("floordiv", o, self)
    def __mod__(self, o): return _binary("mod", self, o)
    def __rmod__(self, o): return _binary("mod", o, self)
    def __pow__(self, o): return _binary("pow", self, o)
    def __rpow__(self, o): return _binary("pow", o, self)
    def __and__(self, o): return _binary("and", self, o)
    def __rand__(self, o): return _binary("and", o, self)
    def __or__(self, o): return _binary("or", self, o)
    def __ror__(self, o): return _binary("or", o, self)
    def __xor__(self, o): return _binary("xor", self, o)
    def __rxor__(self, o): return _binary("xor", o, self)
    def __lshift__(self, o): return _binary("shl", self, o)
    def __rlshift__(self, o): return _binary("shl", o, self)
    def __rshift__(self, o): return _binary("shr", self, o)
    def __rrshift__(self, o): return _binary("shr", o, self)
    def __eq__(self, o): return _binary("eq", self, o)
    def __ne__(self, o): return _binary("ne", self, o)
    def __lt__(self, o): return _binary("lt", self, o)
    def __le__(self, o): return _binary("le", self, o)
    def __gt__(self, o): return _binary("gt", self, o)
    def __ge__(self, o): return _binary("ge", self, o)
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    def __invert__(self): return _invert(self)


class Proxy(_Operators):
    """Stands in for the score or an index (or any value computed from them) while a mod is traced."""

    def __init__(self, tracer: _Tracer, node: int, kind: str):
        self._tracer, self._node, self._kind = tracer, node, kind

    # --- what cannot be traced -------------------------------------------------------
    def __bool__(self):
        raise self._tracer.fail(
            "Python control flow (if / and / or / not / bool()) depends on a traced value",
            "use torch.where(cond, a, b) instead of if/else, and & | ~ instead of and / or / not")

    def __int__(self):
        raise self._tracer.fail("int() of a traced value", "keep it a tensor; use // for integer division")

    def __float__(self):
        raise self._tracer.fail("float() (or a math.* function) of a traced value",
                                "use the torch function instead (torch.exp, torch.tanh, ...)")

    __index__ = __int__

    def __iter__(self):
        raise self._tracer.fail("iteration over a traced value",
                                "a traced value is one element; do not loop over it")

    def __len__(self):
        raise self._tracer.fail("len() of a traced value", "a traced value is one element (shape ())")

    def __setitem__(self, key, value):
        raise self._tracer.fail("item assignment on a traced value", "return a new value instead")

    def __getitem__(self, key):
        if key is Ellipsis or (isinstance(key, tuple) and not key):
            return self
        raise self._tracer.fail("indexing a traced value",
                                "index captured tensors, not the score or the indices")

    def item(self):
        raise self._tracer.fail(".item() of a traced value", "keep it a tensor")

    def __repr__(self):
        return f"Proxy(%{self._node}, {DTYPE_OF_KIND[self._kind]})"

    __hash__ = object.__hash__

    # --- attributes torch code reads -----------------------------------------------------
    @property
    def dtype(self):
        return DTYPE_OF_KIND[self._kind]

    @property
    def device(self):
        # Mask code moves values between devices (``x.to(result.device)``): a traced value
        # lives wherever the kernel runs, so any device is this one.
        return torch.device("meta")

    @property
    def shape(self):
        return torch.Size([])

    def size(self, dim=None):
        if dim is not None:
            raise self._tracer.fail(f".size({dim}) of a traced value", "a traced value has shape ()")
        return torch.Size([])

    def dim(self):
        return 0

    ndim = property(dim)

    def numel(self):
        return 1

    # --- tensor methods ----------------------------------------------------------------
    def __getattr__(self, name):
        bound = _bound_method(self, name)
        if bound is not None:
            return bound
        if name.endswith("_"):
            raise self._tracer.fail(f"in-place method .{name}() on a traced value",
                                    f"use the out-of-place form .{name[:-1]}()")
        raise self._tracer.fail(f".{name} of a traced value is not supported",
                                "use arithmetic, comparisons, torch.where and the elementwise "
                                f"torch functions ({', '.join(sorted(_FUNCTION_NAMES))})")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})


class View(_Operators):
    """A captured tensor indexed with fewer indices than it has dims (``bias[b]`` of a
    ``[B, L]`` bias). More indexing makes a value; a reduction over what is left is
    computed on the host (``x[b].sum()`` is ``x.sum(-1)[b]``); combined with traced values
    it is unrolled into a ``Row`` (``means[q_idx] - means[kv_idx]``)."""

    def __init__(self, tracer: _Tracer, tensor, indices: tuple):
        self._tracer, self._tensor, self._indices = tracer, tensor, indices

    def __getitem__(self, index):
        more = index if isinstance(index, tuple) else (index,)
        return _index(self._tracer, self._tensor, self._indices + more)

    @property
    def shape(self):
        return self._tensor.shape[len(self._indices):]

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return self._tensor.dim() - len(self._indices)

    ndim = property(dim)

    def numel(self):
        return self.shape.numel()

    @property
    def dtype(self):
        return self._tensor.dtype

    def _what(self) -> str:
        return f"a partly indexed captured tensor (shape {list(self.shape)} left)"

    def _row(self) -> "Row":
        """Every element this view stands for, one load each (at most ``ROW_LIMIT``)."""
        _check_row_size(self._tracer, self.shape, self._what())
        items = [_index(self._tracer, self._tensor, self._indices + rest)
                 for rest in _positions(self.shape)]
        return Row(self._tracer, self.shape, items, self._what())

    def _reduce(self, name, reduce, dim=None, keepdim=False):
        # A reduction over dims no proxy indexes is a tensor the host can compute:
        # x[b].sum() is x.sum(-1)[b]. It is computed at each trace (a buffer derived
        # from x, never memoized past this call, so an in-place update of x is seen).
        first = len(self._indices)
        if not self.dim():
            return _index(self._tracer, self._tensor, self._indices)
        dims = _reduced_dims(self._tracer, self.dim(), dim, f".{name}()")
        reduced = reduce(self._tensor, tuple(first + d for d in dims), keepdim)
        self._tracer.derived = True
        return _index(self._tracer, reduced, self._indices)

    def sum(self, dim=None, keepdim=False, dtype=None):
        return self._reduce("sum", lambda t, dims, k: t.sum(dim=dims, keepdim=k, dtype=dtype), dim, keepdim)

    def amax(self, dim=None, keepdim=False):
        return self._reduce("amax", lambda t, dims, k: t.amax(dim=dims, keepdim=k), dim, keepdim)

    def amin(self, dim=None, keepdim=False):
        return self._reduce("amin", lambda t, dims, k: t.amin(dim=dims, keepdim=k), dim, keepdim)

    def max(self, dim=None, keepdim=False):
        return self.amax() if dim is None else self._row().max(dim, keepdim)

    def min(self, dim=None, keepdim=False):
        return self.amin() if dim is None else self._row().min(dim, keepdim)

    def mean(self, dim=None, keepdim=False, dtype=None):
        return self._reduce("mean", lambda t, dims, k: t.float().mean(dim=dims, keepdim=k), dim, keepdim)

    def any(self, dim=None, keepdim=False):
        return self._reduce("any", lambda t, dims, k: t.to(torch.bool).any(dim=dims, keepdim=k),
                            dim, keepdim)

    def all(self, dim=None, keepdim=False):
        return self._reduce("all", lambda t, dims, k: t.to(torch.bool).all(dim=dims, keepdim=k),
                            dim, keepdim)

    def prod(self, dim=None, keepdim=False, dtype=None):
        return self._row().prod(dim, keepdim)

    def __iter__(self):
        return iter(self._row())

    def __len__(self):
        return self.shape[0]

    def __matmul__(self, other):
        return self._row() @ other

    def __rmatmul__(self, other):
        return other @ self._row()

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _METHODS or name in Row.__dict__:
            return getattr(self._row(), name)
        raise self._tracer.fail(
            f".{name} of a partly indexed captured tensor (shape {list(self.shape)} left)",
            "index every dimension (bias[b, q_idx], or bias[b][q_idx]), or reduce the rest "
            "with .sum() / .max() / .min() / .mean()")

    def _not_a_value(self, *args, **kwargs):
        raise self._tracer.fail(
            f"a partly indexed captured tensor (shape {list(self.shape)} left) was used as a value",
            "index every dimension (bias[b, q_idx], or bias[b][q_idx]), or reduce the rest "
            "with .sum() / .max() / .min() / .mean()")

    __bool__ = __float__ = __int__ = _not_a_value
    __hash__ = object.__hash__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})


# A row is unrolled: each element is its own loads and arithmetic in the kernel, for
# every score element. torch's compiled kernels unroll small reductions the same way.
ROW_LIMIT = 64


class Row(_Operators):
    """Several traced values at once, with a shape: a partly indexed captured tensor
    combined with traced values (``means[q_idx] - means[kv_idx]``, ``topk[b, h, t] == kv_t``).

    Every element is a ``Proxy``; shapes broadcast as in torch. A reduction
    (``.sum(-1)``, ``.any(-1)``, ``.max()``, ``torch.dot``) gives one value again; a row
    itself cannot be the mod's result. At most ``ROW_LIMIT`` elements.
    """

    def __init__(self, tracer: _Tracer, shape, items, what: str):
        self._tracer, self._shape, self._items, self._what = tracer, tuple(shape), list(items), what

    # --- what torch code reads ---------------------------------------------------------
    @property
    def shape(self):
        return torch.Size(self._shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self):
        return len(self._shape)

    ndim = property(dim)

    def numel(self):
        return len(self._items)

    @property
    def dtype(self):
        return self._items[0].dtype

    @property
    def device(self):
        return torch.device("meta")

    def __len__(self):
        return self._shape[0]

    def __iter__(self):
        return (self[i] for i in range(self._shape[0]))

    # --- shape operations (plain Python on element numbers: torch.compile traces it) ----
    def _regrid(self, shape, numbers):
        if not shape:
            return self._items[numbers[0]]
        _check_row_size(self._tracer, shape, self._what)
        return Row(self._tracer, shape, [self._items[i] for i in numbers], self._what)

    def _grid(self):
        return self._shape, list(range(len(self._items)))

    def __getitem__(self, key):
        parts = _expand_key(self._tracer, key, self.dim())
        if any(isinstance(k, (Row, View)) for k in parts):
            raise self._tracer.fail(f"{self._what} was indexed with a row of positions",
                                    "index it with one traced position, Python ints or slices")
        static, picks = _static_key(parts)
        try:
            picked = self._regrid(*_grid_index(*self._grid(), static))
        except IndexError as err:
            raise self._tracer.fail(f"{self._what} was indexed with {key!r}: {err}",
                                    "index within its shape, as in torch") from None
        # A traced position selects along its dim: a chain of torch.where over the positions.
        for d, index in reversed(picks):
            picked = _select(picked, d, index)
        return picked

    def reshape(self, *shape):
        try:
            return self._regrid(*_grid_reshape(*self._grid(), _sizes(shape)))
        except ValueError as err:
            raise self._tracer.fail(f"{self._what} was reshaped: {err}",
                                    "keep the number of elements, as in torch") from None

    view = reshape

    def flatten(self, start_dim=0, end_dim=-1):
        n = self.dim()
        if n == 0:
            return self.reshape(1)
        start, end = start_dim % n, end_dim % n
        middle = 1
        for size in self._shape[start:end + 1]:
            middle *= size
        return self.reshape(*self._shape[:start], middle, *self._shape[end + 1:])

    def unsqueeze(self, dim):
        d = dim % (self.dim() + 1)
        return self.reshape(*self._shape[:d], 1, *self._shape[d:])

    def squeeze(self, dim=None):
        dims = range(self.dim()) if dim is None else [d % self.dim() for d in
                                                      (dim if isinstance(dim, (tuple, list)) else (dim,))]
        return self.reshape(*[n for d, n in enumerate(self._shape) if not (d in dims and n == 1)])

    def permute(self, *dims):
        return self._regrid(*_grid_permute(*self._grid(), [d % self.dim() for d in _sizes(dims)]))

    def transpose(self, dim0, dim1):
        order = list(range(self.dim()))
        d0, d1 = dim0 % self.dim(), dim1 % self.dim()
        order[d0], order[d1] = order[d1], order[d0]
        return self.permute(*order)

    def t(self):
        return self if self.dim() < 2 else self.transpose(0, 1)

    def movedim(self, source, destination):
        src = [d % self.dim() for d in (source if isinstance(source, (tuple, list)) else (source,))]
        dst = [d % self.dim() for d in (destination if isinstance(destination, (tuple, list))
                                        else (destination,))]
        rest = iter([d for d in range(self.dim()) if d not in src])
        order = [None] * self.dim()
        for s_, d_ in zip(src, dst):
            order[d_] = s_
        return self.permute(*[o if o is not None else next(rest) for o in order])

    def flip(self, *dims):
        flipped = [d % self.dim() for d in _sizes(dims)]
        shape, numbers = self._grid()
        strides = _strides(shape)
        out = []
        for pos in _positions(shape):
            flat = 0
            for d, i in enumerate(pos):
                flat += strides[d] * ((shape[d] - 1 - i) if d in flipped else i)
            out.append(flat)
        return self._regrid(shape, out)

    def expand(self, *sizes):
        sizes = _sizes(sizes)
        lead = len(sizes) - self.dim()
        target = tuple(self._shape[d - lead] if n == -1 else n for d, n in enumerate(sizes))
        return self._regrid(target, _broadcast_numbers(self._shape, target))

    def expand_as(self, other):
        return self.expand(*other.shape)

    def contiguous(self, *args, **kwargs):
        return self

    clone = detach = contiguous

    # --- reductions -----------------------------------------------------------------
    def _fold(self, name, combine, dim=None, keepdim=False, prepare=None, whole=None):
        """``combine`` over the reduced dims, element by element (one value, or a row);
        ``whole(items)`` instead makes one value of each group at once."""
        dims = _reduced_dims(self._tracer, self.dim(), dim, f".{name}()")
        groups = {}
        for item, pos in zip(self._items, _positions(self._shape)):
            key = tuple(i for d, i in enumerate(pos) if d not in dims)
            groups.setdefault(key, []).append(prepare(item) if prepare is not None else item)
        out = []
        for items in groups.values():
            if whole is not None and len(items) > 1:
                out.append(whole(items))
                continue
            acc = items[0]
            for x in items[1:]:
                acc = combine(acc, x)
            out.append(acc)
        shape = [1 if d in dims else n for d, n in enumerate(self._shape)] if keepdim else \
            [n for d, n in enumerate(self._shape) if d not in dims]
        return out[0] if not shape else Row(self._tracer, shape, out, self._what)

    def sum(self, dim=None, keepdim=False, dtype=None):
        # torch sums bools as integers (a count), never as a logical or.
        count = (lambda x: _cast(x, torch.int32)) if self.dtype == torch.bool else None
        return self._fold("sum", lambda a, b: _binary("add", a, b), dim, keepdim, count)

    def prod(self, dim=None, keepdim=False, dtype=None):
        count = (lambda x: _cast(x, torch.int32)) if self.dtype == torch.bool else None
        return self._fold("prod", lambda a, b: _binary("mul", a, b), dim, keepdim, count)

    def mean(self, dim=None, keepdim=False, dtype=None):
        n = 1
        for d in _reduced_dims(self._tracer, self.dim(), dim, ".mean()"):
            n *= self._shape[d]
        return _binary("truediv", self.sum(dim, keepdim), float(n))

    def _extreme(self, name, op, dim, keepdim):
        if self.dtype == torch.bool:          # (of bools: a logical or / and)
            return self._fold(name, lambda a, b: _binary(op, a, b), dim, keepdim)
        # One n-ary node per group: a chain of binary maximum nodes would make sympy
        # compare every pair of elements while building it (minutes for 64 elements).
        return self._fold(name, None, dim, keepdim, whole=lambda items: _proxy(
            self._tracer, _line(op + "of", _promote_all(items), *items), _promote_all(items)))

    def amax(self, dim=None, keepdim=False):
        return self._extreme("amax", "max", dim, keepdim)

    def amin(self, dim=None, keepdim=False):
        return self._extreme("amin", "min", dim, keepdim)

    def any(self, dim=None, keepdim=False):
        return self._fold("any", lambda a, b: _binary("or", a, b), dim, keepdim, _bool_of)

    def all(self, dim=None, keepdim=False):
        return self._fold("all", lambda a, b: _binary("and", a, b), dim, keepdim, _bool_of)

    def _arg(self, name, extreme, dim=None, keepdim=False):
        """(extreme values, first positions holding them) along ``dim``, as torch returns;
        positions count along ``dim``, or in the flattened row for dim=None."""
        if dim is None:
            flat = Row(self._tracer, (len(self._items),), self._items, self._what)
            return flat._arg(name, extreme, 0)
        d = _reduced_dims(self._tracer, self.dim(), dim, f".{name}()")[0]
        values = self._extreme(name, extreme[:3], d, keepdim=True)
        values = values if isinstance(values, Row) else Row(self._tracer, [1], [values], self._what)
        # The first j whose element is the extreme: a where-chain from the last j back to the
        # first, each element compared with the extreme once (linear in size, where a chain
        # of running extremes or a min over positions costs sympy far more).
        spread = _broadcast_numbers(values._shape, self._shape)
        groups = {}
        for i, pos in enumerate(_positions(self._shape)):
            key = tuple([k for e, k in enumerate(pos) if e != d])
            groups.setdefault(key, []).append((self._items[i], values._items[spread[i]], pos[d]))
        out = []
        for members in groups.values():
            first = _const(self._tracer, members[-1][2])
            for x, top, j in reversed(members[:-1]):
                first = _where(_binary("eq", x, top), j, first)
            out.append(first)
        shape = [1 if e == d else n for e, n in enumerate(self._shape)] if keepdim else \
            [n for e, n in enumerate(self._shape) if e != d]
        positions = out[0] if not shape else Row(self._tracer, shape, out, self._what)
        return (values if keepdim else values.squeeze(d)), positions

    def argmax(self, dim=None, keepdim=False):
        return self._arg("argmax", "maximum", dim, keepdim)[1]

    def argmin(self, dim=None, keepdim=False):
        return self._arg("argmin", "minimum", dim, keepdim)[1]

    def max(self, dim=None, keepdim=False):
        if dim is None:
            return self.amax()
        if isinstance(dim, (Proxy, View, Row, torch.Tensor)):
            return _binary("maximum", self, dim)             # torch.max(a, b)
        return _MinMax(*self._arg("max", "maximum", dim, keepdim))

    def min(self, dim=None, keepdim=False):
        if dim is None:
            return self.amin()
        if isinstance(dim, (Proxy, View, Row, torch.Tensor)):
            return _binary("minimum", self, dim)
        return _MinMax(*self._arg("min", "minimum", dim, keepdim))

    def norm(self, p=2, dim=None, keepdim=False, dtype=None):
        if p in (2, 2.0, "fro"):
            return _unary("sqrt", (self * self).sum(dim, keepdim))
        if p in (1, 1.0):
            return _unary("abs", self).sum(dim, keepdim)
        raise self._tracer.fail(f".norm(p={p!r}) of {self._what}", "use p=2 or p=1, or write the sum out")

    def dot(self, other):
        return (self * other).sum()

    __matmul__ = dot

    def __rmatmul__(self, other):
        return (other * self).sum()

    # --- everything else: the proxies' methods, element by element ------------------
    def __getattr__(self, name):
        bound = _bound_method(self, name)
        if bound is not None:
            return bound
        raise self._tracer.fail(f".{name} of {self._what} is not supported",
                                "use elementwise torch functions and reduce with .sum() / "
                                ".max() / .any() / torch.dot")

    def _not_a_value(self, *args, **kwargs):
        raise _row_used_as_value(self)

    __bool__ = __float__ = __int__ = __index__ = _not_a_value
    __hash__ = object.__hash__

    def __repr__(self):
        return f"Row({list(self._shape)}, {self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})


class _MinMax(tuple):
    """``(values, indices)`` of ``.max(dim)`` / ``.min(dim)``, as torch's named tuple."""
    values = property(lambda self: self[0])
    indices = property(lambda self: self[1])

    def __new__(cls, values, indices):
        return super().__new__(cls, (values, indices))


def _promote_all(items) -> str:
    """The kind torch's promotion gives a row's elements together."""
    return max([_kind(x) for x in items], key=_RANK.get)


def _bool_of(x):
    return _as_bool(_operand(x._tracer, x))


def _positions(shape) -> list:
    """Every position of ``shape``, row-major (plain Python: torch.compile traces it)."""
    out = [()]
    for n in shape:
        out = [p + (i,) for p in out for i in range(n)]
    return out


def _strides(shape) -> list:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _sizes(args) -> tuple:
    """``f(2, 3)`` or ``f((2, 3))``: the sizes, as torch's shape methods take them."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) \
        else tuple(args)


def _grid_index(shape, numbers, parts):
    """(shape, numbers) of ``grid[parts]`` for ints, slices and None, as torch indexes."""
    axes, fixed, d = [], 0, 0
    strides = _strides(shape)
    for k in parts:
        if k is None:
            axes.append(None)
            continue
        if d >= len(shape):
            raise IndexError(f"too many indices for {len(shape)} dims")
        n = shape[d]
        if isinstance(k, slice):
            axes.append((d, list(range(*k.indices(n)))))
        else:
            if not -n <= int(k) < n:
                raise IndexError(f"index {int(k)} is out of bounds for a dim of size {n}")
            fixed += strides[d] * (int(k) % n)
        d += 1
    axes += [(e, list(range(shape[e]))) for e in range(d, len(shape))]
    out_shape = tuple(1 if a is None else len(a[1]) for a in axes)
    out = []
    for pos in _positions(out_shape):
        flat = fixed
        for a, i in zip(axes, pos):
            if a is not None:
                flat += strides[a[0]] * a[1][i]
        out.append(numbers[flat])
    return out_shape, out


def _grid_reshape(shape, numbers, sizes):
    total = len(numbers)
    known = 1
    for n in sizes:
        known *= n if n != -1 else 1
    sizes = tuple(total // known if n == -1 else n for n in sizes)
    check = 1
    for n in sizes:
        check *= n
    if check != total:
        raise ValueError(f"shape {list(sizes)} is invalid for a row of {total} elements")
    return sizes, numbers


def _grid_permute(shape, numbers, dims):
    strides = _strides(shape)
    out_shape = tuple([shape[d] for d in dims])
    out = []
    for pos in _positions(out_shape):
        flat = 0
        for d, i in zip(dims, pos):
            flat += strides[d] * i
        out.append(numbers[flat])
    return out_shape, out


def _broadcast_shape(shapes) -> tuple:
    out = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) > len(out):
            out = [1] * (len(shape) - len(out)) + out
        for i, n in enumerate(shape):
            d = len(out) - len(shape) + i
            if n != 1 and out[d] not in (1, n):
                raise ValueError("shapes do not broadcast")
            out[d] = n if n != 1 else out[d]
    return tuple(out)


def _broadcast_numbers(shape, target) -> list:
    """For each position of ``target``, the element number of ``shape`` torch broadcasts there."""
    strides = _strides(shape)
    lead = len(target) - len(shape)
    out = []
    for pos in _positions(target):
        flat = 0
        for d, n in enumerate(shape):
            flat += strides[d] * (0 if n == 1 else pos[lead + d])
        out.append(flat)
    return out


def _check_row_size(tracer: _Tracer, shape, what: str) -> None:
    numel = 1
    for n in shape:
        numel *= n
    if numel > ROW_LIMIT:
        raise tracer.fail(
            f"{what} is combined with traced values element by element: {numel} elements "
            f"(shape {list(shape)}), more than the {ROW_LIMIT} flexgen unrolls per score element",
            "compute the reduction outside the mod into a table indexed by positions "
            "(e.g. dist = torch.cdist(means, means); use dist[q_idx, kv_idx]), or reduce "
            "the captured tensor alone first (x[b].sum(-1) is computed once, outside the kernel)")


def _is_position(k) -> bool:
    """A traced position or a 0-d integer tensor: an index that removes its dim, chosen at run time."""
    return isinstance(k, Proxy) or (isinstance(k, torch.Tensor) and not isinstance(k, (View, Row))
                                    and k.dim() == 0 and not k.dtype.is_floating_point)


def _expand_key(tracer: _Tracer, key, ndim: int) -> list:
    """``key`` as a list with its Ellipsis spelled out as slices."""
    parts = list(key) if isinstance(key, tuple) else [key]
    if sum(k is Ellipsis for k in parts) > 1:
        raise tracer.fail("an index with two '...'", "use at most one Ellipsis, as in torch")
    if any(k is Ellipsis for k in parts):                 # (identity: == on a proxy traces)
        i = next(n for n, k in enumerate(parts) if k is Ellipsis)
        used = sum(k is not None for k in parts) - 1
        parts[i:i + 1] = [slice(None)] * max(0, ndim - used)
    return parts


def _static_key(parts: list) -> tuple:
    """(key with each traced position replaced by ``:``, [(output dim, position)]): applying
    the key keeps a dim where a position is; selecting along it afterwards removes it."""
    static, picks, out = [], [], 0
    for k in parts:
        if _is_position(k):
            picks.append((out, k))
            static.append(slice(None))
            out += 1
        else:
            static.append(k)
            out += 0 if isinstance(k, int) else 1
    return static, picks


def _select(row: "Row", d: int, index):
    """``row`` at traced position ``index`` along dim ``d``."""
    n = row.shape[d]
    i = _operand(row._tracer, index)
    i = _where(_binary("lt", i, 0), _binary("add", i, n), i)      # -1 is the last, as in torch
    lead = (slice(None),) * d
    picked = row[lead + (0,)]
    for j in range(1, n):
        picked = _where(_binary("eq", i, j), row[lead + (j,)], picked)
    return picked


def _reduced_dims(tracer: _Tracer, ndim: int, dim, what: str) -> list:
    if dim is None:
        return list(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = []
    for d in dims:
        if not isinstance(d, int) or isinstance(d, bool) or not -max(ndim, 1) <= d < max(ndim, 1):
            raise tracer.fail(f"{what} over dim={dim!r} of a value with {ndim} dims",
                              f"pass dims from {-ndim} to {ndim - 1}")
        out.append(d % max(ndim, 1))
    return sorted(set(out))


def _row_used_as_value(row: "Row"):
    return row._tracer.fail(
        f"{row._what} was used where one value is needed (it has shape {list(row._shape)})",
        "index every dimension (bias[b, q_idx], or bias[b][q_idx]), or reduce the rest to one "
        "value with .sum(-1) / .max() / .any(-1) / torch.dot(a, b)")


def _rows_in(values) -> list:
    return [v for v in values if isinstance(v, (Row, View))]


def _as_row(value) -> "Row":
    return value._row() if isinstance(value, View) else value


def _map_rows(fn, args: tuple, kwargs: dict):
    """``fn`` applied element by element where arguments are rows (broadcast as in torch)."""
    rows = {i: _as_row(a) for i, a in enumerate(args) if isinstance(a, (Row, View))}
    krows = {k: _as_row(v) for k, v in kwargs.items() if isinstance(v, (Row, View))}
    every = list(rows.values()) + list(krows.values())
    tracer, what = every[0]._tracer, every[0]._what
    try:
        shape = _broadcast_shape([r.shape for r in every])
    except ValueError:
        raise tracer.fail("rows of shapes " + ", ".join(str(list(r.shape)) for r in every)
                          + " were combined", "give them shapes that broadcast, as in torch") from None
    _check_row_size(tracer, shape, what)
    # Each row's element at every position of the result, as torch broadcasts.
    spread = {i: [r._items[j] for j in _broadcast_numbers(r.shape, shape)] for i, r in rows.items()}
    kspread = {k: [r._items[j] for j in _broadcast_numbers(r.shape, shape)] for k, r in krows.items()}
    items = []
    for n in range(len(_positions(shape))):
        a = [spread[i][n] if i in spread else v for i, v in enumerate(args)]
        k = {name: kspread[name][n] if name in kspread else v for name, v in kwargs.items()}
        items.append(fn(*a, **k))
    return items[0] if not shape else Row(tracer, shape, items, what)


def _elementwise(fn):
    """Lets a builder of one traced value take rows: then it builds one value per element."""
    def wrapped(*args, **kwargs):
        if any(isinstance(v, (Row, View)) for v in (*args, *kwargs.values())):
            return _map_rows(fn, args, kwargs)
        return fn(*args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped


# ---------------------------------------------------------------------------- building lines

def _tracer_of(*values) -> _Tracer | None:
    for v in values:
        if isinstance(v, (Proxy, View, Row)):
            return v._tracer
    return None


def _proxy(tracer: _Tracer, line: str, kind: str) -> Proxy:
    return Proxy(tracer, tracer.node(line), kind)


def _const(tracer: _Tracer, value) -> Proxy:
    if isinstance(value, bool):
        return _proxy(tracer, f"const b {int(value)}", "b")
    if isinstance(value, int):
        return _proxy(tracer, f"const i {value}", "i")
    return _proxy(tracer, f"const f {float(value)!r}", "f")


def _operand(tracer: _Tracer, value) -> Proxy:
    """A proxy for a proxy, a captured 0-d tensor, or a Python number."""
    if isinstance(value, Proxy):
        return value
    if isinstance(value, View):
        value._not_a_value()
    if isinstance(value, Row):
        raise _row_used_as_value(value)
    if isinstance(value, torch.Tensor):
        if value.dim() != 0:
            raise tracer.fail(f"a captured tensor of shape {list(value.shape)} was used as a value",
                              "index it with traced positions (e.g. bias[h, q_idx]) "
                              "or capture a 0-d tensor or a Python number")
        return _index(tracer, value, ())
    if isinstance(value, (bool, int, float)):
        return _const(tracer, value)
    raise tracer.fail(f"a value of type {type(value).__name__} ({value!r}) was combined "
                      "with a traced value", "use Python numbers, tensors, or traced values")


def _kind(value) -> str:
    """The kind torch's promotion gives ``value``: proxies, tensors and Python numbers."""
    if isinstance(value, Proxy):
        return value._kind
    if isinstance(value, torch.Tensor):
        return KIND_OF_DTYPE.get(value.dtype, "f")
    if isinstance(value, bool):
        return "b"
    if isinstance(value, int):
        return "i"
    return "f"


def _promote(a, b) -> str:
    ka, kb = _kind(a), _kind(b)
    return ka if _RANK[ka] >= _RANK[kb] else kb


def _line(op: str, kind: str, *operands: Proxy) -> str:
    return f"{op} {kind} " + " ".join(f"%{p._node}" for p in operands)


@_elementwise
def _binary(op: str, a, b) -> Proxy:
    tracer = _tracer_of(a, b)
    pa, pb = _operand(tracer, a), _operand(tracer, b)
    if op in COMPARISONS:
        return _proxy(tracer, _line(op, "b", pa, pb), "b")
    kind = _promote(a, b)
    if op in ("and", "or", "xor", "shl", "shr"):
        if kind == "f":
            raise tracer.fail(f"'{op}' of float values",
                              "compare first, then combine the bools with & | ^"
                              if op in ("and", "or", "xor") else "shift integers only")
        if op in ("shl", "shr") and kind == "b":
            kind = "i"
    elif op == "truediv":
        kind = "f"
    elif op == "pow" and kind == "i" and _negative_const(b):
        kind = "f"
    elif kind == "b":
        # torch keeps bool + bool and bool * bool as bool: logical or / and.
        if op in ("add", "mul"):
            return _proxy(tracer, _line("or" if op == "add" else "and", "b", pa, pb), "b")
        if op == "sub":
            raise tracer.fail("subtraction of two bools (torch refuses it too)",
                              "use ^ (logical xor) or & ~ (and not)")
        if op not in ("minimum", "maximum"):
            kind = "i"
    return _proxy(tracer, _line(op, kind, pa, pb), kind)


def _negative_const(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


@_elementwise
def _unary(op: str, x) -> Proxy:
    tracer = _tracer_of(x)
    p = _operand(tracer, x)
    if op == "neg":
        if p._kind == "b":
            raise tracer.fail("negation of a bool (torch refuses it too)", "use ~ for logical not")
        return _proxy(tracer, _line("neg", p._kind, p), p._kind)
    if op == "not":
        return _proxy(tracer, _line("not", "b", _as_bool(p)), "b")
    if op in ("abs", "sign", "floor", "ceil", "relu"):
        kind = "i" if p._kind == "b" else p._kind
        if op in ("floor", "ceil") and kind == "i":
            return p if p._kind == "i" else _cast(p, torch.int32)
        return _proxy(tracer, _line(op, kind, p), kind)
    return _proxy(tracer, _line(op, "f", p), "f")


@_elementwise
def _invert(x) -> Proxy:
    tracer = _tracer_of(x)
    p = _operand(tracer, x)
    if p._kind == "f":
        raise tracer.fail("~ of a float value", "use ~ on bools (comparisons) or integers")
    op = "not" if p._kind == "b" else "bitnot"
    return _proxy(tracer, _line(op, p._kind, p), p._kind)


def _as_bool(p: Proxy) -> Proxy:
    if p._kind == "b":
        return p
    return _proxy(p._tracer, _line("ne", "b", p, _const(p._tracer, 0)), "b")


@_elementwise
def _where(cond, a, b) -> Proxy:
    tracer = _tracer_of(cond, a, b)
    c = _operand(tracer, cond)
    if c._kind != "b":
        raise tracer.fail("torch.where's condition is not a bool", "pass a comparison as the condition")
    kind = _promote(a, b)
    return _proxy(tracer, _line("where", kind, c, _operand(tracer, a), _operand(tracer, b)), kind)


@_elementwise
def _clamp(x, min=None, max=None) -> Proxy:
    out = x
    if min is not None:
        out = _binary("maximum", out, min)
    if max is not None:
        out = _binary("minimum", out, max)
    return _operand(_tracer_of(x, min, max), out)


@_elementwise
def _cast(x, dtype) -> Proxy:
    tracer = _tracer_of(x)
    p = _operand(tracer, x)
    if isinstance(dtype, (str, torch.device)) or dtype is None:
        return p                      # .to(device): a traced value is on the kernel's device
    if isinstance(dtype, Proxy):
        dtype = dtype.dtype           # .to(other): other's dtype
    elif isinstance(dtype, torch.Tensor):
        dtype = dtype.dtype
    if not isinstance(dtype, torch.dtype) or dtype not in KIND_OF_DTYPE:
        raise tracer.fail(f".to({dtype!r})", "cast with a real torch dtype, e.g. .to(torch.int32)")
    target = KIND_OF_DTYPE[dtype]
    if target == p._kind:
        return p
    if target == "b":
        return _as_bool(p)
    return _proxy(tracer, _line("cast", target, p), target)


def _to(x, *args, **kwargs) -> Proxy:
    """``.to(dtype)``, ``.to(device)``, ``.to(device, dtype)``, ``.to(other)``, ``.to(dtype=...)``."""
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, (torch.dtype, Proxy, torch.Tensor)):
            dtype = a
    return _cast(x, dtype)


@_elementwise
def _full(like, value, dtype=None) -> Proxy:
    """A constant with torch's dtype for ``x.new_full((), value)`` and friends."""
    tracer = _tracer_of(like)
    if dtype is None:
        dtype = like.dtype if isinstance(like, (Proxy, View)) else torch.float32
    if isinstance(value, (Proxy, torch.Tensor)):
        return _cast(_operand(tracer, value), dtype)
    return _cast(_const(tracer, value), dtype)


def _check_scalar_size(tracer, size):
    size = (size,) if isinstance(size, int) else tuple(size or ())
    if size not in ((), (1,)):
        raise tracer.fail(f"a new tensor of size {tuple(size)} in a mod",
                          "a mod computes one element: create scalars (size ())")


def _new(value):
    def make(x, size=(), *args, dtype=None, device=None, **kwargs):
        _check_scalar_size(_tracer_of(x), size)
        return _full(x, value, dtype or (x.dtype if isinstance(x, Proxy) else None))
    return make


def _new_full(x, size, fill_value, *args, dtype=None, device=None, **kwargs):
    _check_scalar_size(_tracer_of(x), size)
    return _full(x, fill_value, dtype or x.dtype)


def _like(value):
    def make(x, *args, dtype=None, device=None, **kwargs):
        return _full(x, value, dtype or x.dtype)
    return make


def _full_like(x, fill_value, *args, dtype=None, device=None, **kwargs):
    return _full(x, fill_value, dtype or x.dtype)


# Tensor methods on proxies: name -> function(proxy, *args, **kwargs).
_METHODS = {name: (lambda n: lambda x: _unary(n, x))(name) for name in UNARY
            if name not in ("not", "bitnot", "neg")}
_METHODS.update({
    "neg": lambda x: _unary("neg", x), "negative": lambda x: _unary("neg", x),
    "logical_not": lambda x: _unary("not", x), "bitwise_not": _invert,
    "add": lambda x, o, alpha=1: _binary("add", x, o if alpha == 1 else _binary("mul", o, alpha)),
    "sub": lambda x, o, alpha=1: _binary("sub", x, o if alpha == 1 else _binary("mul", o, alpha)),
    "mul": lambda x, o: _binary("mul", x, o), "multiply": lambda x, o: _binary("mul", x, o),
    "div": lambda x, o, rounding_mode=None: _div(x, o, rounding_mode),
    "divide": lambda x, o, rounding_mode=None: _div(x, o, rounding_mode),
    "true_divide": lambda x, o: _binary("truediv", x, o),
    "floor_divide": lambda x, o: _binary("floordiv", x, o),
    "remainder": lambda x, o: _binary("mod", x, o), "pow": lambda x, o: _binary("pow", x, o),
    "minimum": lambda x, o: _binary("minimum", x, o), "maximum": lambda x, o: _binary("maximum", x, o),
    "logical_and": lambda x, o: _logical("and", x, o), "logical_or": lambda x, o: _logical("or", x, o),
    "logical_xor": lambda x, o: _logical("xor", x, o),
    "bitwise_and": lambda x, o: _binary("and", x, o), "bitwise_or": lambda x, o: _binary("or", x, o),
    "bitwise_xor": lambda x, o: _binary("xor", x, o),
    "bitwise_left_shift": lambda x, o: _binary("shl", x, o),
    "bitwise_right_shift": lambda x, o: _binary("shr", x, o),
    "eq": lambda x, o: _binary("eq", x, o), "ne": lambda x, o: _binary("ne", x, o),
    "lt": lambda x, o: _binary("lt", x, o), "le": lambda x, o: _binary("le", x, o),
    "gt": lambda x, o: _binary("gt", x, o), "ge": lambda x, o: _binary("ge", x, o),
    "not_equal": lambda x, o: _binary("ne", x, o), "greater": lambda x, o: _binary("gt", x, o),
    "greater_equal": lambda x, o: _binary("ge", x, o), "less": lambda x, o: _binary("lt", x, o),
    "less_equal": lambda x, o: _binary("le", x, o),
    "clamp": _clamp, "clip": _clamp,
    "where": lambda x, cond, other: _where(cond, x, other),
    "masked_fill": lambda x, mask, value: _where(mask, value, x),
    "to": _to, "type": lambda x, dtype=None: x.dtype if dtype is None else _cast(x, dtype),
    "float": lambda x: _cast(x, torch.float32), "double": lambda x: _cast(x, torch.float32),
    "half": lambda x: _cast(x, torch.float32), "bfloat16": lambda x: _cast(x, torch.float32),
    "int": lambda x: _cast(x, torch.int32), "long": lambda x: _cast(x, torch.int32),
    "short": lambda x: _cast(x, torch.int32), "bool": lambda x: _cast(x, torch.bool),
    "new_ones": _new(1), "new_zeros": _new(0), "new_full": _new_full,
    "new_empty": _new(0), "new_tensor": lambda x, value, dtype=None, **k: _full(x, value, dtype),
    "squeeze": lambda x, *a, **k: x, "unsqueeze": lambda x, *a, **k: x,
    "view": lambda x, *a, **k: x, "reshape": lambda x, *a, **k: x,
    "expand": lambda x, *a, **k: x, "expand_as": lambda x, *a, **k: x,
    "contiguous": lambda x, *a, **k: x, "clone": lambda x, *a, **k: x,
    "detach": lambda x: x, "cpu": lambda x: x, "cuda": lambda x, *a, **k: x,
    # A traced value is one element: reducing it keeps it (torch's rules for a 0-d tensor).
    "sum": lambda x, *a, **k: x, "amax": lambda x, *a, **k: x, "amin": lambda x, *a, **k: x,
    "prod": lambda x, *a, **k: x, "mean": lambda x, *a, **k: _cast(x, torch.float32),
    "max": lambda x, *a, **k: _scalar_extreme(x, "maximum", *a, **k),
    "min": lambda x, *a, **k: _scalar_extreme(x, "minimum", *a, **k),
    "any": lambda x, *a, **k: _cast(x, torch.bool), "all": lambda x, *a, **k: _cast(x, torch.bool),
})


def _bound_method(value, name):
    """``value.name`` for a tensor method the tracer knows (a Proxy's or a Row's), else None;
    a private name is an AttributeError (Python and dynamo probe for them)."""
    if name.startswith("_"):
        raise AttributeError(name)
    method = _METHODS.get(name)
    return None if method is None else (lambda *args, **kwargs: method(value, *args, **kwargs))


@_elementwise
def _logical(op, a, b):
    tracer = _tracer_of(a, b)
    return _binary(op, _as_bool(_operand(tracer, a)), _as_bool(_operand(tracer, b)))


def _scalar_extreme(x, op, other=None, keepdim=False):
    """``x.max()``, ``x.max(other)`` (elementwise) or ``x.max(dim)`` (values, indices) of one value."""
    if other is None:
        return x
    if isinstance(other, (Proxy, View, Row, torch.Tensor, float)):
        return _binary(op, x, other)
    return _MinMax(x, _const(x._tracer, 0))


def _div(x, o, rounding_mode):
    if rounding_mode is None:
        return _binary("truediv", x, o)
    if rounding_mode == "floor":
        return _binary("floordiv", x, o)
    tracer = _tracer_of(x, o)
    raise tracer.fail(f"division with rounding_mode={rounding_mode!r}",
                      "use rounding_mode='floor' (or //), or plain /")


def _tensor_method(name):
    """The torch-namespace function ``torch.<name>(x, ...)`` for a tensor method."""
    method = _METHODS[name]
    return lambda x, *args, **kwargs: method(x, *args, **kwargs)


# ---------------------------------------------------------------------------- torch functions

def _functions() -> dict:
    """The exact function objects a mod may call on traced values -> what they do.

    Keyed by the object itself (torch.exp, torch.Tensor.exp, torch.ops.aten.exp.default),
    never by name: a user's own ``mylib::exp`` operator is not torch's exp.
    """
    table = {}
    aten = torch.ops.aten
    F = torch.nn.functional

    def add(fn, *objects):
        for obj in objects:
            if obj is not None:
                table[obj] = fn

    def overloads(packet):
        return [getattr(packet, name) for name in packet.overloads()] + [packet]

    def aten_op(name):
        return overloads(getattr(aten, name)) if hasattr(aten, name) else []

    for name in UNARY:
        if name in ("not", "bitnot", "silu", "relu"):
            continue
        fn = (lambda n: lambda x, *a, **k: _unary(n, x))(name)
        add(fn, getattr(torch, name, None), getattr(torch.Tensor, name, None), *aten_op(name))
    add(lambda x, *a, **k: _unary("neg", x), torch.negative, torch.Tensor.negative,
        torch.Tensor.__neg__)
    add(lambda x, *a, **k: _unary("silu", x), F.silu, *aten_op("silu"))
    add(lambda x, *a, **k: _unary("relu", x), F.relu, torch.relu, torch.Tensor.relu, *aten_op("relu"))
    add(_elu, F.elu, *aten_op("elu"))
    # Activations and helpers torch has as one function: their formulas in the ops above.
    add(_gelu, F.gelu, *aten_op("gelu"))
    add(_softplus, F.softplus, *aten_op("softplus"))
    add(lambda x, *a, **k: _unary("neg", _softplus(_unary("neg", x))), F.logsigmoid,
        *aten_op("log_sigmoid"))
    add(_leaky_relu, F.leaky_relu, *aten_op("leaky_relu"))
    add(lambda x, *a, **k: _binary("mul", x, x), torch.square, torch.Tensor.square, *aten_op("square"))
    add(lambda x, *a, **k: _binary("truediv", 1.0, x), torch.reciprocal, torch.Tensor.reciprocal,
        *aten_op("reciprocal"))
    add(lambda x, *a, **k: _unary("log", _binary("add", x, 1.0)), torch.log1p, torch.Tensor.log1p,
        *aten_op("log1p"))
    add(lambda x, *a, **k: _binary("sub", _unary("exp", x), 1.0), torch.expm1, torch.Tensor.expm1,
        *aten_op("expm1"))
    add(lambda x, *a, **k: _unary("not", x), torch.logical_not, torch.Tensor.logical_not,
        *aten_op("logical_not"))
    add(_invert, torch.bitwise_not, torch.Tensor.bitwise_not, torch.Tensor.__invert__,
        *aten_op("bitwise_not"))
    add(lambda x, *a, **k: _unary("abs", x), torch.Tensor.__abs__)
    binary = {
        "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
        "true_divide": "truediv", "floor_divide": "floordiv", "remainder": "mod", "pow": "pow",
        "minimum": "minimum", "maximum": "maximum", "fmin": "minimum", "fmax": "maximum",
        "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
        "bitwise_left_shift": "shl", "bitwise_right_shift": "shr",
        "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
        "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
    }
    for name, op in binary.items():
        fn = (lambda o: lambda a, b, *rest, **k: _binary(o, a, b))(op)
        add(fn, getattr(torch, name, None), getattr(torch.Tensor, name, None), *aten_op(name))
    for name in ("logical_and", "logical_or", "logical_xor"):
        op = name.split("_")[1]
        fn = (lambda o: lambda a, b, *r, **k: _logical(o, a, b))(op)
        add(fn, getattr(torch, name), getattr(torch.Tensor, name), *aten_op(name))
    dunders = {"__add__": ("add", False), "__radd__": ("add", True), "__sub__": ("sub", False),
               "__rsub__": ("sub", True), "__mul__": ("mul", False), "__rmul__": ("mul", True),
               "__truediv__": ("truediv", False), "__rtruediv__": ("truediv", True),
               "__floordiv__": ("floordiv", False), "__rfloordiv__": ("floordiv", True),
               "__mod__": ("mod", False), "__rmod__": ("mod", True), "__pow__": ("pow", False),
               "__rpow__": ("pow", True), "__and__": ("and", False), "__rand__": ("and", True),
               "__or__": ("or", False), "__ror__": ("or", True), "__xor__": ("xor", False),
               "__rxor__": ("xor", True), "__lshift__": ("shl", False), "__rlshift__": ("shl", True),
               "__rshift__": ("shr", False), "__rrshift__": ("shr", True),
               "__eq__": ("eq", False), "__ne__": ("ne", False), "__lt__": ("lt", False),
               "__le__": ("le", False), "__gt__": ("gt", False), "__ge__": ("ge", False)}
    for name, (op, reflected) in dunders.items():
        fn = (lambda o, r: (lambda a, b: _binary(o, b, a)) if r else (lambda a, b: _binary(o, a, b)))(
            op, reflected)
        add(fn, getattr(torch.Tensor, name, None))
    add(lambda a, b, rounding_mode=None: _div(a, b, rounding_mode),
        torch.div, torch.divide, torch.Tensor.div, torch.Tensor.divide, *aten_op("div"))
    add(lambda c, a, b: _where(c, a, b), torch.where, *aten_op("where"))
    add(lambda x, cond, other: _where(cond, x, other), torch.Tensor.where)
    add(lambda x, mask, value: _where(mask, value, x), torch.masked_fill, torch.Tensor.masked_fill,
        *aten_op("masked_fill"))
    add(_clamp, torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip, *aten_op("clamp"))
    add(_to, torch.Tensor.to, torch.Tensor.type)
    add(lambda x, dtype=None, *a, **k: _cast(x, dtype), *aten_op("_to_copy"))
    for name, dtype in (("float", torch.float32), ("double", torch.float32), ("half", torch.float32),
                        ("bfloat16", torch.float32), ("int", torch.int32), ("long", torch.int32),
                        ("short", torch.int32), ("bool", torch.bool)):
        add((lambda d: lambda x, *a, **k: _cast(x, d))(dtype), getattr(torch.Tensor, name))
    for name in ("new_ones", "new_zeros", "new_full", "new_empty", "new_tensor"):
        add((lambda n: lambda x, *a, **k: _METHODS[n](x, *a, **k))(name), getattr(torch.Tensor, name))
    add(_like(1), torch.ones_like, *aten_op("ones_like"))
    add(_like(0), torch.zeros_like, torch.empty_like, *aten_op("zeros_like"))
    add(_full_like, torch.full_like, *aten_op("full_like"))
    add(lambda x, *a, **k: _operand(_tracer_of(x), x), *aten_op("alias"), *aten_op("clone"),
        *aten_op("detach"), *aten_op("lift_fresh"))
    table[torch.Tensor.__getitem__] = table[operator.getitem] = _getitem
    for name in ("sum", "mean", "amax", "amin", "max", "min", "any", "all", "prod", "argmax",
                 "argmin", "norm", "dot"):
        add(_reducing(name), getattr(torch, name, None), getattr(torch.Tensor, name, None))
    add(_reducing("dot"), torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.inner)
    # torch.export (strict) hands a mode Python's operators rather than Tensor's dunders.
    for name, op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "truediv"),
                     ("floordiv", "floordiv"), ("mod", "mod"), ("pow", "pow"), ("and_", "and"),
                     ("or_", "or"), ("xor", "xor"), ("lshift", "shl"), ("rshift", "shr"),
                     ("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge")):
        table[getattr(operator, name)] = (lambda o: lambda a, b: _binary(o, a, b))(op)
    table[operator.neg] = lambda x: _unary("neg", x)
    table[operator.abs] = lambda x: _unary("abs", x)
    table[operator.invert] = _invert
    return table


def _elu(x, alpha=1.0, *args, **kwargs):
    """F.elu (the linear-attention feature map elu(x) + 1): x above 0, alpha * (exp(x) - 1) below."""
    return _where(_binary("gt", x, 0.0), x, _binary("mul", alpha, _binary("sub", _unary("exp", x), 1.0)))


def _gelu(x, approximate="none"):
    """torch's gelu: x * Phi(x) with erf, or its tanh approximation."""
    if approximate == "tanh":
        cube = _binary("mul", _binary("mul", x, x), x)
        inner = _binary("mul", math.sqrt(2.0 / math.pi), _binary("add", x, _binary("mul", 0.044715, cube)))
        return _binary("mul", _binary("mul", 0.5, x), _binary("add", 1.0, _unary("tanh", inner)))
    if approximate != "none":
        raise _tracer_of(x).fail(f"gelu(approximate={approximate!r})", "use 'none' or 'tanh', as torch")
    phi = _binary("add", 1.0, _unary("erf", _binary("mul", x, math.sqrt(0.5))))
    return _binary("mul", _binary("mul", 0.5, x), phi)


def _softplus(x, beta=1.0, threshold=20.0):
    """torch's softplus: log(1 + exp(beta x)) / beta, x itself where beta x > threshold."""
    bx = _binary("mul", x, beta)
    smooth = _binary("truediv", _unary("log", _binary("add", _unary("exp", bx), 1.0)), beta)
    return _where(_binary("gt", bx, threshold), _cast(x, torch.float32), smooth)


def _leaky_relu(x, negative_slope=0.01, inplace=False):
    return _where(_binary("gt", x, 0), x, _binary("mul", x, negative_slope))


def _reducing(name):
    """torch.<name>(x, ...): a row's reduction (unrolled), a partly indexed captured
    tensor's (on the host where it can be), or a traced value's (it is one element)."""
    def call(x, *args, **kwargs):
        if isinstance(x, (Row, View)):
            return getattr(x, name)(*args, **kwargs)
        method = _METHODS.get(name)
        if method is None:
            raise _tracer_of(x, *args).fail(f"torch.{name} of one traced value",
                                            f"torch.{name} needs a row (a partly indexed captured tensor)")
        return method(x, *args, **kwargs)
    return call


def _getitem(tensor, index):
    tracer = _tracer_of(tensor, *(index if isinstance(index, tuple) else (index,)))
    if isinstance(tensor, (Proxy, View)):
        return tensor[index]
    return _index(tracer, tensor, index if isinstance(index, tuple) else (index,))


_FUNCTION_NAMES = set(UNARY) | {"where", "clamp", "minimum", "maximum", "masked_fill", "to",
                                "new_ones", "new_zeros", "new_full", "ones_like", "zeros_like",
                                "gelu", "softplus", "logsigmoid", "leaky_relu", "square",
                                "reciprocal", "log1p", "expm1",
                                "full_like"}


def _torch_function(func, args, kwargs):
    impl = _FUNCTIONS.get(func)
    if impl is None:
        tracer = _tracer_of(*args, *kwargs.values())
        name = getattr(func, "__name__", str(func))
        if name.endswith("_") and not name.endswith("__"):
            raise tracer.fail(f"in-place operation {name}() on a traced value",
                              f"use the out-of-place form {name[:-1]}()")
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                and _qualified(func).split("::")[0] not in ("aten", "prims"):
            raise tracer.fail(
                f"the custom operator '{_qualified(func)}' is called on a traced value; flexgen "
                "builds the kernel from the mod's own torch operations and cannot see inside it",
                "write the operator's formula in the mod with torch functions (e.g. torch.tanh "
                "for a fast tanh); flexgen picks the kernel's instructions itself")
        raise tracer.fail(f"torch function '{_qualified(func)}' is not supported in a mod",
                          "use arithmetic, comparisons, torch.where and the elementwise functions "
                          + " ".join(sorted(_FUNCTION_NAMES)))
    return impl(*args, **kwargs)


class _TraceMode(torch.overrides.TorchFunctionMode):
    """Routes every torch function a mod calls on traced values to ``_torch_function``.

    Proxies' own ``__torch_function__`` covers eager code, but torch.compile asks it
    only about top-level arguments: ``bias[h, q_idx]`` passes a tuple of proxies. A
    mode sees every call; calls on real tensors alone (``bias.sum()``) run as they are.
    One that reads a captured tensor's value into Python (``limit.item()``) makes that
    value a constant of this trace, which then must not be reused once the tensor changes.
    """

    def __init__(self, tracer: _Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _tracer_of(*args, *kwargs.values()) is None and not any(
                isinstance(a, tuple) and _tracer_of(*a) is not None for a in args):
            if func in _READS_VALUE:
                self.tracer.derived = True
            return func(*args, **kwargs)
        return _torch_function(func, args, kwargs)


# Tensor methods that hand a tensor's values to Python (a constant in the traced program).
_READS_VALUE = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
                          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__})


def _qualified(func) -> str:
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name                          # "approx::tanh"
    if isinstance(func, torch._ops.OpOverload):
        return f"{func.name()}.{func._overloadname}"            # "aten::cumsum.default"
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return f"{module}.{name}" if module and not str(name).startswith(module) else str(name)


# ---------------------------------------------------------------------------- captured tensors

def _index(tracer: _Tracer, t, indices: tuple):
    """``t[indices]`` for a captured tensor: a load (every dim indexed) or a ``View``."""
    if isinstance(t, (Proxy, View, Row)):
        raise tracer.fail("a traced value was indexed", "index captured tensors only")
    if any(i is None or i is Ellipsis or isinstance(i, slice) for i in indices):
        return _sliced(tracer, t, indices)
    if any(isinstance(i, (Row, View)) for i in indices):
        # A row of positions (table[ids[b]] with ids[b] a row): one load per element.
        if len(indices) < t.dim():
            raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was indexed with a row "
                              f"of positions and {len(indices)} indices",
                              f"give all {t.dim()} indices when one of them is a row")
        return _map_rows(lambda *ix: _index(tracer, t, ix), tuple(indices), {})
    if t.dtype not in KIND_OF_DTYPE:
        raise tracer.fail(f"captured tensor dtype {t.dtype} is not supported",
                          "use a bool, integer or floating tensor")
    if len(indices) > t.dim():
        raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was indexed with "
                          f"{len(indices)} indices", f"give at most {t.dim()} indices, one per dimension")
    nodes = []
    for i, idx in enumerate(indices):
        if isinstance(idx, (slice, type(None), type(Ellipsis))) or isinstance(idx, View):
            raise tracer.fail(f"index {i} of a captured tensor is {idx!r}",
                              "index with traced integer positions or Python ints only")
        if isinstance(idx, torch.Tensor) and not isinstance(idx, Proxy) and (
                idx.dim() != 0 or idx.dtype.is_floating_point or idx.dtype == torch.bool):
            raise tracer.fail(f"index {i} of a captured tensor is a tensor of shape "
                              f"{list(idx.shape)} and dtype {idx.dtype}",
                              "index with traced positions, Python ints or 0-d integer tensors")
        p = _operand(tracer, idx)
        if p._kind != "i":
            if p._kind == "b":
                p = _cast(p, torch.int32)
            else:
                raise tracer.fail(f"index {i} of a captured tensor has dtype {p.dtype}",
                                  "indices must be integers: use // instead of /, or "
                                  ".to(torch.int32) after torch.floor")
        nodes.append(p)
    if len(indices) < t.dim():
        return View(tracer, t, tuple(indices))
    slot = tracer.slot(t)
    kind = KIND_OF_DTYPE[t.dtype]
    return _proxy(tracer, f"load {kind} {slot} " + " ".join(f"%{p._node}" for p in nodes), kind)


def _sliced(tracer: _Tracer, t, indices: tuple):
    """``t[indices]`` with slices, None or ... among the positions (``bias[q_idx, 1:]``).

    The slices apply to the captured tensor itself (a view, no copy); a traced position
    removes its dim as in torch, so the dims left, in order, are those of the result.
    """
    parts = _expand_key(tracer, indices, t.dim())
    if any(isinstance(k, (Row, View)) for k in parts):
        raise tracer.fail("a captured tensor was indexed with a row of positions and a slice",
                          "index it with one traced position per dim, Python ints or slices")
    static, picks = _static_key(parts)
    moved = t[tuple(static)]
    dims = [d for d, _ in picks]
    moved = moved.movedim(dims, list(range(len(dims)))) if dims else moved
    if not picks:
        return _row_of_tensor(tracer, moved)
    return _index(tracer, moved, tuple(k for _, k in picks))


def _row_of_tensor(tracer: _Tracer, t):
    """A captured tensor sliced statically (``bias[1:3]``): a row of its elements."""
    return View(tracer, t, ())._row() if t.dim() else _index(tracer, t, ())


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


# Built at import (~2 ms): torch.compile traces the lookups, but not the building.
_FUNCTIONS = _functions()


# ---------------------------------------------------------------------------- reading the text

@dataclass(frozen=True, eq=False)
class Node:
    """One line of a traced program, with its operands resolved: ``args`` holds child
    Nodes or plain Python values (a var's name, a constant, a load's slot)."""
    op: str
    args: tuple
    dtype: torch.dtype


_PARSED: dict = {}


def parse(graph: str) -> tuple:
    """(kind, name, root Node, ((dtype name, ndim) per buffer)) of a traced program. Memoized."""
    hit = _PARSED.get(graph)
    if hit is None:
        nodes, kind, name, root, buffers = [None], None, None, None, []
        for number, line in enumerate(graph.split(LINE_END)):
            op, rest = line.split(" ", 1)
            fields = rest.split(" ")
            if op == "program":
                kind, name = fields
                continue
            if op == "buffer":
                buffers.append((fields[1], int(fields[2])))
                continue
            dtype = DTYPE_OF_KIND[fields[0]]
            refs = [nodes[int(f[1:])] for f in fields[1:] if f.startswith("%")]
            if op == "root":
                root = refs[0]
                continue
            if op == "var":
                node = Node("var", (fields[1],), dtype)
            elif op == "const":
                text = fields[1]
                value = (text == "1") if fields[0] == "b" else int(text) if fields[0] == "i" else float(text)
                node = Node("const", (value,), dtype)
            elif op == "load":
                node = Node("load", (int(fields[1]), tuple(refs)), dtype)
            else:
                node = Node(op, tuple(refs), dtype)
            nodes.append(node)
            assert len(nodes) == number + 1, "flexgen internal error: a malformed traced program"
        hit = (kind, name, root, tuple(buffers))
        if len(_PARSED) >= _MEMO_MAX:
            _PARSED.clear()
        _PARSED[graph] = hit
    return hit


TracedMod.root = property(lambda self: parse(self.graph)[2],
                          doc="The program's value as a Node graph (``parse``).")


# ---------------------------------------------------------------------------- the eager memo
#
# A training or serving loop passes the same mod every step; tracing it again costs far
# more than the rest of a warm call. A trace is reused while the mod provably computes
# the same program: same function, same code, and the very same objects behind every
# name it reads (its globals, closure cells, defaults and keyword defaults, and those of
# the functions it calls), each of a kind whose identity pins what the mod can read
# from it. A tensor counts by identity (its values are read by the kernel at run time);
# a module only if it is a library's (a user module's attributes can be reassigned); a
# class, a config object, a list, a bound method or a partial cannot be pinned: such a
# mod is traced on every call (correct, slower). torch.compile traces every time and
# guards on what the mod read itself.

_MEMO_MAX = 4096
_RECENT: dict = {}             # id(mod) -> (mod, kind, checks, traced)
_STABLE_VALUES = (int, float, bool, str, bytes, type(None), torch.Tensor, torch.dtype, torch.device,
                  types.BuiltinFunctionType, type(Ellipsis))
_LIBRARY_MODULES = ("torch", "math", "operator", "numpy", "flexgen", "builtins", "functools",
                    "transformers.masking_utils")


class _Missing:
    """A name a function's code uses that is not one of its globals (an attribute, a builtin)."""


_MISSING = _Missing()


def _pinned(value) -> bool:
    """Whether identity pins everything a mod can read from ``value`` (functions aside)."""
    if isinstance(value, _STABLE_VALUES) or value is _MISSING:
        return True
    if isinstance(value, types.ModuleType):
        name = value.__name__
        return any(name == lib or name.startswith(lib + ".") for lib in _LIBRARY_MODULES)
    if isinstance(value, (tuple, frozenset)):
        return all(_pinned(v) or inspect.isfunction(v) for v in value)
    return _hashable(value) and value in _LIBRARY_CALLABLES


def _library_callables() -> frozenset:
    found = set(_FUNCTIONS)
    for obj in (torch.where, torch.clamp, torch.tensor, torch.full, torch.ones, torch.zeros):
        found.add(obj)
    return frozenset(o for o in found if _hashable(o))


def _hashable(o) -> bool:
    try:
        hash(o)
        return True
    except TypeError:
        return False


def _checks(mod, out: list, depth: int = 0) -> bool:
    """Append (holder, key, expected) identity checks covering what ``mod`` reads; False
    where something it reads cannot be pinned (then the mod is not memoized)."""
    if depth > 8 or not inspect.isfunction(mod):
        return False
    code = mod.__code__
    out.append((mod, "__code__", code))
    out.append((mod, "__defaults__", mod.__defaults__))
    values = list(mod.__defaults__ or ())
    kwdefaults = mod.__kwdefaults__
    out.append((mod, "__kwdefaults__", kwdefaults))
    if kwdefaults:
        # A dict: its entries can change in place, so each one is checked.
        for name, value in kwdefaults.items():
            out.append((kwdefaults, name, value))
            values.append(value)
    g = mod.__globals__
    for name in code.co_names:
        value = g.get(name, _MISSING)
        out.append((g, name, value))
        values.append(value)
    for cell in mod.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:          # an empty cell: calling the mod fails anyway
            return False
        out.append((cell, None, value))
        values.append(value)
    for value in values:
        if inspect.isfunction(value):
            if value is not mod and not _checks(value, out, depth + 1):
                return False
        elif isinstance(value, (tuple, frozenset)):
            for item in value:
                if inspect.isfunction(item) and not _checks(item, out, depth + 1):
                    return False
            if not _pinned(value):
                return False
        elif not _pinned(value):
            return False
    return True


def _unchanged(checks) -> bool:
    for holder, key, expected in checks:
        if key is None:                                   # a closure cell
            try:
                if holder.cell_contents is not expected:
                    return False
            except ValueError:
                return False
        elif isinstance(holder, dict):
            if holder.get(key, _MISSING) is not expected:
                return False
        elif getattr(holder, key) is not expected:
            return False
    return True


def trace_cached(mod, kind: str) -> TracedMod:
    """``trace(mod, kind)``, reusing the last trace while nothing the mod reads has changed."""
    if torch.compiler.is_compiling():
        return trace(mod, kind)
    recent = _RECENT.get(id(mod))
    if recent is not None and recent[0] is mod and recent[1] == kind and _unchanged(recent[2]):
        return recent[3]
    traced = trace(mod, kind)
    checks: list = []
    if not traced.derived and _checks(mod, checks):
        if len(_RECENT) >= _MEMO_MAX:
            _RECENT.clear()
        # The entry holds the mod, so its id is not reused while the entry lives.
        _RECENT[id(mod)] = (mod, kind, tuple(checks), traced)
    return traced


def clear_memos() -> None:
    """Forget every memoized trace and parsed program (``flexgen.clear_caches``)."""
    _RECENT.clear()
    _PARSED.clear()


_LIBRARY_CALLABLES = _library_callables()
