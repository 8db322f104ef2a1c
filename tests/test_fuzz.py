"""Random score_mod / mask_mod expression trees against the float64 oracle (hypothesis).

Each example draws a shape (batch, GQA heads, odd and block-multiple lengths, head
dims, dtype), a few captured tensors, and random expression trees: a score_mod
(arithmetic with float and integer constants, negation, comparisons,
``torch.where``, exp / log / tanh / sigmoid / sin / cos / abs / clamp / minimum /
maximum / ``**``, ``//`` and ``%`` on positions, loads of captured tensors at
clamped or wrapped indices, values constant along any axis) and a mask_mod
(comparisons of index arithmetic and integer loads, ``& | ~``). The mods are
closures over the tree (``Expr``), evaluated by ``evaluate`` with torch
functions, so the very same code runs under flexgen's tracer and in the oracle;
an ``Expr``'s repr is the mod as Python source, which is what hypothesis prints
for a failing example.

``test_fuzz_forward`` runs ``flex_attention`` (short queries take the decode
kernel, as they do for a user) or ``decode_attention`` with an element-wise
mask_mod, and compares output and LSE with ``flex_attention_reference`` in
float64 (``conftest.check``). ``test_fuzz_backward`` compares the gradients of q,
k, v and of captured tensors that require grad with torch autograd through the
oracle; a mod with floor / ceil / sign on the score's (or a learned tensor's)
path may raise ``flexgen.GradientError`` and nothing else. Every kernel an
example launches is compiled for sm_90 inside the example (unless
``FLEXGEN_TEST_AOT=0``), so a compile error is shrunk like any other failure.

Numerically sane by construction, so that a mismatch is a bug and not float
noise: q and k hold multiples of 1/4 in [-1, 1] and the scale is 1/2 or 1/4,
so every score is exact in float32 as in float64; float constants that a score
is compared with, clamped to or floored at are never on that grid (no ties);
exp sees a bounded argument, log and division see ``abs(x) + 1``, and products
are kept below ~50 in magnitude (``Expr.bound``). For gradients, kinks (abs,
minimum, maximum, clamp) take only operands that float32 and float64 compute
alike: elsewhere rounding could pick the other side of a kink in each
precision, and the gradient with it (``_Gen``).

Budget: ``CI_EXAMPLES`` examples per test (a fixed seed, so the same examples
every run), after replaying the failures stored in ``tests/fuzz_db/``
(hypothesis' example database, kept in the repository and read-only here).
For a longer run::

    FLEXGEN_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/test_fuzz.py \\
        --hypothesis-show-statistics

which also writes new failures into ``tests/fuzz_db/`` (commit them with the fix) and deletes
none of the stored ones.
``FLEXGEN_FUZZ_SEED`` picks another fixed seed (default 0). ``FLEXGEN_FUZZ_DEVICE=cuda`` runs
the same examples on a GPU (the stored ones first; the database stays read-only there), e.g.
under ``compute-sanitizer`` (``benchmarks/run_all.sh``, step sanitize). With
``FLEXGEN_FUZZ_BACKEND=gluon`` as well, the mods go through the Gluon kernels on an sm_90 GPU
(``GLUON``; step gluonfuzz there).
"""
from __future__ import annotations

import contextlib
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen import decode_attention
from flexgen.reference import flex_attention_reference
from flexgen.runtime import aot
from conftest import AOT_ENABLED, check, compile_error

# Examples per test in CI: the whole file stays near a minute with the sm_90 compiles
# (every example is a new mod, so new kernels: ~1 s of compiling each).
CI_EXAMPLES = {"forward": 20, "backward": 9}
LONG_EXAMPLES = int(os.environ.get("FLEXGEN_FUZZ_EXAMPLES", "0"))
FUZZ_SEED = int(os.environ.get("FLEXGEN_FUZZ_SEED", "0"))
DEVICE = torch.device(os.environ.get("FLEXGEN_FUZZ_DEVICE", "cpu"))
# FLEXGEN_FUZZ_BACKEND=gluon (with FLEXGEN_FUZZ_DEVICE=cuda, on an sm_90 GPU): the same mods
# through the Gluon kernels, which the interpreter cannot run: kernel_options BACKEND "gluon",
# shapes they take (half precision, equal head dims 64 / 128, 128-position blocks, lengths up
# to three tiles), and per backward example the fused kernel or the dQ and dK/dV pair. (No
# learned tensors: they come with float32 inputs only, below.)
GLUON = os.environ.get("FLEXGEN_FUZZ_BACKEND", "") == "gluon"
if os.environ.get("FLEXGEN_FUZZ_BACKEND", "") not in ("", "gluon"):
    raise pytest.UsageError(f"FLEXGEN_FUZZ_BACKEND: expected 'gluon' or unset, got "
                            f"{os.environ['FLEXGEN_FUZZ_BACKEND']!r}")
if GLUON and DEVICE.type != "cuda":
    raise pytest.UsageError("FLEXGEN_FUZZ_BACKEND=gluon runs the Gluon kernels, which need an sm_90 GPU: "
                            "set FLEXGEN_FUZZ_DEVICE=cuda too")


class _KeepingDatabase(DirectoryBasedExampleDatabase):
    """hypothesis' example database, but one that only grows: hypothesis deletes a stored
    example once it passes, and these are the suite's regression seeds (CI replays them), so a
    long run that found nothing new left the repository with examples missing."""

    def delete(self, key: bytes, value: bytes) -> None:
        pass

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.save(dest, value)


_DB = _KeepingDatabase(str(Path(__file__).parent / "fuzz_db"))


def test_a_long_run_keeps_the_stored_examples(tmp_path):
    """A passing stored example stays (hypothesis would delete it); new ones are still saved."""
    db = _KeepingDatabase(str(tmp_path))
    db.save(b"test", b"example")
    db.delete(b"test", b"example")
    db.move(b"test", b"other", b"example")
    assert list(db.fetch(b"test")) == [b"example"] and list(db.fetch(b"other")) == [b"example"]


def _settings(test: str):
    """Fixed seed, the stored failures first; a long run (FLEXGEN_FUZZ_EXAMPLES) on the CPU saves new ones."""
    writable = LONG_EXAMPLES and DEVICE.type == "cpu"
    return settings(max_examples=LONG_EXAMPLES or CI_EXAMPLES[test], deadline=None,
                    database=_DB if writable else ReadOnlyDatabase(_DB),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


# --- expression trees -------------------------------------------------------------------

@dataclass(frozen=True)
class Buf:
    """A captured tensor: ``kind`` "float" (randn), "int" (ids in [low, high]), "bool", "scalar" (0-d),
    "inf" (an additive mask: 0, or -inf at about one entry in four) or "nan" (randn with NaN at
    about one entry in four, read only through comparisons with itself)."""
    name: str
    kind: str
    shape: tuple
    dtype: torch.dtype = torch.float32
    low: int = 0
    high: int = 0

    def __repr__(self):
        if self.kind == "int":
            return (f"{self.name} = torch.randint({self.low}, {self.high + 1}, {list(self.shape)}, "
                    f"dtype={self.dtype})")
        if self.kind == "bool":
            return f"{self.name} = torch.rand({list(self.shape)}) < 0.5"
        if self.kind == "inf":
            return f"{self.name} = torch.where(torch.rand({list(self.shape)}) < 0.25, float('-inf'), 0.0)"
        if self.kind == "nan":
            return (f"{self.name} = torch.where(torch.rand({list(self.shape)}) < 0.25, float('nan'), "
                    f"torch.randn({list(self.shape)}))")
        return f"{self.name} = torch.randn({list(self.shape)}, dtype={self.dtype})"


@dataclass(frozen=True)
class Expr:
    """One node of a mod: ``op`` over ``args`` (child Exprs or Python values).

    ``bound`` bounds |value| (softly for the score), so that generation keeps
    values sane; ``score`` / ``learnable``: depends on the score / on a float
    captured tensor; ``step``: a floor, ceil or sign of something that does, or
    any integer value computed from it (``torch.where(score <= c, ids[a], ids[b])``):
    piecewise constant, so the gradient may legitimately be refused.
    """
    op: str
    args: tuple = ()
    kind: str = "float"
    bound: float = 0.0
    score: bool = False
    learnable: bool = False
    step: bool = False

    def __repr__(self):
        return show(self)

    def _repr_pretty_(self, printer, cycle):      # what hypothesis prints for a failing example
        printer.text(repr(self))


BINARY = {"add": ("+", operator.add), "sub": ("-", operator.sub), "mul": ("*", operator.mul),
          "truediv": ("/", operator.truediv), "floordiv": ("//", operator.floordiv),
          "mod": ("%", operator.mod), "pow": ("**", operator.pow),
          "and": ("&", operator.and_), "or": ("|", operator.or_),
          "eq": ("==", operator.eq), "ne": ("!=", operator.ne), "lt": ("<", operator.lt),
          "le": ("<=", operator.le), "gt": (">", operator.gt), "ge": (">=", operator.ge)}
FUNCS = ("exp", "log", "tanh", "sigmoid", "sin", "cos", "abs", "floor", "ceil", "sign",
         "minimum", "maximum")


def show(e) -> str:
    """The node as Python source (what the mod computes)."""
    if not isinstance(e, Expr):
        return f"float('{e}')" if isinstance(e, float) and not math.isfinite(e) else repr(e)
    a = e.args
    if e.op == "var":
        return a[0]
    if e.op == "load":
        return f"{a[0].name}[{', '.join(show(i) for i in a[1:])}]"
    if e.op == "scalar":
        return a[0].name
    if e.op in BINARY:
        return f"({show(a[0])} {BINARY[e.op][0]} {show(a[1])})"
    if e.op in FUNCS:
        return f"torch.{e.op}({', '.join(show(x) for x in a)})"
    if e.op == "neg":
        return f"-{show(a[0])}"
    if e.op == "not":
        return f"~{show(a[0])}"
    if e.op == "float":
        return f"{show(a[0])}.float()"
    if e.op == "where":
        return f"torch.where({show(a[0])}, {show(a[1])}, {show(a[2])})"
    if e.op == "clamp":
        return f"torch.clamp({show(a[0])}, {a[1]!r}, {a[2]!r})"
    raise AssertionError(e.op)


def evaluate(e, env: dict):
    """The value of ``e`` with ``env`` (score, b, h, q_idx, kv_idx and each Buf's tensor)."""
    if not isinstance(e, Expr):
        return e
    op, a = e.op, e.args
    if op == "var":
        return env[a[0]]
    if op == "load":
        index = tuple(evaluate(i, env) for i in a[1:])
        return env[a[0].name][index if len(index) > 1 else index[0]]
    if op == "scalar":
        return env[a[0].name]
    args = [evaluate(x, env) for x in a]
    if op in BINARY:
        return BINARY[op][1](*args)
    if op in FUNCS:
        return getattr(torch, op)(*args)
    if op == "neg":
        return -args[0]
    if op == "not":
        return ~args[0]
    if op == "float":
        return args[0].float()
    if op == "where":
        return torch.where(*args)
    if op == "clamp":
        return torch.clamp(*args)
    raise AssertionError(op)


def make_mod(tree, buffers: dict, kind: str):
    """A score_mod or mask_mod computing ``tree`` (a closure over it and the captured tensors)."""
    if tree is None:
        return None
    if kind == "score":
        def fuzz_score_mod(score, b, h, q_idx, kv_idx):
            return evaluate(tree, dict(buffers, score=score, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))
        return fuzz_score_mod

    def fuzz_mask_mod(b, h, q_idx, kv_idx):
        return evaluate(tree, dict(buffers, b=b, h=h, q_idx=q_idx, kv_idx=kv_idx))
    return fuzz_mask_mod


def node(op, *args, kind="float", bound=None):
    """An Expr whose flags follow from its children's (bound: the children's largest by default)."""
    children = [x for x in args if isinstance(x, Expr)]
    if bound is None:
        numbers = [abs(x) for x in args if isinstance(x, (int, float)) and not isinstance(x, bool)]
        bound = max([x.bound for x in children] + numbers)
    score = any(x.score for x in children)
    learnable = any(x.learnable for x in children)
    step = any(x.step for x in children) or ((op in ("floor", "ceil", "sign") or kind == "int")
                                             and (score or learnable))
    return Expr(op, args, kind, float(bound), score, learnable, step)


MAX_FLOAT, MAX_INT = 50.0, 2.0 ** 15
SCORE_BOUND = 4.0                      # |score| stays below this but in the rarest rows
INT_CONSTS = (-3, -1, 0, 1, 2, 3, 5, 7)
# Float constants off the score grid (multiples of 1/64): a score never ties with them.
FLOAT_CONSTS = (0.3, -0.7, 1.3, -1.9, 0.45, 2.1, -0.15, 3.3)
# Divisors of a float %: no multiple of them within the scores' range lies on or near the grid
# (0.45 would: 5 * 0.45 = 2.25 is a score, and float32 and float64 floor 2.25 / 0.45 apart).
FMOD_DIVISORS = (0.4373, 1.3129, 2.0917)
POSITIONS = {"q_idx": 127, "kv_idx": 127, "b": 1, "h": 5}


class _Gen:
    """Draws typed trees for one example (what they may read: the score, the buffers).

    ``smooth`` (for gradients): kinks (abs, minimum, maximum, clamp) only take operands
    that the kernel and the oracle compute alike (``_exact``), and log, division and
    exp use smooth guards instead of abs and clamp. A kink of a value computed with
    rounding (tanh(2 * score + 5) ** 2 against (score % 1.3) ** 2: float32's tanh is
    exactly 1 where float64's is not) can pick the other side in each, and the
    gradient with it: the oracle would differ, and no kernel be wrong.
    """

    def __init__(self, draw, buffers, with_score: bool, smooth: bool = False):
        self.draw, self.buffers, self.with_score, self.smooth = draw, buffers, with_score, smooth

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def of(self, kind):
        return [b for b in self.buffers if b.kind == kind]

    # --- integers (positions) -----------------------------------------------------------
    def int(self, depth):
        d = self.draw
        if depth <= 0 or d(st.integers(0, 3)) == 0:
            loads = self.of("int")
            choice = self.pick(["q_idx", "q_idx", "kv_idx", "kv_idx", "b", "h"]
                               + ["load"] * (2 if loads else 0))
            if choice == "load":
                return self.load(self.pick(loads), depth - 1)
            return node("var", choice, kind="int", bound=POSITIONS[choice])
        op = self.pick(["add", "sub", "mul", "neg", "abs", "floordiv", "mod", "minimum", "maximum",
                        "where", "clamp", "cancel"])
        x = self.int(depth - 1)
        if op in ("add", "sub"):
            y = self.int(depth - 1) if d(st.booleans()) else self.pick(INT_CONSTS)
            return node(op, x, y, kind="int", bound=x.bound + _bound(y))
        if op == "mul":
            y = self.int(depth - 1) if d(st.booleans()) else self.pick(INT_CONSTS)
            if x.bound * _bound(y) > MAX_INT:
                y = self.pick((-1, 2, 3))
            return node("mul", x, y, kind="int", bound=x.bound * _bound(y))
        if op in ("neg", "abs"):
            return node(op, x, kind="int")
        if op in ("floordiv", "mod"):
            if d(st.booleans()):
                c = self.pick((2, 3, 7, -3) if op == "floordiv" else (2, 3, 5, 7))
                return node(op, x, c, kind="int", bound=x.bound if op == "floordiv" else abs(c))
            y = self.int(depth - 1)
            div = node("add", node("abs", y, kind="int"), 1, kind="int", bound=y.bound + 1)
            return node(op, x, div, kind="int", bound=x.bound if op == "floordiv" else div.bound)
        if op in ("minimum", "maximum"):
            return node(op, x, self.int(depth - 1), kind="int")
        if op == "where":
            return node("where", self.bool(depth - 1), x, self.int(depth - 1), kind="int")
        if op == "clamp":
            lo = self.pick(INT_CONSTS)
            hi = lo + d(st.integers(0, 40))
            return node("clamp", x, lo, hi, kind="int", bound=max(abs(lo), abs(hi)))
        return node("sub", x, x, kind="int", bound=0)        # cancel: x - x, a constant

    def index(self, size, depth):
        """A position in [-size, size) (torch wraps the negative ones) from an int tree."""
        how = self.pick(["mod", "clamp", "clamp_negative", "const"])
        if how == "const":
            return self.draw(st.integers(-size, size - 1))
        x = self.int(depth)
        if how == "mod":
            return node("mod", x, size, kind="int", bound=size)
        lo = 0 if how == "clamp" else -size
        return node("clamp", x, lo, size - 1, kind="int", bound=size)

    def load(self, buf, depth):
        index = [self.index(n, depth) for n in buf.shape]
        if not any(isinstance(i, Expr) for i in index):
            # All-constant indices would read the tensor outside the tracer, a concrete value
            # that the tracer refuses as an index of another load (a TraceError by design).
            index[0] = node("mod", node("var", "q_idx", kind="int", bound=127), buf.shape[0],
                            kind="int", bound=buf.shape[0])
        if buf.kind == "int":
            return node("load", buf, *index, kind="int", bound=max(abs(buf.low), abs(buf.high)))
        e = node("load", buf, *index, kind="float", bound=4.0)
        e = Expr(e.op, e.args, e.kind, e.bound, e.score, True, e.step)
        # Eager torch computes on a bfloat16 value in bfloat16 (clamp(x, -0.7, 0.3) rounds
        # 0.3); the kernel, like torch.compile, computes in float32: convert first.
        return e if buf.dtype == torch.float32 else node("float", e)

    # --- truth values ----------------------------------------------------------------------
    def bool(self, depth):
        d = self.draw
        choices = ["int_cmp", "int_cmp"] + (["score_cmp"] if self.with_score else []) \
            + (["load"] if self.of("bool") else []) + (["inf_cmp"] if self.of("inf") else []) \
            + (["nan_check"] * 3 if self.of("nan") else [])
        if depth > 0:
            choices += ["and", "or", "not"]
        op = self.pick(choices)
        if op == "int_cmp":
            x = self.int(depth - 1)
            y = self.int(depth - 1) if d(st.booleans()) else self.pick(INT_CONSTS)
            return node(self.pick(["eq", "ne", "lt", "le", "gt", "ge"]), x, y, kind="bool", bound=1)
        if op == "load":
            buf = self.pick(self.of("bool"))
            return node("load", buf, *(self.index(n, depth - 1) for n in buf.shape), kind="bool", bound=1)
        if op == "inf_cmp":
            # An infinite entry compared with an infinity: kept, not folded as if finite.
            x = self.load(self.pick(self.of("inf")), depth - 1)
            return node(self.pick(["eq", "ne", "lt", "le", "gt", "ge"]), x, self.pick([-math.inf, math.inf]),
                        kind="bool", bound=1)
        if op == "score_cmp":
            return node(self.pick(["lt", "le", "gt", "ge"]), self.score_linear(), self.pick(FLOAT_CONSTS),
                        kind="bool", bound=1)
        if op == "nan_check":
            # x != x, x == x, ...: NaN's own truth table, not folded as x - x.
            x = self.load(self.pick(self.of("nan")), depth - 1)
            return node(self.pick(["eq", "ne", "lt", "le", "gt", "ge"]), x, x, kind="bool", bound=1)
        if op == "not":
            return node("not", self.bool(depth - 1), kind="bool", bound=1)
        return node(op, self.bool(depth - 1), self.bool(depth - 1), kind="bool", bound=1)

    def score_linear(self):
        """``score`` or ``score * k``: exact in float32, so comparing or flooring it has no ties."""
        s = node("var", "score", bound=SCORE_BOUND)
        s = Expr(s.op, s.args, "float", SCORE_BOUND, True)
        k = self.pick([1, 1, 2, -1, 3])
        return s if k == 1 else node("mul", s, k, bound=SCORE_BOUND * abs(k))

    # --- floats ----------------------------------------------------------------------------
    def float(self, depth):
        d = self.draw
        if depth <= 0 or d(st.integers(0, 3)) == 0:
            choices = ["from_int"] + ["load"] * (2 if self.of("float") else 0) \
                + ["scalar"] * bool(self.of("scalar")) + ["score"] * (4 if self.with_score else 0)
            choice = self.pick(choices)
            if choice == "score":
                return self.score_linear() if d(st.integers(0, 3)) == 0 else \
                    Expr("var", ("score",), "float", SCORE_BOUND, True)
            if choice == "load":
                return self.load(self.pick(self.of("float")), depth - 1)
            if choice == "scalar":
                return Expr("scalar", (self.pick(self.of("scalar")),), "float", 4.0, False, True)
            x = self.int(depth - 1)
            how = self.pick(["mul", "truediv", "float"])
            if how == "float":
                return node("float", x) if x.bound <= MAX_FLOAT else node("mul", x, 0.01, bound=x.bound / 100)
            c = self.pick((0.1, -0.05, 1.28, 0.3) if how == "mul" else (10.0, -7.0, 3.3))
            bound = x.bound * abs(c) if how == "mul" else x.bound / abs(c)
            return _tame(node(how, x, c, bound=bound))
        op = self.pick(["add", "sub", "mul", "truediv", "neg", "abs", "exp", "log", "tanh", "sigmoid",
                        "sin", "cos", "clamp", "minimum", "maximum", "where", "pow", "step",
                        "fmod", "cancel"])
        if op in ("step", "fmod") and not self.with_score:
            op = "tanh"
        if op == "step":
            return node(self.pick(["floor", "ceil", "sign"]), self.score_linear())
        if op == "fmod":
            return node("mod", self.score_linear(), self.pick(FMOD_DIVISORS), bound=max(FMOD_DIVISORS))
        x = self.float(depth - 1)
        if self.smooth and op in ("abs", "clamp", "minimum", "maximum") and not _exact(x):
            x = self.exact_float(depth - 1)
        if op in ("add", "sub", "mul"):
            y = self.pick(["tree", "float", "int"])
            y = self.float(depth - 1) if y == "tree" else \
                self.pick(FLOAT_CONSTS if y == "float" else INT_CONSTS)
            bound = x.bound * _bound(y) if op == "mul" else x.bound + _bound(y)
            if op == "mul" and bound > MAX_FLOAT:
                return node("add", x, y, bound=x.bound + _bound(y))
            return _tame(node(op, x, y, bound=bound))
        if op == "truediv":
            if d(st.booleans()):
                c = self.pick((2.1, -0.7, 3))
                return node("truediv", x, c, bound=x.bound / abs(c))
            y = self.float(depth - 1)
            return node("truediv", x, node("add", self.magnitude(y), 1.0, bound=y.bound + 1), bound=x.bound)
        if op in ("neg", "abs"):
            return node(op, x)
        if op == "exp":
            if x.bound > 3:
                x = node("mul", node("tanh", x, bound=1.0), 2.9, bound=2.9) if self.smooth else \
                    node("clamp", x, -2.9, 2.9, bound=2.9)
            return node("exp", x, bound=math.exp(x.bound))
        if op == "log":
            m = self.magnitude(x)
            return node("log", node("add", m, 1, bound=m.bound + 1), bound=math.log(m.bound + 1))
        if op in ("tanh", "sigmoid", "sin", "cos"):
            return node(op, x, bound=1.0)
        if op == "clamp":
            lo, hi = sorted(self.draw(st.lists(st.sampled_from(FLOAT_CONSTS), min_size=2, max_size=2,
                                                unique=True)))
            which = self.pick(["both", "min", "max"])
            lo, hi = (lo if which != "max" else None), (hi if which != "min" else None)
            return node("clamp", x, lo, hi, bound=min(x.bound, max(abs(v) for v in (lo, hi) if v is not None))
                        if which == "both" else max(x.bound, abs(lo or 0), abs(hi or 0)))
        if op in ("minimum", "maximum"):
            y = self.exact_float(depth - 1) if self.smooth else self.float(depth - 1)
            return node(op, x, y)
        if op == "where":
            y = self.float(depth - 1) if d(st.booleans()) else self.pick(FLOAT_CONSTS + INT_CONSTS)
            return node("where", self.bool(depth - 1), x, y)
        if op == "pow":
            if x.bound > 7:
                x = node("tanh", x, bound=1.0)
            return node("pow", x, 2, bound=x.bound ** 2)
        return node("sub", x, x, bound=0.0)                   # cancel: x - x, a constant


    def magnitude(self, x):
        """|x| (x * x where a kink at 0 would matter), for log(... + 1) and x / (... + 1)."""
        if self.smooth and not _exact(x):
            return node("mul", x, x, bound=x.bound ** 2)
        return node("abs", x)

    def exact_float(self, depth):
        """A float that float32 and float64 compute alike (``_exact``)."""
        choices = ["index"] + ["score"] * self.with_score + ["load"] * bool(self.of("float"))
        choice = self.pick(choices)
        if choice == "score":
            return self.score_linear()
        if choice == "load":
            return self.load(self.pick(self.of("float")), depth)
        x = self.int(depth)
        c = self.pick((0.1, -0.05, 1.28))
        while x.bound * abs(c) > MAX_FLOAT:
            # Halved rather than tamed with a tanh, which float32 and float64 round apart where it
            # saturates (tanh(q_idx * 1.28) is 1.0 in float32 from q_idx = 8: a tie with a score
            # of 1 at a kink, which float64 breaks).
            c /= 2
        return node("mul", x, c, bound=x.bound * abs(c))


def _exact(e) -> bool:
    """Whether the kernel (float32) and the oracle (float64, float32 for positions) compute
    ``e`` to the same value: integers, the score and loaded values, the score times an integer,
    and positions times a constant (one float32 rounding in both). Not tanh(kv_idx * 1.28):
    Triton's and torch's float32 tanh differ by an ulp where it saturates, one gives 1.0."""
    if e.kind == "int" or e.op in ("var", "load", "scalar"):
        return True
    if e.op == "float":
        return _exact(e.args[0])
    if e.op == "mul" and isinstance(e.args[0], Expr):
        a, c = e.args
        return isinstance(c, int) if a.op == "var" and a.kind == "float" else a.kind == "int"
    return False


def _bound(v) -> float:
    return v.bound if isinstance(v, Expr) else abs(v)


def _size(e) -> int:
    """Nodes in a tree (its constants not counted)."""
    return 1 + sum(_size(a) for a in e.args) if isinstance(e, Expr) else 0


def _tame(e: Expr) -> Expr:
    """``e``, or tanh(e) when its bound grew past MAX_FLOAT."""
    return e if e.bound <= MAX_FLOAT else node("tanh", e, bound=1.0)


# --- examples -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Example:
    score: Expr | None
    mask: Expr | None
    buffers: tuple
    learn: tuple            # per buffer: requires grad (backward only, float buffers)
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lkv: int
    D: int
    Dv: int
    dtype: torch.dtype
    block_size: int         # of the block mask (the decode path: none)
    path: str               # "flex" or "decode" (decode_attention with an element-wise mask_mod)
    with_lse: bool          # backward: the loss also depends on the LSE
    seed: int
    fused: bool = False     # GLUON: the fused Gluon backward (plan.GLUON_FUSED), else the pair

    @property
    def scale(self) -> float:
        return 0.5 if self.D <= 32 else 0.25

    def __repr__(self):
        lines = [f"Example(B={self.B}, Hq={self.Hq}, Hkv={self.Hkv}, Lq={self.Lq}, Lkv={self.Lkv}, "
                 f"D={self.D}, Dv={self.Dv}, {self.dtype}, path={self.path}, "
                 f"block_size={self.block_size}, with_lse={self.with_lse}, seed={self.seed}"
                 + (f", BACKEND gluon, fused={self.fused})" if GLUON else ")")]
        for buf, learn in zip(self.buffers, self.learn):
            lines.append(f"    {buf!r}" + (".requires_grad_()" if learn else ""))
        if self.score is not None:
            lines.append(f"    score_mod = lambda score, b, h, q_idx, kv_idx: {show(self.score)}")
        if self.mask is not None:
            lines.append(f"    mask_mod = lambda b, h, q_idx, kv_idx: {show(self.mask)}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):      # what hypothesis prints for a failing example
        printer.text(repr(self))


LQ = (1, 16, 17, 32, 45, 64, 67, 96, 128)
LKV = (1, 7, 32, 33, 45, 64, 70, 96, 128)
LQ_GLUON = (1, 17, 64, 128, 129, 200, 256, 384)
LKV_GLUON = (1, 33, 64, 128, 130, 256, 300, 384)


@st.composite
def examples(draw, grad: bool):
    n_float, n_int, n_bool, n_scalar = (draw(st.integers(0, m)) for m in (2, 1, 1, 1))
    buffers = []
    for i in range(n_float):
        shape = draw(st.sampled_from([(1,), (5,), (16,), (40,), (130,), (3, 40), (6, 17)]))
        # Learned tensors are float32 (a half-precision gradient would need its own tolerance).
        dtype = torch.float32 if grad else draw(st.sampled_from([torch.float32, torch.bfloat16]))
        buffers.append(Buf(f"bias{i}", "float", shape, dtype))
    for i in range(n_int):
        low = draw(st.sampled_from([0, -4]))
        buffers.append(Buf(f"ids{i}", "int", draw(st.sampled_from([(7,), (40,), (130,)])),
                           draw(st.sampled_from([torch.int32, torch.int64])), low,
                           low + draw(st.sampled_from([1, 3, 20]))))
    for i in range(n_bool):
        buffers.append(Buf(f"flags{i}", "bool", draw(st.sampled_from([(9,), (2, 40)])), torch.bool))
    for i in range(n_scalar):
        buffers.append(Buf(f"scalar{i}", "scalar", ()))
    # Forward only (torch's derivatives of -inf - -inf are NaN): an additive mask of 0 / -inf
    # entries, added to the score and compared with infinities.
    if not grad and draw(st.integers(0, 3)) == 0:
        buffers.append(Buf("neg_inf", "inf", draw(st.sampled_from([(40,), (130,), (2, 40)]))))
    gen = _Gen(draw, buffers, with_score=True, smooth=grad)
    score = None
    if draw(st.integers(0, 5)):
        score = gen.int(3) if draw(st.integers(0, 9)) == 0 else gen.float(draw(st.integers(1, 4)))
        if draw(st.integers(0, 5)) == 0:     # -inf on some positions: rows may die entirely
            score = node("where", gen.bool(1), score, -math.inf, bound=score.bound)
        if gen.of("inf") and draw(st.booleans()):
            score = node("add", score, gen.load(gen.of("inf")[0], 1), bound=score.bound)
    mask = None
    if draw(st.integers(0, 2)):
        mask = _Gen(draw, [b for b in buffers if b.kind in ("int", "bool")], with_score=False).bool(
            draw(st.integers(0, 3)))
    group = draw(st.sampled_from([1, 1, 2, 3]))
    Hkv = draw(st.sampled_from([1, 2]))
    D = draw(st.sampled_from([64, 128] if GLUON else [16, 24, 32, 64]))
    path = "flex" if grad or GLUON or draw(st.integers(0, 3)) else "decode"
    Lq = draw(st.sampled_from(LQ_GLUON if GLUON else LQ if path == "flex" else (1, 3, 16)))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16] if GLUON else
                                 [torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    # Learned tensors with float32 inputs only: with half-precision ones their gradients, sums
    # of many dZ terms computed from rounded outputs, are off by several percent (a test of
    # precision, not of the kernels; test_backward's GPU cases allow 5% there).
    learn = tuple(grad and dtype == torch.float32 and b.kind in ("float", "scalar") and draw(st.booleans())
                  for b in buffers)
    # NaN guards, forward and backward: a tensor with NaN entries read only through comparisons
    # with itself, on the score's path or in the mask. Drawn last, so that the examples stored
    # before it (whose data ends earlier, read as zeros) decode as they did: 0 adds nothing.
    if draw(st.integers(0, 3)) == 3:
        nan = Buf("nan0", "nan", draw(st.sampled_from([(40,), (130,)])))
        buffers.append(nan)
        learn += (False,)
        check = _Gen(draw, [nan], with_score=False).bool(draw(st.integers(1, 2)))
        if score is not None and draw(st.booleans()):
            score = node("where", check, score, draw(st.sampled_from(FLOAT_CONSTS)), bound=score.bound)
        else:
            mask = check if mask is None else node("and", mask, check, kind="bool", bound=1)
    return Example(
        score=score, mask=mask, buffers=tuple(buffers), learn=learn,
        B=draw(st.sampled_from([1, 2])), Hq=Hkv * group, Hkv=Hkv, Lq=Lq,
        Lkv=draw(st.sampled_from(LKV_GLUON if GLUON else LKV)),
        D=D, Dv=D if GLUON else draw(st.sampled_from([D, D, 16, 32])),
        dtype=dtype,
        block_size=128 if GLUON else draw(st.sampled_from([32, 64])), path=path,
        with_lse=grad and draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)),
        fused=GLUON and grad and draw(st.booleans()))


def _inputs(ex: Example):
    """q, k (multiples of 1/4 in [-1, 1]: exact scores), v, and the captured tensors by name, on
    ``DEVICE`` (drawn on the CPU: the same values on every device)."""
    g = torch.Generator().manual_seed(ex.seed)

    def grid(*shape):
        return (torch.randint(-4, 5, shape, generator=g) / 4).to(ex.dtype)

    q, k = grid(ex.B, ex.Hq, ex.Lq, ex.D).to(DEVICE), grid(ex.B, ex.Hkv, ex.Lkv, ex.D).to(DEVICE)
    v = torch.randn(ex.B, ex.Hkv, ex.Lkv, ex.Dv, generator=g).to(DEVICE, ex.dtype)
    buffers = {}
    for buf, learn in zip(ex.buffers, ex.learn):
        if buf.kind == "int":
            t = torch.randint(buf.low, buf.high + 1, buf.shape, generator=g, dtype=buf.dtype)
        elif buf.kind == "bool":
            t = torch.rand(buf.shape, generator=g) < 0.5
        elif buf.kind == "inf":
            t = torch.where(torch.rand(buf.shape, generator=g) < 0.25, -math.inf, 0.0)
        elif buf.kind == "nan":
            t = torch.where(torch.rand(buf.shape, generator=g) < 0.25, math.nan, torch.randn(buf.shape, generator=g))
        else:
            t = torch.randn(buf.shape, generator=g).to(buf.dtype)
        t = t.to(DEVICE)
        buffers[buf.name] = t.requires_grad_() if learn else t
    return q, k, v, buffers


def _compile_for_hopper(launches, ex: Example, score_mod, mask_mod, backward: bool) -> None:
    """Each launch compiles for sm_90 (memoized across the session with the conftest's), and so
    do the Gluon kernels of the example's mods (``_gluon_launches``)."""
    if not AOT_ENABLED or DEVICE.type != "cpu":
        return
    for spec, args, constexprs in list(launches) + _gluon_launches(ex, score_mod, mask_mod, backward):
        error = compile_error(spec, args, constexprs)
        assert error is None, f"sm_90 compile of {spec.kernel_name} failed: {error[-3000:]}"


def _gluon_launches(ex: Example, score_mod, mask_mod, backward: bool) -> list:
    """The Gluon kernels (Hopper; the interpreter cannot run them) of the example's mods as
    [(spec, args, constexprs)]: its batch, heads and lengths at a shape they take (bf16, head dim
    64, or 128 for an odd ``seed``: the fused kernel's warpgroups share dSᵀ differently there,
    128-position blocks), planned as if on Hopper with BACKEND "gluon"; the forward, and for a
    backward example the dQ, dK/dV and fused kernels (no fused one where a captured tensor wants
    a gradient)."""
    from test_backward_gluon import gluon_backward_launch
    from test_forward_gluon import gluon_forward_launch, planned_as_if_on_hopper
    D = 128 if ex.seed % 2 else 64
    q = torch.zeros(ex.B, ex.Hq, ex.Lq, D, dtype=torch.bfloat16)
    k, v = (torch.zeros(ex.B, ex.Hkv, ex.Lkv, D, dtype=torch.bfloat16) for _ in range(2))
    bm = None if mask_mod is None else create_block_mask(mask_mod, ex.B, ex.Hq, ex.Lq, ex.Lkv, BLOCK_SIZE=128)
    with planned_as_if_on_hopper():
        launches = [gluon_forward_launch(q, k, v, score_mod, bm)]
        for part in ("dq", "dkdv", "fused") if backward else ():
            with _fused_backward(part == "fused"):
                launch = gluon_backward_launch(q, k, v, score_mod, bm, part)
            assert launch is not None or part == "fused", f"no Gluon {part} kernel planned"
            if launch is not None:
                launches.append((launch[0], *launch[2:]))
    return launches


def _events(ex: Example, kernel_path: str) -> None:
    """hypothesis' statistics (--hypothesis-show-statistics): what the examples covered."""
    event(f"path: {kernel_path}")
    event(f"dtype: {str(ex.dtype).replace('torch.', '')}")
    event(f"mods: {'score' if ex.score else '-'} / {'mask' if ex.mask else '-'}")
    size = sum(_size(t) for t in (ex.score, ex.mask))
    event(f"tree nodes: {'<4' if size < 4 else '4-9' if size < 10 else '10+'}")


def _block_mask(ex: Example, mask_mod):
    if mask_mod is None:
        return None
    return create_block_mask(mask_mod, ex.B, ex.Hq, ex.Lq, ex.Lkv, device=DEVICE, BLOCK_SIZE=ex.block_size)


OPTIONS = {"BACKEND": "gluon"} if GLUON else {"BLOCK_M": 32, "BLOCK_N": 32}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Outputs filled with NaN before each launch, whatever the environment says."""
    from flexgen.runtime import poison
    monkeypatch.setattr(poison, "ENABLED", True)


@contextlib.contextmanager
def _fused_backward(fused: bool | None):
    """Plan the fused Gluon backward (``fused``) or never (plan.GLUON_FUSED; None: as it is),
    with the plans made under the other setting forgotten before and after."""
    if fused is None:
        yield
        return
    from flexgen.runtime import plan
    before = plan.GLUON_FUSED
    plan.GLUON_FUSED = fused
    plan.clear_memos()
    try:
        yield
    finally:
        plan.GLUON_FUSED = before
        plan.clear_memos()


@_settings("forward")
@seed(FUZZ_SEED)
@given(ex=examples(grad=False))
def test_fuzz_forward(ex):
    q, k, v, buffers = _inputs(ex)
    score_mod, mask_mod = make_mod(ex.score, buffers, "score"), make_mod(ex.mask, buffers, "mask")
    gqa = ex.Hq != ex.Hkv
    with aot.recording() as launches:
        if ex.path == "decode":
            out, lse = decode_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, scale=ex.scale,
                                        enable_gqa=gqa, return_lse=True, q_offsets=0)
        else:
            out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(ex, mask_mod),
                                      scale=ex.scale, enable_gqa=gqa, return_lse=True,
                                      kernel_options=OPTIONS)
    templates = sorted({spec.template for spec, _, _ in launches if spec.template != "decode_merge"})
    _events(ex, "+".join(templates))
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod, scale=ex.scale, enable_gqa=gqa,
                                            return_lse=True, dtype=torch.float64)
    check(out, ref, ex.dtype, lse, ref_lse)
    _compile_for_hopper(launches, ex, score_mod, mask_mod, backward=False)


# Gradient error allowed, relative to the largest reference gradient (or 1). The 16-bit
# kernels round P and dS to the input dtype for their dots (as every flash backward does),
# and a steep mod (exp(2.9 * tanh(score)): slopes up to 50) multiplies those roundings:
# bf16 (8 mantissa bits) reaches 5-8% there, exactly where float32 agrees to 1e-6 (the
# float32 examples are the precise check; the 16-bit ones catch wrong code, O(1) errors).
GRAD_TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@_settings("backward")
@seed(FUZZ_SEED)
@given(ex=examples(grad=True))
def test_fuzz_backward(ex):
    q, k, v, buffers = _inputs(ex)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    learned = [buffers[b.name] for b, learn in zip(ex.buffers, ex.learn) if learn]
    score_mod, mask_mod = make_mod(ex.score, buffers, "score"), make_mod(ex.mask, buffers, "mask")
    gqa = ex.Hq != ex.Hkv
    with aot.recording() as launches, _fused_backward(ex.fused if GLUON else None):
        try:
            out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=_block_mask(ex, mask_mod),
                                      scale=ex.scale, enable_gqa=gqa, return_lse=True,
                                      kernel_options=OPTIONS)
        except flexgen.GradientError as err:
            # Only a step function on the score's or a learned tensor's path excuses it.
            assert ex.score is not None and ex.score.step, f"unexpected GradientError: {err}"
            event("GradientError (a step function on the gradient's path)")
            return
        g = torch.Generator().manual_seed(ex.seed + 1)
        d_out = torch.randn(out.shape, generator=g).to(DEVICE)
        d_lse = torch.randn(lse.shape, generator=g).to(DEVICE) if ex.with_lse else None
        loss = (out.float() * d_out).sum()
        if d_lse is not None:
            loss = loss + (torch.where(lse.isinf(), 0.0, lse) * d_lse).sum()
        leaves = [q, k, v, *learned]
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
    kernels = sorted({spec.template + (f".{spec.part}" if getattr(spec, "part", None) else "")
                      for spec, _, _ in launches})
    _events(ex, "+".join(kernels) if GLUON else "forward+backward")
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod, scale=ex.scale, enable_gqa=gqa,
                                            return_lse=True, dtype=torch.float64)
    check(out.detach(), ref.detach(), ex.dtype, lse.detach(), ref_lse.detach())
    ref_loss = (ref * d_out.double()).sum()
    if d_lse is not None:
        ref_loss = ref_loss + (torch.where(ref_lse.isinf(), 0.0, ref_lse) * d_lse.double()).sum()
    want = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    names = ["dq", "dk", "dv"] + [f"d{b.name}" for b, learn in zip(ex.buffers, ex.learn) if learn]
    for name, leaf, a, b in zip(names, leaves, got, want):
        a = torch.zeros_like(leaf) if a is None else a
        b = torch.zeros_like(leaf, dtype=torch.float64) if b is None else b.double()
        assert not a.isnan().any(), f"{name}: NaN in the gradient"
        err, largest = (a.double() - b).abs().max().item(), b.abs().max().item()
        assert err <= GRAD_TOL[ex.dtype] * max(largest, 1.0), \
            f"{name}: max error {err:.3g}, largest gradient {largest:.3g}"
    _compile_for_hopper(launches, ex, score_mod, mask_mod, backward=True)
