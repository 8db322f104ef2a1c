"""Golden generated kernels: the rendered source of every mod in flexgen.mods.

For each mod (and a few compositions) the forward kernel that
``flexgen.kernel_source`` renders for small CPU tensors is compared with a
text file under ``tests/snapshots/test_snapshots/``, one readable ``.py.txt``
file per kernel. A change to a template, the tracer, the sympy
canonicalization or the printer shows up there as a diff, reviewed like code.

Rewrite the golden files after an intended change with::

    python -m pytest tests/test_snapshots.py --snapshot-update

The spec key (``# key: <sha256>``) and the kernel name derived from it hash
the flexgen and Triton versions too, so the test replaces them with
placeholders before comparing: a Triton upgrade alone changes no snapshot.
The other tests here check that the raw source holds no absolute path or
date, parses as Python, and is the same in processes with different
``PYTHONHASHSEED`` values.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

import flexgen
from flexgen import create_block_mask, kernel_source
from flexgen import mods as M


class KernelSourceExtension(SingleFileSnapshotExtension):
    """One UTF-8 text file per snapshot: tests/snapshots/<test file>/<test id>.py.txt."""
    file_extension = "py.txt"
    _write_mode = WriteMode.TEXT

    @classmethod
    def dirname(cls, *, test_location) -> str:
        # syrupy's default is tests/__snapshots__/<test file>/; DESIGN.md names tests/snapshots/.
        return str(Path(test_location.filepath).parent / "snapshots" / test_location.basename)


@pytest.fixture
def snapshot(snapshot):
    return snapshot.use_extension(KernelSourceExtension)


B, HQ, HKV, L, D = 1, 4, 2, 128, 64
DTYPE = torch.bfloat16
BLOCK_SIZE = 128

DOC = M.doc_ids_from_lengths([40, 50, 38])
DOC_B = DOC[None, :]
REL_TABLE = torch.zeros(HQ, 2 * L - 1)
T5_TABLE = torch.zeros(HQ, 32)

# id -> (score_mod, mask_mod); captured tensors' values never reach the source,
# only their dtype and rank.
CASES = {
    # mask mods
    "causal_mask": (None, M.causal_mask),
    "causal_offset_int": (None, M.causal(3)),
    "causal_offset_tensor": (None, M.causal(torch.tensor(3))),
    "causal_lower_right": (None, M.causal_lower_right(L, L)),
    "sliding_window": (None, M.sliding_window(32)),
    "sliding_window_two_sided": (None, M.sliding_window(32, causal=False)),
    "prefix_lm": (None, M.prefix_lm(16)),
    "prefix_lm_per_batch": (None, M.prefix_lm(torch.tensor([16]))),
    "document_mask_1d": (None, M.document_mask(DOC)),
    "document_mask_2d": (None, M.document_mask(DOC_B)),
    "document_mask_cross": (None, M.document_mask(DOC, M.doc_ids_from_offsets([0, 64, 100, 128]))),
    "attention_sinks": (None, M.attention_sinks(4, 32)),
    "chunked_local": (None, M.chunked_local(32)),
    "dilated_sliding_window": (None, M.dilated_sliding_window(8, 2)),
    "neighborhood_2d": (None, M.neighborhood_2d(8, 16, 3, 5)),
    "neighborhood_2d_unclamped": (None, M.neighborhood_2d(8, 16, 3, 5, clamp_at_border=False)),
    "block_causal": (None, M.block_causal(16)),
    "kv_padding": (None, M.kv_padding(torch.tensor([100]))),
    "q_padding": (None, M.q_padding(torch.tensor([100]))),
    "noop_mask": (None, M.noop_mask),
    "or_masks_empty": (None, M.or_masks()),
    # score mods
    "alibi_power_of_two": (M.alibi(4), None),
    "alibi_not_power_of_two": (M.alibi(6), None),
    "alibi_slopes_tensor": (M.alibi(slopes=M.alibi_slopes(HQ)), None),
    "tanh_softcap": (M.tanh_softcap(30.0), None),
    "tanh_softcap_approx": (M.tanh_softcap(30.0, approx=True), None),
    "relative_position_bias": (M.relative_position_bias(REL_TABLE, L), None),
    "relative_position_bias_1d": (M.relative_position_bias(REL_TABLE[0], L), None),
    "t5_relative_bias": (M.t5_relative_bias(T5_TABLE), None),
    "t5_relative_bias_causal_1d": (M.t5_relative_bias(T5_TABLE[0], bidirectional=False), None),
    "no_mods": (None, None),
    # compositions
    "and_causal_document": (None, M.and_masks(M.causal_mask, M.document_mask(DOC))),
    "or_window_sinks": (None, M.or_masks(M.sliding_window(16), M.attention_sinks(4, 1))),
    "compose_alibi_softcap": (M.compose_score_mods(M.alibi(4), M.tanh_softcap(50.0)), None),
    "softcap_causal_document": (M.tanh_softcap(50.0),
                                M.and_masks(M.causal_mask, M.document_mask(DOC))),
}

KEY_LINE = re.compile(r"^# key: [0-9a-f]{64}$", re.MULTILINE)
KERNEL_NAME = re.compile(r"\bflexgen_(\w+?)_[0-9a-f]{12}\b")


def tensors():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, L, D, generator=gen).to(DTYPE)
    k = torch.randn(B, HKV, L, D, generator=gen).to(DTYPE)
    return q, k, k.clone()


def raw_source(case_id: str) -> str:
    """The kernel module flexgen would generate (and cache) for the case, unchanged."""
    score_mod, mask_mod = CASES[case_id]
    q, k, v = tensors()
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, B, None, L, L, device="cpu", BLOCK_SIZE=BLOCK_SIZE)
    return kernel_source(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


def normalize(source: str) -> str:
    """The source with the version-dependent spec key replaced by placeholders."""
    assert len(KEY_LINE.findall(source)) == 1, "expected exactly one '# key: <sha256>' line"
    assert KERNEL_NAME.search(source), "expected a kernel named flexgen_<template>_<key[:12]>"
    source = KEY_LINE.sub("# key: <sha256 of the spec, flexgen and triton versions>", source)
    return KERNEL_NAME.sub(r"flexgen_\1_KEY", source)


@pytest.mark.parametrize("case_id", CASES)
def test_kernel_source(case_id, snapshot):
    assert normalize(raw_source(case_id)) == snapshot


def _forbidden_fragments() -> list[str]:
    """Absolute locations that must not leak into a generated source."""
    places = [Path(flexgen.__file__).resolve().parent.parent, Path.home(), Path(tempfile.gettempdir()),
              Path(sys.prefix), Path(os.getcwd()), Path(torch.__file__).resolve().parent]
    return sorted({str(p) for p in places if len(str(p)) > 1})


DATE_OR_TIME = re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b|\b\d\d:\d\d:\d\d\b")


@pytest.mark.parametrize("case_id", ["causal_mask", "document_mask_2d", "softcap_causal_document",
                                     "t5_relative_bias"])
def test_source_is_portable_python(case_id):
    source = raw_source(case_id)
    for fragment in _forbidden_fragments():
        assert fragment not in source, f"the source contains the local path {fragment!r}"
    assert not DATE_OR_TIME.search(source), "the source contains a date or a time"
    assert "0x7f" not in source and " at 0x" not in source, "the source contains an object address"
    ast.parse(normalize(source))
    ast.parse(source)


_DUMP = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("snapshot_cases", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
json.dump({case: module.raw_source(case) for case in module.CASES}, sys.stdout)
"""


@pytest.mark.once       # rendering, not Triton: one pass is enough
def test_sources_do_not_depend_on_the_hash_seed(tmp_path):
    """Raw sources (keys included) agree between this process and two with other hash seeds."""
    here = {case: raw_source(case) for case in CASES}
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, FLEXGEN_CACHE_DIR=str(tmp_path / seed))
        done = subprocess.run([sys.executable, "-c", _DUMP, __file__], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        there = json.loads(done.stdout)
        different = sorted(case for case in CASES if there[case] != here[case])
        assert not different, f"PYTHONHASHSEED={seed} renders different sources for {different}"


def test_snapshot_cases_cover_every_mod():
    names = set()
    for score_mod, mask_mod in CASES.values():
        for mod in (score_mod, mask_mod):
            if mod is not None:
                names.add(mod.__qualname__.split(".")[0])
    # Factories return closures named after the factory (e.g. "sliding_window.<locals>...");
    # plain mods (causal_mask, noop_mask) are named after themselves.
    # causal_lower_right returns a causal(offset) mask; the rest build a mod's parameters.
    helpers = {"alibi_slopes", "doc_ids_from_lengths", "doc_ids_from_offsets", "tanh_approx",
               "causal_lower_right"}
    missing = set(M.__all__) - helpers - names
    assert not missing, f"mods without a snapshot case: {sorted(missing)}"



def test_gluon_forward_source(snapshot, monkeypatch):
    """The Gluon forward kernel (sm_90) for an ALiBi score_mod with a captured slope tensor,
    a document + causal mask_mod and GQA: planned as on a Hopper GPU, rendered on CPU."""
    from flexgen.runtime import plan as plan_module
    monkeypatch.setattr(plan_module, "gluon_unavailable", lambda query, D, Dv: None)
    plan_module.clear_memos()
    torch.manual_seed(0)
    q = torch.randn(2, 4, 300, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 333, 128, dtype=torch.bfloat16)
    slopes = torch.linspace(0.1, 0.8, 4)
    doc = torch.arange(333) // 97

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    bm = create_block_mask(document_causal, None, None, 300, 333, device="cpu")
    try:
        source = kernel_source(q, k, k, score_mod=alibi, block_mask=bm, enable_gqa=True,
                               kernel_options={"BACKEND": "gluon"})
    finally:
        plan_module.clear_memos()
    assert "@gluon.jit" in source and "gl.warp_specialize" in source
    assert normalize(source) == snapshot
