"""The torch functions a mod may call on traced values: the table from each exact function
object to its builder, and the dispatch (``_torch_function``, ``_TraceMode``) that routes
every call on a traced value there."""
from __future__ import annotations

import math
import operator

import torch

from .program import UNARY

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
    add(lambda x: _logical("or", _binary("eq", x, float("inf")), _binary("eq", x, float("-inf"))),
        torch.isinf, torch.Tensor.isinf, *aten_op("isinf"))
    add(lambda x: _binary("eq", x, float("inf")), torch.isposinf, torch.Tensor.isposinf, *aten_op("isposinf"))
    add(lambda x: _binary("eq", x, float("-inf")), torch.isneginf, torch.Tensor.isneginf, *aten_op("isneginf"))
    # x != x holds for NaN alone (the lowering keeps a float compared with itself: expr.IsNan).
    add(lambda x: _binary("ne", x, x), torch.isnan, torch.Tensor.isnan, *aten_op("isnan"))
    add(lambda x: _logical("and", _binary("eq", x, x), _logical("and", _binary("ne", x, float("inf")),
                                                                _binary("ne", x, float("-inf")))),
        torch.isfinite, torch.Tensor.isfinite, *aten_op("isfinite"))
    add(_lerp, torch.lerp, torch.Tensor.lerp, *aten_op("lerp"))
    add((lambda x, y: _logaddexp(x, y, "exp", "log")), torch.logaddexp, torch.Tensor.logaddexp,
        *aten_op("logaddexp"))
    add((lambda x, y: _logaddexp(x, y, "exp2", "log2")), torch.logaddexp2, torch.Tensor.logaddexp2,
        *aten_op("logaddexp2"))
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
    add(lambda x, min: _clamp(x, min=min), torch.clamp_min, torch.Tensor.clamp_min, *aten_op("clamp_min"))
    add(lambda x, max: _clamp(x, max=max), torch.clamp_max, torch.Tensor.clamp_max, *aten_op("clamp_max"))
    add(lambda x, *a, **k: _trunc(x), torch.trunc, torch.Tensor.trunc, torch.fix, torch.Tensor.fix,
        *aten_op("trunc"), *aten_op("fix"))
    add(lambda x, *a, **k: _binary("sub", x, _trunc(x)), torch.frac, torch.Tensor.frac, *aten_op("frac"))
    add(_round, torch.round, torch.Tensor.round, *aten_op("round"))
    # log10(x) = log2(x) * log10(2): within an ulp or two of torch's log10.
    add(lambda x, *a, **k: _binary("mul", _unary("log2", x), math.log10(2.0)), torch.log10,
        torch.Tensor.log10, *aten_op("log10"))
    add(_fmod, torch.fmod, torch.Tensor.fmod, *aten_op("fmod"))
    add(_searchsorted, torch.searchsorted, *aten_op("searchsorted"))
    add(lambda x, boundaries, *, out_int32=False, right=False: _searchsorted(boundaries, x, right=right),
        torch.bucketize, *aten_op("bucketize"))
    # More of torch.nn.functional's activations (a score_mod such as attention-gym's
    # log(activation(score) + offset) takes any of them), each as torch defines it.
    add(lambda x, min_val=-1.0, max_val=1.0, *a, **k: _clamp(x, min_val, max_val), F.hardtanh,
        *aten_op("hardtanh"))
    add(lambda x, *a, **k: _clamp(x, 0.0, 6.0), F.relu6, *aten_op("relu6"))
    add(lambda x, *a, **k: _hardsigmoid(x), F.hardsigmoid, *aten_op("hardsigmoid"))
    add(lambda x, *a, **k: _binary("mul", x, _hardsigmoid(x)), F.hardswish, *aten_op("hardswish"))
    add(lambda x: _binary("truediv", x, _binary("add", _unary("abs", x), 1.0)), F.softsign)
    add(lambda x, *a, **k: _binary("mul", x, _unary("tanh", _softplus(x))), F.mish, *aten_op("mish"))
    add(lambda x, *a, **k: _binary("mul", _SELU_SCALE, _elu(x, _SELU_ALPHA)), F.selu, torch.selu,
        *aten_op("selu"))
    add(_celu, F.celu, torch.celu, *aten_op("celu"))
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
    # aten.index(t, [i, j]) is t[i, j] (PyTorch's own FlexAttention tests spell loads so);
    # a None in the list leaves that dim whole, as a ':' does.
    add(lambda t, indices: _getitem(t, tuple(slice(None) if i is None else i for i in indices)),
        *aten_op("index"))
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


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _celu(x, alpha=1.0, *args, **kwargs):
    """F.celu: x above 0, alpha * (exp(x / alpha) - 1) below."""
    below = _binary("mul", alpha, _binary("sub", _unary("exp", _binary("truediv", x, alpha)), 1.0))
    return _where(_binary("gt", x, 0.0), x, below)


def _hardsigmoid(x):
    """F.hardsigmoid as torch computes it: relu6(x + 3) / 6."""
    return _binary("truediv", _clamp(_binary("add", x, 3.0), 0.0, 6.0), 6.0)


def _searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """torch.searchsorted of a traced value in a small sorted captured tensor (or a row of one,
    ``offsets[b]``): the number of entries before it, (sequence < value).sum(), or at or
    before it with right=True. A document id from the offsets alone: searchsorted(offsets,
    q_idx, right=True) - 1. Unrolled as a row, so at most ROW_LIMIT entries."""
    tracer = _tracer_of(sorted_sequence, values)
    if sorter is not None:
        raise tracer.fail("torch.searchsorted with a sorter",
                          "sort the captured sequence outside the mod and search the sorted one")
    if not isinstance(values, Proxy) or isinstance(sorted_sequence, (Proxy, Row)) \
            or sorted_sequence.dim() != 1:
        raise tracer.fail("torch.searchsorted / bucketize other than of one traced value in a 1-D "
                          "captured tensor", "search a 1-D captured tensor (or a row of one, "
                          "offsets[b]) for a traced value")
    before = _binary("le" if right or side == "right" else "lt", sorted_sequence, values)
    return before.sum()


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


def _lerp(start, end, weight):
    """torch.lerp: start + weight * (end - start)."""
    return _binary("add", start, _binary("mul", weight, _binary("sub", end, start)))


def _logaddexp(x, y, exp, log):
    """log(exp(x) + exp(y)) without overflow: max + log(1 + exp(-|x - y|)) (base e or 2).
    Where the larger is infinite the result is it, as torch's (two -inf give -inf, two +inf
    +inf: the NaN of inf - inf is kept out)."""
    high = _binary("maximum", x, y)
    gap = _unary("neg", _unary("abs", _binary("sub", x, y)))
    infinite = _logical("or", _binary("eq", high, float("-inf")), _binary("eq", high, float("inf")))
    rest = _unary(log, _binary("add", 1.0, _unary(exp, _where(infinite, 0.0, gap))))
    return _where(infinite, high, _binary("add", high, rest))


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
                                "reciprocal", "log1p", "expm1", "lerp", "logaddexp", "logaddexp2",
                                "isinf", "isposinf", "isneginf", "isnan", "isfinite",
                                "full_like", "clamp_min", "clamp_max", "trunc", "frac", "round",
                                "log10", "fmod", "elu", "celu", "selu", "hardtanh", "relu6",
                                "hardsigmoid", "hardswish", "softsign", "mish", "searchsorted",
                                "bucketize"}


def _torch_function(func, args, kwargs):
    if getattr(func, "__module__", None) == "torch._tensor":
        impl = _TENSOR_OPERATORS.get(getattr(func, "__name__", None))
    else:
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
        if _tracer_of(*args, *kwargs.values()) is None:
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


# Imported after this module's definitions: the note at the end of proxy.py says why.
from .proxy import Proxy, Row, _Tracer, View  # noqa: E402
from .rows import _index  # noqa: E402
from .builders import (  # noqa: E402
    _binary, _cast, _clamp, _div, _fmod, _full_like, _invert, _like, _logical, _METHODS, _operand,
    _round, _to, _tracer_of, _trunc, _unary, _where)

# Built at import (~2 ms): torch.compile traces the lookups, but not the building.
_FUNCTIONS = _functions()
# The operators torch.Tensor defines in Python (torch/_tensor.py: __rsub__, __rtruediv__,
# __rpow__, __rfloordiv__, __rmod__, ...), by name: under torch.compile the table's lookup of
# them misses (dynamo's view of the wrapped function is not the key), then its guard fails
# (``score / temperature`` with a captured 0-d tensor).
_TENSOR_OPERATORS = {name: _FUNCTIONS[obj] for name, obj in vars(torch.Tensor).items()
                     if name.startswith("__") and getattr(obj, "__module__", None) == "torch._tensor"
                     and obj in _FUNCTIONS}
