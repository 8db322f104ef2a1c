"""Classify undecided mask blocks with torch ops, without compiling a kernel.

``create_block_mask`` decides most blocks from interval bounds
(``flexgen.bounds``); the few it leaves undecided (the diagonal of a causal
mask, the edges of a window or of documents) need their elements looked at.
The generated block-mask kernel does that, but compiling it costs ~2 s the
first time a mod is seen. Here the same elements are evaluated with torch
ops on ``[n, Q_BLOCK, KV_BLOCK]`` tiles of just those blocks.

What runs is the mod's own Triton snippet (``LoweredMod.snippet``, the lines
``flexgen.codegen`` printed and the kernel pastes in), executed with a small
torch stand-in for ``triton.language``. Running the very statements the
kernel runs is what makes the two paths agree: the same cast points, the same
floor division and modulo helpers, the same wrapped, bounds-checked loads of
captured buffers. A snippet that uses anything the stand-in lacks is refused
(``Unsupported``) and the caller launches the kernel instead.
"""
from __future__ import annotations

import ast

import torch

from . import bounds

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
        return _Pointer(self.flat, offset if self.offset is None else self.offset + offset)

    __radd__ = __add__


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

    float32, int32, int64 = torch.float32, torch.int32, torch.int64
    exp, exp2, log, sqrt, rsqrt = torch.exp, torch.exp2, torch.log, torch.sqrt, torch.rsqrt
    log2, sin, cos, sigmoid = torch.log2, torch.sin, torch.cos, torch.sigmoid
    abs, floor, ceil = torch.abs, torch.floor, torch.ceil

    def __init__(self, device):
        self.device = device

    def _tensor(self, x):
        if isinstance(x, torch.Tensor):
            return x
        dtype = torch.bool if isinstance(x, bool) else torch.int32 if isinstance(x, int) else torch.float32
        return torch.full((), x, dtype=dtype, device=self.device)

    def full(self, shape, value, dtype):
        return torch.full(tuple(shape), value, dtype=dtype, device=self.device)

    def where(self, cond, a, b):
        cond = self._tensor(cond)
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
        if mask is None:
            return pointer.flat[0 if pointer.offset is None else pointer.offset]
        offset, mask = torch.broadcast_tensors(pointer.offset, mask)
        # Out-of-bounds lanes read element 0, then ``other``, as a masked load does.
        return torch.where(mask, pointer.flat[torch.where(mask, offset, 0)], other)


# The names a snippet may use besides its own temporaries and buffer arguments.
_TL_NAMES = frozenset(n for n in dir(_Lang) if not n.startswith("_"))
_HELPERS = {"_floordiv": _floordiv, "_floormod": _floormod, "_floormod_float": _floormod_float,
            "_tanh": _tanh, "float": float}
_INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
# Python syntax whose meaning is the same on torch tensors as on Triton tensors.
# Not //, % or ** (the printer emits helpers for those) nor `and` / `or` / `if`.
_SYNTAX = (ast.Module, ast.Assign, ast.Name, ast.Load, ast.Store, ast.Attribute, ast.Call,
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
                if (node.attr not in _TL_NAMES) if is_tl else node.attr != "to":
                    raise Unsupported(f"the attribute .{node.attr}")
            if isinstance(node, ast.Compare) and len(node.ops) > 1:
                raise Unsupported("a chained comparison")
        known.add(statement.targets[0].id)
    return compile(tree, "<flexgen mask snippet>", "exec")


def supports(lowered) -> bool:
    """Whether ``classify_blocks`` can evaluate this lowered mask_mod."""
    try:
        _compile(lowered.snippet, lowered.buffers)
    except Unsupported:
        return False
    return True


def classify_blocks(lowered, buffers, blocks: torch.Tensor, Q_LEN: int, KV_LEN: int,
                    Q_BLOCK: int, KV_BLOCK: int) -> torch.Tensor:
    """int8 ``[N]``: EMPTY, PARTIAL or FULL for each block of ``blocks``.

    ``blocks`` is ``[N, 4]`` (b, h, q block, kv block), any integer dtype;
    ``buffers`` are the mod's captured tensors in slot order. Work is chunked
    so that no chunk holds more than CHUNK_ELEMENTS positions. Raises
    ``Unsupported`` when the snippet cannot run on torch (the caller then
    launches the block-mask kernel).
    """
    code = _compile(lowered.snippet, lowered.buffers)
    device = blocks.device
    scope = {"tl": _Lang(device), **_HELPERS}
    for sig, t in zip(lowered.buffers, buffers):
        scope[f"{sig.name}_ptr"] = _pointer(t)
        for d in range(t.dim()):
            scope[f"{sig.name}_size{d}"], scope[f"{sig.name}_stride{d}"] = t.shape[d], t.stride(d)
    coords = blocks.to(torch.int32)
    # Positions past Q_LEN / KV_LEN are clamped onto the last valid one: a
    # repeated position changes neither "none kept" nor "all kept", so a
    # ragged block is classified on its valid positions only, as the kernel
    # does with its `valid` mask, and the mod never sees an index past the end.
    q_offsets = torch.arange(Q_BLOCK, dtype=torch.int32, device=device)
    kv_offsets = torch.arange(KV_BLOCK, dtype=torch.int32, device=device)
    per_chunk = max(1, CHUNK_ELEMENTS // (Q_BLOCK * KV_BLOCK))
    states = []
    for chunk in coords.split(per_chunk):
        n = chunk.shape[0]
        q_idx = torch.add(q_offsets, chunk[:, 2:3], alpha=Q_BLOCK).clamp_(max=Q_LEN - 1)
        kv_idx = torch.add(kv_offsets, chunk[:, 3:4], alpha=KV_BLOCK).clamp_(max=KV_LEN - 1)
        # The kernel's shapes with a leading block dim: q_idx a column, kv_idx a row.
        scope["q_idx"], scope["kv_idx"] = q_idx.view(n, Q_BLOCK, 1), kv_idx.view(n, 1, KV_BLOCK)
        scope["b"], scope["h"] = chunk[:, 0].view(n, 1, 1), chunk[:, 1].view(n, 1, 1)
        try:
            exec(code, scope)
        except (RuntimeError, TypeError, AttributeError, ArithmeticError) as exc:
            # e.g. an integer division by zero, which torch refuses on the CPU.
            raise Unsupported(f"{type(exc).__name__}: {exc}") from exc
        keep = scope["_keep"]
        if not isinstance(keep, torch.Tensor):       # a constant mask
            keep = torch.full((1, 1, 1), bool(keep), device=device)
        if keep.dtype != torch.bool:
            raise Unsupported(f"a mask of dtype {keep.dtype}")
        # One flat row of bytes per block (a copy only for a mask constant along
        # q_idx or kv_idx): empty when nothing is kept, full when everything is,
        # so min + max is EMPTY, PARTIAL or FULL. (amin and amax, not aminmax:
        # the latter is ~100x slower on CPU bytes.)
        keep = keep.expand(n, Q_BLOCK, KV_BLOCK).reshape(n, Q_BLOCK * KV_BLOCK).view(torch.int8)
        states.append(keep.amin(1) + keep.amax(1))
    return states[0] if len(states) == 1 else torch.cat(states)


assert (bounds.EMPTY, bounds.PARTIAL, bounds.FULL) == (0, 1, 2), "classify_blocks adds min and max"
