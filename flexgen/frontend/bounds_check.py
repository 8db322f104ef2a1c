"""Indices of captured tensors checked on the host, like torch's indexing checks them.

torch raises ``IndexError`` when a mod reads ``bias[q_idx]`` with a ``bias``
shorter than the sequence; a kernel's load is masked instead and reads 0 past
the end, silently. Where an index depends only on positions (``b``, ``h``,
``q_idx``, ``kv_idx``), its range over a call is known before launch: interval
bounds over the call's ranges (``b`` in [0, B), ``h`` in [0, H), ``q_idx`` in
[0, Q_LEN), ``kv_idx`` in [0, KV_LEN)) say it is in bounds, or else the index is
evaluated exactly at the corners of those ranges, and a corner that lands
outside ``[-size, size)`` (negative indices wrap, as in torch) raises
``IndexBoundsError`` naming the mod, the tensor, its shape and the index's range.
Interval bounds over-estimate (``q * kv // (kv + 1)``), so only an exact value
at a real position is reported: never an error torch would not raise.

Indices that depend on loaded data (``bias[doc[q_idx]]``) or on the score cannot
be checked here without reading the tensors (a device sync): ``FLEXGEN_DEBUG=1``
makes the kernels check those reads on the device (``flexgen.codegen.debug``).

Pure functions of (lowered mod, buffer shapes, ranges), memoized: a repeated
call costs a dict lookup, and mods without captured tensors return at once.

Most captured tensors are read at integer-affine positions (``doc[q_idx]``,
``lengths[b]``, ``table[h, q_idx - kv_idx + c]``, ``slopes[h]``), whose exact range
over a call is their interval's ends. The lowering records such a mod's indices as
plain data (``index_table``), and this module checks and proves them without sympy:
a process whose mods have shipped or recorded forms never imports it. A mod with any
other index that depends on positions only (``q_idx // 2``) takes the sympy path for all.
"""
from __future__ import annotations

import functools
import math

import torch

from ..errors import InputError
from ..frontend.lowering import lower

# A range of one position variable: n (for [0, n)), a half-open (lo, hi), or None (unknown:
# an index that depends on it is not checked).
_NAMES = ("b", "h", "q_idx", "kv_idx")


class IndexBoundsError(InputError, IndexError):
    """A mod indexes a captured tensor outside its bounds (torch raises IndexError there)."""


def check_call_indices(score_traced, mask_traced, B, H, Q_LEN, KV_LEN) -> None:
    """Check the captured-tensor indices of a call's score_mod and mask_mod (either may be None).

    ``B``, ``H``, ``Q_LEN``, ``KV_LEN``: the ranges of ``b``, ``h``, ``q_idx``, ``kv_idx``
    over the call, each ``n`` (for [0, n)), a half-open ``(lo, hi)``, or None when unknown.
    Raises ``IndexBoundsError`` for an index that leaves its tensor at some position.
    """
    for traced in (score_traced, mask_traced):
        if traced is not None and traced.buffers:
            check_indices(lower(traced), traced.kind, traced.name,
                          tuple(tuple(t.shape) for t in traced.buffers), B, H, Q_LEN, KV_LEN)


# (id(lowered), kind, name, shapes, ranges) -> (lowered, error message or None). Keyed by
# identity, not by the LoweredMod's hash (a walk over its snippet), since it runs per decode
# step; the entry holds the object, so its id is not reused while the entry exists.
_CHECKED: dict = {}
_CHECKED_MAX = 4096


def check_indices(lowered, kind: str, name: str, shapes: tuple, B, H, Q_LEN, KV_LEN) -> None:
    """``check_call_indices`` for one lowered mod (``kind`` / ``name`` for the message) whose
    captured tensors have ``shapes``. Memoized; raises ``IndexBoundsError``."""
    ranges = tuple(_half_open(r) for r in (B, H, Q_LEN, KV_LEN))
    if any(r is not None and r[0] >= r[1] for r in ranges):
        return                          # no position at all (a zero length, batch or head count)
    indices, used = _indices(lowered)
    # The memo sees only the ranges the indices read: a decode step's new length does not
    # miss it for a mod that indexes by head (ALiBi slopes).
    key = (id(lowered), kind, name, shapes, tuple(r if n in used else None for n, r in zip(_NAMES, ranges)))
    hit = _CHECKED.get(key)
    if hit is None or hit[0] is not lowered:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        hit = _CHECKED[key] = (lowered, _error(indices, kind, name, shapes, dict(zip(_NAMES, key[-1]))))
    if hit[1] is not None:
        raise IndexBoundsError(hit[1])


_INDICES: dict = {}          # id(lowered) -> (lowered, its checkable indices, the names they read)


def _indices(lowered) -> tuple:
    """((slot, dim, index, the position names it reads) of each index of a captured tensor that
    depends on positions only, the position names they read): what the host can check, walked
    once. ``index``: an ``_Affine`` (from the index table) or a ``_SympyIndex``."""
    hit = _INDICES.get(id(lowered))
    if hit is None or hit[0] is not lowered:
        found = [(slot, dim, index, index.names) for _, slot, dims in _reads(lowered)
                 for dim, index in enumerate(dims) if index is not None]
        used = frozenset(n for *_, names in found for n in names)
        hit = _INDICES[id(lowered)] = (lowered, tuple(found), used)
    return hit[1:]


def _reads(lowered) -> list:
    """(load text, slot, per dim an ``_Affine`` or a ``_SympyIndex``, or None where the index
    reads the score or a tensor) of each captured-tensor read of ``lowered``, in sympy's order."""
    if lowered.index_table is not None:
        return [(text, slot, tuple(_Affine(*d[1:]) if d[0] == "affine" else None for d in dims))
                for text, slot, dims in lowered.index_table]
    return [(str(load), slot, tuple(None if i is None else _SympyIndex(i) for i in dims))
            for load, slot, dims in _sympy_reads(lowered.expr)]


def _sympy_reads(expr) -> list:
    """(load application, slot, per dim its index, or None where it reads the score, a tensor
    or any symbol but the positions: known on the device only) of each read in ``expr``."""
    import sympy

    from ..frontend.expr import INDEX_SYMBOLS, is_load
    reads = []
    for load in sorted((f for f in expr.atoms(sympy.Function) if is_load(f) and f.args),
                       key=sympy.default_sort_key):
        dims = tuple(index if all(s.name in INDEX_SYMBOLS and s == INDEX_SYMBOLS[s.name]
                                  for s in index.free_symbols)
                     and not any(is_load(f) for f in index.atoms(sympy.Function)) else None
                     for index in load.args)
        reads.append((load, int(load.func.__name__[4:]), dims))      # "sbuf3" / "mbuf3"
    return reads


class _SympyIndex:
    """A sympy index with the position names it reads."""

    def __init__(self, index):
        from ..frontend.expr import whole_divisions
        # Divisions of integers whole, as the kernels compute them (split into terms, float
        # bounds and float64 values can land one below an exact multiple).
        self.index, self.text = whole_divisions(index), str(index)
        self.names = tuple(sorted(s.name for s in index.free_symbols))

    def __str__(self) -> str:
        return self.text

    def bounds(self, ranges: dict) -> tuple:
        """(lo, hi), inclusive, over-estimated by interval arithmetic over ``ranges`` by name."""
        from ..frontend.expr import INDEX_SYMBOLS
        return _Interval({INDEX_SYMBOLS[n]: r for n, r in ranges.items() if r is not None})(self.index)


class _Affine:
    """An index ``const + sum(coefficient * position)``, from a lowered mod's index table."""

    def __init__(self, text: str, terms, const: int):
        self.text, self.terms, self.const = text, tuple((n, int(c)) for n, c in terms), int(const)
        self.names = tuple(sorted(n for n, _ in self.terms))

    def __str__(self) -> str:
        return self.text

    def bounds(self, ranges: dict) -> tuple:
        """(lo, hi), inclusive and exact, over half-open ``ranges`` by name (all known)."""
        lo = hi = self.const
        for name, c in self.terms:
            first, last = ranges[name][0], ranges[name][1] - 1
            lo, hi = lo + min(c * first, c * last), hi + max(c * first, c * last)
        return lo, hi


def index_table(expr) -> tuple | None:
    """``expr``'s captured-tensor reads as plain data (the lowering records it, with sympy):
    ``(load text, slot, dims)`` per read, in ``_sympy_reads``' order, each dim ``("affine",
    text, ((position, coefficient), ...), constant)`` or ``("data",)`` (known on the device
    only). None where an index depends on positions only but is not affine, or holds a
    parameter of the lowered form: those take the sympy path, with the mod's constants."""
    import sympy

    from ..frontend.expr import is_parameter
    table = []
    for load, slot, dims in _sympy_reads(expr):
        if any(is_parameter(s) for index in load.args for s in index.free_symbols):
            return None
        plain = []
        for index in dims:
            if index is None:
                plain.append(("data",))
                continue
            terms, const = [], 0
            for term, c in sympy.expand(index).as_coefficients_dict().items():
                if not c.is_Integer:
                    return None
                if term == 1:
                    const = int(c)
                elif term.is_Symbol:
                    terms.append((term.name, int(c)))
                else:
                    return None
            plain.append(("affine", str(index), tuple(sorted(terms)), const))
        table.append((str(load), slot, tuple(plain)))
    return tuple(table)


def index_variables(lowered) -> frozenset:
    """The position names (b, h, q_idx, kv_idx) that the host-checkable indices of ``lowered`` read."""
    return _indices(lowered)[1]


def _error(indices, kind: str, name: str, shapes: tuple, ranges: dict) -> str | None:
    """The message for the first index that leaves its tensor, or None."""
    for slot, dim, index, free in indices:
        size = shapes[slot][dim]
        where = _out_of_bounds(index, free, size, ranges)
        if where:
            return (f"{kind} '{name}': captured tensor {slot} (shape {list(shapes[slot])}) is indexed "
                    f"out of bounds along dim {dim}: the index `{index}` {where}, but that dim has "
                    f"{size} entries (valid indices {-size}..{size - 1}; torch raises IndexError here). "
                    f"Fix: give the tensor more entries along dim {dim}, or clamp the index "
                    f"(torch.clamp(index, 0, {size - 1}))")
    return None


# ---------------------------------------------------------------------------------- proven loads
#
# The same interval bounds, used the other way: where they prove that every index of a load
# lies in [0, size) at every position of a call, the kernel can read without the wrap of
# negative indices and without the bounds mask (flexgen.codegen.printer, "proven" loads).
# Kernels clamp the positions such a load reads into [0, Q_LEN) and [0, KV_LEN), so the
# padded rows and keys of ragged tiles read a real position's entry. A proof is a pure
# function of the call's shapes, so the planner keeps it in the kernel spec.

# Offsets of a proven load's position-dependent dims are int32: their extent must fit.
_INT32_EXTENT = 2 ** 31


def proven_loads(traced, B, H, Q_LEN, KV_LEN) -> tuple:
    """The loads of ``traced`` (a TracedMod, or None) proven in bounds over the call's ranges.

    Ranges as ``check_call_indices`` takes them (``n`` for [0, n), ``(lo, hi)``, None:
    unknown). A load is proven when it reads at least one position, each of its indices
    depends on positions only and interval bounds put it in [0, size) over the ranges (none
    empty), and the dims that read q_idx or kv_idx span fewer than 2**31 elements (their
    offsets are int32 in the kernel). Returns the proven loads' printed forms
    (``str`` of the sympy application, what the printer matches), sorted. Memoized.
    """
    from ..codegen import debug
    if traced is None or not traced.buffers or debug.DEBUG:
        return ()            # FLEXGEN_DEBUG asserts every read on the device instead
    ranges = tuple(_plain_range(r) for r in (B, H, Q_LEN, KV_LEN))
    if any(r is None or r[0] >= r[1] for r in ranges):
        return ()            # an unknown (symbolic) or empty range: nothing to prove over
    layout = []
    for t in traced.buffers:
        shape, strides = tuple(t.shape), tuple(t.stride())
        if not all(type(n) is int for n in shape + strides):
            return ()        # symbolic sizes (dynamic shapes): keep the checked loads
        layout.append((shape, strides))
    lowered = lower(traced)
    key = (id(lowered), tuple(layout), ranges)
    hit = _PROVEN.get(key)
    if hit is None or hit[0] is not lowered:
        if len(_PROVEN) >= _CHECKED_MAX:
            _PROVEN.clear()
        hit = _PROVEN[key] = (lowered, _prove(lowered, layout, dict(zip(_NAMES, ranges))))
    return hit[1]


_PROVEN: dict = {}
_POSITIONS = ("q_idx", "kv_idx")


def _prove(lowered, layout, ranges) -> tuple:
    found = []
    for text, slot, dims in _reads(lowered):
        shape, strides = layout[slot]
        extent, reads_position = 0, False
        for dim, index in enumerate(dims):
            if index is None:
                break            # the score or a tensor's value in the index: known on the device only
            lo, hi = index.bounds(ranges)
            if not (0 <= lo and hi < shape[dim]):
                break
            if set(index.names) & set(_POSITIONS):
                extent += (shape[dim] - 1) * strides[dim]
            reads_position = reads_position or bool(index.names)
        else:
            if reads_position and extent < _INT32_EXTENT:
                found.append(text)
    return tuple(sorted(found))


def _plain_range(r):
    """``_half_open(r)`` for a range of plain ints, else None (unknown, or symbolic)."""
    if type(r) is int or (type(r) is tuple and all(type(x) is int for x in r)):
        return _half_open(r)
    return None


def _half_open(r):
    if r is None:
        return None
    return (0, int(r)) if isinstance(r, int) else (int(r[0]), int(r[1]))


def _out_of_bounds(index, free, size: int, ranges: dict) -> str | None:
    """A phrase saying where ``index`` (over the positions named ``free``) leaves [-size, size),
    or None when it does not (or where a range it reads is unknown)."""
    if not free and isinstance(index, _Affine):
        i = index.const
        return None if -size <= i < size else f"is {i}"
    if isinstance(index, _SympyIndex) and index.index.is_Integer:
        i = int(index.index)
        return None if -size <= i < size else f"is {i}"
    if any(ranges[n] is None for n in free):
        return None
    if isinstance(index, _Affine):
        values = index.bounds(ranges)        # exact: an affine index's ends are real positions'
    else:
        lo, hi = index.bounds(ranges)
        if -size <= lo and hi < size:
            return None
        # Bounds over-estimate: confirm with the values at real positions (every position where
        # that is cheap, else the corners).
        values = _position_values(index.index, free, ranges)
    bad = [v for v in values if not -size <= v < size]
    if not bad:
        return None
    where = ", ".join(f"{n} in [{ranges[n][0]}, {ranges[n][1]})" for n in free)
    return f"takes values from {min(values)} to {max(values)} for {where}"


@functools.lru_cache(maxsize=256)
def _numpy_function(expr, symbols: tuple):
    """``expr`` as a numpy function of ``symbols`` (kept: a decode loop checks each new length)."""
    import numpy as np
    import sympy

    def trunc(x):
        x = np.asarray(x, dtype=np.float64)
        return np.where(np.isnan(x), 0.0, np.clip(np.trunc(x), -2.0 ** 31, 2.0 ** 31 - 1))

    def float_compare(op, a, b):
        return (np.greater_equal, np.greater, np.equal, np.not_equal)[int(op)](a, b)

    return sympy.lambdify(symbols, expr, modules=[{"Trunc": trunc, "IsNan": np.isnan,
                                                   "FloatCompare": float_compare,
                                                   "FloorDiv": np.floor_divide,
                                                   "IntRatio": np.true_divide}, "numpy"])


# Positions the check evaluates an index at, one by one, at most (a numpy array of float64).
_GRID_MAX = 1 << 22


@functools.cache
def _distance():
    """The symbol standing for kv_idx - q_idx (made at first use: sympy loads lazily)."""
    import sympy
    return sympy.Symbol("_flexgen_kv_minus_q", integer=True)


@functools.lru_cache(maxsize=256)
def _relative_form(expr):
    """``expr`` of q_idx and kv_idx as a function of kv_idx - q_idx alone, or None where it is
    not one (kept: sympy's substitution takes milliseconds, a decode loop checks each length)."""
    from ..frontend.expr import INDEX_SYMBOLS
    q, kv = INDEX_SYMBOLS["q_idx"], INDEX_SYMBOLS["kv_idx"]
    relative = expr.xreplace({kv: q + _distance()})
    return None if q in relative.free_symbols else relative


def _position_values(expr, free, ranges) -> list:
    """The values ``expr`` takes at the call's positions, computed in float64 IEEE arithmetic
    (numpy; a float becomes an int as on the device: toward zero, saturated to int32, NaN to
    0), where sympy's exact arithmetic has none (log(0) is zoo there, -inf here: T5's buckets
    take it at distance 0, in the branch torch.where drops). Where the index reads q_idx and
    kv_idx only through kv_idx - q_idx (relative positions), at every difference; else at every
    position when there are at most _GRID_MAX; else at the corners (where an index monotone in
    each position takes its extremes; one that is not may leave its tensor unseen there)."""
    import numpy as np

    from ..frontend.expr import INDEX_SYMBOLS
    relative = _relative_form(expr) if set(free) == {"q_idx", "kv_idx"} else None
    if relative is not None:
        (q_lo, q_hi), (kv_lo, kv_hi) = ranges["q_idx"], ranges["kv_idx"]
        values = _relative_values(relative, kv_lo - q_hi + 1, kv_hi - q_lo)
    else:
        every = math.prod(ranges[n][1] - ranges[n][0] for n in free) <= _GRID_MAX
        axes = [np.arange(lo, hi, dtype=np.float64) if every else np.array(sorted({lo, hi - 1}), dtype=np.float64)
                for lo, hi in (ranges[n] for n in free)]
        values = _evaluate(expr, [INDEX_SYMBOLS[n] for n in free], axes)
    values = values[np.isfinite(values)]
    return [int(values.min()), int(values.max())] if values.size else []


def _evaluate(expr, symbols, axes):
    """``expr`` at every point of the grid ``axes`` (one float64 axis per symbol), flattened."""
    import numpy as np
    grids = np.meshgrid(*axes, indexing="ij", sparse=True)
    with np.errstate(all="ignore"):
        values = np.asarray(_numpy_function(expr, tuple(symbols))(*grids), dtype=np.float64)
    return np.broadcast_to(values, tuple(len(a) for a in axes)).reshape(-1)


_RELATIVE: dict = {}        # relative index -> (lo, hi, its values at distances lo .. hi - 1)
_RELATIVE_MAX = 64          # entries (each up to a few MB at long lengths)


def _relative_values(expr, lo: int, hi: int):
    """A relative index's values at distances lo .. hi - 1. Kept over a span twice as wide as
    asked: a decode loop asks for one more key each step, and slicing costs microseconds
    where evaluating costs a millisecond."""
    import numpy as np
    hit = _RELATIVE.get(expr)
    if hit is None or lo < hit[0] or hi > hit[1]:
        width = hi - lo
        span = (min(lo, hit[0]) if hit else lo) - width, (max(hi, hit[1]) if hit else hi) + width
        if len(_RELATIVE) >= _RELATIVE_MAX:
            _RELATIVE.clear()
        hit = _RELATIVE[expr] = (*span, _evaluate(expr, [_distance()], [np.arange(*span, dtype=np.float64)]))
    return hit[2][lo - hit[0]:hi - hit[0]]


def clear_memos() -> None:
    for memo in (_CHECKED, _INDICES, _PROVEN, _RELATIVE):
        memo.clear()
    _numpy_function.cache_clear()
    _relative_form.cache_clear()


class _Interval:
    """Interval bounds (lo, hi), inclusive floats, of an expression over position ranges."""

    def __init__(self, ranges: dict):
        self.ranges = ranges

    def __call__(self, e):
        if e.is_Number:
            v = float(e)
            return (v, v) if not math.isnan(v) else _UNKNOWN
        if e in self.ranges:
            lo, hi = self.ranges[e]
            return float(lo), float(hi - 1)
        method = getattr(self, "_" + type(e).__name__, None)
        return method(e) if method is not None else _UNKNOWN

    def _Add(self, e):
        bounds = [self(a) for a in e.args]
        return sum(b[0] for b in bounds), sum(b[1] for b in bounds)

    def _Mul(self, e):
        lo, hi = self(e.args[0])
        for a in e.args[1:]:
            l2, h2 = self(a)
            products = [_mul(x, y) for x in (lo, hi) for y in (l2, h2)]
            lo, hi = min(products), max(products)
        return lo, hi

    def _Pow(self, e):
        base, exp = e.args
        if not (exp.is_Integer and exp > 0):
            return _UNKNOWN
        lo, hi = self(base)
        n = int(exp)
        ends = (lo ** n, hi ** n)
        if n % 2 == 0 and lo < 0 < hi:
            return 0.0, max(ends)
        return min(ends), max(ends)

    def _floor(self, e):
        lo, hi = self(e.args[0])
        return math.floor(lo) if math.isfinite(lo) else lo, math.floor(hi) if math.isfinite(hi) else hi

    def _ceiling(self, e):
        lo, hi = self(e.args[0])
        return math.ceil(lo) if math.isfinite(lo) else lo, math.ceil(hi) if math.isfinite(hi) else hi

    def _FloorDiv(self, e):
        num, den = e.args
        if not (den.is_Integer and den > 0):
            return _UNKNOWN
        (lo, hi), d = self(num), int(den)
        return (math.floor(lo / d) if math.isfinite(lo) else lo, math.floor(hi / d) if math.isfinite(hi) else hi)

    def _IntRatio(self, e):
        num, den = e.args
        if not (den.is_Integer and den > 0):
            return _UNKNOWN
        lo, hi = self(num)
        return lo / int(den), hi / int(den)

    def _Trunc(self, e):
        lo, hi = self(e.args[0])
        return (math.trunc(lo) if math.isfinite(lo) else lo, math.trunc(hi) if math.isfinite(hi) else hi)

    def _Mod(self, e):
        a, m = e.args
        if not (m.is_Number and m > 0):
            return _UNKNOWN
        m = float(m)
        lo, hi = self(a)
        if math.isfinite(lo) and math.isfinite(hi) and math.floor(lo / m) == math.floor(hi / m):
            shift = math.floor(lo / m) * m
            return lo - shift, hi - shift
        return 0.0, m - 1 if e.is_integer else m

    def _Abs(self, e):
        lo, hi = self(e.args[0])
        if lo >= 0:
            return lo, hi
        if hi <= 0:
            return -hi, -lo
        return 0.0, max(-lo, hi)

    def _Min(self, e):
        bounds = [self(a) for a in e.args]
        return min(b[0] for b in bounds), min(b[1] for b in bounds)

    def _Max(self, e):
        bounds = [self(a) for a in e.args]
        return max(b[0] for b in bounds), max(b[1] for b in bounds)

    def _Piecewise(self, e):
        # Either branch may be taken (conditions are not narrowed): their union.
        bounds = [self(piece.expr) for piece in e.args]
        return min(b[0] for b in bounds), max(b[1] for b in bounds)


_UNKNOWN = (-math.inf, math.inf)


def _mul(x: float, y: float) -> float:
    # 0 * inf is 0 here: a bound of 0 is exact, an infinite one only says "unknown".
    return 0.0 if x == 0 or y == 0 else x * y


def check_decode_indices(score_traced, mask_traced, query_shape, q_offsets, host_q_lengths,
                         host_kv_lengths, kv_max, capacity: int) -> None:
    """``check_call_indices`` for a decode call, whose sequences differ in their positions.

    Decode steps come one after the other with new lengths, so the first check is
    one that does not change with them: every position of the cache (``q_idx``
    and ``kv_idx`` in [0, ``capacity``), memoized), which passes for tensors
    sized to the cache. Where it does not, the call's own positions decide:
    the corners of a box around all sequences need not be real positions, so
    real sequences are checked, those that reach furthest (the longest, the one
    whose queries end last, the one whose queries start first). Queries without
    ``q_offsets`` are taken to lie within their sequence (the last ones).
    ``query_shape`` is (B, H, Lq); ``host_q_lengths`` / ``host_kv_lengths`` are
    per-sequence lists or None (the default: every sequence ``Lq`` queries /
    ``kv_max`` keys; or lengths on the GPU, never read back, as are CUDA
    ``q_offsets``); ``kv_max`` None: unknown.
    """
    if not any(t is not None and t.buffers for t in (score_traced, mask_traced)):
        return                          # the common case, on every decode step: nothing to check
    B, H, Lq = query_shape
    within = q_offsets is None or (isinstance(q_offsets, int) and 0 <= q_offsets <= capacity - Lq)
    if within:
        try:
            check_call_indices(score_traced, mask_traced, B, H, capacity, capacity)
            return
        except IndexBoundsError:
            pass                        # somewhere in the cache: are this call's positions there?
    for ranges in decode_ranges(query_shape, q_offsets, host_q_lengths, host_kv_lengths, kv_max):
        check_call_indices(score_traced, mask_traced, *ranges)


def decode_ranges(query_shape, q_offsets, host_q_lengths, host_kv_lengths, kv_max) -> list:
    """The (b, h, q_idx, kv_idx) ranges of the sequences ``check_decode_indices`` checks."""
    B, H, Lq = query_shape
    kv = host_kv_lengths if host_kv_lengths is not None else None if kv_max is None else [kv_max] * B
    if not kv:
        return [(B, H, None, None)]
    q_lens = host_q_lengths or [Lq] * B
    if q_offsets is None:
        starts = [n - m for n, m in zip(kv, q_lens)]
    elif isinstance(q_offsets, int):
        starts = [q_offsets] * B
    elif isinstance(q_offsets, torch.Tensor) and q_offsets.device.type == "cuda":
        starts = None                   # not read back (no sync)
    else:
        values = [int(x) for x in (q_offsets.reshape(-1).tolist() if isinstance(q_offsets, torch.Tensor)
                                   else q_offsets)]
        starts = values * B if len(values) == 1 else values
    if starts is None:
        picks = [max(range(B), key=kv.__getitem__)]
    else:
        picks = [max(range(B), key=kv.__getitem__), max(range(B), key=lambda b: starts[b] + q_lens[b]),
                 min(range(B), key=starts.__getitem__)]
    return [((b, b + 1), H, None if starts is None else (starts[b], starts[b] + q_lens[b]), kv[b])
            for b in dict.fromkeys(picks)]
