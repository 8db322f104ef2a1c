"""Classify undecided mask blocks with torch ops, without compiling a kernel.

``create_block_mask`` decides most blocks from interval bounds
(``flexgen.masks.bounds``); the few it leaves undecided (the diagonal of a causal
mask, the edges of a window or of documents) need their elements looked at.
The generated block-mask kernel does that, but compiling it costs ~2 s the
first time a mod is seen. Here the same elements are evaluated with torch
ops on ``[n, Q_BLOCK, KV_BLOCK]`` tiles of just those blocks.

What runs is the mod's own Triton snippet (``LoweredMod.snippet``, the lines
``flexgen.codegen.printer`` printed and the kernel pastes in), executed with a small
torch stand-in for ``triton.language``. Running the very statements the
kernel runs is what makes the two paths agree: the same cast points, the same
floor division and modulo helpers, the same wrapped, bounds-checked loads of
captured buffers. A snippet that uses anything the stand-in lacks is refused
(``Unsupported``) and the caller launches the kernel instead. Its operators
run through functions that fold, on the host, what is known there with the
kernel's result (b of a one-batch mask is 0, a load's bounds check passes for
every index in range, ``x * 1`` is ``x``): each op left is a launch on a GPU.
"""
from __future__ import annotations

import ast
import operator

import torch

from ..runtime.checks import may_cache
from .states import EMPTY, FULL, PARTIAL

# Undecided blocks are evaluated in chunks of at most this many mask elements,
# so temporaries stay bounded (2**24 bools are 16 MiB, an int64 index tile 128 MiB).
CHUNK_ELEMENTS = 2 ** 24

# Above this many undecided elements create_block_mask launches the generated
# kernel instead. Below it the torch ops cost at most a few milliseconds on a
# GPU, against ~2 s to compile the kernel for a new mod; the common masks
# (causal, sliding window, documents, prefix LM) stay far below it: at 32k
# tokens with 128 x 128 blocks they leave ~256-1000 blocks, 4M-16M elements.
# A mask with many undecided blocks (a random pattern in a captured tensor)
# is cheaper as one kernel launch than as large torch temporaries.
TORCH_MAX_ELEMENTS = 4 * CHUNK_ELEMENTS


class Unsupported(Exception):
    """The snippet needs something the torch stand-in for triton.language does not have."""


# --- the torch stand-in for the few triton.language names a printed mask uses ----

class _Pointer:
    """A captured buffer's address: ``ptr + offsets`` (in elements) is what a load reads."""

    def __init__(self, flat: torch.Tensor, offset=None):
        self.flat, self.offset = flat, offset       # None: the base address (no add op)

    def __add__(self, offset):
        return _Pointer(self.flat, offset if self.offset is None else _op_add(self.offset, offset))

    __radd__ = __add__


# --- values known on the host: folded instead of launched ---------------------------
#
# Each op of a snippet is a kernel launch on a GPU, and a mask built per training
# step pays for every one. Some values are known on the host, so the ops on them
# can be decided there, with the kernel's result: b (h) is 0 on every lane of a
# mask built for one batch (head), a bounds check of a load ``q_idx < size`` is
# true when Q_LEN <= size, and ``x * 1`` (a stride of 1) is ``x``. The snippet's
# operators and ``.to`` calls are rewritten into the ``_op_*`` functions below
# (``_check_and_compile``), which fold only what they can fold exactly and
# otherwise do what the plain operator does.

_INT_RANGE = {torch.int32: (-2 ** 31, 2 ** 31 - 1), torch.int64: (-2 ** 63, 2 ** 63 - 1)}


class _Const:
    """A Triton tensor of ``dtype`` (int32, int64 or bool) holding ``value`` on every lane.

    It promotes like the tensor it stands for; where an operation cannot be
    folded exactly it becomes a ``[1, 1, 1]`` torch tensor (one op) and the
    plain operation runs.
    """

    __slots__ = ("value", "dtype", "device", "_tensor")

    def __init__(self, value, dtype, device):
        self.value, self.dtype, self.device, self._tensor = value, dtype, device, None

    def __bool__(self):
        # Never tested for truth by accident: the caller reads .value (a snippet doing it is refused).
        raise TypeError("the truth value of a folded snippet value")

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = torch.full((1, 1, 1), self.value, dtype=self.dtype, device=self.device)
        return self._tensor


def _plain(x):
    return x.tensor() if type(x) is _Const else x


def _lifted(fn):
    """``fn`` with _Const arguments made tensors first."""
    def call(*args, **kwargs):
        return fn(*map(_plain, args), **{k: _plain(v) for k, v in kwargs.items()})
    call.__name__ = getattr(fn, "__name__", "lifted")
    return call


def _is_int(x) -> bool:
    """A Python int (a stride, a size, a literal), not a bool."""
    return type(x) is int


def _int_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() \
        and t.dtype is not torch.bool


def _int_const(x) -> bool:
    return type(x) is _Const and x.dtype in _INT_RANGE


def _fold_int(a, b, fn):
    """``fn`` of two int consts, or of an int const and a Python int: a _Const, or None.

    The result type is Triton's: int64 if either tensor is, else int32 (a
    literal is typed int32, so only one that fits folds next to an int32);
    None where the result would overflow it (the plain op then wraps).
    """
    consts = [x for x in (a, b) if type(x) is _Const]
    if not all(_int_const(x) or _is_int(x) for x in (a, b)):
        return None
    dtype = torch.int64 if any(x.dtype is torch.int64 for x in consts) else torch.int32
    lo, hi = _INT_RANGE[dtype]
    if any(_is_int(x) and not lo <= x <= hi for x in (a, b)):
        return None
    value = fn(a.value if type(a) is _Const else a, b.value if type(b) is _Const else b)
    return _Const(value, dtype, consts[0].device) if lo <= value <= hi else None


def _identity(t, c, neutral) -> bool:
    """Whether ``t op c`` is ``t`` itself: an integer tensor and the neutral int, of no wider type."""
    if not _int_tensor(t):
        return False
    if _is_int(c):
        return c == neutral
    # No wider: the same type, or an int32 constant next to an int64 tensor.
    return _int_const(c) and c.value == neutral and (c.dtype is t.dtype or t.dtype is torch.int64)


def _arith(a, b, fn, neutral, commutes):
    """``fn(a, b)``, folded where that is exact: two int constants (``_fold_int``), or an
    integer tensor and the neutral element (on either side where ``fn`` commutes)."""
    if type(a) is _Const or type(b) is _Const:
        folded = _fold_int(a, b, fn)
        if folded is not None:
            return folded
    if _identity(a, b, neutral):
        return a
    if commutes and _identity(b, a, neutral):
        return b
    return fn(_plain(a), _plain(b))


def _op_add(a, b):
    if type(a) is _Pointer or type(b) is _Pointer:
        return a + b if type(a) is _Pointer else b + a
    return _arith(a, b, operator.add, 0, True)


def _op_sub(a, b):
    return _arith(a, b, operator.sub, 0, False)


def _op_mul(a, b):
    return _arith(a, b, operator.mul, 1, True)


def _op_truediv(a, b):
    return _plain(a) / _plain(b)


def _bool_const(x) -> bool:
    return type(x) is _Const and x.dtype is torch.bool


def _bool_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype is torch.bool


def _op_and(a, b):
    for c, t in ((a, b), (b, a)):
        if _bool_const(c) and (_bool_const(t) or _bool_tensor(t)):
            return t if c.value else c          # True & x is x; False & x is False
    return _plain(a) & _plain(b)


def _op_or(a, b):
    for c, t in ((a, b), (b, a)):
        if _bool_const(c) and (_bool_const(t) or _bool_tensor(t)):
            return c if c.value else t          # True | x is True; False | x is x
    return _plain(a) | _plain(b)


def _op_xor(a, b):
    return _plain(a) ^ _plain(b)


def _op_neg(a):
    return -_plain(a)


def _op_pos(a):
    return +_plain(a)


def _op_inv(a):
    return ~_plain(a)


_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
            "eq": operator.eq, "ne": operator.ne}
# The comparison seen from its right operand: a < b is b > a.
_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _decide(name, lo, hi, c):
    """True / False when ``x <op> c`` is that for every integer x in [lo, hi], else None."""
    if name in ("eq", "ne"):
        if lo == hi:
            return (lo == c) == (name == "eq")
        return None if lo <= c <= hi else name == "ne"
    fn = _COMPARE[name]
    at_lo = fn(lo, c)
    return at_lo if at_lo == fn(hi, c) else None      # monotone in x


def _plain_value(x):
    return x.value if type(x) is _Const else x


def _ops(ranges: dict) -> dict:
    """The ``_op_*`` functions of one snippet run.

    ``ranges``: id(tensor) -> (tensor, lo, hi), the values an index tensor of
    the run can hold (q_idx, kv_idx, b, h, and their integer casts, added
    here); the tensor is held so that its id stays its own.
    """
    def known(x):
        r = ranges.get(id(x)) if isinstance(x, torch.Tensor) else None
        return r if r is not None and r[0] is x else None

    def comparison(name):
        fn = _COMPARE[name]

        def compare(a, b):
            if type(a) is _Const or type(b) is _Const:
                if (_int_const(a) or _is_int(a)) and (_int_const(b) or _is_int(b)):
                    device = (a if type(a) is _Const else b).device
                    return _Const(fn(_plain_value(a), _plain_value(b)), torch.bool, device)
            for x, c, op in ((a, b, name), (b, a, _MIRROR[name])):
                r = known(x)
                if r is not None and (_is_int(c) or _int_const(c)):
                    decided = _decide(op, r[1], r[2], _plain_value(c))
                    if decided is not None:
                        return _Const(decided, torch.bool, x.device)
            return fn(_plain(a), _plain(b))

        return compare

    def to(x, *args, **kwargs):
        if type(x) is _Const and not kwargs and len(args) == 1 and args[0] in _INT_RANGE \
                and x.dtype in (torch.int32, torch.int64, torch.bool):
            lo, hi = _INT_RANGE[args[0]]
            value = int(x.value)
            if lo <= value <= hi:
                return _Const(value, args[0], x.device)
        y = _plain(x).to(*args, **kwargs)
        r = known(x)
        if r is not None and y is not x and y.dtype in _INT_RANGE \
                and _INT_RANGE[y.dtype][0] <= r[1] and r[2] <= _INT_RANGE[y.dtype][1]:
            ranges[id(y)] = (y, r[1], r[2])
        return y

    return {**_PURE_OPS, "_op_to": to, **{f"_op_{name}": comparison(name) for name in _COMPARE}}


_PURE_OPS = {"_op_add": _op_add, "_op_sub": _op_sub, "_op_mul": _op_mul, "_op_truediv": _op_truediv,
             "_op_and": _op_and, "_op_or": _op_or, "_op_xor": _op_xor, "_op_neg": _op_neg,
             "_op_pos": _op_pos, "_op_inv": _op_inv}
_BINARY = {ast.Add: "_op_add", ast.Sub: "_op_sub", ast.Mult: "_op_mul", ast.Div: "_op_truediv",
           ast.BitAnd: "_op_and", ast.BitOr: "_op_or", ast.BitXor: "_op_xor"}
_UNARY = {ast.USub: "_op_neg", ast.UAdd: "_op_pos", ast.Invert: "_op_inv"}
_COMPARISONS = {ast.Lt: "_op_lt", ast.LtE: "_op_le", ast.Gt: "_op_gt", ast.GtE: "_op_ge",
                ast.Eq: "_op_eq", ast.NotEq: "_op_ne"}


class _Rewrite(ast.NodeTransformer):
    """Operators and ``x.to(...)`` of a checked snippet as calls of the ``_op_*`` functions."""

    @staticmethod
    def _call(name, args, keywords=()):
        return ast.Call(ast.Name(name, ast.Load()), list(args), list(keywords))

    def visit_BinOp(self, node):
        self.generic_visit(node)
        return self._call(_BINARY[type(node.op)], (node.left, node.right))

    def visit_UnaryOp(self, node):
        self.generic_visit(node)
        return self._call(_UNARY[type(node.op)], (node.operand,))

    def visit_Compare(self, node):
        self.generic_visit(node)
        return self._call(_COMPARISONS[type(node.ops[0])], (node.left, node.comparators[0]))

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "to" and not (
                isinstance(f.value, ast.Name) and f.value.id == "tl"):
            return self._call("_op_to", (f.value, *node.args), node.keywords)
        return node


def _pointer(t: torch.Tensor) -> _Pointer:
    # A 1-D view of the elements the tensor spans, so that offsets computed
    # from its strides (as the kernel computes them) index it directly.
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 1
    flat = t.as_strided((span,), (1,)) if t.numel() else t.new_zeros(1)
    return _Pointer(flat)


def _floordiv(a, b):
    # The kernel's _floordiv rounds toward -inf whatever its backend's // does: so does torch's.
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return a // b
    return torch.div(a, b, rounding_mode="floor")


def _floormod(a, b):
    return a - _floordiv(a, b) * b


def _floormod_float(a, b):
    return a - torch.floor(a / b) * b


def _tanh(x):
    # The kernel's formula, not torch.tanh: the same rounding on both paths.
    t = torch.exp(-2.0 * torch.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return torch.where(x < 0, -y, y)


class _Lang:
    """``tl`` for a snippet run on torch tensors of ``device``.

    Triton types a Python int literal as int32 and a float literal as
    float32; torch keeps a scalar "weak" next to a tensor, which gives the
    same result types, so literals stay Python numbers except where every
    operand is one (``tl.where(c, 1, 0)`` is int32 in Triton, int64 in torch).
    """

    float32, float64, int32, int64 = torch.float32, torch.float64, torch.int32, torch.int64
    # (a folded constant made a tensor first)
    exp, exp2, log, sqrt, rsqrt, log2, sin, cos, sigmoid, abs, floor, ceil, erf = (
        staticmethod(_lifted(f)) for f in (torch.exp, torch.exp2, torch.log, torch.sqrt, torch.rsqrt,
                                           torch.log2, torch.sin, torch.cos, torch.sigmoid, torch.abs,
                                           torch.floor, torch.ceil, torch.erf))

    def __init__(self, device):
        self.device = device

    def _tensor(self, x):
        if type(x) is _Const:
            return x.tensor()
        if isinstance(x, torch.Tensor):
            return x
        dtype = torch.bool if isinstance(x, bool) else torch.int32 if isinstance(x, int) else torch.float32
        return torch.full((), x, dtype=dtype, device=self.device)

    def full(self, shape, value, dtype):
        return torch.full(tuple(shape), _plain(value), dtype=dtype, device=self.device)

    def where(self, cond, a, b):
        cond, a, b = self._tensor(cond), _plain(a), _plain(b)
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            a, b = self._tensor(a), self._tensor(b)
        return torch.where(cond, a, b)

    def minimum(self, a, b):
        return torch.minimum(*self._pair(a, b))

    def maximum(self, a, b):
        return torch.maximum(*self._pair(a, b))

    def _pair(self, a, b):
        # torch.minimum takes tensors only; a 0-d tensor next to a sized one is
        # weak like a scalar, so the result type is still Triton's.
        return self._tensor(a), self._tensor(b)

    def load(self, pointer, mask=None, other=0):
        if type(mask) is _Const and mask.dtype is torch.bool and mask.value:
            mask = None             # in bounds on every lane (folded from the index ranges)
        offset, mask, other = _plain(pointer.offset), _plain(mask), _plain(other)
        if mask is None:
            return pointer.flat[0 if offset is None else offset]
        offset, mask = torch.broadcast_tensors(offset, mask)
        # Out-of-bounds lanes read element 0, then ``other``, as a masked load does.
        return torch.where(mask, pointer.flat[torch.where(mask, offset, 0)], other)


# The names a snippet may use besides its own temporaries and buffer arguments.
_TL_NAMES = frozenset(n for n in dir(_Lang) if not n.startswith("_"))
_HELPERS = {"_floordiv": _lifted(_floordiv), "_floormod": _lifted(_floormod),
            "_floormod_float": _lifted(_floormod_float), "_tanh": _lifted(_tanh), "float": _lifted(float)}
_INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
# Python syntax whose meaning is the same on torch tensors as on Triton tensors.
# Not //, % or ** (the printer emits helpers for those) nor `and` / `or`. A conditional
# expression only picks a loaded element's type from its dtype (printer._loaded).
_SYNTAX = (ast.Module, ast.Assign, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Call, ast.IfExp,
           ast.keyword, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Constant, ast.List,
           ast.Add, ast.Sub, ast.Mult, ast.Div, ast.BitAnd, ast.BitOr, ast.BitXor,
           ast.Invert, ast.USub, ast.UAdd, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE)

_COMPILED: dict = {}


def _compile(snippet, buffer_sigs):
    """The snippet as a code object assigning ``_keep``, or raise Unsupported (memoized)."""
    key = (snippet, buffer_sigs)
    hit = _COMPILED.get(key)
    if hit is None:
        try:
            hit = _check_and_compile(snippet, buffer_sigs)
        except Unsupported as exc:
            hit = exc
        _COMPILED[key] = hit
    if isinstance(hit, Unsupported):
        raise hit
    return hit


def _check_and_compile(snippet, buffer_sigs):
    if snippet.kind != "bool":
        raise Unsupported(f"a mask snippet of kind {snippet.kind}")
    source = "\n".join((*snippet.lines, f"_keep = {snippet.result}"))
    tree = ast.parse(source)
    known = {"tl", *_HELPERS, *_INDEX_NAMES}
    for sig in buffer_sigs:
        known.add(f"{sig.name}_ptr")
        known.update(f"{sig.name}_{what}{d}" for d in range(sig.ndim) for what in ("size", "stride"))
    # Statements run in order, so a name is known once an earlier line assigned it.
    for statement in tree.body:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Name)):
            raise Unsupported(f"the statement {ast.unparse(statement)}")
        for node in ast.walk(statement.value):
            if not isinstance(node, _SYNTAX):
                raise Unsupported(f"Python syntax {type(node).__name__}")
            if isinstance(node, ast.Name) and node.id not in known:
                raise Unsupported(f"the name {node.id}")
            if isinstance(node, ast.Attribute):
                is_tl = isinstance(node.value, ast.Name) and node.value.id == "tl"
                if (node.attr not in _TL_NAMES) if is_tl else node.attr not in ("to", "dtype"):
                    raise Unsupported(f"the attribute .{node.attr}")
            if isinstance(node, ast.Compare) and len(node.ops) > 1:
                raise Unsupported("a chained comparison")
        known.add(statement.targets[0].id)
    tree = ast.fix_missing_locations(_Rewrite().visit(tree))
    return compile(tree, "<flexgen mask snippet>", "exec")


def supports(lowered) -> bool:
    """Whether ``classify_blocks`` can evaluate this lowered mask_mod."""
    try:
        _compile(lowered.snippet, lowered.buffers)
    except Unsupported:
        return False
    return True


# (device, block) -> int32 arange(block): the in-block offsets, made once per device
_OFFSETS: dict = {}


def _offsets(block: int, device) -> torch.Tensor:
    key = (device, block)
    t = _OFFSETS.get(key)
    if t is None:
        t = torch.arange(block, dtype=torch.int32, device=device)
        if may_cache(device):
            _OFFSETS[key] = t
    return t


def classify_blocks(lowered, buffers, blocks: torch.Tensor, Q_LEN: int, KV_LEN: int,
                    Q_BLOCK: int, KV_BLOCK: int, hits: bool = False, B=None, H=None) -> torch.Tensor:
    """int8 ``[N]``: EMPTY, PARTIAL or FULL for each block of ``blocks``.

    ``blocks`` is ``[N, 4]`` (b, h, q block, kv block), any integer dtype;
    ``buffers`` are the mod's captured tensors in slot order. Work is chunked
    so that no chunk holds more than CHUNK_ELEMENTS positions. Raises
    ``Unsupported`` when the snippet cannot run on torch (the caller then
    launches the block-mask kernel). With ``hits``: int32 ``[2, N]`` instead,
    whether each block is partial (``[0]``) and whether it is full (``[1]``),
    what ``create_block_mask`` writes into its block lists. ``B`` / ``H``, the
    mask's batch and heads where known, are only used to tell when b or h is
    0 on every block.
    """
    code = _compile(lowered.snippet, lowered.buffers)
    device = blocks.device
    scope = {"tl": _Lang(device), **_HELPERS}
    for sig, t in zip(lowered.buffers, buffers):
        scope[f"{sig.name}_ptr"] = _pointer(t)
        for d in range(t.dim()):
            scope[f"{sig.name}_size{d}"], scope[f"{sig.name}_stride{d}"] = t.shape[d], t.stride(d)
    # Positions past Q_LEN / KV_LEN are clamped onto the last valid one: a
    # repeated position changes neither "none kept" nor "all kept", so a
    # ragged block is classified on its valid positions only, as the kernel
    # does with its `valid` mask, and the mod never sees an index past the end.
    # (No clamp where the length is a whole number of blocks.)
    q_offsets, kv_offsets = _offsets(Q_BLOCK, device), _offsets(KV_BLOCK, device)
    q_ragged, kv_ragged = Q_LEN % Q_BLOCK != 0, KV_LEN % KV_BLOCK != 0
    names = code.co_names
    n_all = blocks.shape[0]
    # Per block, the largest and the smallest kept byte: any kept, all kept.
    extremes = torch.empty(2, n_all, dtype=torch.int8, device=device)
    any_kept, all_kept = extremes.unbind(0)
    per_chunk = max(1, CHUNK_ELEMENTS // (Q_BLOCK * KV_BLOCK))
    for start in range(0, n_all, per_chunk):
        chunk = blocks if n_all <= per_chunk else blocks[start:start + per_chunk]
        n = chunk.shape[0]
        # int32 positions, as in the kernel, straight from the int64 block coordinates,
        # in the kernel's shapes with a leading block dim: q_idx a column, kv_idx a row.
        pos = torch.empty(n, Q_BLOCK + KV_BLOCK, dtype=torch.int32, device=device)
        q_idx = pos.as_strided((n, Q_BLOCK, 1), (Q_BLOCK + KV_BLOCK, 1, 1))
        kv_idx = pos.as_strided((n, 1, KV_BLOCK), (Q_BLOCK + KV_BLOCK, KV_BLOCK, 1), Q_BLOCK)
        if Q_BLOCK == KV_BLOCK:        # both in one op
            torch.add(q_offsets, chunk[:, 2:4, None], alpha=Q_BLOCK, out=pos.view(n, 2, Q_BLOCK))
        else:
            torch.add(q_offsets, chunk[:, 2:3], alpha=Q_BLOCK, out=q_idx.view(n, Q_BLOCK))
            torch.add(kv_offsets, chunk[:, 3:4], alpha=KV_BLOCK, out=kv_idx.view(n, KV_BLOCK))
        if q_ragged:
            q_idx.clamp_(max=Q_LEN - 1)
        if kv_ragged:
            kv_idx.clamp_(max=KV_LEN - 1)
        scope["q_idx"], scope["kv_idx"] = q_idx, kv_idx
        ranges = {id(q_idx): (q_idx, 0, Q_LEN - 1), id(kv_idx): (kv_idx, 0, KV_LEN - 1)}
        scope.update(_ops(ranges))
        # b (h) of a mask built for one batch (head) is 0 on every block: a constant.
        if ("b" in names and B != 1) or ("h" in names and H != 1):
            bh = chunk[:, :2].to(torch.int32)
        for d, name, size in ((0, "b", B), (1, "h", H)):
            if name not in names:
                continue
            if size == 1:
                scope[name] = _Const(0, torch.int32, device)
            else:
                scope[name] = bh[:, d].view(n, 1, 1)
                if size is not None:
                    ranges[id(scope[name])] = (scope[name], 0, size - 1)
        try:
            exec(code, scope)
        except (RuntimeError, TypeError, AttributeError, ArithmeticError) as exc:
            # e.g. an integer division by zero, which torch refuses on the CPU.
            raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
        keep = scope["_keep"]
        if type(keep) is _Const:                    # a bool folds to a constant mask, else refused below
            keep = bool(keep.value) if keep.dtype is torch.bool else keep.tensor()
        if not isinstance(keep, torch.Tensor):       # a constant mask
            keep = torch.full((1, 1, 1), bool(keep), device=device)
        if keep.dtype != torch.bool:
            raise Unsupported(f"a mask of dtype {keep.dtype}")
        # Bytes reduced over each block's tile as it is (broadcast, no copy, for a
        # mask constant along q_idx or kv_idx): none kept, or all kept.
        # (amin and amax, not aminmax: the latter is ~100x slower on CPU bytes.)
        keep = keep.view(torch.int8)
        if keep.dim() != 3 or keep.shape[0] != n:
            keep = keep.expand(n, Q_BLOCK, KV_BLOCK)
        if n != n_all:
            torch.amax(keep, (1, 2), out=any_kept[start:start + n])
            torch.amin(keep, (1, 2), out=all_kept[start:start + n])
        else:
            torch.amax(keep, (1, 2), out=any_kept)
            torch.amin(keep, (1, 2), out=all_kept)
    if not hits:
        return torch.add(any_kept, all_kept)        # EMPTY 0, PARTIAL 1, FULL 2
    out = torch.empty(2, n_all, dtype=torch.int32, device=device)
    partial, full = out.unbind(0)
    torch.sub(any_kept, all_kept, out=partial)      # some kept, not all
    full.copy_(all_kept)
    return out


assert (EMPTY, PARTIAL, FULL) == (0, 1, 2), "classify_blocks adds min and max"
