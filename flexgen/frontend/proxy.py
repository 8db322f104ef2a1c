"""The values a mod computes on while it is traced: ``Proxy`` (one value), ``View`` (a
partly indexed captured tensor) and ``Row`` (several values with a shape), the operators
they share, and the per-trace state ``_Tracer`` (see ``flexgen.frontend.trace``)."""
from __future__ import annotations

import inspect
import os

import torch

from ..errors import TraceError, reported
from .program import DTYPE_OF_KIND, LINE_END

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
        self.int64_lines = []      # per line: reads_int64, computed as far as asked
        self.derived = False

    def node(self, line: str) -> int:
        found = self.index.get(line)
        if found is None:
            found = len(self.lines)
            self.lines.append(line)
            self.index[line] = found
        return found

    def reads_int64(self, node: int) -> bool:
        """Whether line ``node`` computes from an element of an int64 captured tensor: the
        kernels keep those in int64, as torch does, where other integers are int32."""
        wide = self.int64_lines
        for line in self.lines[len(wide):node + 1]:      # lines only refer to earlier ones
            fields = line.split()
            wide.append((fields[0] == "load" and self.buffers[int(fields[2])].dtype == torch.int64)
                        or any(wide[int(f[1:])] for f in fields[2:] if f.startswith("%")))
        return wide[node]

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
        if not self._indices:         # met whole by a traced value (builders._whole)
            return f"a captured tensor of shape {list(self.shape)}, not indexed,"
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
        if _method(name) is not None or name in Row.__dict__:
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


# The tracer's values (proxy.py), their builders (builders.py), rows and captured tensors
# (rows.py) and the torch-function table (torch_functions.py) call one another. Each
# module imports the others' names only here, after its own definitions, so whichever
# of them is imported first, the others find what they need already defined.
from .rows import (  # noqa: E402
    _bool_of, _broadcast_numbers, _check_row_size, _expand_key, _grid_index, _grid_permute,
    _grid_reshape, _index, _positions, _promote_all, _reduced_dims, _row_used_as_value, _select,
    _sizes, _static_key, _strides)
from .builders import (  # noqa: E402
    _binary, _bound_method, _cast, _const, _invert, _line, _method, _proxy, _unary, _where)
from .torch_functions import _FUNCTION_NAMES, _torch_function  # noqa: E402
