"""Trace a score_mod / mask_mod into an expression graph.

The mod is called once with proxy objects in place of the score and the
indices. Every operation on a proxy records a ``Node``; the value the mod
returns is the root of the graph. Captured tensors that the mod indexes
(``bias[h, q_idx]``) or uses directly (a 0-d tensor) become numbered buffers:
their values are kernel arguments, only their dtype and rank shape the kernel.

Every node carries the dtype torch would give the same computation (indices
int32, the score float32, comparisons bool), so the kernel and the reference
agree on integer versus float arithmetic.
"""
from __future__ import annotations

import inspect
import math
import os
import types
from dataclasses import dataclass, field

import torch

from ..errors import TraceError

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")

# Elementwise torch functions a mod may call, by the name torch dispatches.
UNARY_FUNCS = {
    "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos",
    "abs", "sign", "floor", "ceil", "neg", "negative", "logical_not", "bitwise_not",
}
BINARY_FUNCS = {
    "add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
    "div": "truediv", "divide": "truediv", "true_divide": "truediv",
    "floor_divide": "floordiv", "remainder": "mod", "pow": "pow",
    "minimum": "minimum", "maximum": "maximum",
    "logical_and": "and", "logical_or": "or", "logical_xor": "xor",
    "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le",
    "not_equal": "ne",
}
# Tensor dunder methods reach __torch_function__ when a captured tensor is on
# the left of an operator and a proxy on the right.
DUNDERS = {
    "__add__": ("add", False), "__radd__": ("add", True),
    "__sub__": ("sub", False), "__rsub__": ("sub", True),
    "__mul__": ("mul", False), "__rmul__": ("mul", True),
    "__truediv__": ("truediv", False), "__rtruediv__": ("truediv", True),
    "__div__": ("truediv", False), "__rdiv__": ("truediv", True),
    "__floordiv__": ("floordiv", False), "__rfloordiv__": ("floordiv", True),
    "__mod__": ("mod", False), "__rmod__": ("mod", True),
    "__pow__": ("pow", False), "__rpow__": ("pow", True),
    "__and__": ("and", False), "__rand__": ("and", True),
    "__or__": ("or", False), "__ror__": ("or", True),
    "__xor__": ("xor", False), "__rxor__": ("xor", True),
    "__eq__": ("eq", False), "__ne__": ("ne", False),
    "__lt__": ("lt", False), "__le__": ("le", False),
    "__gt__": ("gt", False), "__ge__": ("ge", False),
}
COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge"}
CASTS = {"float": torch.float32, "double": torch.float32, "half": torch.float32,
         "bfloat16": torch.float32, "int": torch.int32, "long": torch.int32, "bool": torch.bool}


@dataclass(frozen=True, eq=False)
class Node:
    """One operation. ``args`` holds child Nodes or plain Python values."""
    op: str
    args: tuple
    dtype: torch.dtype
    key: tuple = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "key", (self.op, str(self.dtype)) + _key(self.args))


def _key(value):
    """A hashable, value-based key: equal graphs give equal keys."""
    if isinstance(value, Node):
        return value.key
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    if isinstance(value, float) and math.isnan(value):
        return ("float", "nan")
    return (type(value).__name__, repr(value))


@dataclass(frozen=True)
class Traced:
    """The result of tracing one mod."""
    kind: str                  # "score_mod" or "mask_mod"
    name: str                  # the mod's name, for messages
    root: Node
    buffers: tuple             # captured tensors, in slot order

    @property
    def signature(self) -> tuple:
        """What the kernel depends on: the graph and each buffer's dtype and rank."""
        return (self.kind, self.root.key,
                tuple((str(t.dtype), t.dim()) for t in self.buffers))


class _Tracer:
    """Per-trace state: the mod (for messages) and the captured buffers."""

    def __init__(self, mod, kind):
        self.mod, self.kind = mod, kind
        self.name = getattr(mod, "__name__", type(mod).__name__)
        self.buffers: list[torch.Tensor] = []
        self._slots: dict[int, int] = {}

    def buffer_slot(self, t: torch.Tensor) -> int:
        if id(t) not in self._slots:
            self._slots[id(t)] = len(self.buffers)
            self.buffers.append(t)
        return self._slots[id(t)]

    def fail(self, what: str, fix: str) -> TraceError:
        return TraceError(f"{self.kind} '{self.name}'{_user_location()}: {what}. Fix: {fix}")


_ACTIVE: list[_Tracer] = []


def _user_location() -> str:
    """' (file.py:12: `source line`)' for the innermost frame of user code."""
    here = os.path.dirname(os.path.abspath(__file__))
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


def _tracer() -> _Tracer:
    return _ACTIVE[-1]


def _example(value):
    """What torch.result_type needs to mimic promotion for ``value``."""
    if isinstance(value, Proxy):
        zero_d = value.node.op == "load" and value.node.args[1] == ()
        return torch.empty(() if zero_d else (1,), dtype=value.node.dtype)
    return value


def _promote(a, b) -> torch.dtype:
    """torch's result dtype for an elementwise op of two proxies, tensors or numbers."""
    ea, eb = _example(a), _example(b)
    if not isinstance(ea, torch.Tensor) and not isinstance(eb, torch.Tensor):
        ea = torch.tensor(ea)
    return _kernel_dtype(torch.result_type(ea, eb))


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """Collapse torch dtypes to the three kinds the kernel computes in."""
    if dtype == torch.bool:
        return torch.bool
    if dtype.is_floating_point:
        return torch.float32
    if dtype.is_complex:
        raise _tracer().fail(f"complex values ({dtype}) are not supported", "use real tensors")
    return torch.int32


def _node(value) -> Node:
    """A Node for a proxy, a captured 0-d tensor, or a Python number."""
    if isinstance(value, Proxy):
        return value.node
    if isinstance(value, torch.Tensor):
        return _capture(value, ()).node
    if isinstance(value, bool):
        return Node("const", (value,), torch.bool)
    if isinstance(value, int):
        return Node("const", (value,), torch.int32)
    if isinstance(value, float):
        return Node("const", (value,), torch.float32)
    raise _tracer().fail(f"a value of type {type(value).__name__} ({value!r}) was combined "
                         "with a traced value", "use Python numbers, tensors, or traced values")


def _capture(t: torch.Tensor, indices: tuple) -> "Proxy":
    tracer = _tracer()
    if isinstance(t, Proxy):
        raise tracer.fail("a traced value was indexed", "index captured tensors only")
    if len(indices) != t.dim():
        if not indices:
            raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was used as a value",
                              "index it with traced positions (e.g. bias[h, q_idx]) "
                              "or capture a 0-d tensor or a Python number")
        raise tracer.fail(f"a captured tensor of shape {list(t.shape)} was indexed with "
                          f"{len(indices)} indices", f"give exactly {t.dim()} indices, one per dimension")
    if t.is_complex() or t.dtype not in _LOADABLE:
        raise tracer.fail(f"captured tensor dtype {t.dtype} is not supported",
                          "use a bool, integer or floating tensor")
    nodes = []
    for i, idx in enumerate(indices):
        if isinstance(idx, (slice, type(None), type(Ellipsis))) or (
                isinstance(idx, torch.Tensor) and not isinstance(idx, Proxy)):
            raise tracer.fail(f"index {i} of a captured tensor is {idx!r}",
                              "index with traced integer positions or Python ints only")
        n = _node(idx)
        if n.dtype != torch.int32:
            raise tracer.fail(f"index {i} of a captured tensor has dtype {n.dtype}",
                              "indices must be integers: use // instead of /, or "
                              ".to(torch.int32) after torch.floor")
        nodes.append(n)
    slot = tracer.buffer_slot(t)
    return Proxy(Node("load", (slot, tuple(nodes)), _kernel_dtype(t.dtype)))


_LOADABLE = {torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
             torch.float16, torch.bfloat16, torch.float32, torch.float64}


def _binary(op: str, a, b) -> "Proxy":
    na, nb = _node(a), _node(b)
    if op in COMPARISONS:
        return Proxy(Node(op, (na, nb), torch.bool))
    dtype = _promote(a, b)
    if op in ("and", "or", "xor"):
        if dtype == torch.float32:
            raise _tracer().fail(f"'{op}' of float values", "compare first, then combine the bools with & | ^")
    elif op == "truediv" or (op == "pow" and dtype == torch.int32 and isinstance(b, (int, Proxy))
                             and _negative_const(nb)):
        dtype = torch.float32
    elif dtype == torch.bool:
        # torch keeps bool + bool and bool * bool as bool: logical or / and.
        if op in ("add", "mul"):
            return Proxy(Node("or" if op == "add" else "and", (na, nb), torch.bool))
        if op == "sub":
            raise _tracer().fail("subtraction of two bools (torch refuses it too)",
                                 "use ^ (logical xor) or & ~ (and not)")
        dtype = torch.int32 if op not in ("minimum", "maximum") else torch.bool
    return Proxy(Node(op, (na, nb), dtype))


def _negative_const(n: Node) -> bool:
    return n.op == "const" and n.args[0] < 0


def _unary(op: str, x) -> "Proxy":
    n = _node(x)
    if op in ("neg", "negative"):
        return Proxy(Node("neg", (n,), n.dtype))
    if op in ("logical_not",):
        return Proxy(Node("not", (_as_bool(n),), torch.bool))
    if op in ("invert", "bitwise_not"):
        if n.dtype == torch.float32:
            raise _tracer().fail("~ of a float value", "use ~ on bools (comparisons) or integers")
        return Proxy(Node("not" if n.dtype == torch.bool else "bitnot", (n,), n.dtype))
    if op in ("abs", "sign", "floor", "ceil"):
        dtype = torch.int32 if n.dtype == torch.bool else n.dtype
        return Proxy(Node(op, (n,), dtype))
    return Proxy(Node(op, (n,), torch.float32))


def _as_bool(n: Node) -> Node:
    return n if n.dtype == torch.bool else Node("ne", (n, Node("const", (0,), torch.int32)), torch.bool)


def _where(cond, a, b) -> "Proxy":
    c = _node(cond)
    if c.dtype != torch.bool:
        raise _tracer().fail("torch.where's condition is not a bool", "pass a comparison as the condition")
    dtype = _promote(a, b)
    return Proxy(Node("where", (c, _node(a), _node(b)), dtype))


def _clamp(x, min=None, max=None) -> "Proxy":
    out = x
    if min is not None:
        out = _binary("maximum", out, min)
    if max is not None:
        out = _binary("minimum", out, max)
    if not isinstance(out, Proxy):
        out = Proxy(_node(out))
    return out


def _cast(x, dtype) -> "Proxy":
    n = _node(x)
    if not isinstance(dtype, torch.dtype):
        raise _tracer().fail(f".to({dtype!r})", "cast with a torch dtype, e.g. .to(torch.int32)")
    target = _kernel_dtype(dtype)
    if target == n.dtype:
        return Proxy(n)
    if target == torch.bool:
        return Proxy(_as_bool(n))
    return Proxy(Node("cast", (n,), target))


class Proxy:
    """Stands in for the score or an index while a mod is traced."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    # --- what cannot be traced -------------------------------------------------
    def __bool__(self):
        raise _tracer().fail(
            "Python control flow (if / and / or / not / bool()) depends on a traced value",
            "use torch.where(cond, a, b) instead of if/else, and & | ~ instead of and / or / not")

    def __int__(self):
        raise _tracer().fail("int() of a traced value", "keep it a tensor; use // for integer division")

    def __float__(self):
        raise _tracer().fail("float() (or a math.* function) of a traced value",
                             "use the torch function instead (torch.exp, torch.tanh, ...)")

    __index__ = __int__

    def __iter__(self):
        raise _tracer().fail("iteration over a traced value", "a traced value is one element; do not loop over it")

    def __setitem__(self, key, value):
        raise _tracer().fail("item assignment on a traced value", "return a new value instead")

    def __getitem__(self, key):
        raise _tracer().fail("indexing a traced value", "index captured tensors, not the score or the indices")

    def __repr__(self):
        return f"Proxy({self.node.op}, {self.node.dtype})"

    __hash__ = object.__hash__

    # --- arithmetic ---------------------------------------------------------------
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
    def __neg__(self): return _unary("neg", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("abs", self)
    def __invert__(self): return _unary("invert", self)
    def __and__(self, o): return _binary("and", self, o)
    def __rand__(self, o): return _binary("and", o, self)
    def __or__(self, o): return _binary("or", self, o)
    def __ror__(self, o): return _binary("or", o, self)
    def __xor__(self, o): return _binary("xor", self, o)
    def __rxor__(self, o): return _binary("xor", o, self)
    def __eq__(self, o): return _binary("eq", self, o)
    def __ne__(self, o): return _binary("ne", self, o)
    def __lt__(self, o): return _binary("lt", self, o)
    def __le__(self, o): return _binary("le", self, o)
    def __gt__(self, o): return _binary("gt", self, o)
    def __ge__(self, o): return _binary("ge", self, o)

    # --- tensor-style methods (score.tanh(), q_idx.to(torch.float32), ...) ----------
    def __getattr__(self, name):
        if name.endswith("_") and not name.endswith("__"):
            raise _tracer().fail(f"in-place method .{name}() on a traced value",
                                 f"use the out-of-place form .{name[:-1]}()")
        if name in UNARY_FUNCS:
            return lambda: _unary(name, self)
        if name in BINARY_FUNCS:
            return lambda other: _binary(BINARY_FUNCS[name], self, other)
        if name in ("clamp", "clip"):
            return lambda min=None, max=None: _clamp(self, min, max)
        if name == "where":
            return lambda cond, other: _where(cond, self, other)
        if name == "masked_fill":
            return lambda mask, value: _where(mask, value, self)
        if name == "to":
            return lambda dtype, *a, **k: _cast(self, dtype)
        if name in CASTS:
            return lambda: _cast(self, CASTS[name])
        if name == "dtype":
            return self.node.dtype
        raise _tracer().fail(f".{name} of a traced value is not supported",
                             "use arithmetic, comparisons, torch.where and the elementwise "
                             "torch functions listed in flexgen.trace.UNARY_FUNCS")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__getitem__":
            tensor, index = args
            return _capture(tensor, index if isinstance(index, tuple) else (index,))
        if name in DUNDERS:
            op, reflected = DUNDERS[name]
            a, b = args
            return _binary(op, b, a) if reflected else _binary(op, a, b)
        if name.endswith("_") and not name.endswith("__"):
            raise _tracer().fail(f"in-place operation {name}() on a traced value",
                                 f"use the out-of-place form {name[:-1]}()")
        if name == "where":
            return _where(*args, **kwargs)
        if name in ("clamp", "clip"):
            return _clamp(*args, **kwargs)
        if name in UNARY_FUNCS and len(args) == 1 and not kwargs:
            return _unary(name, args[0])
        if name in ("div", "divide") and kwargs.get("rounding_mode") == "floor":
            return _binary("floordiv", *args)
        if name in BINARY_FUNCS and len(args) == 2 and not kwargs:
            return _binary(BINARY_FUNCS[name], *args)
        if name in ("to", "type"):
            dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
            return _cast(args[0], dtype)
        if name in CASTS:
            return _cast(args[0], CASTS[name])
        raise _tracer().fail(f"torch function '{name}' is not supported in a mod",
                             "use arithmetic, comparisons, torch.where and the elementwise "
                             "functions exp exp2 log log2 sqrt rsqrt tanh sigmoid sin cos abs "
                             "sign floor ceil clamp minimum maximum")


def _check_arity(mod, kind: str, names: tuple) -> None:
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


def trace(mod, kind: str) -> Traced:
    """Trace ``mod`` (``kind`` is "score_mod" or "mask_mod") into a ``Traced`` graph."""
    if not callable(mod):
        raise TraceError(f"{kind}: expected a callable, got {type(mod).__name__} ({mod!r}). "
                         f"Fix: pass a function, or None for no {kind}")
    names = SCORE_ARGS if kind == "score_mod" else MASK_ARGS
    _check_arity(mod, kind, names)
    tracer = _Tracer(mod, kind)
    proxies = [Proxy(Node("var", (n,), torch.float32 if n == "score" else torch.int32)) for n in names]
    _ACTIVE.append(tracer)
    try:
        try:
            result = mod(*proxies)
        except TraceError:
            raise
        except Exception as exc:  # the mod itself failed on our proxies
            raise TraceError(f"{kind} '{tracer.name}': calling it with traced values raised "
                             f"{type(exc).__name__}: {exc}. Fix: use only arithmetic, comparisons, "
                             "torch.where and elementwise torch functions on the arguments") from exc
        if isinstance(result, torch.Tensor) and not isinstance(result, Proxy):
            if result.dim() != 0:
                raise tracer.fail(f"it returned a tensor of shape {list(result.shape)}",
                                  "return an expression of the arguments")
        root = _node(result)
    finally:
        _ACTIVE.pop()
    if kind == "mask_mod" and root.dtype != torch.bool:
        raise TraceError(f"mask_mod '{tracer.name}': expected it to return a bool (a comparison "
                         f"or a combination of comparisons), got a value of dtype {root.dtype}. "
                         "Fix: return a comparison such as q_idx >= kv_idx")
    if kind == "score_mod" and root.dtype == torch.bool:
        raise TraceError(f"score_mod '{tracer.name}': expected it to return a number (the new "
                         "score), got a bool. Fix: to mask positions use a mask_mod, or "
                         "torch.where(cond, score, -float('inf'))")
    return Traced(kind, tracer.name, root, tuple(tracer.buffers))


# --- memoized tracing for the hot path ----------------------------------------------
_TRACES: dict = {}


def _fingerprint(mod, depth: int = 0):
    """Identities of everything a plain-function mod can read, or None when unknown.

    A function's behaviour is fixed by its code and what its closure cells and
    globals hold. Identity (not value) is enough: a tensor mutated in place is
    still the same buffer, so the kernel reads its new values; a rebound name
    or a new closure changes an identity and the mod is traced again.
    """
    code = getattr(mod, "__code__", None)
    if code is None or depth > 3 or not inspect.isfunction(mod):
        return None
    parts = [id(mod), id(code)]
    cells = []
    for cell in mod.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:          # an empty cell
            return None
    names = [mod.__globals__.get(name, _MISSING) for name in code.co_names]
    for value in cells + names:
        part = _value_fingerprint(value, depth)
        if part is None:
            return None
        parts.append(part)
    return tuple(parts)


def _value_fingerprint(value, depth):
    if inspect.isfunction(value):
        return _fingerprint(value, depth + 1)
    if isinstance(value, tuple):
        inner = tuple(_value_fingerprint(v, depth) for v in value)
        return None if None in inner else (id(value), inner)
    if value is _MISSING or isinstance(value, _STABLE_TYPES):
        return id(value)
    # An object whose attributes the mod may read (a config, a list): its
    # identity does not pin its content, so the mod is traced on every call.
    return None


class _Missing:
    """A co_name that is not a global: an attribute or a builtin name."""


_MISSING = _Missing()
# Values whose identity pins what a mod can read from them (a tensor's values
# are read by the kernel at run time, so identity is enough for it too).
_STABLE_TYPES = (types.ModuleType, types.BuiltinFunctionType, torch.Tensor,
                 int, float, bool, str, type(None), torch.dtype, type)


def _reads(mod) -> tuple:
    """What a plain function reads: (the global of each name its code uses, ``_MISSING``
    for none; its closure cells' contents). ValueError for an empty cell."""
    g = mod.__globals__
    return (tuple(g.get(name, _MISSING) for name in mod.__code__.co_names),
            tuple(cell.cell_contents for cell in mod.__closure__ or ()))


def _reads_same(mod, names, globals_read, cells_read) -> bool:
    """Whether ``mod`` still reads these very objects (``_reads``, compared by identity)."""
    g = mod.__globals__
    for name, value in zip(names, globals_read):
        if g.get(name, _MISSING) is not value:
            return False
    if cells_read:
        for cell, value in zip(mod.__closure__, cells_read):
            try:
                if cell.cell_contents is not value:
                    return False
            except ValueError:      # a cell emptied since
                return False
    return True


# The warm path's shortcut past _fingerprint: id(mod) -> (mod, kind, code, reads, trace).
# A mod whose fingerprint is the identities of its code and of what it reads directly
# (only _STABLE_TYPES values: no function or tuple, whose own reads _fingerprint walks)
# keeps that fingerprint while the same function has the same code and reads the same
# objects. Checking that is a few identity tests in a plain loop, where building the
# fingerprint and hashing it cost ~1.5 us of a ~15 us warm call.
_RECENT: dict = {}


def trace_cached(mod, kind: str) -> Traced:
    """``trace(mod, kind)``, reusing the last trace while nothing the mod reads has changed."""
    recent = _RECENT.get(id(mod))
    if recent is not None and recent[0] is mod and recent[1] == kind:
        code = recent[2]
        if mod.__code__ is code and _reads_same(mod, code.co_names, *recent[3]):
            return recent[4]
    key = _fingerprint(mod)
    if key is None:
        return trace(mod, kind)
    key = (kind, key)
    hit = _TRACES.get(key)
    if hit is None:
        if len(_TRACES) > 4096:      # mods made per call: keep the memo bounded
            _TRACES.clear()
        # Keep the mod alive with its trace so its id (part of the key) is not reused.
        hit = _TRACES[key] = (trace(mod, kind), mod)
    # A fingerprint was found, so every read passed _value_fingerprint: those that are
    # neither functions nor tuples count by identity alone.
    reads = _reads(mod)
    if not any(isinstance(r, tuple) or inspect.isfunction(r) for r in (*reads[0], *reads[1])):
        if len(_RECENT) > 4096:
            _RECENT.clear()
        _RECENT[id(mod)] = (mod, kind, mod.__code__, reads, hit[0])
    return hit[0]
