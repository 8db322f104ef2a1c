"""The lowered forms of everyday mods, shipped with flexgen (``mods/lowered.json``).

A process lowers each mod the restart index has not seen through sympy: its import
(0.2-0.3 s) and the canonical form (~0.05 s) are a fifth of a cold first call on the
H100, paid even where the mods are the everyday ones (a causal or document mask, a
soft-cap, ALiBi). Their lowered forms depend neither on the values of their captured
tensors nor on their data constants (a soft-cap's cap of 37.12 is a parameter of the
form: ``flexgen.frontend.program.lowered_form``; Gemma 2's caps of 50 and 30 are values,
shipped as forms of their own), so flexgen computes them when it is built and ships
them: ``flexgen.frontend.lowering`` looks here after the restart index and before sympy,
and a hand-written mod of the same form (``q_idx >= kv_idx``, ``c * torch.tanh(score / c)``
with any such ``c``) finds them too. Any other mod takes sympy as before.

``build()`` computes the table from ``examples()``; a test keeps the file equal to it.
After a change to the tracer, the sympy conversion or the printer, regenerate it:
``python -m flexgen.frontend.seeds``.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path

FILE = "lowered.json"


@functools.lru_cache(maxsize=1)
def table() -> dict:
    """The shipped forms (lowered-form key -> the restart index's record of it); {} where the
    file is missing or unreadable (the lowering then takes sympy)."""
    try:
        data = json.loads(importlib.resources.files("flexgen.mods").joinpath(FILE).read_text())
        forms = data["forms"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return forms if isinstance(forms, dict) else {}


def get(key: str) -> dict | None:
    return table().get(key)


def examples() -> list:
    """(mod, kind) of each shipped form: flexgen.mods' mods whose form holds for every value of
    their arguments, with the integer dtypes and ranks their captured tensors come in. (A
    sliding window's or a prefix's length is a value of its mask's form: mask_mods keep their
    constants, so those are not here.)"""
    import torch

    from flexgen import mods
    masks = [mods.causal_mask, mods.noop_mask]
    for dtype in (torch.int32, torch.int64):
        ids = torch.zeros(8, dtype=dtype)
        masks += [mods.document_mask(ids), mods.document_mask(ids.view(1, 8)),
                  mods.and_masks(mods.causal_mask, mods.document_mask(ids)),
                  mods.and_masks(mods.causal_mask, mods.document_mask(ids.view(1, 8))),
                  mods.kv_padding(ids[:1]), mods.q_padding(ids[:1]),
                  mods.and_masks(mods.causal_mask, mods.kv_padding(ids[:1]))]
    # Soft-caps: Gemma 2's two caps (50 on attention logits, 30 on final ones: values of their
    # forms) and any other cap (a parameter); ALiBi's slopes for the usual head counts.
    scores = [mods.tanh_softcap(cap, approx=approx) for cap in (50.0, 30.0, 20.3) for approx in (False, True)]
    scores += [mods.alibi(n) for n in (8, 12, 16, 32, 64)] + [mods.alibi(slopes=torch.ones(16))]
    scores += [mods.alibi(n, max_bias=7.3) for n in (12, 16)]     # any other max bias: parameters
    return [(m, "mask_mod") for m in masks] + [(s, "score_mod") for s in scores]


def build() -> dict:
    """The file's contents, computed with sympy."""
    import sympy

    from .lowering import PREFIX, _lower, _record
    from .program import lowered_form
    from .trace import TracedMod, trace
    from ..codegen.printer import print_snippet
    forms = {}
    for mod, kind in examples():
        traced = trace(mod, kind)
        form, values = lowered_form(traced.graph, parameters=kind != "mask_mod")
        prefix = PREFIX[kind]
        lowered = _lower(TracedMod(kind, traced.name, form, traced.buffers), prefix)
        record = _record(lowered)
        reads = [text for text, _, dims in lowered.index_table or ()
                 if all(d[0] == "affine" for d in dims) and any(d[2] for d in dims)]
        if reads and not values:
            # The snippet a call prints when it proves every position read in bounds (tensors
            # as long as the sequences: lowering.proven_snippet), keyed as it asks.
            proven = tuple(sorted(reads))
            snippet = print_snippet(lowered.expr, f"{prefix}_", frozenset(proven))
            record["proven"] = {" ".join(proven): snippet.record()}
        forms[f"{prefix}\n{form}"] = record
    return {"sympy": sympy.__version__, "forms": forms}


def write(path: Path | None = None) -> Path:
    """Write ``build()`` to the package's file (or ``path``)."""
    path = Path(path) if path is not None else Path(str(importlib.resources.files("flexgen.mods"))) / FILE
    data = build()
    # One form per line: a regenerated file's diff shows which forms changed.
    lines = [f"  {json.dumps(key)}: {json.dumps(record, sort_keys=True)}"
             for key, record in sorted(data["forms"].items())]
    path.write_text(f'{{"sympy": {json.dumps(data["sympy"])},\n "forms": {{\n' + ",\n".join(lines) + "\n}}\n")
    table.cache_clear()
    return path


if __name__ == "__main__":
    print(f"wrote {write()}")
