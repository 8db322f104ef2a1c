"""Classify mask blocks as full, empty or undecided from interval bounds.

For every (batch, head, query block, kv block) at once, each sub-expression
of a canonical mask expression gets an interval ``[lo, hi]`` over the
positions of that block, as torch tensors broadcast to ``[B, H, NQ, NKV]``.
A mask whose interval is {True} on a block is full there, {False} empty;
anything else is undecided and left to the block-mask kernel, which looks at
the elements. Intervals are conservative, so a decided block is always right.

Captured buffers indexed by ``b``, ``h``, constants, or exactly ``q_idx`` /
``kv_idx`` get their per-block minimum and maximum (``doc[b, q_idx]``), which
decides most blocks of document masks without looking at elements.
Work and memory are O(number of blocks + buffer size), never O(Q_LEN x KV_LEN).

What is evaluated is the expression's *block-bounds program* (``compile_flags``):
its distinct sub-expressions as plain tuples, operands before their users, each
relation stored with its ``lhs - rhs`` already formed. It is JSON data, so the
restart index (``flexgen.codegen.index``) keeps it with the lowered mod and a
warm process builds block masks without importing sympy; only ``compile_flags``
needs sympy. A sympy expression passed to ``classify`` / ``block_flags`` is
compiled first.

``classify`` states the decision plainly (the mask's interval); ``block_flags``,
which create_block_mask runs, reaches the same decisions with fewer ops (each a
launch on a GPU): relations compared side against side, And / Or / Not on
flags. A test holds the two to the same answer on every block.
"""
from __future__ import annotations

import functools
import math
import operator

import torch

from .states import EMPTY, FULL, PARTIAL, UNDECIDED  # noqa: F401
INF = math.inf

# Program nodes (``compile_flags``): ("sym", name), ("int", k), ("num", float), ("bool", 0 or 1),
# ("load", buffer name, *index nodes), (relation, node of lhs - rhs), ("Piecewise", value,
# condition, ..., last value, True), ("ITE", its Piecewise), ("PowN", base, n), and (function
# name, *operand nodes) for the rest; operands are indices of earlier nodes.
_RELATION_NAMES = ("GreaterThan", "StrictGreaterThan", "LessThan", "StrictLessThan", "Equality",
                   "Unequality")
# Truth values: bounds within [0, 1], finite by construction.
_BOOL_OPS = frozenset(("bool", "ITE", "And", "Or", "Not", "Xor", "Equivalent", *_RELATION_NAMES))
_NUMBER_OPS = ("int", "num")
# Operations whose bounds are finite when their operands' are.
_FINITE_OF_FINITE = ("Add", "Mul", "floor", "ceiling", "FloorDiv", "IntRatio")


def _finite_value(node) -> bool:
    """A number node with a finite value (sympy's ``is_Number and is_finite``)."""
    return node[0] in _NUMBER_OPS and math.isfinite(node[1])


class _Evaluator:
    def __init__(self, program, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, buffers: dict, device):
        self.program = program      # the nodes; the last one is the mask
        self.device = device
        self.B, self.H = B, H
        self.Q_LEN, self.KV_LEN, self.Q_BLOCK, self.KV_BLOCK = Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK
        self.nq, self.nkv = -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)
        self.env = {}               # index name -> (lo, hi), made on first use (see symbol)
        self.buffers = buffers      # buffer name (mbuf0, ...) -> captured tensor
        self.memo = {}              # node -> (lo, hi)
        self.finite = set()         # nodes whose bounds are finite (never nan)
        # buffer name -> its float64 copy; (name, dim, length, block) -> per-block (min, max)
        self.reduced = {}

    # torch.full, not torch.tensor: no host-to-device copy (which waits for the GPU).
    def unknown(self):
        return torch.full((), -INF, dtype=torch.float64, device=self.device), \
            torch.full((), INF, dtype=torch.float64, device=self.device)

    def const(self, v):
        t = torch.full((), float(v), dtype=torch.float64, device=self.device)
        return t, t

    def __call__(self, i):
        if i not in self.memo:
            lo, hi = self.evaluate(i)
            if self.is_finite(i):
                self.finite.add(i)
            else:
                # nan comes from inf - inf or 0 * inf: the bound is then unknown.
                lo = torch.nan_to_num(lo, nan=-INF, posinf=INF, neginf=-INF)
                hi = torch.nan_to_num(hi, nan=INF, posinf=INF, neginf=-INF)
            self.memo[i] = (lo, hi)
        return self.memo[i]

    def is_finite(self, i) -> bool:
        """Whether node ``i``'s bounds are finite by construction, so nan_to_num can be skipped.

        Index symbols and finite numbers are; truth values are 0 or 1; sums,
        products, floor and ceiling of finite bounds are finite. Index
        arithmetic (every common mask) never needs the cleanup.
        """
        op, *args = node = self.program[i]
        if op == "sym" or i in self.finite or op in _BOOL_OPS:
            return True
        if op in _NUMBER_OPS:
            return _finite_value(node)
        return op in _FINITE_OF_FINITE and \
            all(a in self.finite or _finite_value(self.program[a]) for a in args)

    def symbol(self, name):
        """(lo, hi) of an index symbol over each block, made when an expression first uses it.

        Lazily, because every op counts when a mask is built per training step,
        and a document mask reads q_idx and kv_idx only through buffer loads.
        """
        if name not in self.env:
            f64 = dict(dtype=torch.float64, device=self.device)
            if name in ("b", "h"):
                n = self.B if name == "b" else self.H
                t = torch.arange(n, **f64).view((n, 1, 1, 1) if name == "b" else (1, n, 1, 1))
                self.env[name] = (t, t)
            else:
                # First and last position of each block (the last clamped to the length).
                n, block, length = ((self.nq, self.Q_BLOCK, self.Q_LEN) if name == "q_idx"
                                    else (self.nkv, self.KV_BLOCK, self.KV_LEN))
                shape = (1, 1, -1, 1) if name == "q_idx" else (1, 1, 1, -1)
                lo = torch.arange(0, n * block, block, **f64)
                hi = torch.arange(block - 1, n * block, block, **f64).clamp_(max=length - 1)
                self.env[name] = (lo.view(shape), hi.view(shape))
        return self.env[name]

    def evaluate(self, i):
        op, *args = self.program[i]
        if op == "sym":
            return self.symbol(args[0])
        if op in ("int", "num", "bool"):
            return self.const(args[0])
        if op == "load":
            return self.load(i, args[0], args[1:])
        method = getattr(self, "op_" + op, None)
        return method(*args) if method is not None else self.unknown()

    # --- numbers -------------------------------------------------------------------
    def op_Add(self, *terms):
        # A number term (sympy puts it first) is added as a Python float: no tensor for it.
        # Summed in sympy's argument order, as before, so the rounding is unchanged.
        c = None
        if _finite_value(self.program[terms[0]]):
            c, terms = float(self.program[terms[0]][1]), terms[1:]
        los, his = zip(*(self(a) for a in terms))
        lo, hi = (los[0], his[0]) if c is None else (los[0] + c, his[0] + c)
        return functools.reduce(operator.add, los[1:], lo), functools.reduce(operator.add, his[1:], hi)

    def op_Mul(self, *factors):
        first = self.program[factors[0]]
        if len(factors) == 2 and _finite_value(first) and first[1] != 0:
            # c * x (-kv_idx, 2 * q_idx): two scalings instead of the four
            # products of two intervals, with the same values.
            c = float(first[1])
            lo, hi = self(factors[1])
            return (lo * c, hi * c) if c > 0 else (hi * c, lo * c)
        lo, hi = self(factors[0])
        for a in factors[1:]:
            l2, h2 = self(a)
            products = torch.stack(torch.broadcast_tensors(lo * l2, lo * h2, hi * l2, hi * h2))
            lo, hi = products.amin(0), products.amax(0)
        return lo, hi

    def op_Pow(self, base, exp):
        b, e = self.program[base], self.program[exp]
        if b[0] in _NUMBER_OPS and b[1] == 2:
            lo, hi = self(exp)
            return torch.exp2(lo), torch.exp2(hi)
        if e[0] in _NUMBER_OPS and e[1] == -1:
            lo, hi = self(base)
            inv_lo, inv_hi = 1 / hi, 1 / lo
            ok = (lo > 0) | (hi < 0)
            return torch.where(ok, inv_lo, -INF), torch.where(ok, inv_hi, INF)
        return self.unknown()

    def op_PowN(self, base, n):
        """``base ** n`` for an integer n > 0: the product of n copies (as op_Mul multiplies)."""
        return self.op_Mul(*[base] * n)

    def op_floor(self, a):
        lo, hi = self(a)
        return torch.floor(lo), torch.floor(hi)

    def op_ceiling(self, a):
        lo, hi = self(a)
        return torch.ceil(lo), torch.ceil(hi)

    def op_IntRatio(self, a, d):
        """a / d of an integer a and a positive constant d (``frontend.expr.IntRatio``): the
        integer bounds divided whole, where a/6 + b/6 in floats could land below a multiple."""
        d = self.program[d]
        if not (d[0] == "int" and d[1] > 0):
            return self.unknown()
        lo, hi = self(a)
        return lo / d[1], hi / d[1]

    def op_FloorDiv(self, a, d):
        lo, hi = self.op_IntRatio(a, d)
        return torch.floor(lo), torch.floor(hi)

    def op_Trunc(self, a):
        lo, hi = self(a)
        return torch.trunc(lo), torch.trunc(hi)

    def op_Mod(self, a, m):
        m = self.program[m]
        if not (m[0] in _NUMBER_OPS and m[1] > 0):
            return self.unknown()
        m = float(m[1])
        lo, hi = self(a)
        same_period = torch.floor(lo / m) == torch.floor(hi / m)
        return (torch.where(same_period, lo - torch.floor(lo / m) * m, torch.zeros_like(lo)),
                torch.where(same_period, hi - torch.floor(hi / m) * m, torch.full_like(hi, m)))

    def op_Abs(self, a):
        lo, hi = self(a)
        return (torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, torch.zeros_like(lo))),
                torch.maximum(lo.abs(), hi.abs()))

    def _fold(self, args, fn):
        lo, hi = self(args[0])
        for a in args[1:]:
            l2, h2 = self(a)
            lo, hi = fn(lo, l2), fn(hi, h2)
        return lo, hi

    def op_Min(self, *args): return self._fold(args, torch.minimum)
    def op_Max(self, *args): return self._fold(args, torch.maximum)

    def _monotone(self, a, fn, domain_lo=-INF):
        lo, hi = self(a)
        ok = lo >= domain_lo
        return torch.where(ok, fn(lo), -INF), torch.where(ok, fn(hi), INF)

    def op_exp(self, a): return self._monotone(a, torch.exp)
    def op_tanh(self, a): return self._monotone(a, torch.tanh)
    def op_Sigmoid(self, a): return self._monotone(a, torch.sigmoid)
    def op_log(self, a): return self._monotone(a, torch.log, domain_lo=0.0)

    def op_Piecewise(self, *args):
        *pieces, last, _ = args         # (value, condition) pairs; the last condition is True
        lo, hi = self(last)
        for k in range(len(pieces) - 2, -1, -2):
            vlo, vhi = self(pieces[k])
            clo, chi = self(pieces[k + 1])
            lo = torch.where(clo == 1, vlo, torch.where(chi == 0, lo, torch.minimum(vlo, lo)))
            hi = torch.where(clo == 1, vhi, torch.where(chi == 0, hi, torch.maximum(vhi, hi)))
        return lo, hi

    def op_ITE(self, piecewise):
        return self.op_Piecewise(*self.program[piecewise][1:])

    # --- truth values: [lo, hi] within {0, 1} ---------------------------------------
    def _relation(self, d, always, never):
        lo, hi = self(d)                # d: the node of lhs - rhs
        return always(lo, hi).double(), (~never(lo, hi)).double()

    def op_GreaterThan(self, d): return self._relation(d, lambda l, h: l >= 0, lambda l, h: h < 0)
    def op_StrictGreaterThan(self, d): return self._relation(d, lambda l, h: l > 0, lambda l, h: h <= 0)
    def op_LessThan(self, d): return self._relation(d, lambda l, h: h <= 0, lambda l, h: l > 0)
    def op_StrictLessThan(self, d): return self._relation(d, lambda l, h: h < 0, lambda l, h: l >= 0)
    def op_Equality(self, d): return self._relation(d, lambda l, h: (l == 0) & (h == 0), lambda l, h: (l > 0) | (h < 0))
    def op_Unequality(self, d): return self._relation(d, lambda l, h: (l > 0) | (h < 0), lambda l, h: (l == 0) & (h == 0))

    def op_And(self, *args): return self._fold(args, torch.minimum)
    def op_Or(self, *args): return self._fold(args, torch.maximum)

    def op_Not(self, a):
        lo, hi = self(a)
        return 1 - hi, 1 - lo

    def op_Xor(self, *args):
        lo, hi = self(args[0])
        for a in args[1:]:
            l2, h2 = self(a)
            known = (lo == hi) & (l2 == h2)
            value = (lo != l2).double()
            lo, hi = torch.where(known, value, 0.0), torch.where(known, value, 1.0)
        return lo, hi

    def op_Equivalent(self, *args):
        lo, hi = self.op_Xor(*args)
        return 1 - hi, 1 - lo

    # --- captured buffers ------------------------------------------------------------
    def load(self, i, name, args):
        tensor = self.buffers.get(name)
        if tensor is None:
            return self.unknown()
        if name not in self.reduced:
            self.reduced[name] = tensor.to(device=self.device, dtype=torch.float64)
        t_lo = t_hi = raw = self.reduced[name]
        index = []
        for d, arg in enumerate(args):
            node = self.program[arg]
            if node in (("sym", "q_idx"), ("sym", "kv_idx")):
                is_q = node[1] == "q_idx"
                length, block = (self.Q_LEN, self.Q_BLOCK) if is_q else (self.KV_LEN, self.KV_BLOCK)
                key = (name, d, length, block)
                if t_lo is raw:
                    # Memoized: doc[q_idx] and doc[kv_idx] reduce alike when the blockings match.
                    if key not in self.reduced:
                        self.reduced[key] = (_block_reduce(raw, d, length, block, torch.amin),
                                             _block_reduce(raw, d, length, block, torch.amax))
                    t_lo, t_hi = self.reduced[key]
                else:
                    t_lo = _block_reduce(t_lo, d, length, block, torch.amin)
                    t_hi = _block_reduce(t_hi, d, length, block, torch.amax)
                blocks = torch.arange(t_lo.shape[d], device=self.device)
                index.append(blocks.view((1, 1, -1, 1) if is_q else (1, 1, 1, -1)))
                continue
            size = tensor.shape[d]
            # b, h and constants are known on the host: checked here, without the
            # device comparisons below (each a sync on a GPU).
            if node in (("sym", "b"), ("sym", "h")):
                n = self.B if node[1] == "b" else self.H
                if n > size:
                    return self.unknown()
                index.append(self.symbol(node[1])[0].long())
                continue
            if node[0] == "int":
                k = node[1] + (size if node[1] < 0 else 0)
                if not 0 <= k < size:
                    return self.unknown()
                index.append(torch.full((), k, dtype=torch.long, device=self.device))
                continue
            # Any other index must be exact on every block.
            lo, hi = self(arg)
            if not torch.equal(lo, hi) or not torch.isfinite(lo).all():
                return self.unknown()
            k = lo.long()
            k = torch.where(k < 0, k + size, k)
            if ((k < 0) | (k >= size)).any():
                return self.unknown()
            index.append(k)
        if not tensor.is_floating_point():
            self.finite.add(i)      # integer values: no inf, no nan
        if not index:
            return t_lo, t_hi
        return t_lo[tuple(index)], t_hi[tuple(index)]


def _block_reduce(t: torch.Tensor, dim: int, length: int, block: int, reduce):
    """``reduce`` (amin / amax) of ``t`` along ``dim`` over each block of positions [0, length).

    Positions at or past the tensor's size read 0, as the kernel's masked loads do.
    """
    t = t.movedim(dim, -1)
    size = t.shape[-1]
    if size < length:
        t = torch.cat([t, t.new_zeros(t.shape[:-1] + (length - size,))], -1)
    t = t[..., :length]
    n = -(-length // block)
    pad = n * block - length
    if pad:   # repeat the last value: it changes neither min nor max
        t = torch.cat([t, t[..., -1:].expand(t.shape[:-1] + (pad,))], -1)
    return reduce(t.reshape(t.shape[:-1] + (n, block)), -1).movedim(-1, dim)


def program_of(expr) -> tuple:
    """``expr`` as a block-bounds program: a program is returned as it is, a sympy
    expression compiled (``compile_flags``, which imports sympy)."""
    return expr if isinstance(expr, tuple) else compile_flags(expr)


def classify(expr, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, buffers: dict, device) -> torch.Tensor:
    """int8 ``[B, H, NQ, NKV]``: EMPTY, FULL, or UNDECIDED per block of the mask ``expr``
    (a block-bounds program or a sympy expression)."""
    program = program_of(expr)
    ev = _Evaluator(program, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, buffers, device)
    lo, hi = ev(len(program) - 1)
    shape = (B, H, ev.nq, ev.nkv)
    states = torch.full(shape, UNDECIDED, dtype=torch.int8, device=device)
    states.masked_fill_(lo >= 1, FULL)
    states.masked_fill_(hi <= 0, EMPTY)
    return states


def block_flags(expr, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, buffers: dict, device, out=None) -> tuple:
    """(full, empty) per block of the boolean mask ``expr`` (a block-bounds program or a
    sympy expression): ``classify``'s decisions (full where it says FULL, empty where
    EMPTY), as flags broadcast to ``[B, H, NQ, NKV]``, in fewer ops (``_flags``); with
    ``out`` (int32, that shape) full is written there. create_block_mask builds its block
    lists from these."""
    program = program_of(expr)
    ev = _Evaluator(program, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, buffers, device)
    return _flags(ev, len(program) - 1, out)


def _op(fn, a, b, out=None):
    """``fn(a, b)``, or into ``out`` (the mask's full shape, int32): ``a`` broadcast to it."""
    return fn(a, b) if out is None else fn(a.expand(out.shape), b, out=out)


def _cmp(fn, a, b, out=None):
    """``fn(a, b)`` of bounds where either may be a Python number (an empty side: 0)."""
    if not isinstance(a, torch.Tensor):
        a, b, fn = b, a, _MIRRORED[fn]
    return _op(fn, a, b, out)


_MIRRORED = {torch.ge: torch.le, torch.le: torch.ge, torch.gt: torch.lt, torch.lt: torch.gt,
             torch.eq: torch.eq}

# A relation ``P - N <op> 0`` from the bounds of P ([pl, ph]) and of N ([nl, nh]), the
# interval of P - N being [pl - nh, ph - nl]: (full, empty) of each block, bounds' own
# tests (``_Evaluator._relation``'s always and never) with the subtraction moved
# across the comparison.
_RELATIONS = {
    "GreaterThan": lambda pl, ph, nl, nh, out: (_cmp(torch.ge, pl, nh, out), _cmp(torch.lt, ph, nl)),
    "StrictGreaterThan": lambda pl, ph, nl, nh, out: (_cmp(torch.gt, pl, nh, out), _cmp(torch.le, ph, nl)),
    "LessThan": lambda pl, ph, nl, nh, out: (_cmp(torch.le, ph, nl, out), _cmp(torch.gt, pl, nh)),
    "StrictLessThan": lambda pl, ph, nl, nh, out: (_cmp(torch.lt, ph, nl, out), _cmp(torch.ge, pl, nh)),
    "Equality": lambda pl, ph, nl, nh, out: (
        _op(torch.bitwise_and, _cmp(torch.eq, pl, nh), _cmp(torch.eq, ph, nl), out),
        _cmp(torch.gt, pl, nh) | _cmp(torch.lt, ph, nl)),
    "Unequality": lambda pl, ph, nl, nh, out: (
        _op(torch.bitwise_or, _cmp(torch.gt, pl, nh), _cmp(torch.lt, ph, nl), out),
        _cmp(torch.eq, pl, nh) & _cmp(torch.eq, ph, nl)),
}

# Buffers whose values are exact in float64 whatever is done with them here.
_EXACT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32)


def _sides(ev, d):
    """Node ``d`` as P - N + k: (P's terms, N's terms, k), each term a (multiple, node)
    pair, where every bound stays an exact integer in float64, or None.

    Index symbols, loads of integer buffers (up to int32), integer multiples
    of them and an integer: sums of such bounds are exact, so comparing P
    with N decides what comparing P - N with 0 decides, without the negation
    and the sum. Anything else (floats, floor, a buffer of int64) is left
    whole, as P.
    """
    program = ev.program
    op, *args = program[d]
    terms = args if op == "Add" else (d,)
    if len(terms) > 16:
        return None
    pos, neg, k = [], [], 0
    for t in terms:
        node = program[t]
        if node[0] == "int":
            k += node[1]
            continue
        c, x = 1, t
        if node[0] == "Mul" and len(node) == 3 and program[node[1]][0] == "int":
            c, x = program[node[1]][1], node[2]
        xop = program[x]
        if not (xop[0] == "sym" or (xop[0] == "load" and getattr(ev.buffers.get(xop[1]), "dtype", None)
                                    in _EXACT_DTYPES)):
            return None
        if c == 0 or abs(c) > 2 ** 16:
            return None
        (pos if c > 0 else neg).append((abs(c), x))
    if abs(k) > 2 ** 40 or not (pos or neg):
        return None
    return pos, neg, k


def _term_bounds(ev, term):
    """(lo, hi) of ``c * x`` for a term (c, x) of ``_sides``: c > 0, x's bounds finite."""
    c, x = term
    lo, hi = ev(x)
    return (lo, hi) if c == 1 else (lo * float(c), hi * float(c))


def _side_bounds(ev, terms, k):
    """(lo, hi) of ``sum(terms) + k``: Python numbers for an empty side."""
    if not terms:
        return k, k
    lo, hi = _term_bounds(ev, terms[0])
    for t in terms[1:]:
        tl, th = _term_bounds(ev, t)
        lo, hi = lo + tl, hi + th
    return (lo + k, hi + k) if k else (lo, hi)


def _relation(ev, d, kind, out):
    sides = _sides(ev, d)
    if sides is None:
        (pl, ph), (nl, nh) = ev(d), (0, 0)
    else:
        pos, neg, k = sides
        (pl, ph), (nl, nh) = _side_bounds(ev, pos, max(k, 0)), _side_bounds(ev, neg, max(-k, 0))
    return _RELATIONS[kind](pl, ph, nl, nh, out)


def _flags(ev, i, out=None) -> tuple:
    """(full, empty): bool tensors broadcast to ``[B, H, NQ, NKV]``, whether the
    boolean mask node ``i`` is true / false on every position of a block.

    The same decisions as ``bounds.classify`` (its intervals of truth values
    are 0 or 1: full where lo = 1, empty where hi = 0), kept as flags: a
    relation is one comparison of the bounds of ``lhs - rhs`` each way, And /
    Or combine the flags of their terms, Not swaps them; anything else goes
    through the interval evaluator. Only the comparisons run, not bounds'
    conversions of them to float intervals and back (nor, for integer
    terms, the negation and sum of ``lhs - rhs``: see ``_sides``). Never both full and
    empty (lo <= hi, and nan compares false). With ``out``, full is written
    there (int32 0 / 1) and returned.
    """
    kind, *args = ev.program[i]
    if kind in ("And", "Or"):
        terms = [_flags(ev, a) for a in args]
        all_of, any_of = torch.bitwise_and, torch.bitwise_or
        fold_full, fold_empty = (all_of, any_of) if kind == "And" else (any_of, all_of)
        return _fold(fold_full, [t[0] for t in terms], out), _fold(fold_empty, [t[1] for t in terms])
    if kind == "Not":
        full, empty = _flags(ev, args[0])
        if out is not None:
            empty = out.copy_(empty.expand(out.shape))
        return empty, full
    if kind in _RELATIONS:
        return _relation(ev, args[0], kind, out)
    lo, hi = ev(i)
    return _op(torch.ge, lo, 1, out), hi <= 0


def _fold(fn, flags, out=None):
    result = flags[0]
    for i, f in enumerate(flags[1:], 2):
        result = _op(fn, result, f, out if i == len(flags) else None)
    if len(flags) == 1 and out is not None:
        result = out.copy_(result.expand(out.shape))
    return result


# The sympy functions the evaluator has an op_ for, by class name (operands in sympy's order).
_FUNCTIONS = frozenset(("Add", "Mul", "floor", "ceiling", "FloorDiv", "IntRatio", "Trunc", "Mod", "Abs",
                        "Min", "Max", "exp", "tanh", "Sigmoid", "log", "And", "Or", "Not", "Xor",
                        "Equivalent"))


def compile_flags(expr, buffers=None) -> tuple:
    """The block-bounds program of a canonical mask expression (imports sympy).

    A tuple of nodes (see the module's top), each distinct sub-expression once,
    operands first; the mask is the last node. ``buffers`` (the mod's BufferSigs)
    are not needed: which loads are exact is decided per call from the tensors.
    Operations without an op_ become ("unknown",): unbounded, as before.
    """
    import sympy
    from sympy.core.function import UndefinedFunction

    from ..frontend.expr import INDEX_SYMBOLS, whole_divisions
    names = {s: n for n, s in INDEX_SYMBOLS.items()}
    nodes, seen = [], {}

    def emit(node) -> int:
        nodes.append(node)
        return len(nodes) - 1

    def visit(e) -> int:
        hit = seen.get(e)
        if hit is not None:
            return hit
        kind = type(e).__name__
        if e in names:
            i = emit(("sym", names[e]))
        elif e is sympy.true or e is sympy.false:
            i = emit(("bool", int(e is sympy.true)))
        elif e.is_Integer:
            i = emit(("int", int(e)))
        elif e.is_Number:
            try:
                i = emit(("num", float(e)))
            except TypeError:           # zoo and the like: no value to bound with
                i = emit(("unknown",))
        elif isinstance(type(e), UndefinedFunction):
            i = emit(("load", e.func.__name__, *(visit(a) for a in e.args)))
        elif kind in _RELATION_NAMES:
            i = emit((kind, visit(e.lhs - e.rhs)))
        elif kind == "Piecewise":
            i = emit(("Piecewise", *(visit(part) for piece in e.args for part in piece)))
        elif kind == "ITE":
            as_piecewise = sympy.Piecewise((e.args[1], e.args[0]), (e.args[2], True))
            inner = visit(as_piecewise)
            i = emit(("ITE", inner)) if nodes[inner][0] == "Piecewise" else inner
        elif kind == "Pow":
            base, exp = e.base, e.exp
            if not base == 2 and exp.is_Integer and exp > 0:
                i = emit(("PowN", visit(base), int(exp)))
            else:
                i = emit(("Pow", visit(base), visit(exp)))
        elif kind in _FUNCTIONS:
            i = emit((kind, *(visit(a) for a in e.args)))
        else:
            i = emit(("unknown",))
        seen[e] = i
        return i

    # Divisions of integers whole (frontend.expr.whole_divisions), as the kernels compute them:
    # split into terms, their float bounds could miss an exact multiple and call a block empty.
    visit(whole_divisions(expr))
    return tuple(nodes)
