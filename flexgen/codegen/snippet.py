"""``Snippet``: a mod's printed Triton statements, as kernel specs hold them.

Its own module, free of sympy, so that a spec can be rebuilt from the restart
index (``flexgen.codegen.index``) in a process that never imports the printer.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass

TL_DTYPES = {"float": "tl.float32", "int": "tl.int32", "bool": "tl.int1"}


@dataclass(frozen=True)
class Snippet:
    """Statements computing one value, ready to paste into a template."""
    lines: tuple        # "name = code" statements, in order
    result: str         # the expression holding the value after ``lines``
    kind: str           # "bool", "int" or "float"
    # The names among score, b, h, q_idx, kv_idx the value depends on, sorted (a tuple:
    # the spec's key is its repr, which must not depend on the hash seed); None: unknown.
    free: tuple | None = None

    def tile(self, rows: str, cols: str) -> str:
        """``result`` as a full [rows, cols] tile, the shape a template's softmax and dots need.

        In every template ``score`` is a [rows, cols] tile, ``q_idx`` a column and
        ``kv_idx`` a row, so a value of ``score`` or of both positions is a tile
        already; anything else (``q_idx * 0.1``, ``h``, a constant) is broadcast. A
        Python literal becomes a [1, 1] tile first (``tl.broadcast_to`` takes tensors),
        not a tile of the full shape: a Gluon kernel's broadcast puts the result in its
        score tiles' layout, where a full tile of its own takes another one (and then
        differs in type from the scores of the masked tiles' branch).
        """
        free = self.free
        if free is not None and ("score" in free or ("q_idx" in free and "kv_idx" in free)):
            return self.result
        if literal_value(self.result) is not None:
            return f"tl.broadcast_to(tl.full([1, 1], {self.result}, {TL_DTYPES[self.kind]}), ({rows}, {cols}))"
        return f"tl.broadcast_to({self.result}, ({rows}, {cols}))"

    def record(self) -> dict:
        """As the restart index and the shipped forms keep it (JSON)."""
        return dict(lines=list(self.lines), result=self.result, kind=self.kind,
                    free=None if self.free is None else list(self.free))

    @classmethod
    def from_record(cls, r: dict) -> "Snippet":
        """``record``'s inverse (KeyError / TypeError on a record of another layout)."""
        return cls(tuple(r["lines"]), r["result"], r["kind"], None if r["free"] is None else tuple(r["free"]))

    @property
    def positions(self) -> tuple:
        """The positions (``q_idx``, ``kv_idx``) the statements and the result read, also inside
        a load's index (``free`` names the result's only: a loaded value stands for its index)."""
        text = "\n".join(self.lines + (self.result,))
        return tuple(name for name in ("q_idx", "kv_idx") if re.search(rf"\b{name}(_clamped)?\b", text))

    @property
    def clamped(self) -> tuple:
        """The clamped positions (``q_idx_clamped``, ``kv_idx_clamped``) the statements read:
        loads proven in bounds read at them (``flexgen.codegen.printer``), and a template
        binds them where it binds ``q_idx`` and ``kv_idx``."""
        return tuple(name for name in ("q_idx_clamped", "kv_idx_clamped")
                     if any(re.search(rf"\b{name}\b", line) for line in self.lines))

    @property
    def checks_reads(self) -> bool:
        """Whether the statements assert that loads stay in bounds (debug mode): they read ``live``."""
        return any(line.startswith("tl.device_assert(") for line in self.lines)


@dataclass(frozen=True)
class Address:
    """Where a scatter writes: statements, then an offset and a bounds mask (None: always)."""
    lines: tuple
    offset: str
    in_bounds: str | None


_SPECIAL_FLOATS = {'float("nan")': float("nan"), 'float("inf")': float("inf"),
                   'float("-inf")': float("-inf")}


def literal_value(code: str):
    """The value of ``code`` when it is a Python literal (``2``, ``-1``, ``0.5``, ``True``,
    ``float("inf")``), else None: a literal has no ``.to()``, no shape and no dtype."""
    if code in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[code]
    try:
        value = ast.literal_eval(code)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, (bool, int, float)) else None
