"""Golden sources of every kernel template, beyond the forward pointer kernel of test_snapshots.

tests/test_snapshots.py keeps one forward (pointer) kernel per mod in flexgen.mods; this
file keeps the other templates and variants: the forward's TMA variant and its float32
form (one pass over both block lists), the Gluon forward (no block mask, head dims 256 and
96), the backward's dQ and dK/dV kernels (pointer and TMA, and the dQ kernel's deterministic
fixed-point scatter), the Gluon dQ (deterministic too), dK/dV and fused kernels, with and
without a block mask, the fused backward's delta kernel, decode,
decode_merge (softmax and sigmoid), block_mask, block_lists and paged_write (linear and linear_decode: tests/test_linear.py),
and varlen_attention's forms of the forward (tl and Gluon) and backward kernels. Each case renders a spec the way the
runtime makes it (nothing is launched, so a CPU renders TMA and Gluon kernels too), with a
padded head dim (80 -> 128, 48 -> 64) where the template masks head-dim lanes. Files: tests/snapshots/test_template_snapshots/.

Rewrite them after an intended template change, and review the diff like code::

    python -m pytest tests/test_template_snapshots.py --snapshot-update

The TMA and deterministic variants are also compiled for sm_90 here (when the suite's
AOT check is on), from launches under the interpreter at small sizes.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention, kernel_source
from flexgen import mods as M
from flexgen.api import decode_kernel_source
from flexgen.codegen.cache import source
from flexgen.frontend.lowering import lower
from flexgen.frontend.trace import trace_cached
from flexgen.kernels.backward import delta_spec
from flexgen.kernels.paged import paged_write_spec
from flexgen.masks.builder import block_mask_spec, lists_spec
from flexgen.runtime import aot
import conftest
from test_snapshots import KernelSourceExtension, normalize


@pytest.fixture
def snapshot(snapshot):
    return snapshot.use_extension(KernelSourceExtension)


L = 128
DOC = M.doc_ids_from_lengths([40, 50, 38])
TMA = {"USE_TMA": True}


@contextlib.contextmanager
def deterministic(on: bool):
    """torch's deterministic mode, which makes the dQ kernel scatter in fixed point."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def qkv(Lq=L, D=64, Dv=64, Lkv=L, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, Lq, D, generator=gen).to(dtype)
    k = torch.randn(1, 2, Lkv, D, generator=gen).to(dtype)
    v = torch.randn(1, 2, Lkv, Dv, generator=gen).to(dtype)
    return q, k, v


def rel_bias():
    """A score_mod with a captured tensor that requires grad: the dQ kernel scatters its gradient."""
    return M.relative_position_bias(torch.zeros(4, 2 * L - 1, requires_grad=True), L)


def attention(part, score_mod=None, mask_mod=None, options=None, det=False, Lq=L, D=64, Dv=64,
              dtype=torch.bfloat16):
    """The source of one of flex_attention's kernels (``part``: forward, dq or dkdv)."""
    def render():
        q, k, v = qkv(Lq, D, Dv, dtype=dtype)
        mask = None if mask_mod is None else create_block_mask(mask_mod, 1, None, Lq, L, device="cpu")
        with deterministic(det):
            return kernel_source(q, k, v, score_mod, mask, enable_gqa=True, kernel_options=options,
                                 part=part)
    return render


def gluon(part, score_mod=None, mask_mod=None, D=64, block=None, det=False):
    """A Gluon kernel (sm_90; ``part`` "forward", "dq", "dkdv" or "fused"), planned as on a Hopper GPU
    and rendered on CPU."""
    def render():
        from flexgen.runtime import plan as plan_module
        real = plan_module.gluon_unavailable
        plan_module.gluon_unavailable = lambda query, D, Dv: None
        plan_module.clear_memos()
        try:
            q, k, v = qkv(L, D, D)
            mask = None if mask_mod is None else create_block_mask(
                mask_mod, 1, None, L, L, device="cpu", **({} if block is None else {"BLOCK_SIZE": block}))
            with deterministic(det):
                return kernel_source(q, k, v, score_mod, mask, enable_gqa=True,
                                     kernel_options={"BACKEND": "gluon"}, part=part)
        finally:
            plan_module.gluon_unavailable = real
            plan_module.clear_memos()
    return render


def learned_relative_bias():
    """A score_mod reading a relative-position table that wants a gradient."""
    table = torch.linspace(-1.0, 1.0, 2 * L).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + L]
    return score_mod


def decode_api(score_mod, mask_mod, D=64, Dv=64):
    """decode_attention's kernel (a mask_mod evaluated per position, no block lists)."""
    def render():
        q, k, v = qkv(4, D, Dv)
        return decode_kernel_source(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True)
    return render


def decode_merge(Dv, sigmoid=False):
    """The kernel merging decode's splits, from the plan of a one-query call (sigmoid_attention's
    with ``sigmoid``: its splits' sums add, no LSE)."""
    def render():
        q, k, v = qkv(1, 64, Dv)
        if not sigmoid:
            return source(flexgen.api.plan(q, k, v, enable_gqa=True).decode.merge_spec)
        from flexgen.api import _mods, check_scale
        from flexgen.runtime.options import parse_options
        from flexgen.runtime.plan import plan_sigmoid
        plan = plan_sigmoid(q, k, v, *_mods(None, None), check_scale(None, 64), True, parse_options(None).text)
        return source(plan.decode.merge_spec)
    return render


def block_mask(mask_mod, dense=False):
    """The block-mask builder kernel of a mask_mod (the one create_block_mask launches: over a
    list of undecided blocks on the CPU, over every block in place on a GPU)."""
    def render():
        return source(block_mask_spec(lower(trace_cached(mask_mod, "mask_mod")), dense=dense))
    return render


def paged_write(D, Dv):
    """The kernel writing new keys and values into a paged cache [pages, page_size, Hkv, D]."""
    def render():
        k_cache = torch.zeros(8, 16, 2, D, dtype=torch.bfloat16)
        v_cache = torch.zeros(8, 16, 2, Dv, dtype=torch.bfloat16)
        return source(paged_write_spec(k_cache, v_cache))
    return render


def varlen(part, score_mod=None, mask_mod=None, gluon=False):
    """A kernel of varlen_attention (``part``: forward, dq or dkdv) over packed sequences of
    ragged lengths, its forward planned as on a Hopper GPU with ``gluon``."""
    def render():
        from flexgen.runtime import plan as plan_module
        from flexgen.runtime.options import parse_options
        real = plan_module.gluon_unavailable
        if gluon:
            plan_module.gluon_unavailable = lambda query, D, Dv: None
        plan_module.clear_memos()
        try:
            lengths = torch.tensor([0, 40, 43, 243], dtype=torch.int32)
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(243, h, 64, generator=gen).to(torch.bfloat16) for h in (4, 2, 2))
            s = None if score_mod is None else trace_cached(score_mod, "score_mod")
            m = None if mask_mod is None else trace_cached(mask_mod, "mask_mod")
            plan = plan_module.plan_varlen(q, k, v, lengths, lengths, s.graph if s else "",
                                           s.buffers if s else (), m.graph if m else "",
                                           m.buffers if m else (), 0.125, True,
                                           parse_options({"BACKEND": "gluon"} if gluon else None).text)
            if part == "forward":
                return source(plan.spec)
            return source(getattr(plan_module.plan_varlen_backward(plan, q, k, v, ()), part))
        finally:
            plan_module.gluon_unavailable = real
            plan_module.clear_memos()
    return render


def window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= 32)


PAD = dict(D=80, Dv=48)
# id -> (template, what the source must show, a function rendering it).
CASES = {
    # forward, TMA
    "forward_tma_softcap_causal": ("forward", "K.load(", attention("forward", M.tanh_softcap(30.0),
                                                                   M.causal_mask, TMA)),
    "forward_tma_padded_alibi_document": ("forward", "K.load(", attention(
        "forward", M.alibi(slopes=M.alibi_slopes(4)), M.document_mask(DOC), TMA, **PAD)),
    "forward_tma_no_mask": ("forward", "K.load(", attention("forward", options=TMA)),
    # forward, float32: one loop over the partial and the full blocks, mask_mod under a branch
    "forward_float32_softcap_document": ("forward", "if in_partial:", attention(
        "forward", M.tanh_softcap(30.0), M.document_mask(DOC), dtype=torch.float32)),
    # forward, Gluon (sm_90): no block lists; head dim 256 (64-key slots, two deep); 96 padded to 128
    "forward_gluon_no_mask": ("forward_gluon", "sparse_q, sparse_kv = BLOCK_M, BLOCK_N", gluon("forward")),
    "forward_gluon_softcap_causal_d256": ("forward_gluon", "BLOCK_N = 64", gluon(
        "forward", M.tanh_softcap(30.0), M.causal_mask, D=256)),
    "forward_gluon_padded_alibi_document_d96": ("forward_gluon", "HEAD_COLS = 128", gluon(
        "forward", M.alibi(slopes=M.alibi_slopes(4)), M.document_mask(DOC), D=96)),
    # backward: dQ
    "dq_relbias_window": ("backward", "tl.atomic_add(", attention("dq", rel_bias(), M.sliding_window(32))),
    "dq_deterministic_relbias_window": ("backward", "tl.floor(g_val", attention(
        "dq", rel_bias(), M.sliding_window(32), det=True)),
    "dq_tma_relbias_window": ("backward", "K.load(", attention("dq", rel_bias(), M.sliding_window(32), TMA)),
    "dq_tma_deterministic_relbias_window": ("backward", "tl.floor(g_val", attention(
        "dq", rel_bias(), M.sliding_window(32), TMA, det=True)),
    "dq_padded_no_mods": ("backward", "< 48", attention("dq", **PAD)),
    # backward: dK / dV
    "dkdv_softcap_causal": ("backward", "FULL_Q_IDX", attention("dkdv", M.tanh_softcap(30.0), M.causal_mask)),
    "dkdv_tma_softcap_causal": ("backward", "Q.load(", attention("dkdv", M.tanh_softcap(30.0),
                                                                M.causal_mask, TMA)),
    "dkdv_tma_padded_no_mods": ("backward", "DV.store(", attention("dkdv", options=TMA, **PAD)),
    "dkdv_padded_alibi_document": ("backward", "< 80", attention(
        "dkdv", M.alibi(slopes=M.alibi_slopes(4)), M.document_mask(DOC), **PAD)),
    # backward: the Gluon dK/dV kernel (sm_90): two consumer warpgroups, and one (KV_BLOCK 64)
    "dkdv_gluon_softcap_causal": ("backward_gluon", "warpgroup_mma(", gluon(
        "dkdv", M.tanh_softcap(30.0), M.causal_mask)),
    "dkdv_gluon_alibi_document_kv64_d128": ("backward_gluon", "CONSUMERS = gl.constexpr(1)", gluon(
        "dkdv", M.alibi(slopes=M.alibi_slopes(4)), M.document_mask(DOC), D=128, block=(128, 64))),
    "dq_gluon_softcap_causal_d128": ("backward_gluon", "dq = warpgroup_mma(ds_op", gluon(
        "dq", M.tanh_softcap(30.0), M.causal_mask, D=128)),
    "dq_gluon_alibi_document": ("backward_gluon", "delta_r = gl.sum(", gluon(
        "dq", M.alibi(slopes=M.alibi_slopes(4)), M.document_mask(DOC))),
    # without a block mask: every tile, unmasked (no lists)
    "dq_gluon_no_mask": ("backward_gluon", "sparse_q, sparse_kv = BLOCK_M, BLOCK_N", gluon("dq")),
    "dkdv_gluon_no_mask": ("backward_gluon", "return 0, gl.cdiv(Q_LEN, TILE_M)", gluon("dkdv")),
    # ... adding a learned relative-position table's gradient, a sum per tile diagonal
    "dq_gluon_learned_relative_causal": ("backward_gluon", "g_rot = gl.gather(g_tile", gluon(
        "dq", learned_relative_bias(), M.causal_mask)),
    # ... and in deterministic mode, its sums as int64 fixed point
    "dq_gluon_deterministic_relbias_window": ("backward_gluon", "gl.floor(g_val", gluon(
        "dq", rel_bias(), M.sliding_window(32), det=True)),
    # backward: the fused Gluon kernel (dK, dV, and dQ by TMA reduce-adds): its warpgroups
    # share the dSᵀ tile and split dQ's columns (at head dim 128 the tile is dK's operand too),
    # except at head dim 128 under a soft-cap; and the kernel before it (delta, the zeroed sum)
    "fused_gluon_softcap_causal_d128": ("backward_gluon", "_tma_atomic_add(DQ", gluon(
        "fused", M.tanh_softcap(30.0), M.causal_mask, D=128)),
    "fused_gluon_causal_d128": ("backward_gluon", "dk = warpgroup_mma(ds_bufs", gluon(
        "fused", None, M.causal_mask, D=128)),
    "fused_gluon_softcap_causal": ("backward_gluon", "mbarrier.wait(ds_ready", gluon(
        "fused", M.tanh_softcap(30.0), M.causal_mask)),
    # (without a block mask: plain rows at head dim 128, as AUTO fuses them)
    "fused_gluon_no_mask_d128": ("backward_gluon", "return 0, gl.cdiv(Q_LEN, TILE_M)", gluon("fused", D=128)),
    "backward_delta": ("backward_delta", "tl.sum(", lambda: source(delta_spec(128, 128, torch.bfloat16))),
    "backward_delta_padded": ("backward_delta", "< 48", lambda: source(delta_spec(**PAD, dtype=torch.float16))),
    # decode (a few queries)
    "decode_softcap_document": ("decode", "VISIT_IDX", attention("forward", M.tanh_softcap(30.0),
                                                                 M.document_mask(DOC), Lq=1)),
    "decode_padded_no_mods": ("decode", "< 48", attention("forward", Lq=1, **PAD)),
    "decode_api_alibi_causal": ("decode", "q_idx", decode_api(M.alibi(4), M.causal_mask)),
    "decode_merge": ("decode_merge", "L_PART", decode_merge(64)),
    "decode_merge_padded": ("decode_merge", "< 48", decode_merge(48)),
    "decode_merge_sigmoid": ("decode_merge", "acc += tl.load(O_PART", decode_merge(64, sigmoid=True)),
    # varlen_attention: packed sequences, a mask's band in place of block lists
    "forward_varlen_softcap_window": ("forward", "full_hi", varlen("forward", M.tanh_softcap(20.0), window)),
    "forward_gluon_varlen_causal": ("forward_gluon", "cu_q", varlen("forward", None, M.causal_mask, gluon=True)),
    "dq_varlen_softcap_window": ("backward", "cu_q", varlen("dq", M.tanh_softcap(20.0), window)),
    "dkdv_varlen_alibi_causal": ("backward", "cu_k", varlen("dkdv", M.alibi(4), M.causal_mask)),
    # block-mask builder
    "block_mask_document": ("block_mask", "mask_buf", block_mask(M.document_mask(DOC))),
    "block_mask_sliding_window": ("block_mask", "HITS", block_mask(M.sliding_window(32))),
    "block_mask_dense_document": ("block_mask", "TOTAL", block_mask(M.document_mask(DOC), dense=True)),
    # the lists of a block mask from its flags (no mod: one kernel for every mask)
    "block_lists": ("block_lists", "tl.cumsum(", lambda: source(lists_spec())),
    # paged KV cache writes
    "paged_write": ("paged_write", "K_CACHE", paged_write(64, 64)),
    "paged_write_padded": ("paged_write", "< 48", paged_write(**PAD)),
}


@pytest.mark.parametrize("case_id", CASES)
def test_template_source(case_id, snapshot):
    template, shows, render = CASES[case_id]
    text = render()
    assert f'from the template "{template}"' in text
    assert shows in text, f"the {case_id} kernel should contain {shows!r}"
    assert normalize(text) == snapshot


def test_tma_snapshots_are_tma_and_pointer_ones_are_not():
    for case_id, (template, _, render) in CASES.items():
        if template in ("forward", "backward"):
            assert ("tma" in case_id) == ("_descriptor(" in render()), case_id


def test_snapshot_files_are_there():
    folder = Path(__file__).parent / "snapshots" / "test_template_snapshots"
    assert {p.name for p in folder.glob("*.py.txt")} == {
        f"test_template_source[{case}].py.txt" for case in CASES}


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_tma_and_deterministic_kernels_compile_for_sm90():
    """The TMA forward, dQ and dK/dV kernels with a block mask, a padded head dim and a
    captured tensor whose gradient the dQ kernel scatters in fixed point (deterministic
    mode, a combination no other test launches) compile to sm_90 code with TMA copies."""
    n = 40
    table = torch.zeros(2, 2 * n - 1, requires_grad=True)
    score_mod = M.relative_position_bias(table, n)
    mask = create_block_mask(M.causal_mask, None, None, n, n, device="cpu", BLOCK_SIZE=32)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=gen).to(torch.bfloat16).requires_grad_()
               for d in (80, 80, 48))
    with deterministic(True), aot.recording() as launches:
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, kernel_options=TMA)
        # A contiguous upstream gradient: an expanded one (out.sum()'s) takes the pointer kernels.
        out.backward(torch.randn(out.shape, generator=gen).to(out.dtype))
    assert sorted(spec.template for spec, _, _ in launches if spec.use_tma) == ["backward", "backward",
                                                                              "forward"]
    assert any(getattr(spec, "deterministic", False) for spec, _, _ in launches)
    for spec, args, constexprs in launches:
        compiled = aot.compile_launch(spec, args, constexprs)
        assert compiled.asm.get("cubin"), spec.kernel_name
        if spec.template in ("forward", "backward"):
            assert "cp.async.bulk.tensor" in compiled.asm["ptx"], spec.kernel_name
