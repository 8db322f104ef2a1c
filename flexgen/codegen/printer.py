"""Print a canonical sympy expression as Triton source.

One ``_print_<Class>`` method per sympy node type (sympy's own printer
pattern): adding an operation is adding a method. Each method returns
``(code, kind)`` with kind "bool", "int" or "float", so the printer inserts
the casts torch's promotion implies (int32 index math stays int32, float math
is float32; an int64 or float64 tensor's elements keep their type). Common
subexpressions become numbered temporaries; loads of captured buffers become
statements with bounds-checked, wrapped indices.

The snippet uses the names the template binds: ``score`` (float32 tile),
``b``, ``h`` (scalars), ``q_idx`` (column vector), ``kv_idx`` (row vector),
``t`` (positions) and ``x`` (float32 entries) in the linear-attention kernels,
and per buffer ``{name}_ptr``, ``{name}_size{d}``, ``{name}_stride{d}``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
from sympy.core.function import UndefinedFunction

from ..codegen import debug
from ..frontend.expr import (SYMBOLS, BitAnd, BitNot, BitOr, BitXor, FloorDiv, Sigmoid, Trunc,
                             free_indices, int_fraction, is_parameter, whole_divisions)
# Defined without sympy, for the restart index (flexgen.codegen.index):
from .snippet import TL_DTYPES, Address, Snippet, literal_value  # noqa: F401


def cast(code: str, kind: str, target: str) -> str:
    """``code`` (of ``kind``) converted to ``target`` ("float", "int" or "bool") as torch converts.

    A Python literal is converted here, in Python: Triton has no ``(2).to(...)``.
    """
    if kind == target:
        return code
    value = literal_value(code)
    if value is not None and (target == "bool" or value == value and abs(value) != float("inf")):
        if target == "float":
            return _float_literal(value)
        if target == "int":
            return str(int(value))          # toward zero, as .to(torch.int32)
        return repr(bool(value))
    if value is not None:
        # inf or nan to an integer: no literal for it; let the device convert as it does.
        code = f"tl.full([1, 1], {code}, tl.float32)"
    if target == "bool":
        return f"({code} != 0)"
    return f"({code}).to({TL_DTYPES[target]})"


def _float_literal(value) -> str:
    v = float(value)
    if v != v:
        return 'float("nan")'
    if v in (float("inf"), float("-inf")):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


# The positions a proven load reads, clamped into the sequence by the kernel (templates bind
# these names: [BLOCK_M, 1] and [1, BLOCK_N] like q_idx and kv_idx, or transposed likewise).
CLAMPED = {SYMBOLS["q_idx"]: sympy.Symbol("q_idx_clamped", integer=True, nonnegative=True),
           SYMBOLS["kv_idx"]: sympy.Symbol("kv_idx_clamped", integer=True, nonnegative=True)}


def clamp_proven(exprs, proven) -> tuple:
    """(``exprs`` with each load named in ``proven`` reading clamped positions, those loads).

    ``proven``: the printed forms (``str``) of loads the host proved in bounds for every
    position of a call (``flexgen.frontend.bounds_check.proven_loads``). Rewritten before
    common subexpressions are found, so the clamped indices share temporaries among
    themselves and the unclamped ones are computed only where something else reads them.
    """
    if not proven or debug.DEBUG:
        return list(exprs), frozenset()
    loads = {f for e in exprs for f in e.atoms(sympy.Function)
             if isinstance(type(f), UndefinedFunction) and f.args and str(f) in proven}
    clamped = {f: f.func(*(a.xreplace(CLAMPED) for a in f.args)) for f in loads}
    return [e.xreplace(clamped) for e in exprs], frozenset(clamped.values())


class TritonPrinter:
    """``proven``: loads (as ``clamp_proven`` rewrote them) read without wrap or mask
    (``_print_proven_load``)."""

    def __init__(self, temp_prefix: str, proven=frozenset()):
        self.temp_prefix = temp_prefix
        self.lines: list[str] = []
        self.kinds: dict[sympy.Symbol, str] = {}
        self.names: dict[sympy.Symbol, str] = {}
        self.count = 0
        self.proven = frozenset(proven)
        self.full: dict = {}        # common subexpression symbol -> what it stands for
        self.float_loads = False    # whether a float element was loaded (it may be float64)

    def define(self, sym, sub) -> None:
        """Print common subexpression ``sym`` = ``sub`` as a temporary."""
        code, kind = self.print(sub)
        name, kind = self.temp(code, kind)
        self.names[sym], self.kinds[sym] = name, kind
        self.full[sym] = sub.xreplace(self.full)

    def temp(self, code: str, kind: str) -> tuple:
        name = f"{self.temp_prefix}{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {code}")
        return name, kind

    def print(self, e) -> tuple:
        if getattr(e, "is_number", False) and not e.is_Integer and e.is_finite:
            return self._print_number(e)
        for cls in type(e).__mro__:
            method = getattr(self, "_print_" + cls.__name__, None)
            if method is not None:
                return method(e)
        if isinstance(type(e), UndefinedFunction):
            return self._print_load(e)
        if getattr(e, "is_number", False):
            return self._print_number(e)
        raise RuntimeError(f"flexgen internal error: no Triton form for {type(e).__name__}: {e}")

    # --- helpers -----------------------------------------------------------------
    def as_float(self, e) -> str:
        return cast(*self.print(e), "float")

    def as_int(self, e) -> str:
        return cast(*self.print(e), "int")

    def as_bool(self, e) -> str:
        return cast(*self.print(e), "bool")

    def numeric(self, args):
        printed = [self.print(a) for a in args]
        kind = "float" if any(k == "float" for _, k in printed) else "int"
        return printed, kind

    # --- atoms -------------------------------------------------------------------
    def _print_Symbol(self, e):
        if e in self.names:
            return self.names[e], self.kinds[e]
        return e.name, ("int" if e.is_integer else "float")   # score, x: float; indices, t: int

    def _print_Integer(self, e):
        return str(int(e)), "int"

    def _print_Rational(self, e):
        return _float_literal(e), "float"

    def _print_Float(self, e):
        return _float_literal(e), "float"

    def _print_number(self, e):
        if e.is_integer:
            return str(int(e)), "int"
        return _float_literal(sympy.N(e, 20)), "float"

    def _print_Infinity(self, e):
        return 'float("inf")', "float"

    def _print_NegativeInfinity(self, e):
        return 'float("-inf")', "float"

    def _print_NaN(self, e):
        return 'float("nan")', "float"

    def _print_BooleanTrue(self, e):
        return "True", "bool"

    def _print_BooleanFalse(self, e):
        return "False", "bool"

    # --- arithmetic --------------------------------------------------------------
    def _print_Add(self, e):
        pos, neg = [], []
        for term in sympy.Add.make_args(e):
            coeff, rest = term.as_coeff_Mul()
            if coeff.is_negative:
                neg.append(-term)
            else:
                pos.append(term)
        printed_pos, k1 = self.numeric(pos) if pos else ([("0", "int")], "int")
        printed_neg, k2 = self.numeric(neg) if neg else ([], "int")
        code = " + ".join(c for c, _ in printed_pos)
        for c, _ in printed_neg:
            code += f" - ({c})" if " " in c else f" - {c}"
        return f"({code})", ("float" if "float" in (k1, k2) else "int")

    def _print_Mul(self, e):
        num, den = [], []
        coeff, rest = e.as_coeff_Mul()
        sign = ""
        if coeff.is_negative:
            sign, coeff = "-", -coeff
        float_coeff = None
        if coeff != 1:
            if coeff.is_Rational and not coeff.is_Integer and max(coeff.p, coeff.q) <= 4096:
                # A small fraction (x / 30, 3 * x / 4) is printed as written.
                num.append(sympy.Integer(coeff.p)) if coeff.p != 1 else None
                den.append(sympy.Integer(coeff.q))
            elif coeff.is_Integer:
                num.append(coeff)
            else:
                # A float constant (0.05 becomes 3602879701896397 / 2**56 in sympy):
                # multiply in float, as torch does, never in int32.
                float_coeff = _float_literal(coeff)
        reciprocals = []
        for f in sympy.Mul.make_args(rest):
            if f.is_Pow and f.exp.is_Integer and f.exp < 0:
                base = f.base ** -f.exp
                if base.free_symbols and all(is_parameter(s) for s in base.free_symbols):
                    # Over a parameter (score / cap): times its reciprocal, as a data
                    # constant's division prints (0.0269 * score); Triton folds 1.0 / cap.
                    reciprocals.append(base)
                else:
                    den.append(base)
            else:
                num.append(f)
        if (den or reciprocals or float_coeff is not None) and all(n.is_Integer for n in num):
            # Only integers above the line (1 / score): a float literal, as a Python
            # int has no .to() in a kernel.
            printed, kind = [(_float_literal(sympy.Mul(*num)), "float")], "float"
        else:
            printed, kind = self.numeric(num or [sympy.Integer(1)])
        code = " * ".join(c for c, _ in printed)
        if float_coeff is not None:
            code = f"{float_coeff} * " + cast(code, kind, "float")
            kind = "float"
        if reciprocals:
            rcode = " * ".join(self.as_float(d) for d in reciprocals)
            code, kind = f"{cast(code, kind, 'float')} * (1.0 / ({rcode}))", "float"
        if den:
            dcode = " * ".join(self.as_float(d) for d in den)
            fnum = cast(code, kind, "float")
            code, kind = f"{fnum} / ({dcode})" if len(den) > 1 else f"{fnum} / {dcode}", "float"
        return f"{sign}({code})" if sign else f"({code})", kind

    def _print_Pow(self, e):
        base, exp = e.base, e.exp
        if base == 2:
            return f"tl.exp2({self.as_float(exp)})", "float"
        if exp == sympy.Rational(1, 2):
            return f"tl.sqrt({self.as_float(base)})", "float"
        if exp == -sympy.Rational(1, 2):
            return f"tl.rsqrt({self.as_float(base)})", "float"
        if exp.is_Integer and exp > 0 and exp <= 8:
            code, kind = self.print(base)
            if len(code) > 12:
                code, kind = self.temp(code, kind)
            return "(" + " * ".join([code] * int(exp)) + ")", kind
        if exp.is_Integer and exp < 0:
            return f"(1.0 / {self.as_float(base ** -exp)})", "float"
        return f"tl.exp2({self.as_float(exp)} * tl.log2({self.as_float(base)}))", "float"

    def _print_exp(self, e):
        return f"tl.exp({self.as_float(e.args[0])})", "float"

    def _print_log(self, e):
        return f"tl.log({self.as_float(e.args[0])})", "float"

    def _print_tanh(self, e):
        return f"_tanh({self.as_float(e.args[0])})", "float"

    def _print_sin(self, e):
        return f"tl.sin({self.as_float(e.args[0])})", "float"

    def _print_cos(self, e):
        return f"tl.cos({self.as_float(e.args[0])})", "float"

    def _print_tan(self, e):
        # Triton has no tan: sin / cos of one temporary.
        x, _ = self.temp(self.as_float(e.args[0]), "float")
        return f"(tl.sin({x}) / tl.cos({x}))", "float"

    def _print_erf(self, e):
        return f"tl.erf({self.as_float(e.args[0])})", "float"

    def _print_Sigmoid(self, e):
        return f"tl.sigmoid({self.as_float(e.args[0])})", "float"

    def _print_Abs(self, e):
        code, kind = self.print(e.args[0])
        return f"tl.abs({code})", kind

    def _print_sign(self, e):
        code, kind = self.print(e.args[0])
        code, kind = self.temp(code, kind) if len(code) > 12 else (code, kind)
        one, zero = ("1.0", "0.0") if kind == "float" else ("1", "0")
        return f"tl.where({code} > 0, {one}, tl.where({code} < 0, -{one}, {zero}))", kind

    def _print_floor(self, e):
        frac = int_fraction(e.args[0])
        if frac:
            return self._print_FloorDiv(FloorDiv(*frac))
        return f"tl.floor({self.as_float(e.args[0])})", "float"

    def _print_ceiling(self, e):
        frac = int_fraction(e.args[0])
        if frac:
            return self.print(-FloorDiv(-frac[0], frac[1]))
        return f"tl.ceil({self.as_float(e.args[0])})", "float"

    def _print_FloorDiv(self, e):
        return f"_floordiv({self.as_int(e.args[0])}, {self.as_int(e.args[1])})", "int"

    def _print_IntRatio(self, e):
        return f"{self.as_float(e.args[0])} / {self.as_float(e.args[1])}", "float"

    def _print_Mod(self, e):
        (a, ka), (m, km) = self.print(e.args[0]), self.print(e.args[1])
        if ka == km == "int":
            return f"_floormod({a}, {m})", "int"
        return f"_floormod_float({self.as_float(e.args[0])}, {self.as_float(e.args[1])})", "float"

    def _print_Trunc(self, e):
        return cast(self.as_float(e.args[0]), "float", "int"), "int"

    def _minmax(self, e, fn):
        args = list(sympy.ordered(e.args))
        printed, kind = self.numeric(args)
        code = printed[0][0]
        for c, _ in printed[1:]:
            code = f"{fn}({code}, {c})"
        return code, kind

    def _print_Min(self, e):
        return self._minmax(e, "tl.minimum")

    def _print_Max(self, e):
        return self._minmax(e, "tl.maximum")

    def _print_Piecewise(self, e):
        pieces = list(e.args)
        code, kind = self.print(pieces[-1].expr)
        kinds = {kind}
        for piece in reversed(pieces[:-1]):
            c, k = self.print(piece.expr)
            kinds.add(k)
            code = f"tl.where({self.as_bool(piece.cond)}, {c}, {code})"
        return code, ("float" if "float" in kinds else "int")

    def _print_Heaviside(self, e):
        # Heaviside(x, h0): the derivative of Max / Min; h0 (1/2 by default) at x == 0.
        x = e.args[0]
        h0 = e.args[1] if len(e.args) > 1 else sympy.Rational(1, 2)
        above = self.print(sympy.StrictGreaterThan(x, 0, evaluate=False))[0]
        below = self.print(sympy.StrictLessThan(x, 0, evaluate=False))[0]
        return f"tl.where({above}, 1.0, tl.where({below}, 0.0, {_float_literal(h0)}))", "float"

    def _bitop(self, e, op):
        return "(" + f" {op} ".join(self.as_int(a) for a in e.args) + ")", "int"

    def _print_BitAnd(self, e): return self._bitop(e, "&")
    def _print_BitOr(self, e): return self._bitop(e, "|")
    def _print_BitXor(self, e): return self._bitop(e, "^")
    def _print_BitNot(self, e): return f"(~{self.as_int(e.args[0])})", "int"

    # --- logic -------------------------------------------------------------------
    def _print_Relational(self, e):
        op = e.rel_op
        lhs, rhs = e.lhs, e.rhs
        if rhs == 0 and lhs.is_Add:
            # d >= 0 with d = p - n is printed p >= n: no float cancellation.
            pos = [t for t in lhs.args if not t.as_coeff_Mul()[0].is_negative]
            neg = [-t for t in lhs.args if t.as_coeff_Mul()[0].is_negative]
            lhs, rhs = sympy.Add(*pos), sympy.Add(*neg)
        return f"({self.print(lhs)[0]} {op} {self.print(rhs)[0]})", "bool"

    def _logic(self, e, op):
        return "(" + f" {op} ".join(self.as_bool(a) for a in sympy.ordered(e.args)) + ")", "bool"

    def _print_And(self, e): return self._logic(e, "&")
    def _print_Or(self, e): return self._logic(e, "|")
    def _print_Xor(self, e): return self._logic(e, "^")

    def _print_Not(self, e):
        return f"({self.as_bool(e.args[0])} == 0)", "bool"

    def _print_IsNan(self, e):
        # x != x: true for NaN alone (an unordered compare, which LLVM keeps as is).
        x, _ = self.temp(self.as_float(e.args[0]), "float")
        return f"({x} != {x})", "bool"

    def _print_FloatCompare(self, e):
        # The comparison as the mod wrote it (expr.FloatCompare: its difference would cancel).
        op, a, b = e.args
        return f"({self.as_float(a)} {type(e).OPS[int(op)]} {self.as_float(b)})", "bool"

    def _print_Equivalent(self, e):
        a, b = e.args
        return f"({self.as_bool(a)} == {self.as_bool(b)})", "bool"

    def _print_ITE(self, e):
        c, a, b = e.args
        return f"tl.where({self.as_bool(c)}, {self.as_bool(a)}, {self.as_bool(b)})", "bool"

    # --- captured buffers --------------------------------------------------------
    def _index_terms(self, e, stride_name: str) -> tuple:
        """(offsets, in_bounds) of load ``e``: one term per dimension, strides of ``stride_name``.

        Negative indices wrap as in torch indexing; the bounds are those of the
        loaded buffer. A constant index becomes a [1, 1] tile so that every mask
        is a tensor (the interpreter rejects scalar masks).
        """
        name = e.func.name
        offsets, in_bounds = [], []
        for d, index in enumerate(e.args):
            if index.is_Integer:
                i, _ = self.temp(f"tl.full([1, 1], {int(index)}, tl.int32)", "int")
            elif not index.free_symbols:
                # Read from a 0-d captured tensor (bias[t, q_idx]): a [1, 1] tile as well; the
                # interpreter turns a mask built from a loaded scalar into int32 and rejects it.
                i, _ = self.temp(f"tl.full([1, 1], 0, tl.int32) + {self.as_int(index)}", "int")
            elif index.is_Symbol and index.is_nonnegative:
                i = self.as_int(index)
            else:
                i, _ = self.temp(self.as_int(index), "int")
            if not index.is_nonnegative:
                self.lines.append(f"{i} = tl.where({i} < 0, {i} + {name}_size{d}, {i})")
                in_bounds.append(f"({i} >= 0)")
            offsets.append(f"{i}.to(tl.int64) * {stride_name}_stride{d}")
            in_bounds.append(f"({i} < {name}_size{d})")
        return offsets, in_bounds

    def _print_load(self, e):
        name = e.func.name
        if e.args and self.proven and e.xreplace(self.full) in self.proven:
            return self._print_proven_load(e)
        if not e.args:
            code = f"tl.load({name}_ptr)"
        else:
            offsets, in_bounds = self._index_terms(e, name)
            if debug.DEBUG:
                # ``live``: the tile's real positions (the template binds it); padding may
                # index anything. The host checked what it could (frontend/bounds_check.py).
                mod = "score_mod" if name.startswith("s") else "mask_mod"
                self.lines.append(f"tl.device_assert(({' & '.join(in_bounds)}) | (live == 0), \"flexgen "
                                  f"(FLEXGEN_DEBUG=1): the {mod} reads its captured tensor {name[4:]} "
                                  f"out of bounds (torch raises IndexError)\")")
            # Positions outside the tensor (padded tails; without debug mode, also an index
            # the host could not check) read 0.
            code = (f"tl.load({name}_ptr + {' + '.join(offsets)}, "
                    f"mask={' & '.join(in_bounds)}, other=0)")
        return self._loaded(code, bool(e.is_integer))

    def _loaded(self, code: str, integer: bool) -> tuple:
        """Loaded element ``code`` as the mod computes with it: an int64 or float64 tensor's
        element in its own type, as torch computes it (ids that differ only above bit 31,
        timestamps that differ in their last seconds stay different), any other in int32 or
        float32. The kernel picks the type from the pointer's, at compile time. A float64
        value makes what follows float64 too; the snippet's float result is float32 again
        (``print_snippet``)."""
        kind = "int" if integer else "float"
        wide, narrow = ("tl.int64", "tl.int32") if integer else ("tl.float64", "tl.float32")
        self.float_loads |= not integer
        raw, _ = self.temp(code, kind)
        return self.temp(f"{raw}.to({wide} if {raw}.dtype == {wide} else {narrow})", kind)

    def result(self, e) -> tuple:
        """``e`` printed as a snippet's value: float32 where it is a float (a float64 load
        before it made it float64; the templates' tiles and statistics are float32)."""
        code, kind = self.print(e)
        if kind == "float" and self.float_loads:
            code = f"({code}).to(tl.float32)"
        return code, kind

    def _print_proven_load(self, e):
        """A load every index of which the host proved in [0, size) over the call's positions.

        No wrap and no bounds mask. The indices read the clamped positions (``clamp_proven``),
        so the padded rows and keys of a ragged tile read a real position's entry (whose
        score is masked anyway) and never leave the tensor. The dims that read positions
        add an int32 offset (the proof bounds their extent below 2**31); the others (b, h,
        constants) one int64 term per tile.
        """
        name = e.func.name
        base, tile = [], []
        for d, index in enumerate(e.args):
            if index.xreplace(self.full).free_symbols & set(CLAMPED.values()):
                tile.append(f"{self.as_int(index)} * {name}_stride{d}")
            elif index.is_Integer:
                if index != 0:
                    base.append(f"tl.full([1, 1], {int(index)}, tl.int64) * {name}_stride{d}")
            else:
                base.append(f"{self.as_int(index)}.to(tl.int64) * {name}_stride{d}")
        address = f"{name}_ptr"
        for terms in (base, tile):
            if terms:
                address += f" + ({' + '.join(terms)})"
        return self._loaded(f"tl.load({address})", bool(e.is_integer))

    def print_address(self, e, grad_name: str) -> tuple:
        """(offset, in_bounds) of load ``e``'s element in the buffer ``{grad_name}_ptr``.

        The same index arithmetic as ``_print_load`` with the strides of
        ``grad_name``: a gradient is scattered to exactly the element the load read.
        A 0-d load gives offset "0" and in_bounds None.
        """
        if not e.args:
            return "0", None
        offsets, in_bounds = self._index_terms(e, grad_name)
        return " + ".join(offsets), " & ".join(in_bounds)


def _printable(exprs, proven) -> tuple:
    """(exprs, proven) clamped (``clamp_proven``) and with whole divisions, as printed."""
    exprs, proven = clamp_proven(exprs, proven)
    return [whole_divisions(e) for e in exprs], frozenset(whole_divisions(p) for p in proven)


class _SharedLoadPrinter(TritonPrinter):
    """A printer that loads each buffer element once, however often the expressions read it.

    sympy.cse leaves some repeated loads in place (a 0-d buffer's ``sbuf0()``
    is an atom to it); a load is pure, so its temporary is reused.
    """

    def __init__(self, temp_prefix: str, proven=frozenset()):
        super().__init__(temp_prefix, proven)
        self.loaded: dict = {}

    def _print_load(self, e):
        if e not in self.loaded:
            self.loaded[e] = super()._print_load(e)
        return self.loaded[e]


@dataclass(frozen=True)
class JointSnippet:
    """Statements computing several values at once (shared subexpressions computed once)."""
    lines: tuple        # "name = code" statements, in order
    results: tuple      # one expression per value, valid after ``lines``
    kinds: tuple        # "bool", "int" or "float" per value
    frees: tuple = ()   # the free names (Snippet.free) of each value

    def snippet(self, i: int) -> Snippet:
        """Value ``i`` as a ``Snippet`` (after all of the statements)."""
        return Snippet(self.lines, self.results[i], self.kinds[i],
                       self.frees[i] if self.frees else None)


def print_joint(exprs, temp_prefix: str, proven=frozenset()) -> JointSnippet:
    """Triton statements computing every expression of ``exprs`` (e.g. a mod and its derivatives).

    Common subexpressions across all of them (a loaded bias, ``tanh(score / c)``)
    are computed once; temporaries are named ``{temp_prefix}{n}``. ``proven``: the
    loads read without checks (``TritonPrinter``).
    """
    exprs, proven = _printable(exprs, proven)
    printer = _SharedLoadPrinter(temp_prefix, proven)
    replacements, reduced = sympy.cse(exprs, symbols=sympy.numbered_symbols("_cse"),
                                      order="none")
    for sym, sub in replacements:
        printer.define(sym, sub)
    printed = [printer.result(r) for r in reduced]
    return JointSnippet(tuple(printer.lines), tuple(c for c, _ in printed), tuple(k for _, k in printed),
                        tuple(tuple(sorted(free_indices(e))) for e in exprs))


def print_address(load, grad_name: str, temp_prefix: str) -> Address:
    """The element of the gradient buffer ``grad_name`` that load application ``load`` read."""
    printer = TritonPrinter(temp_prefix)
    offset, in_bounds = printer.print_address(load, grad_name)
    return Address(tuple(printer.lines), offset, in_bounds)


def print_snippet(expr, temp_prefix: str, proven=frozenset()) -> Snippet:
    """Triton statements for ``expr``; temporaries are named ``{temp_prefix}{n}``. ``proven``:
    the loads read without checks (``TritonPrinter``)."""
    (clamped,), proven = _printable([expr], proven)
    printer = TritonPrinter(temp_prefix, proven)
    replacements, (reduced,) = sympy.cse([clamped], symbols=sympy.numbered_symbols("_cse"),
                                         order="none")
    for sym, sub in replacements:
        printer.define(sym, sub)
    code, kind = printer.result(reduced)
    return Snippet(tuple(printer.lines), code, kind, tuple(sorted(free_indices(expr))))


__all__ = ["Snippet", "TritonPrinter", "print_snippet", "SYMBOLS",
           "JointSnippet", "Address", "print_joint", "print_address",
           "BitAnd", "BitOr", "BitXor", "BitNot", "Sigmoid", "Trunc"]
