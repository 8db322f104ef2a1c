"""Building the program's lines: each operation on traced values (arithmetic, comparisons,
torch.where, casts, constants) appends one line with the kind torch's promotion gives it;
``_METHODS`` maps the tensor methods a mod may call to them."""
from __future__ import annotations

import numbers

import torch

from .program import COMPARISONS, KIND_OF_DTYPE, UNARY, _RANK


def _elementwise(fn=None, *, whole=True):
    """Lets a builder of one traced value take rows: then it builds one value per element.
    ``whole=False`` for a builder whose tensor arguments are not values (``.to(other)``)."""
    if fn is None:
        return lambda f: _elementwise(f, whole=whole)

    def wrapped(*args, **kwargs):
        tracer = _tracer_of(*args, *kwargs.values()) if whole else None
        if tracer is not None:
            args = tuple(_whole(tracer, v) for v in args)
            kwargs = {k: _whole(tracer, v) for k, v in kwargs.items()}
        if any(isinstance(v, (Row, View)) for v in (*args, *kwargs.values())):
            return _map_rows(fn, args, kwargs)
        return fn(*args, **kwargs)
    wrapped.__name__, wrapped.__doc__ = fn.__name__, fn.__doc__
    return wrapped


def _whole(tracer: _Tracer, value):
    """A small captured tensor met whole by a traced value is a row, as torch broadcasts it:
    ``(offsets <= q_idx).sum()`` counts the offsets at or before the query (a document id
    without a table). A larger one stays a tensor, for ``_operand``'s error to say how to index it."""
    if (isinstance(value, torch.Tensor) and not isinstance(value, (View, Row)) and value.dim()
            and value.numel() <= ROW_LIMIT):
        return View(tracer, value, ())
    return value


# ---------------------------------------------------------------------------- building lines

def _tracer_of(*values) -> _Tracer | None:
    for v in values:
        if isinstance(v, (Proxy, View, Row)):
            return v._tracer
        # Calls that take a list of tensors (torch.stack, aten.index's indices) hold
        # traced values one level down: the error for an unsupported one must name the mod.
        if isinstance(v, (list, tuple)):
            found = _tracer_of(*v)
            if found is not None:
                return found
    return None


def _proxy(tracer: _Tracer, line: str, kind: str) -> Proxy:
    return Proxy(tracer, tracer.node(line), kind)


def _const(tracer: _Tracer, value) -> Proxy:
    if isinstance(value, bool):
        return _proxy(tracer, f"const b {int(value)}", "b")
    if isinstance(value, int):
        if not _INT32_MIN <= value <= _INT32_MAX:
            # The kernels compute integers in int32 (as torch's compiled FlexAttention does):
            # such a constant failed deep in Triton ("Scalar ... is out of range for type int32").
            raise tracer.fail(f"the integer constant {value} does not fit in int32, the type "
                              "the kernels compute integer constants and positions in (an int64 "
                              "tensor's elements stay int64, but not the constants they meet)",
                              "use a constant within [-2**31, 2**31) (a hash multiplier can be "
                              "taken modulo 2**32 and shifted into that range), or a float")
        return _proxy(tracer, f"const i {value}", "i")
    return _proxy(tracer, f"const f {float(value)!r}", "f")


def _plain(value):
    """A numpy scalar (np.float32(0.5), np.int64(2): hyperparameters read from numpy arrays)
    as the Python number torch takes it for; any other value as it is."""
    if isinstance(value, numbers.Number) and not isinstance(value, (bool, int, float)):
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
    elif type(value).__name__ == "ndarray" and getattr(value, "ndim", None) == 0:
        # A 0-d array; under torch.compile numpy scalars arrive so too: a captured 0-d tensor.
        return torch.as_tensor(value)
    return value


def _operand(tracer: _Tracer, value) -> Proxy:
    """A proxy for a proxy, a captured 0-d tensor, or a Python number."""
    if isinstance(value, Proxy):
        return value
    value = _plain(value)
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
    value = _plain(value)
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
    if op in COMPARISONS:
        decided = _compare_beyond_int32(tracer, op, a, b)
        if decided is not None:
            return decided
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


_INT32_MIN, _INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _compare_beyond_int32(tracer: _Tracer, op: str, a, b):
    """An integer compared with a number outside int32's range (a window of sys.maxsize, 1e12
    or float('inf') that means \"no limit\", a NaN) is decided here, as torch decides it:
    integers are int32 in the kernels, so ``q_idx - kv_idx < 10**10`` is True. Kept as a
    comparison, the lowering rewrites it to ``kv_idx - q_idx + 9999999999 >= 0``, which
    wraps in int32 and masked rows silently. None where nothing is decided, and for a value
    read from an int64 tensor (int64 in the kernels too: its constant is refused instead)."""
    for value, number, flipped in ((a, b, False), (b, a, True)):
        number = _plain(number)
        if _kind(value) == "f" or isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        if number != number:                                    # NaN: only != holds
            return _const(tracer, op == "ne")
        if _INT32_MIN <= number <= _INT32_MAX:
            continue
        if isinstance(value, Proxy) and tracer.reads_int64(value._node):
            continue
        # value < number for every int32 value when number is above them, > when below.
        below = (number > _INT32_MAX) != flipped
        return _const(tracer, op == "ne" or (op in ("lt", "le") if below else op in ("gt", "ge")))
    return None


def _negative_const(value) -> bool:
    value = _plain(value)
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


@_elementwise(whole=False)
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


@_elementwise(whole=False)
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
    "type_as": lambda x, other: _cast(x, other.dtype),
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
    method = _method(name)
    return None if method is None else (lambda *args, **kwargs: method(value, *args, **kwargs))


def _method(name: str):
    """The tracer's tensor method ``name`` (a function of the value and the call's arguments),
    or None. A method whose torch function the tracer knows is that function (x.log1p() as
    torch.log1p(x)): one table, so that no supported function is refused in its method spelling."""
    method = _METHODS.get(name)
    if method is None:
        method = torch_functions._FUNCTIONS.get(getattr(torch.Tensor, name, None))
    return method


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
    if rounding_mode == "trunc":
        a, b = _operand(tracer, x), _operand(tracer, o)
        if a.dtype.is_floating_point or b.dtype.is_floating_point:
            t = _binary("truediv", a, b)
            return _where(_binary("lt", t, 0), _unary("ceil", t), _unary("floor", t))
        # Integers: floor division rounds toward -inf; one up where the signs differ and the
        # division is not exact (torch's trunc rounds toward 0).
        q = _binary("floordiv", a, b)
        inexact = _binary("ne", _binary("mod", a, b), 0)
        signs_differ = _binary("ne", _binary("lt", a, 0), _binary("lt", b, 0))
        return _where(_logical("and", inexact, signs_differ), _binary("add", q, 1), q)
    raise tracer.fail(f"division with rounding_mode={rounding_mode!r}",
                      "use rounding_mode='floor' (or //), 'trunc', or plain /")


def _trunc(x):
    """Rounding toward zero (an integer is its own)."""
    return _where(_binary("lt", x, 0), _unary("ceil", x), _unary("floor", x))


@_elementwise
def _round(x, *args, decimals=0, **kwargs):
    """torch.round: to the nearest integer, halves to the even one. From the fraction
    x - floor(x), which is exact, rather than floor(x + 0.5), which rounds for x close to a
    half (0.49999997 + 0.5 is 1.0 in float32) and beyond 2**23 (where x is an integer)."""
    tracer = _tracer_of(x)
    if args or decimals:
        raise tracer.fail("torch.round with decimals", "scale by 10**decimals, round, and divide back")
    if _operand(tracer, x)._kind != "f":
        return x
    low = _unary("floor", x)
    fraction = _binary("sub", x, low)
    odd = _binary("ne", _binary("sub", low, _binary("mul", _unary("floor", _binary("mul", low, 0.5)), 2.0)), 0.0)
    up = _logical("or", _binary("gt", fraction, 0.5), _logical("and", _binary("eq", fraction, 0.5), odd))
    return _where(up, _binary("add", low, 1.0), low)


@_elementwise
def _fmod(a, b):
    """torch.fmod of integers: the remainder of the division rounded toward zero (its sign
    is a's). Floats are refused: a - trunc(a / b) * b is not exact where a / b rounds across
    an integer (fmod(0.3, 0.1)), which torch's fmod is."""
    tracer = _tracer_of(a, b)
    if _operand(tracer, a)._kind == "f" or _operand(tracer, b)._kind == "f":
        raise tracer.fail("torch.fmod of float values",
                          "use torch.remainder (or %), or integer operands")
    return _binary("sub", a, _binary("mul", _div(a, b, "trunc"), b))


def _tensor_method(name):
    """The torch-namespace function ``torch.<name>(x, ...)`` for a tensor method."""
    method = _METHODS[name]
    return lambda x, *args, **kwargs: method(x, *args, **kwargs)


# Imported after this module's definitions: the note at the end of proxy.py says why.
from .proxy import _MinMax, Proxy, ROW_LIMIT, Row, _Tracer, View  # noqa: E402
from .rows import _index, _map_rows, _row_used_as_value  # noqa: E402
from . import torch_functions  # noqa: E402  (its table, read at call time)
