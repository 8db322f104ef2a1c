"""The traced program's text: the mods' arguments and kinds, ``TracedMod``, and ``parse``
(the text back into ``Node`` objects). The format itself is described in the docstring of
``flexgen.frontend.trace``; this module needs nothing of the tracer (the text is all later
stages read)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
# The linear-attention mods: a log-decay per (batch, query head, position) and an
# elementwise feature map of the query / key entries (flexgen.linear_attention).
DECAY_ARGS = ("b", "h", "t")
FEATURE_ARGS = ("x",)
ARGS = {"score_mod": SCORE_ARGS, "mask_mod": MASK_ARGS, "decay_mod": DECAY_ARGS,
        "feature_map": FEATURE_ARGS}
FLOAT_ARGS = ("score", "x")

DTYPE_OF_KIND = {"b": torch.bool, "i": torch.int32, "f": torch.float32}
# A captured tensor's dtype -> the kind its loads compute in.
KIND_OF_DTYPE = {
    torch.bool: "b", torch.int8: "i", torch.int16: "i", torch.int32: "i", torch.int64: "i",
    torch.uint8: "i", torch.float16: "f", torch.bfloat16: "f", torch.float32: "f", torch.float64: "f",
}
DTYPE_NAMES = {dt: str(dt).replace("torch.", "") for dt in KIND_OF_DTYPE}
_RANK = {"b": 0, "i": 1, "f": 2}

UNARY = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "tan", "erf",
         "abs", "sign", "floor", "ceil", "neg", "not", "bitnot", "silu", "relu")
LINE_END = ";"      # between the program's lines (see the module docstring)
BINARY = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "minimum", "maximum",
          "and", "or", "xor", "shl", "shr", "eq", "ne", "lt", "le", "gt", "ge")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")


@dataclass(frozen=True)
class TracedMod:
    """A traced mod: its program text and the captured tensors, in slot order."""
    kind: str                  # "score_mod", "mask_mod", "decay_mod" or "feature_map"
    name: str                  # the mod's name, for messages
    graph: str                 # the program (see the module docstring)
    buffers: tuple             # captured tensors, in slot order
    derived: bool = False      # some buffer was computed while tracing (a reduction of a
                               # captured tensor), or a captured value was read into Python
                               # (.item()): the trace must not outlive this call

    @property
    def signature(self) -> str:
        """What a kernel depends on: the program, buffer signatures included."""
        return self.graph

    @classmethod
    def from_graph(cls, graph: str, buffers) -> "TracedMod":
        """The traced mod a program text and its captured tensors stand for (what ops carry)."""
        kind, name = parse(graph)[:2]
        return cls(kind, name, graph, tuple(buffers))


# ---------------------------------------------------------------------------- reading the text

@dataclass(frozen=True, eq=False)
class Node:
    """One line of a traced program, with its operands resolved: ``args`` holds child
    Nodes or plain Python values (a var's name, a constant, a load's slot)."""
    op: str
    args: tuple
    dtype: torch.dtype

_MEMO_MAX = 4096
_PARSED: dict = {}


def parse(graph: str) -> tuple:
    """(kind, name, root Node, ((dtype name, ndim) per buffer)) of a traced program. Memoized."""
    hit = _PARSED.get(graph)
    if hit is None:
        nodes, kind, name, root, buffers = [None], None, None, None, []
        for number, line in enumerate(graph.split(LINE_END)):
            op, rest = line.split(" ", 1)
            fields = rest.split(" ")
            if op == "program":
                kind, name = fields
                continue
            if op == "buffer":
                buffers.append((fields[1], int(fields[2])))
                continue
            dtype = DTYPE_OF_KIND[fields[0]]
            refs = [nodes[int(f[1:])] for f in fields[1:] if f.startswith("%")]
            if op == "root":
                root = refs[0]
                continue
            if op == "var":
                node = Node("var", (fields[1],), dtype)
            elif op == "param":
                node = Node("param", (int(fields[1]),), dtype)
            elif op == "const":
                text = fields[1]
                value = (text == "1") if fields[0] == "b" else int(text) if fields[0] == "i" else float(text)
                node = Node("const", (value,), dtype)
            elif op == "load":
                node = Node("load", (int(fields[1]), tuple(refs)), dtype)
            else:
                node = Node(op, tuple(refs), dtype)
            nodes.append(node)
            assert len(nodes) == number + 1, "flexgen internal error: a malformed traced program"
        hit = (kind, name, root, tuple(buffers))
        if len(_PARSED) >= _MEMO_MAX:
            _PARSED.clear()
        _PARSED[graph] = hit
    return hit


# ---------------------------------------------------------------------------- the lowered form

# Ops through which a float constant stays a parameter of a value mod's lowered form (see
# ``lowered_form``): they combine it with a traced value as one IEEE operation, whatever the
# constant, so the canonical form and the printed code hold for every value.
_PARAMETER_USERS = frozenset(("add", "sub", "mul", "truediv", "minimum", "maximum", "where")
                             + COMPARISONS)


def _written_as_structure(value: float) -> bool:
    """An integer or a fraction over a power of two up to 4096 (0, 1, 2.0, 0.5, 0.03125, 50.0,
    2.5), as people write scales and offsets by hand; not 0.1, 1/sqrt(128), 37.1234."""
    scaled = value * 4096
    return scaled.is_integer() and abs(scaled) < 2 ** 24


def lowered_form(graph: str, parameters: bool) -> tuple:
    """(the program as its lowering sees it, the parameters' values).

    The lowering does not read the mod's name, so the form drops it: a hand-written
    ``q_idx >= kv_idx`` and ``flexgen.mods.causal_mask`` have one form. With ``parameters``
    (score_mods and the linear-attention mods), a float constant that only meets traced
    values through ``_PARAMETER_USERS`` becomes a ``param <kind> <n>`` line: ``cap *
    tanh(score / cap)`` has one form for every cap, so a new cap is lowered without sympy.
    Constants written as structure (``_written_as_structure``: 2.0, 0.5, 1/32, 50.0) stay
    values, so sympy still simplifies and merges with them (``score * 2.0 / 2.0`` is
    ``score``; ``q_idx / 32.0 - 0.03125 * kv_idx`` and ``(q_idx - kv_idx) / 32`` are one
    kernel); so do infinite and NaN constants, those that meet only other constants (folded
    in torch's arithmetic) and those that feed another op (``exp(0.3)``, an exponent).
    mask_mods keep every constant: their block bounds are computed from the values.
    """
    lines = graph.split(LINE_END)
    kind = lines[0].split(" ")[1]
    floats, constants, uses = {}, set(), {}
    for number, line in enumerate(lines[1:], 1):
        op, *fields = line.split(" ")
        refs = [int(f[1:]) for f in fields[1:] if f.startswith("%")]
        if op == "const":
            constants.add(number)
            value = float(fields[1]) if fields[0] == "f" else None
            if value is not None and value - value == 0 and not _written_as_structure(value):
                floats[number] = value
        for ref in refs:
            if ref in floats:
                uses.setdefault(ref, []).append((op, [r for r in refs if r != ref]))
    chosen = [n for n, users in sorted(uses.items()) if parameters and all(
        op in _PARAMETER_USERS and any(r not in constants for r in others) for op, others in users)]
    slot = {n: k for k, n in enumerate(chosen)}
    out = [f"program {kind} mod"]
    for number, line in enumerate(lines[1:], 1):
        out.append(f"param f {slot[number]}" if number in slot else line)
    return LINE_END.join(out), tuple(floats[n] for n in chosen)


TracedMod.root = property(lambda self: parse(self.graph)[2],
                          doc="The program's value as a Node graph (``parse``).")
