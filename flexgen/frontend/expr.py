"""Traced graphs as sympy expressions, in a canonical form.

Why sympy: two spellings of one mod (``q_idx >= kv_idx`` and
``kv_idx <= q_idx``; ``score * 1.0 + 0`` and ``score``) become the same
expression, so they share one compiled kernel; the same expression feeds the
block classifier (``flexgen.masks.bounds``) and the printer (``flexgen.codegen.printer``).
This runs once per new mod, never per call.

Conventions of the canonical form:
- numbers are exact (a Python float becomes the Rational of its binary value);
- every comparison is ``d >= 0``, ``d > 0`` (float d only), ``d == 0`` or
  ``d != 0`` with ``d`` sign-normalised, except a float compared with itself, which is
  ``IsNan`` (``x != x``) or its negation, comparisons with an infinity, and float
  comparisons whose difference would cancel a term (``FloatCompare``, kept as written);
- a captured tensor is an undefined function ``{prefix}buf{slot}(indices...)``
  whose assumptions say whether it holds integers (bool buffers load as 0/1
  integers and are compared with 0).
"""
from __future__ import annotations

import math

import sympy
import torch
from sympy.core.function import UndefinedFunction

from ..errors import TraceError
from .trace import Node, TracedMod

SCORE = sympy.Symbol("score", real=True)
INDEX_SYMBOLS = {n: sympy.Symbol(n, integer=True, nonnegative=True)
                 for n in ("b", "h", "q_idx", "kv_idx")}
# The linear-attention mods' arguments: a position ``t`` (decay_mod) and an entry ``x`` of
# the query or key (feature_map).
POSITION = sympy.Symbol("t", integer=True, nonnegative=True)
FEATURE = sympy.Symbol("x", real=True)
SYMBOLS = {"score": SCORE, **INDEX_SYMBOLS, "t": POSITION, "x": FEATURE}


class Sigmoid(sympy.Function):
    """1 / (1 + exp(-x)), kept whole so the kernel can call tl.sigmoid."""
    is_real = True

    def fdiff(self, argindex=1):
        return self * (1 - self)

    @classmethod
    def eval(cls, x):
        if x.is_Number and x.is_finite:
            return 1 / (1 + sympy.exp(-x))
        return None


class Trunc(sympy.Function):
    """Float to integer conversion, rounding toward zero (torch's .to(int))."""
    is_integer = True

    @classmethod
    def eval(cls, x):
        if x.is_integer:
            return x
        if x.is_Number and x.is_finite:
            return sympy.Integer(int(x))
        return None


class FloorDiv(sympy.Function):
    """``floor(num / den)`` of integer expressions, one node while printed or bounded (``whole_divisions``)."""
    is_integer = True

    @classmethod
    def eval(cls, num, den):
        if num.is_Integer and den.is_Integer:
            return sympy.Integer(int(num) // int(den))


def _int32_constants(e) -> bool:
    """Whether every integer constant of ``e`` is an int32: a float constant is an exact
    rational in sympy (0.05 is 3602879701896397 / 2**56), which integer arithmetic cannot hold."""
    return all(abs(int(n)) < 2 ** 31 for n in e.atoms(sympy.Integer))


def int_fraction(arg):
    """(numerator, denominator) if ``arg`` is a ratio of integer expressions that int32
    arithmetic can compute."""
    num, den = sympy.fraction(sympy.together(arg))
    if num.is_integer and den.is_integer and den != 1 and _int32_constants(num) and _int32_constants(den):
        return num, den
    return None


class IntRatio(sympy.Function):
    """``num / den``, a float, of an integer ``num`` and a positive integer ``den``: computed as
    torch computes ``(q_idx - kv_idx) / 10``, the difference in integers, then one division."""


def _grouped_ratios(add):
    """``add`` with its terms that are integers times fractions of one denominator (sympy's
    ``q/10 - kv/10`` for ``(q - kv) / 10``) as one ``IntRatio`` per denominator: printed
    term by term they would round at each division and at the sum, and a comparison at an
    exact value (``(q - kv) / 10 > 0.5`` at a distance of 5) would go either way."""
    groups, rest = {}, []
    for term in add.args:
        coeff, factor = term.as_coeff_Mul()
        if (coeff.is_Rational and not coeff.is_Integer and factor.is_integer
                and _int32_constants(coeff.p * factor) and coeff.q < 2 ** 31):
            groups.setdefault(coeff.q, []).append(coeff.p * factor)
        else:
            rest.append(term)
    if not any(len(numerators) > 1 for numerators in groups.values()):
        return add
    for den, numerators in groups.items():
        rest.append(IntRatio(sympy.Add(*numerators), den) if len(numerators) > 1
                    else sympy.Rational(1, den) * numerators[0])
    return sympy.Add(*rest, evaluate=False) if len(rest) > 1 else rest[0]


def whole_divisions(e):
    """``e`` with each floor (ceiling) of a ratio of integers as one ``FloorDiv`` (minus one of
    its negation), printed as integer division, and fractions of one denominator summed as
    one ``IntRatio`` (``_grouped_ratios``). sympy spreads the divisor over the numerator's terms
    (``(kv - pad[b]) // 6`` is floor(kv/6 - pad[b]/6)), and common-subexpression elimination
    then takes a term two floors share (``-pad[b]/6``) out of both, leaving each the float
    floor of a float sum: it rounds at exact multiples (kv = 10, pad = 4: floor(1.6666666 -
    0.6666667) = 0, not 1), silently, as Llama 4's chunked mask did under left padding."""
    def whole(f):
        frac = int_fraction(f.args[0])
        if frac is None:
            return f
        num, den = frac
        return FloorDiv(num, den) if isinstance(f, sympy.floor) else -FloorDiv(-num, den)
    e = e.replace(lambda x: isinstance(x, (sympy.floor, sympy.ceiling)), whole)
    return e.replace(lambda x: isinstance(x, sympy.Add), _grouped_ratios)


class MaxOf(sympy.Max):
    """The largest of a row's elements (traced op ``maxof``), left as built: sympy's Max
    compares every pair of its arguments when built (minutes for a row of 64 loads)."""

    def __new__(cls, *args, **assumptions):
        return super().__new__(cls, *args, evaluate=False)

    def fdiff(self, argindex=1):
        # Max's own derivative, with the rest of the row kept unevaluated as well.
        x = self.args[argindex - 1]
        rest = [a for i, a in enumerate(self.args) if i != argindex - 1]
        return sympy.Heaviside(x - (rest[0] if len(rest) == 1 else type(self)(*rest)))


class MinOf(sympy.Min):
    """The smallest of a row's elements (traced op ``minof``), left as built (see MaxOf)."""

    def __new__(cls, *args, **assumptions):
        return super().__new__(cls, *args, evaluate=False)

    def fdiff(self, argindex=1):
        x = self.args[argindex - 1]
        rest = [a for i, a in enumerate(self.args) if i != argindex - 1]
        return sympy.Heaviside((rest[0] if len(rest) == 1 else type(self)(*rest)) - x)


class IsNan(sympy.logic.boolalg.BooleanFunction):
    """Whether a float is NaN: ``x != x`` (torch.isnan). A comparison of a float with itself
    cannot be taken as a difference (x - x is 0, so ``x != x`` would fold to False and a mod's
    NaN guard on a captured tensor would vanish): it is this, printed ``x != x``. Only numbers
    and integers are decided; sympy takes the score as real, a kernel's may still be NaN."""

    @classmethod
    def eval(cls, x):
        if x is sympy.nan:
            return sympy.true
        if x.is_integer or x.is_Number or x.is_infinite:
            return sympy.false
        return None


class FloatCompare(sympy.logic.boolalg.BooleanFunction):
    """``a op b`` on floats, kept as written (``op``: 0 ``>=``, 1 ``>``, 2 ``==``, 3 ``!=``),
    where the canonical difference would cancel a term of one side against the other: sympy
    takes ``x + 1 - x`` as 1 and ``2 x - x`` as x, exact arithmetic's answers, which IEEE floats
    need not give (an infinite entry of a captured tensor makes x - x NaN, so torch finds
    ``x + 1 > x`` false there; a large one rounds x + 1 to x). The kernel then evaluates the
    comparison as torch does."""
    OPS = (">=", ">", "==", "!=")

    @classmethod
    def eval(cls, op, a, b):
        return None


def _cancels(a, b) -> bool:
    """Whether ``a - b`` loses a non-constant term of ``a`` or of ``b`` (sympy combines them)."""
    def terms(e):
        return sum(1 for t in sympy.Add.make_args(e) if not t.is_number)
    return terms(a - b) < terms(a) + terms(b)


def _bitwise(name, op):
    def eval(cls, *args):
        if all(a.is_Integer for a in args):
            return sympy.Integer(op(*(int(a) for a in args)))
        return None
    return type(name, (sympy.Function,), {"is_integer": True, "eval": classmethod(eval)})


BitAnd = _bitwise("BitAnd", lambda a, b: a & b)
BitOr = _bitwise("BitOr", lambda a, b: a | b)
BitXor = _bitwise("BitXor", lambda a, b: a ^ b)
BitNot = _bitwise("BitNot", lambda a: ~a)


# A value mod's float parameter (``flexgen.frontend.program.lowered_form``): a real symbol
# whose name the printed code carries until ``lowering`` writes the value in its place.
PARAMETER = "_flexgen_param_"


def parameter(slot: int):
    return sympy.Symbol(f"{PARAMETER}{slot}", real=True)


def is_parameter(symbol) -> bool:
    return symbol.name.startswith(PARAMETER)


class ValueDependent(Exception):
    """A parameter met only constants (``-(q * 0 - c)``, once sympy cancels ``q * 0``): the
    lowering folds such a sub-expression with torch's arithmetic, which needs the value, so
    the mod is lowered with its constants (``flexgen.frontend.lowering``)."""


def _parameters_only(e) -> bool:
    free = getattr(e, "free_symbols", None)
    return bool(free) and all(is_parameter(s) for s in free)


def buffer_function(prefix: str, slot: int, dtype: torch.dtype):
    """The sympy function standing for captured buffer ``slot`` of a mod."""
    name = f"{prefix}buf{slot}"
    if dtype == torch.float32:
        return sympy.Function(name, extended_real=True)
    return sympy.Function(name, integer=True)


def _const(value):
    if isinstance(value, bool):
        return sympy.true if value else sympy.false
    if isinstance(value, int):
        return sympy.Integer(value)
    if math.isnan(value):
        return sympy.nan
    if math.isinf(value):
        return sympy.oo if value > 0 else -sympy.oo
    return sympy.Rational(value)


def is_bool(e) -> bool:
    """Whether ``e`` is a truth value (sympy's Symbol is a Boolean too, so test the kinds)."""
    return isinstance(e, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction,
                          sympy.logic.boolalg.BooleanAtom))


def _as_number(e):
    """A bool expression used as a number becomes 1 / 0 (torch's promotion)."""
    if is_bool(e):
        return sympy.Piecewise((sympy.Integer(1), e), (sympy.Integer(0), True))
    return e


def _as_bool(e):
    if is_bool(e):
        return e
    return relation("ne", e, sympy.Integer(0))


def relation(op: str, a, b):
    """A comparison in canonical form: ``d >= 0``, ``d > 0``, ``d == 0`` or ``d != 0``."""
    if a is sympy.nan or b is sympy.nan:
        # IEEE: every comparison with NaN is false but !=, as in torch (sympy refuses them).
        return sympy.true if op == "ne" else sympy.false
    if getattr(a, "is_infinite", False) or getattr(b, "is_infinite", False):
        return _infinite_relation(op, a, b)
    if a == b and not getattr(a, "is_integer", False):
        # IEEE: x == x, x >= x and x <= x hold unless x is NaN; x > x and x < x never do.
        nan = IsNan(_as_number(a))
        return {"ne": nan, "gt": sympy.false, "lt": sympy.false}.get(op, sympy.Not(nan))
    linear, a, b = _linear_ok(a, b), _as_number(a), _as_number(b)
    if not linear and _cancels(a, b):
        if op in ("le", "lt"):
            a, b, op = b, a, {"le": "ge", "lt": "gt"}[op]
        return FloatCompare(sympy.Integer(("ge", "gt", "eq", "ne").index(op)), a, b)
    d = sympy.expand(a - b) if linear else a - b
    if op in ("le", "lt"):
        d, op = -d, {"le": "ge", "lt": "gt"}[op]
    if op in ("eq", "ne") and d.could_extract_minus_sign():
        d = -d
    if op == "gt" and d.is_integer:      # integers: d > 0  <=>  d - 1 >= 0
        d, op = d - 1, "ge"
    return {"ge": sympy.Ge, "gt": sympy.Gt, "eq": sympy.Eq, "ne": sympy.Ne}[op](d, 0)


def _infinite_relation(op: str, a, b):
    """A comparison with +-inf on one side. As a difference it would be lost: sympy absorbs
    bias(kv_idx) + oo into oo, so ``bias[kv_idx] == -inf`` (a captured tensor may hold
    infinities) would fold to False. Over the floats (NaN aside) x >= -inf always holds and
    x > -inf means x != -inf, so each comparison is an equality, an inequality or a constant."""
    a, b = _as_number(a), _as_number(b)
    if a.is_infinite:
        a, b, op = b, a, {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}.get(op, op)
    if a.is_infinite:                                  # both constants: IEEE's answer
        return sympy.true if {"eq": a == b, "ne": a != b, "ge": a >= b, "gt": a > b,
                              "le": a <= b, "lt": a < b}[op] else sympy.false
    low = bool(b.is_extended_negative)                 # x op -inf, else x op +inf
    always = {"ge": low, "le": not low}
    never = {"lt": low, "gt": not low}
    if op in always and always[op] or op in never and never[op]:
        return sympy.true if op in always else sympy.false
    if op in ("eq", "ne"):
        return (sympy.Eq if op == "eq" else sympy.Ne)(a, b)
    # x <= -inf / x >= +inf: x is that infinity; x > -inf / x < +inf: x is not.
    return sympy.Eq(a, b) if op in ("le", "ge") else sympy.Ne(a, b)


def _linear_ok(a, b) -> bool:
    # Expanding integer index arithmetic is exact and makes a - b canonical;
    # float expressions are left as written so rounding follows the source.
    return bool(getattr(a, "is_integer", False)) and bool(getattr(b, "is_integer", False))


def is_constant(e) -> bool:
    """Whether ``e`` is a number or a truth value with no free symbol."""
    return e is sympy.true or e is sympy.false or bool(getattr(e, "is_number", False))


def _python_value(e):
    """A constant sympy expression as the Python number torch would hold (NaN where not real)."""
    if e is sympy.true or e is sympy.false:
        return e is sympy.true
    if e.is_Integer:
        return int(e)
    if e is sympy.nan or e is sympy.zoo:
        return math.nan
    if e.is_Rational or e.is_Float or e.is_infinite:
        return float(e)
    value = complex(sympy.N(e, 30))
    return value.real if value.imag == 0 else math.nan


# How constant sub-expressions are computed: traced op -> torch function on 0-d tensors.
_FOLD = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "truediv": torch.true_divide,
         "floordiv": torch.floor_divide, "mod": torch.remainder, "neg": torch.neg,
         "not": torch.logical_not, "bitnot": torch.bitwise_not, "where": torch.where,
         "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
         "shl": torch.bitwise_left_shift, "shr": torch.bitwise_right_shift}
# These take their operands in the node's dtype (the tracer's: float32 for exp of an
# index, int32 for abs of a bool; pow with a negative exponent is float32).
_FOLD_IN_NODE_DTYPE = {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2,
                       "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh,
                       "sigmoid": torch.sigmoid, "sin": torch.sin, "cos": torch.cos, "pow": torch.pow,
                       "abs": torch.abs, "sign": torch.sign, "floor": torch.floor, "ceil": torch.ceil,
                       "tan": torch.tan, "erf": torch.erf, "silu": torch.nn.functional.silu,
                       "relu": torch.relu, "cast": lambda x: x,
                       "maxof": lambda *xs: torch.stack(xs).amax(), "minof": lambda *xs: torch.stack(xs).amin()}
# (on bools, on numbers)
_FOLD_LOGICAL = {"minimum": (torch.logical_and, torch.minimum), "maximum": (torch.logical_or, torch.maximum),
                 "and": (torch.logical_and, torch.bitwise_and), "or": (torch.logical_or, torch.bitwise_or),
                 "xor": (torch.logical_xor, torch.bitwise_xor)}


def fold(op: str, dtype: torch.dtype, values: list) -> torch.Tensor:
    """Traced op ``op`` of 0-d tensors ``values``, as torch computes it, as a 0-d ``dtype`` tensor."""
    if op in _FOLD_LOGICAL:
        fn = _FOLD_LOGICAL[op][dtype != torch.bool]
    elif op in _FOLD_IN_NODE_DTYPE:
        fn, values = _FOLD_IN_NODE_DTYPE[op], [v.to(dtype) for v in values]
    else:
        fn = _FOLD[op]
    return fn(*values).to(dtype)


# Ops whose symbolic result sympy may leave outside the reals (log(-x) = log(x) + I*pi,
# sqrt(-1 - x**2) = I*sqrt(...), x / 0 = zoo*x): torch gives NaN / inf there instead.
_MAY_LEAVE_REALS = {"log", "log2", "sqrt", "rsqrt", "pow", "truediv"}


class _Converter:
    """Node graph -> sympy, memoized per node (graphs are DAGs).

    Constant sub-expressions (every operand a number: ``sin(q_idx - q_idx + 0.3)``,
    ``log(0 * kv_idx)``) are computed with torch on 0-d tensors of the traced
    dtypes, never by sympy: sympy's numbers are exact and complex (log(-1) is
    I*pi, 1/0 is zoo, sin(oo) an interval, and Min / comparisons of them raise),
    while the kernel and the oracle compute in IEEE floats (NaN, inf) and int32.
    """

    def __init__(self, traced: TracedMod, prefix: str):
        self.prefix = prefix
        self.traced = traced
        self.buffers = traced.buffers
        self.memo: dict[int, sympy.Basic] = {}

    def __call__(self, node: Node):
        if id(node) not in self.memo:
            self.memo[id(node)] = self._convert(node)
        return self.memo[id(node)]

    def _convert(self, node: Node):
        children = [a for a in node.args if isinstance(a, Node)]
        if node.op != "load" and children and all(is_constant(self(c)) for c in children):
            return self._fold(node, children)
        if node.op != "load" and children and all(is_constant(self(c)) or _parameters_only(self(c))
                                                  for c in children):
            raise ValueDependent(node.op)
        e = getattr(self, "op_" + node.op, self.generic)(node, *node.args)
        if node.op in _MAY_LEAVE_REALS and e.has(sympy.I, sympy.zoo):
            return sympy.nan          # a real function outside its domain: NaN, as in torch
        return e

    def _fold(self, node: Node, children):
        values = [torch.tensor(_python_value(self(c)), dtype=c.dtype) for c in children]
        try:
            value = fold(node.op, node.dtype, values).item()
        except RuntimeError as err:   # torch refuses it too (integer division by zero)
            raise self.fail(f"{node.op} of the constants {[v.item() for v in values]} fails in torch "
                            f"({err})", "remove the constant sub-expression") from None
        return _const(value)

    def fail(self, what: str, fix: str) -> TraceError:
        return TraceError(f"{self.traced.kind} '{self.traced.name}': {what}. Fix: {fix}")

    def generic(self, node, *args):
        # trace.py recorded an op this converter does not know: a flexgen bug.
        raise RuntimeError(f"flexgen internal error: no sympy form for traced op {node.op!r}")

    def op_var(self, node, name):
        return SYMBOLS[name]

    def op_const(self, node, value):
        return _const(value)

    def op_param(self, node, slot):
        return parameter(slot)

    def op_load(self, node, slot, indices):
        fn = buffer_function(self.prefix, slot, node.dtype)
        value = fn(*(self(i) for i in indices))
        return _as_bool(value) if node.dtype == torch.bool else value

    def _num(self, n):
        return _as_number(self(n))

    def op_add(self, node, a, b): return self._num(a) + self._num(b)
    def op_sub(self, node, a, b): return self._num(a) - self._num(b)
    def op_mul(self, node, a, b): return self._num(a) * self._num(b)

    def _divisor(self, node, b):
        """The divisor of ``node``, or None where it is the constant 0 (handled by the caller)."""
        d = self._num(b)
        if d.is_zero and node.dtype == torch.int32:
            # torch raises for an integer division by zero; a kernel has no such error.
            raise self.fail(f"an integer {'//' if node.op == 'floordiv' else '%'} by a divisor "
                            "that is always 0", "divide by something that is never 0")
        return None if d.is_zero else d

    def op_truediv(self, node, a, b):
        d = self._divisor(node, b)
        # x / 0 is x * inf in IEEE (inf, -inf, or NaN at x = 0); sympy's x / 0 is zoo.
        return self._num(a) * sympy.oo if d is None else self._num(a) / d

    def op_floordiv(self, node, a, b):
        d = self._divisor(node, b)
        return sympy.floor(self._num(a) * sympy.oo if d is None else self._num(a) / d)

    def op_mod(self, node, a, b):
        d = self._divisor(node, b)
        return sympy.nan if d is None else sympy.Mod(self._num(a), d)
    def op_neg(self, node, a): return -self._num(a)
    def op_abs(self, node, a): return sympy.Abs(self._num(a))
    def op_sign(self, node, a): return sympy.sign(self._num(a))
    def op_floor(self, node, a): return sympy.floor(self._num(a))
    def op_ceil(self, node, a): return sympy.ceiling(self._num(a))
    def op_exp(self, node, a): return sympy.exp(self._num(a))
    def op_exp2(self, node, a): return sympy.Integer(2) ** self._num(a)
    def op_log(self, node, a): return sympy.log(self._num(a))
    def op_log2(self, node, a): return sympy.log(self._num(a)) / sympy.log(2)
    def op_sqrt(self, node, a): return sympy.sqrt(self._num(a))
    def op_rsqrt(self, node, a): return 1 / sympy.sqrt(self._num(a))
    def op_tanh(self, node, a): return sympy.tanh(self._num(a))
    def op_sigmoid(self, node, a): return Sigmoid(self._num(a))
    def op_sin(self, node, a): return sympy.sin(self._num(a))
    def op_cos(self, node, a): return sympy.cos(self._num(a))
    def op_tan(self, node, a): return sympy.tan(self._num(a))
    def op_erf(self, node, a): return sympy.erf(self._num(a))
    def op_silu(self, node, a): return self._num(a) * Sigmoid(self._num(a))
    def op_relu(self, node, a): return sympy.Max(self._num(a), 0)
    def op_shl(self, node, a, b): return self._num(a) * sympy.Integer(2) ** self._num(b)
    def op_shr(self, node, a, b): return sympy.floor(self._num(a) / sympy.Integer(2) ** self._num(b))
    def op_maxof(self, node, *args): return MaxOf(*(self._num(a) for a in args))
    def op_minof(self, node, *args): return MinOf(*(self._num(a) for a in args))
    def op_minimum(self, node, a, b): return self._minmax(sympy.Min, sympy.And, node, a, b)
    def op_maximum(self, node, a, b): return self._minmax(sympy.Max, sympy.Or, node, a, b)

    def _minmax(self, numeric, logical, node, a, b):
        if node.dtype == torch.bool:
            return logical(_as_bool(self(a)), _as_bool(self(b)))
        x, y = self._num(a), self._num(b)
        if x is sympy.nan or y is sympy.nan:
            return sympy.nan          # torch.minimum / maximum propagate NaN (sympy refuses it)
        return numeric(x, y)

    def op_pow(self, node, a, b):
        return self._num(a) ** self._num(b)

    def op_cast(self, node, a):
        value = self._num(a)
        if node.dtype == torch.int32 and not value.is_integer:
            return Trunc(value)
        return value

    def _logic(self, node, a, b, logical, bitwise):
        if node.dtype == torch.bool:
            return logical(_as_bool(self(a)), _as_bool(self(b)))
        return bitwise(self._num(a), self._num(b))

    def op_and(self, node, a, b): return self._logic(node, a, b, sympy.And, BitAnd)
    def op_or(self, node, a, b): return self._logic(node, a, b, sympy.Or, BitOr)
    def op_xor(self, node, a, b): return self._logic(node, a, b, sympy.Xor, BitXor)
    def op_not(self, node, a): return sympy.Not(_as_bool(self(a)))
    def op_bitnot(self, node, a): return BitNot(self._num(a))

    def _compare(self, op, a, b):
        ea, eb = self(a), self(b)
        if a.dtype == torch.bool and b.dtype == torch.bool and op in ("eq", "ne"):
            same = sympy.Equivalent(ea, eb)
            return same if op == "eq" else sympy.Not(same)
        return relation(op, ea, eb)

    def op_eq(self, node, a, b): return self._compare("eq", a, b)
    def op_ne(self, node, a, b): return self._compare("ne", a, b)
    def op_lt(self, node, a, b): return self._compare("lt", a, b)
    def op_le(self, node, a, b): return self._compare("le", a, b)
    def op_gt(self, node, a, b): return self._compare("gt", a, b)
    def op_ge(self, node, a, b): return self._compare("ge", a, b)

    def op_where(self, node, c, a, b):
        cond = _as_bool(self(c))
        if node.dtype == torch.bool:
            return sympy.ITE(cond, _as_bool(self(a)), _as_bool(self(b)))
        return sympy.Piecewise((self._num(a), cond), (self._num(b), True))


def to_sympy(traced: TracedMod, prefix: str):
    """The canonical sympy expression of a traced mod.

    ``prefix`` ("s" for score_mod, "m" for mask_mod) names its buffers, so a
    score_mod's and a mask_mod's captured tensors never collide in one kernel.
    """
    expr = _Converter(traced, prefix)(traced.root)
    if traced.kind == "mask_mod":
        expr = _as_bool(expr)
    return expr


def canonical_text(expr) -> str:
    """A stable text of the canonical form (the part of the cache key a mod gives)."""
    return sympy.srepr(expr)


def free_indices(expr) -> frozenset:
    """Names of the score / index variables ``expr`` depends on."""
    return frozenset(s.name for s in expr.free_symbols if s.name in SYMBOLS)


def has_loads(expr) -> bool:
    """Whether ``expr`` reads a captured buffer."""
    return any(isinstance(f.func, sympy.core.function.UndefinedFunction)
               for f in expr.atoms(sympy.Function))


# --- derivatives, for the backward kernels ---------------------------------------

# Functions that are constant between jumps: a value that flows through one
# of them has a zero derivative wherever it has one, so a gradient that must
# pass through them is silently lost. ``derivative`` refuses them.
PIECEWISE_CONSTANT = (sympy.floor, sympy.ceiling, sympy.sign, Trunc, BitAnd, BitOr, BitXor, BitNot)


class NotDifferentiable(Exception):
    """``derivative`` met a sub-expression the variable cannot be differentiated through.

    ``part`` is that sub-expression and ``reason`` a phrase saying why; the
    caller (which knows the mod's name) turns it into a user-facing error.
    """

    def __init__(self, part, reason: str):
        super().__init__(f"{reason}: {part}")
        self.part, self.reason = part, reason


def is_load(e) -> bool:
    """Whether ``e`` is an application ``{prefix}buf{slot}(indices...)`` of a captured buffer."""
    return isinstance(type(e), UndefinedFunction)


def load_applications(expr, names) -> list:
    """The distinct loads of the buffers named ``names`` in ``expr``, in a stable order."""
    found = {f for f in expr.atoms(sympy.Function) if is_load(f) and f.func.__name__ in names}
    return list(sympy.ordered(found))


def derivative(expr, var):
    """``d expr / d var``, for ``var`` the score symbol or one load application.

    A load application is differentiated as if it were a symbol (the value it
    loads). Piecewise conditions contribute nothing (their derivative is zero
    almost everywhere, as in torch), Min / Max give ``Heaviside`` (1/2 at a
    tie, torch's rule for minimum / maximum), a float ``Mod(a, m)`` is
    ``a - m * floor(a / m)`` with the floor held constant (torch's rule for
    remainder). Raises ``NotDifferentiable`` where the variable reaches a
    piecewise-constant function (floor, ceil, sign, a cast to int, bitwise
    ops) or the index of a load, and where sympy leaves an unevaluated
    derivative.
    """
    x = var if isinstance(var, sympy.Symbol) else sympy.Dummy("load", real=True)
    e = expr if x is var else expr.xreplace({var: x})
    if x not in e.free_symbols:
        return sympy.Integer(0)
    frozen = {}

    def freeze_mod(node):
        # Mod(a, m) = a - m * floor(a / m); the floor is a step function, so
        # it is held constant: d/da = 1, d/dm = -floor(a / m).
        if isinstance(node, sympy.Mod) and x in node.free_symbols and not node.is_integer:
            a, m = node.args
            step = sympy.Dummy("floor")
            frozen[step] = sympy.floor(a / m)
            return a - m * step
        return None

    e = e.replace(lambda n: isinstance(n, sympy.Mod), lambda n: freeze_mod(n) or n)
    _check_differentiable(e, x, var)
    d = sympy.diff(e, x)
    if d.has(sympy.Derivative, sympy.Subs):
        leftover = next(iter(d.atoms(sympy.Derivative, sympy.Subs)))
        raise NotDifferentiable(leftover.xreplace({x: var}), "sympy cannot differentiate it")
    # sign(x) is ruled out above, so DiracDelta (its derivative) can only come
    # from higher-order terms that vanish almost everywhere, as torch treats them.
    d = d.replace(lambda n: isinstance(n, sympy.DiracDelta), lambda n: sympy.Integer(0))
    return d.xreplace(frozen).xreplace({x: var})


def _check_differentiable(e, x, var) -> None:
    """Raise ``NotDifferentiable`` where ``x`` flows into a step function or an index.

    Conditions (of Piecewise, or comparisons) are not followed: a comparison
    of the variable only selects a branch, and contributes nothing itself.
    """
    if x not in e.free_symbols or is_bool(e):
        return
    if isinstance(e, PIECEWISE_CONSTANT) or (isinstance(e, sympy.Mod) and e.is_integer):
        raise NotDifferentiable(e.xreplace({x: var}),
                                "it passes through a piecewise-constant (integer-valued) function")
    if is_load(e):
        raise NotDifferentiable(e.xreplace({x: var}), "it flows into the index of a captured tensor")
    if isinstance(e, sympy.Piecewise):
        for piece in e.args:
            _check_differentiable(piece.expr, x, var)
        return
    for arg in e.args:
        _check_differentiable(arg, x, var)
