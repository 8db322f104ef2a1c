"""The Gluon backward kernels (sm_90): dK/dV and dQ.

``templates/backward_gluon.py.jinja`` renders both parts from the tl specs' fields (the same
printed mods and derivatives). dK/dV: a program owns BLOCK_N keys, 64 per consumer
warpgroup, with K and V in shared memory; a TMA producer warp streams Q and dO tiles of the
query blocks the keys meet (the block mask's transposed lists, every head of the GQA group)
through an mbarrier ring; the consumers compute Sᵀ = K Qᵀ and dPᵀ = V dOᵀ with async wgmma,
recompute Pᵀ from the LSE, and accumulate dV += Pᵀ dO, dK += dSᵀ Q in registers. dQ: a
program owns BLOCK_M queries, 64 per consumer warpgroup, with Q and dO in shared memory, and
the producer streams the K and V tiles of the kv lists; it writes delta and accumulates
dQ += dS K, and adds the gradients of a score_mod's captured tensors with atomics, as the tl
dQ kernel does (one macro, ``common.scatter_gradients``, renders both).

Gluon does not run in Triton's interpreter: on CPU this file checks the choice and its
refusals, and that every variant compiles for sm_90 with the installed Triton (3.6 and the
newest). The comparisons with the float64 oracle need an sm_90 GPU and are skipped elsewhere.
"""
from __future__ import annotations

import re

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen import mods as M
from flexgen.codegen import cache
from flexgen.errors import InputError
from flexgen.frontend.trace import trace_cached
from flexgen.kernels import backward as backward_module
from flexgen.kernels.backward import grad_slots
from flexgen.masks.block_mask import mask_inputs
from flexgen.reference import flex_attention_reference
from flexgen.runtime import aot, launch
from flexgen.runtime import plan as plan_module

import conftest
from conftest import make_qkv

# The Gluon forward's tests' switches and mods (as_if_hopper: plan Gluon kernels for CPU tensors).
from test_forward_gluon import (GLUON, alibi_bias, as_if_hopper, doc_mask, needs_hopper, seconds_mods,  # noqa: E402,F401
                                relative_bias, uniform)


@pytest.fixture(autouse=True)
def two_kernels(monkeypatch):
    """The two-kernel Gluon backward unless a test asks for the fused one (fused_backward)."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", False)


def backward_plan(q, k, v, score=None, bm=None, options=GLUON):
    call = flexgen.api.plan(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True,
                            kernel_options=options)
    buffers = () if score is None else trace_cached(score, "score_mod").buffers
    return call, plan_module.plan_backward(call, q, k, v, grad_slots(buffers))


def gluon_backward_launch(q, k, v, score, bm, part, options=GLUON, dlse=None):
    """(spec, grid, args, constexprs) of the Gluon backward kernel ``part`` ("dq", "dkdv" or
    "fused", which plan.GLUON_FUSED decides) for these CPU inputs and mods, as the runtime
    would launch it (planned as if on Hopper: ``as_if_hopper``; ``dlse``: the LSE's gradient);
    None where the plan has no such kernel."""
    _, bw = backward_plan(q, k, v, score, bm, options)
    spec = {"dq": bw.gluon_dq, "dkdv": bw.gluon_dkdv, "fused": bw.gluon_fused}[part]
    if spec is None:
        return None
    module = cache.load(spec, interpret=False)
    B, H, Lq, _ = q.shape
    _, _, lists, block_size, _ = mask_inputs(bm)
    sparse = None if bm is None else backward_module._lists(lists[:4] if part == "dq" else lists[4:], B, H,
                                                            block_size)
    lse = torch.empty(B, H, Lq)
    score_buffers = () if score is None else trace_cached(score, "score_mod").buffers
    mask_buffers = () if bm is None else trace_cached(bm.mask_mod, "mask_mod").buffers
    grid, args, constexprs = module.arguments(
        q=q, k=k, v=v, out=torch.empty_like(q), dout=torch.empty_like(q), lse=lse, dlse=dlse, delta=lse,
        # (the fused kernel's dQ: the float32 sum its reduce-adds go to)
        dq=torch.empty(q.shape) if part == "fused" else torch.empty_like(q), dk=torch.empty_like(k),
        dv=torch.empty_like(v), sparse=sparse, score_buffers=score_buffers, mask_buffers=mask_buffers,
        grad_buffers=backward_module.gradient_buffers(bw, score_buffers, "cpu") if part == "dq" else (),
        scale=0.125)
    return spec, grid, args, constexprs


# ------------------------------------------------------------------------- the choice

def test_backend_gluon_plans_the_gluon_backward_kernels(as_if_hopper):
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=300, D=64, dtype=torch.bfloat16)
    _, bw = backward_plan(q, k, v)
    assert bw.gluon_dkdv.template == "backward_gluon" and bw.gluon_dkdv.part == "dkdv"
    assert bw.gluon_dq.template == "backward_gluon" and bw.gluon_dq.part == "dq"
    assert bw.dkdv.template == "backward" and bw.dq.template == "backward"
    assert (bw.gluon_dkdv.block_m, bw.gluon_dkdv.block_n) == (128, 128)
    assert (bw.gluon_dq.block_m, bw.gluon_dq.block_n) == (128, 128)
    assert "CONSUMERS = gl.constexpr(2)" in cache.source(bw.gluon_dq)
    _, tl_bw = backward_plan(q, k, v, options={"BACKEND": "tl"})
    assert tl_bw.gluon_dkdv is None and tl_bw.gluon_dq is None


def test_learned_captured_tensors_take_the_gluon_dq_kernel_under_backend_gluon(as_if_hopper, monkeypatch):
    """The Gluon dQ kernel adds a learned tensor's gradient as the tl one does (the same
    scatter, one macro); BACKEND "gluon" takes it, AUTO only under GLUON_DQ_SCATTERS. The
    fused kernel adds none: such a backward keeps the two kernels."""
    q, k, v = make_qkv(B=1, H=4, L=300, D=64, dtype=torch.bfloat16)
    monkeypatch.setattr(plan_module, "GLUON_FUSED", True)
    _, bw = backward_plan(q, k, v, relative_bias(4, 300, 300, learned=True))
    assert bw.dq.scatters and bw.gluon_dq.scatters == bw.dq.scatters and bw.gluon_fused is None
    source = cache.source(bw.gluon_dq)
    assert "gl.atomic_add(gl.convert_layout(g_ptr" in source and "gl.gather(g_tile" in source
    assert "sbuf0_grad_ptr" in cache.load(bw.gluon_dq, interpret=False).KERNEL.arg_names
    big = make_qkv(B=1, H=64, L=4096, D=128, dtype=torch.bfloat16)
    assert backward_plan(*big, learned_bias(64), options=None)[1].gluon_dq is None
    monkeypatch.setattr(plan_module, "GLUON_DQ_SCATTERS", True)
    plan_module.clear_memos()       # (the plan keeps its backward)
    assert backward_plan(*big, learned_bias(64), options=None)[1].gluon_dq.scatters


def test_gluon_dq_diagonal_sums_take_keys_that_fit_shared_memory(as_if_hopper):
    """A gradient summed per tile diagonal rotates each consumer's float32 tile through shared
    memory: at head dim 128 the dQ kernel steps 64 keys (128 keys beside a ring of two would
    need 256 KB); asked for 128 under BACKEND "gluon", it is refused naming the reason."""
    q, k, v = make_qkv(B=1, H=4, L=512, D=128, dtype=torch.bfloat16)
    learned = relative_bias(4, 512, 512, learned=True)
    spec = backward_plan(q, k, v, learned)[1].gluon_dq
    assert spec.block_n == 64 and plan_module._dq_shared_bytes(
        {"BLOCK_M": spec.block_m, "BLOCK_N": 64}, spec.num_stages, 128, True) <= plan_module.GLUON_SHARED_BYTES
    assert backward_plan(q, k, v, relative_bias(4, 512, 512))[1].gluon_dq.block_n == 128   # nothing to sum
    with pytest.raises(InputError, match="summed per diagonal"):
        backward_plan(q, k, v, learned, options=dict(GLUON, BLOCK_N2=128, num_stages=2))
    q, k, v = make_qkv(B=1, H=4, L=512, D=64, dtype=torch.bfloat16)
    assert backward_plan(q, k, v, relative_bias(4, 512, 512, learned=True))[1].gluon_dq.block_n == 128


def symmetric_alibi(H):
    """A score_mod computing a tile of both positions per element (|kv_idx - q_idx| is no
    key term plus row term, unlike ALiBi's kv_idx - q_idx: flexgen.frontend.terms)."""
    slopes = torch.linspace(0.1, 0.8, H)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (kv_idx - q_idx).abs()
    return score_mod


def test_gluon_dq_tiles_follow_the_blocks_the_score_mod_and_the_options(as_if_hopper):
    """Head dim 128 steps 128 keys, unless the score_mod computes a tile of both positions
    (its registers would spill; ALiBi, a key term plus a row term, does not), the kv block is
    64 or BLOCK_N2 says; BLOCK_M2 sets the rows."""
    q, k, v = make_qkv(L=256, D=128, dtype=torch.bfloat16)
    assert (backward_plan(q, k, v)[1].gluon_dq.block_n, backward_plan(q, k, v)[1].gluon_dq.num_stages) == (128, 2)
    assert backward_plan(q, k, v, M.tanh_softcap(30.0))[1].gluon_dq.block_n == 128
    assert backward_plan(q, k, v, alibi_bias(4))[1].gluon_dq.block_n == 128
    assert backward_plan(q, k, v, symmetric_alibi(4))[1].gluon_dq.block_n == 64
    bm64 = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=(128, 64))
    assert backward_plan(q, k, v, bm=bm64)[1].gluon_dq.block_n == 64
    assert backward_plan(q, k, v, options=dict(GLUON, BLOCK_M2=64, BLOCK_N2=128))[1].gluon_dq.block_m == 64
    # (a Q_BLOCK of 64 under AUTO: BACKEND "gluon" refuses it for the forward kernel)
    big = make_qkv(B=1, H=64, L=4096, D=128, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu", BLOCK_SIZE=(64, 128))
    assert backward_plan(*big, bm=bm, options=None)[1].gluon_dq.block_m == 64
    with pytest.raises(InputError, match="BLOCK_N2 32"):
        backward_plan(q, k, v, options=dict(GLUON, BLOCK_N2=32))


@pytest.mark.parametrize("D, score, auto", [
    (64, None, True), (64, M.tanh_softcap(30.0), True), (64, "alibi", True), (64, "symmetric", False),
    (128, None, False)])
def test_auto_takes_the_gluon_backward_kernels_where_they_are_ahead(as_if_hopper, D, score, auto):
    """AUTO, for calls of at least GLUON_BACKWARD_MIN_SCORES scores, takes the kernels where the
    H100 measured them faster: the Gluon dK/dV kernel where it steps 128 query rows (head dim
    64, a score_mod not computing a tile of both positions), the Gluon dQ kernel at head dim
    128 and under a block mask at 64; the tl kernels elsewhere."""
    q, k, v = make_qkv(B=1, H=64, L=4096, D=D, dtype=torch.bfloat16)
    both = score == "symmetric"
    score = {"alibi": alibi_bias(64), "symmetric": symmetric_alibi(64)}.get(score, score)
    _, bw = backward_plan(q, k, v, score, options=None)
    assert (bw.gluon_dkdv is not None) == auto
    if auto:
        assert bw.gluon_dkdv.block_m == 128
    # (the Gluon dQ kernel: at head dim 128 for every mod at this size; at 64 under a block mask
    # only, stepping 128 keys)
    assert (bw.gluon_dq is not None) == (D == 128)
    if D == 64:
        bm = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu")
        assert (backward_plan(q, k, v, score, bm, options=None)[1].gluon_dq is not None) == (not both)
        window = create_block_mask(M.sliding_window(1024), None, None, 4096, 4096, device="cpu")
        assert backward_plan(q, k, v, score, window, options=None)[1].gluon_dq is None
    small = make_qkv(B=1, H=2, L=1024, D=D, dtype=torch.bfloat16)
    small_bw = backward_plan(*small, score, options=None)[1]
    assert small_bw.gluon_dkdv is None and small_bw.gluon_dq is None


def test_gluon_dkdv_query_rows_follow_the_query_block_and_the_score_mod(as_if_hopper):
    """Head dim 64 steps 128 queries, unless the block mask's Q_BLOCK is 64, the score_mod
    computes a tile of both positions (its registers would spill), or BLOCK_M1 says."""
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    assert backward_plan(q, k, v)[1].gluon_dkdv.block_m == 128
    assert backward_plan(q, k, v, M.tanh_softcap(30.0))[1].gluon_dkdv.block_m == 128
    assert backward_plan(q, k, v, alibi_bias(4))[1].gluon_dkdv.block_m == 128
    assert backward_plan(q, k, v, symmetric_alibi(4))[1].gluon_dkdv.block_m == 64
    assert backward_plan(q, k, v, symmetric_alibi(4), options=dict(GLUON, BLOCK_M1=128))[1].gluon_dkdv.block_m == 128
    # (BACKEND "gluon" refuses a Q_BLOCK of 64 for the forward kernel: AUTO's plan at a size it
    # would take, which keeps the tl kernel there, and the Gluon spec asked of it directly)
    big = make_qkv(B=1, H=64, L=4096, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu", BLOCK_SIZE=(64, 128))
    call, bw = backward_plan(*big, bm=bm, options=None)
    assert bw.gluon_dkdv is None
    assert plan_module.gluon_backward_spec(call, *big, bw.dkdv)[0].block_m == 64
    assert backward_plan(q, k, v, options=dict(GLUON, BLOCK_M1=64))[1].gluon_dkdv.block_m == 64


def test_kv_blocks_of_64_take_one_consumer_warpgroup(as_if_hopper):
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=(128, 64))
    _, bw = backward_plan(q, k, v, bm=bm)
    assert bw.gluon_dkdv.block_n == 64
    assert "CONSUMERS = gl.constexpr(1)" in cache.source(bw.gluon_dkdv)


def test_dkdv_producer_puts_the_rows_statistics_beside_the_q_tile(as_if_hopper):
    """The dK/dV kernel's producer loads each query tile's LSE (in base 2, less an ALiBi-like
    mod's row term) and delta rows into the Q tile's slot, then arrives on its Q barrier (which
    counts two arrivals: the expect's and this one); the consumers read them from shared memory
    where used, with no loads of their own (loaded and spread over the score tile's columns by
    the consumers, they waited on a barrier every tile)."""
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    text = cache.source(backward_plan(q, k, v, alibi_bias(4))[1].gluon_dkdv)
    producer, consumer = text.split("def _producer(")[1].split("def _consumer(")
    assert "gl.load(LSE" in producer and "gl.load(DELTA" in producer
    assert "lse2_r = lse2_r - (bias2 + query_step2 * (offs_r - anchor_pos)" in producer
    assert "mbarrier.arrive(q_ready.index(s), count=1)" in producer
    assert "gl.load(LSE" not in consumer and "gl.load(DELTA" not in consumer
    assert "rows_bufs.index(2 * s).load(queries)" in consumer
    assert "mbarrier.init(q_ready.index(i), count=2)" in text


def test_tiles_it_cannot_take_are_refused(as_if_hopper):
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="BLOCK_M1 32"):
        backward_plan(q, k, v, options=dict(GLUON, BLOCK_M1=32))


def test_cpu_tensors_are_refused_with_the_reason():
    q, k, v = make_qkv(L=200, D=64, dtype=torch.bfloat16)
    call = flexgen.api.plan(q, k, v)
    bw = plan_module.plan_backward(call, q, k, v, ())
    why = plan_module.gluon_backward_spec(call, q, k, v, bw.dkdv)[1]
    assert "CUDA GPUs only" in why


def test_sigmoid_and_varlen_backwards_never_take_it(as_if_hopper):
    q, k, v = make_qkv(B=1, H=2, L=300, D=64, dtype=torch.bfloat16)
    bw = plan_module.plan_sigmoid_backward(q, k, v, "", (), "", (), (), (), (), 0.125, False, "", ())
    assert bw.gluon_dkdv is None and bw.dkdv.activation == "sigmoid"


# ------------------------------------------------------------------------- sm_90 compile

def learned_bias(H=4, device="cpu"):
    """A score_mod whose captured tensor requires grad: the dQ kernels scatter its gradient
    (a sum over the whole tile), the dK/dV kernels only read it."""
    bias = torch.linspace(-0.5, 0.5, H, device=device).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h]
    return score_mod


# name -> (D, dtype, H, Hkv, Lq, Lkv, score_mod, mask_mod, BLOCK_SIZE, kernel_options)
CASES = {
    "dense_d128_bf16": (128, torch.bfloat16, 4, 4, 256, 256, None, None, None, {}),
    "causal_d64_fp16": (64, torch.float16, 4, 4, 300, 300, None, M.causal_mask, 128, {}),
    "alibi_document_gqa_d128": (128, torch.bfloat16, 4, 2, 300, 333, "alibi", "doc", 128, {}),
    "softcap_sliding_d64_kv64": (64, torch.bfloat16, 2, 1, 257, 200, M.tanh_softcap(20.0),
                                 M.sliding_window(100), (128, 64), {}),
    "learned_bias_causal_d64_m128": (64, torch.float16, 4, 2, 300, 300, "learned", M.causal_mask, 128,
                                     {"BLOCK_M1": 128}),
    # A learned relative-position table: its gradient summed along each tile diagonal first.
    "learned_relbias_document_gqa_d128": (128, torch.bfloat16, 4, 2, 300, 300, "learned_relbias", "doc",
                                          128, {}),
    "causal_d128_m128": (128, torch.bfloat16, 2, 2, 256, 256, None, M.causal_mask, 128, {"BLOCK_M1": 128}),
    # A constant score_mod (uniform weights over a document; its derivative 0: dQ and dK are 0).
    "uniform_document_d64": (64, torch.bfloat16, 2, 2, 300, 300, "uniform", "doc", 128, {}),
    # Soft-capping at head dim 128: the fused kernel's warpgroups keep their own dSᵀ rows.
    "softcap_causal_gqa_d128": (128, torch.bfloat16, 4, 2, 300, 300, M.tanh_softcap(20.0), M.causal_mask, 128, {}),
    # A learned relative-position table exactly the size the call needs: proven loads at
    # clamped positions in both kernels.
    "relbias_causal_gqa_d64": (64, torch.bfloat16, 4, 2, 300, 333, "relbias", M.causal_mask, 128, {}),
    # Lengths that are multiples of the blocks (EVEN): partial tiles mask with mask_mod alone.
    "document_even_gqa_d64": (64, torch.bfloat16, 4, 2, 512, 512, None, "doc", 128, {}),
    "sliding_even_d128": (128, torch.bfloat16, 2, 2, 512, 512, None, M.sliding_window(100), 128, {}),
    "seconds_d128": (128, torch.bfloat16, 2, 2, 300, 300, "seconds", "seconds", 128, {}),
}


def case_inputs(name, device="cpu"):
    D, dtype, H, Hkv, Lq, Lkv, score, mask, block, options = CASES[name]
    q, k, v = make_qkv(B=2, H=H, Hkv=Hkv, L=Lq, Lkv=Lkv, D=D, dtype=dtype, device=device)
    score = {"alibi": lambda: alibi_bias(H, device), "learned": lambda: learned_bias(H, device),
             "relbias": lambda: relative_bias(H, Lq, Lkv, device),
             "learned_relbias": lambda: relative_bias(H, Lq, Lkv, device, learned=True),
             "uniform": lambda: uniform, "seconds": lambda: seconds_mods(max(Lq, Lkv), device)[0],
             }.get(score, lambda: score)()
    mask = doc_mask(max(Lq, Lkv), device) if mask == "doc" else mask
    mask = seconds_mods(max(Lq, Lkv), device)[1] if mask == "seconds" else mask
    bm = None if mask is None else create_block_mask(mask, None, None, Lq, Lkv, device=device,
                                                     BLOCK_SIZE=block)
    return q, k, v, score, bm, dict(GLUON, **options)


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
@pytest.mark.parametrize("part", ["dq", "dkdv", "fused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_backward_compiles_for_sm90(as_if_hopper, monkeypatch, name, part):
    """Each variant of the three kernels compiles to a cubin for sm_90 with the installed
    Triton, with the argument types of a real launch (Gluon TMA descriptors, the lists,
    captured tensors, their gradient buffers); a score_mod whose captured tensors want
    gradients has no fused kernel, nor have 128 query rows at head dim 128 one."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", part == "fused")
    q, k, v, score, bm, options = case_inputs(name)
    launch = gluon_backward_launch(q, k, v, score, bm, part, options)
    if part == "fused" and (name == "causal_d128_m128" or backward_plan(q, k, v, score, bm, options)[1].dq.scatters):
        assert launch is None
        return
    spec, grid, args, constexprs = launch
    assert spec.template == "backward_gluon" and spec.part == part
    conftest.skip_outside_aot_sample(spec)
    B, H, Lq, _ = q.shape
    if part == "fused":
        assert "cp.reduce.async.bulk.tensor" in aot.compile_launch(spec, args, constexprs).asm["ptx"]
    if part == "dq":
        assert grid == (-(-Lq // spec.block_m) * B * H,)
    else:
        assert grid == (-(-k.shape[2] // spec.block_n) * B * k.shape[1],)
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    # Hopper's asynchronous matrix instructions and TMA copies, not a fallback.
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    if name == "causal_d64_fp16":   # a grid of many waves takes its programs row by row too
        assert constexprs["BLOCK_MAJOR"]
        assert aot.compile_launch(spec, args, dict(constexprs, BLOCK_MAJOR=False)).asm.get("cubin")


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_gluon_dq_lse_gradient_compiles_for_sm90(as_if_hopper):
    """A loss reading the LSE too: the dQ kernel subtracts its gradient from delta (HAS_DLSE), a
    variant the cases above, launched without one, never compile."""
    q, k, v, score, bm, options = case_inputs("causal_d64_fp16")
    dlse = torch.empty(q.shape[:3])
    spec, _, args, constexprs = gluon_backward_launch(q, k, v, score, bm, "dq", options, dlse=dlse)
    assert constexprs["HAS_DLSE"] and any(arg is dlse for arg in args)
    conftest.skip_outside_aot_sample(spec)
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_gluon_dq_deterministic_scatter_compiles_for_sm90(as_if_hopper):
    """Under torch.use_deterministic_algorithms the dQ kernel adds the gradients as int64 fixed
    point (the same order-free sums as the tl kernel's)."""
    q, k, v = make_qkv(B=1, H=4, L=300, D=64, dtype=torch.bfloat16)
    per_key = torch.randn(300).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + per_key[kv_idx]
    torch.use_deterministic_algorithms(True)
    try:
        _, bw = backward_plan(q, k, v, score_mod)
    finally:
        torch.use_deterministic_algorithms(False)
    spec = bw.gluon_dq
    assert spec.deterministic and spec.grad_buffers[0].dtype == "int64"
    conftest.skip_outside_aot_sample(spec)
    lse = torch.empty(1, 4, 300)
    grid, args, constexprs = cache.load(spec, interpret=False).arguments(
        q=q, k=k, v=v, out=torch.empty_like(q), dout=torch.empty_like(q), lse=lse, dlse=None, delta=lse,
        dq=torch.empty_like(q), dk=None, dv=None, sparse=None, score_buffers=[per_key.detach()],
        mask_buffers=(), grad_buffers=backward_module.gradient_buffers(bw, [per_key], "cpu"), scale=0.125)
    ptx = aot.compile_launch(spec, args, constexprs).asm["ptx"]
    adds = set(re.findall(r"\b(?:atom|red)\.[\w.]*add\.(\w+)", ptx))
    assert "u64" in adds and "f32" not in adds, adds


@pytest.mark.parametrize("D", [64, 128])
def test_auto_fuses_soft_capping_and_plain_rows_at_head_dim_128(as_if_hopper, monkeypatch, D):
    """AUTO (GLUON_FUSED None) takes the fused kernel for soft-capping (its derivative is not a
    constant) and, at head dim 128, without a score_mod or with one taken as key and row terms
    (ALiBi) under masks that read no captured tensor where its grid is 3.5 waves or more; not for
    a score_mod computing a tile of both positions, a document mask at head dim 128 or plain
    rows at 64, nor where the backward must be deterministic or a captured tensor wants a
    gradient."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", None)
    q, k, v = make_qkv(B=1, H=64, L=4096, D=D, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu")
    fused = backward_plan(q, k, v, M.tanh_softcap(30.0), bm, options=None)[1].gluon_fused
    assert fused.part == "fused" and fused.block_m == 64 and fused.num_stages == (2 if D == 128 else 3)
    for mask in (None, bm):
        plain = backward_plan(q, k, v, None, mask, options=None)[1].gluon_fused
        assert (plain is not None) == (D == 128)
    documents = create_block_mask(doc_mask(4096), None, None, 4096, 4096, device="cpu")
    assert backward_plan(q, k, v, None, documents, options=None)[1].gluon_fused is None
    assert (backward_plan(q, k, v, alibi_bias(64), bm, options=None)[1].gluon_fused is not None) == (D == 128)
    assert backward_plan(q, k, v, symmetric_alibi(64), bm, options=None)[1].gluon_fused is None
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_plan(q, k, v, M.tanh_softcap(30.0), bm, options=None)[1].gluon_fused is None
    finally:
        torch.use_deterministic_algorithms(False)
    # Plain rows fuse from 3.5 waves of programs (Llama's training shape: 8 KV heads x 64
    # programs of 128 keys, 3.9 waves on 132 SMs, where soft-capping fuses too); a grid of
    # fewer (32 over 4 KV heads: 1.9 waves) takes the two kernels.
    few = make_qkv(B=1, H=16, Hkv=8, L=8192, D=D, dtype=torch.bfloat16)
    causal = create_block_mask(M.causal_mask, None, None, 8192, 8192, device="cpu")
    assert (backward_plan(*few, None, causal, options=None)[1].gluon_fused is not None) == (D == 128)
    assert backward_plan(*few, M.tanh_softcap(30.0), causal, options=None)[1].gluon_fused is not None
    fewer = make_qkv(B=1, H=32, Hkv=4, L=8192, D=D, dtype=torch.bfloat16)
    assert backward_plan(*fewer, None, causal, options=None)[1].gluon_fused is None
    small = make_qkv(B=1, H=2, L=1024, D=D, dtype=torch.bfloat16)
    assert backward_plan(*small, M.tanh_softcap(30.0), options=None)[1].gluon_fused is None
    assert backward_plan(*small, M.tanh_softcap(30.0), options={"BACKEND": "tl"})[1].gluon_fused is None


@pytest.mark.parametrize("D", [64, 128])
def test_auto_follows_the_mods_loads_of_captured_tensors(as_if_hopper, monkeypatch, D):
    """Where the mods read captured tensors per element, AUTO fuses a score_mod adding a tensor
    read at the positions (a per-key bias: the two kernels would load it twice), from 3.5 waves,
    and at head dim 128 takes the Gluon dK/dV kernel at 64 query rows over the tl one for the
    rest (a document mask, a relative bias's table read at both positions), from
    GLUON_BACKWARD_MIN_SCORES_D128 on (with the Gluon dQ kernel unless a captured tensor wants
    a gradient); neither for a tensor read per head or plain rows left to the two kernels."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", None)
    q, k, v = make_qkv(B=1, H=64, L=4096, D=D, dtype=torch.bfloat16)
    causal = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu")
    documents = create_block_mask(doc_mask(4096), None, None, 4096, 4096, device="cpu")
    per_key, per_head = torch.randn(8192), torch.randn(64)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + per_key[kv_idx]

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + per_head[h]

    assert backward_plan(q, k, v, key_bias, causal, options=None)[1].gluon_fused is not None
    assert backward_plan(q, k, v, head_bias, causal, options=None)[1].gluon_fused is None
    assert backward_plan(q, k, v, key_bias, documents, options=None)[1].gluon_fused is None
    few = make_qkv(B=1, H=32, Hkv=4, L=8192, D=D, dtype=torch.bfloat16)     # 1.9 waves
    causal8k = create_block_mask(M.causal_mask, None, None, 8192, 8192, device="cpu")
    assert backward_plan(*few, key_bias, causal8k, options=None)[1].gluon_fused is None
    if D == 128:
        for score in (None, key_bias):
            gluon = backward_plan(q, k, v, score, documents, options=None)[1].gluon_dkdv
            assert gluon is not None and gluon.block_m == 64
        gluon = backward_plan(q, k, v, relative_bias(64, 4096, 4096), documents, options=None)[1].gluon_dkdv
        assert gluon is not None and gluon.block_m == 64
        # The small model's attention (2 x 8 heads x 4k, 2**28 scores: a learned relative bias
        # under a document mask): the Gluon dK/dV kernel, the tl dQ kernel (it scatters the
        # bias's gradient), nothing fused; a per-key bias there the Gluon dQ kernel too.
        small = make_qkv(B=2, H=8, L=4096, D=D, dtype=torch.bfloat16)
        docs2 = create_block_mask(doc_mask(4096), 2, None, 4096, 4096, device="cpu")
        for score, gluon_dq in ((relative_bias(8, 4096, 4096, learned=True), False), (key_bias, True)):
            bw = backward_plan(*small, score, docs2, options=None)[1]
            assert bw.gluon_dkdv is not None and (bw.gluon_dq is not None) == gluon_dq
            assert bw.gluon_fused is None
        # Plain causal rows there: the fused kernel (not the Gluon dK/dV kernel at 64 rows).
        plain = backward_plan(*small, None, causal, options=None)[1]
        assert plain.gluon_dkdv is None and plain.gluon_dq is not None and plain.gluon_fused is not None
        smaller = make_qkv(B=1, H=8, L=4096, D=D, dtype=torch.bfloat16)
        assert backward_plan(*smaller, None, documents, options=None)[1].gluon_dkdv is None
        torch.use_deterministic_algorithms(True)
        try:        # (plain rows, not fused: the tl kernel)
            assert backward_plan(q, k, v, None, causal, options=None)[1].gluon_dkdv is None
        finally:
            torch.use_deterministic_algorithms(False)


def test_kernel_source_shows_the_fused_kernel(as_if_hopper, monkeypatch):
    """kernel_source(part="fused") is the fused kernel's module where the plan takes it (at head
    dim 64: its warpgroups share the dSᵀ tile), and a clear refusal where it does not, or for
    sigmoid attention, whose backward never takes it."""
    q, k, v = make_qkv(B=1, H=2, L=256, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu")
    monkeypatch.setattr(plan_module, "GLUON_FUSED", True)
    text = flexgen.kernel_source(q, k, v, M.tanh_softcap(30.0), bm, kernel_options=GLUON, part="fused")
    assert "_tma_atomic_add(DQ" in text and "mbarrier.wait(ds_ready" in text
    with pytest.raises(InputError, match='"fused" for a call whose backward'):
        flexgen.sigmoid_kernel_source(q, k, v, None, bm, kernel_options=GLUON, part="fused")
    monkeypatch.setattr(plan_module, "GLUON_FUSED", False)
    plan_module.clear_memos()
    with pytest.raises(InputError, match='"fused" for a call whose backward'):
        flexgen.kernel_source(q, k, v, M.tanh_softcap(30.0), bm, kernel_options=GLUON, part="fused")
    with pytest.raises(InputError, match="pick one of the four kernels"):
        flexgen.kernel_source(q, k, v, part="fuse")


# ------------------------------------------------------------------------- on the GPU

def _check(name, got, want, tol):
    """test_backward's measure: max error relative to the largest reference gradient (or 1)."""
    assert got is not None and not got.isnan().any(), f"{name}: missing or NaN"
    want = want.double()
    err = (got.double() - want).abs().max().item()
    ref = want.abs().max().item()
    assert err <= tol * max(ref, 1.0), f"{name}: max error {err:.3g}, largest gradient {ref:.3g}"


def check_gradients(q, k, v, score=None, bm=None, options=GLUON, learned=(), tol=3e-2, fused=False, scale=None):
    """One training step through flex_attention (the Gluon dK/dV and dQ kernels; ``fused``: the
    fused kernel) against
    autograd through the float64 oracle from float32 copies of the same inputs; the Gluon
    kernels must have run."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)] + list(learned)
    with aot.recording() as launches:
        out = flex_attention(*leaves[:3], score_mod=score, block_mask=bm, enable_gqa=True,
                             kernel_options=options, scale=scale)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, dout)
    gluon_parts = [s.part for s, _, _ in launches if s.template == "backward_gluon"]
    assert sorted(gluon_parts) == (["fused"] if fused else ["dkdv", "dq"])
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = flex_attention_reference(*ref_leaves, score_mod=score, mask_mod=bm, enable_gqa=True,
                                   scale=scale, dtype=torch.float64)
    # (allow_unused: a score_mod that ignores the score leaves the oracle's q and k unused)
    want = torch.autograd.grad(ref, ref_leaves + list(learned), dout.double(), allow_unused=True)
    for name, g, w in zip(["dq", "dk", "dv"] + [f"buffer{i}" for i in range(len(learned))], got, want):
        _check(name, g, torch.zeros_like(g, dtype=torch.float64) if w is None else w, tol)
    return got


@needs_hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_cases_match_the_oracle(name):
    q, k, v, score, bm, options = case_inputs(name, device="cuda")
    check_gradients(q, k, v, score, bm, options)


@needs_hopper
@pytest.mark.parametrize("mods", ["none", "causal", "softcap", "alibi"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_grid_matches_the_oracle(mods, D, dtype):
    """The backward grid: GQA, odd lengths (ragged tails at both ends), each mod family."""
    B, H, Hkv, L = (1, 4, 2, 1000) if dtype == torch.bfloat16 else (2, 2, 1, 517)
    q, k, v = make_qkv(B=B, H=H, Hkv=Hkv, L=L, D=D, dtype=dtype, device="cuda")
    score = {"softcap": M.tanh_softcap(20.0), "alibi": alibi_bias(H, "cuda")}.get(mods)
    bm = create_block_mask(M.causal_mask, None, None, L, L, device="cuda") \
        if mods in ("causal", "alibi") else None
    check_gradients(q, k, v, score, bm)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_long_odd_length(D):
    q, k, v = make_qkv(B=1, H=2, Hkv=1, L=4097, D=D, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 4097, 4097, device="cuda")
    check_gradients(q, k, v, bm=bm)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_dead_rows_get_zero_gradients(D):
    """Rows no key is allowed for (LSE -inf) add nothing to dK / dV, and nothing is NaN."""
    q, k, v = make_qkv(B=1, H=2, L=400, D=D, dtype=torch.bfloat16, device="cuda")

    def late(b, h, q_idx, kv_idx):
        return (q_idx >= 150) & (kv_idx <= q_idx)
    bm = create_block_mask(late, None, None, 400, 400, device="cuda")
    dq, dk, dv = check_gradients(q, k, v, bm=bm)
    assert (dq[:, :, :150] == 0).all()


@needs_hopper
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_gluon_lse_gradient(monkeypatch, D, fused):
    """A loss that reads the LSE too: its gradient enters delta, which the Gluon dQ kernel
    writes (and the dK/dV kernel reads), or torch before the fused kernel."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", fused)
    plan_module.clear_memos()
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=777, D=D, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 777, 777, device="cuda")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with aot.recording() as launches:
        out, lse = flex_attention(*leaves, block_mask=bm, enable_gqa=True, return_lse=True,
                                  kernel_options=GLUON)
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    assert sorted(s.part for s, _, _ in launches if s.template == "backward_gluon") == (
        ["fused"] if fused else ["dkdv", "dq"])
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flex_attention_reference(*ref_leaves, mask_mod=bm, enable_gqa=True, return_lse=True,
                                            dtype=torch.float64)
    want = torch.autograd.grad([ref, ref_lse], ref_leaves, [dout.double(), dlse.double()])
    for name, g, w in zip(["dq", "dk", "dv"], got, want):
        _check(name, g, w, 3e-2)


def learned_mods(H, L, device):
    """(name, score_mod, its learned tensor): one of each way the dQ kernel adds a gradient.
    (No bias per head alone: it shifts whole rows, its exact gradient is 0, and the check
    would compare rounding noise with 0.)"""
    per_key = (0.5 * torch.randn(L, device=device)).requires_grad_()
    slopes = torch.linspace(0.05, 0.4, H, device=device).requires_grad_()
    relative = (0.5 * torch.randn(2 * L, device=device)).requires_grad_()
    table = (0.5 * torch.randn(H, L, L, device=device)).requires_grad_()
    return {
        "per_key": (lambda score, b, h, q_idx, kv_idx: score + per_key[kv_idx], per_key),   # rows summed
        "alibi_slopes": (lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx), slopes),
        "relative": (lambda score, b, h, q_idx, kv_idx: score + relative[q_idx - kv_idx + L], relative),
        "table": (lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx, kv_idx], table),   # per element
    }


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("learned", ["per_key", "alibi_slopes", "relative", "table"])
def test_gluon_dq_kernel_adds_learned_tensors_gradients(learned, D):
    """A captured tensor that requires grad: the Gluon dQ kernel adds its gradient (summed over
    the tile's rows, columns, diagonals or not at all, as its index allows), the Gluon dK/dV
    kernel reads the tensor only; ragged length, GQA, a causal mask."""
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=700, D=D, dtype=torch.bfloat16, device="cuda")
    score_mod, tensor = learned_mods(4, 700, "cuda")[learned]
    bm = create_block_mask(M.causal_mask, None, None, 700, 700, device="cuda")
    check_gradients(q, k, v, score_mod, bm, learned=[tensor])


@needs_hopper
def test_gluon_dq_kernel_adds_learned_gradients_deterministically():
    """Deterministic mode: the Gluon dQ kernel's fixed-point sums give the same gradient bit for
    bit on every run, within the oracle's tolerance."""
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=700, D=64, dtype=torch.bfloat16, device="cuda")
    score_mod, tensor = learned_mods(4, 700, "cuda")["relative"]
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(1)            # (the same upstream gradient both times)
        first = check_gradients(q, k, v, score_mod, learned=[tensor])
        torch.manual_seed(1)
        second = check_gradients(q, k, v, score_mod, learned=[tensor])
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first[3], second[3])


@needs_hopper
def test_gluon_matches_the_tl_backward():
    torch.manual_seed(0)
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=1000, D=128, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 1000, 1000, device="cuda")
    dout = torch.randn(1, 4, 1000, 128, dtype=torch.bfloat16, device="cuda")
    grads = {}
    for backend in ("gluon", "tl"):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flex_attention(*leaves, block_mask=bm, enable_gqa=True, kernel_options={"BACKEND": backend})
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    for g, t in zip(grads["gluon"], grads["tl"]):
        torch.testing.assert_close(g.float(), t.float(), atol=3e-2, rtol=3e-2)


@needs_hopper
def test_an_expanded_upstream_gradient_takes_the_tl_kernel():
    """A grad_out TMA cannot address (out.sum()'s expanded one) runs the tl dK/dV kernel."""
    q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=2, L=300, D=64, dtype=torch.bfloat16,
                                                     device="cuda"))
    with aot.recording() as launches:
        flex_attention(q, k, v, kernel_options=GLUON).sum().backward()
    templates = [s.template for s, _, _ in launches]
    assert "backward_gluon" not in templates and templates.count("backward") == 2


# ------------------------------------------------------------------------- the fused kernel

@needs_hopper
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scale", [0.3, -0.2, 0.0])
def test_gluon_dkdv_kernels_take_any_scale(monkeypatch, fused, scale):
    """The dK/dV and fused kernels recompute P times the scale where it is positive
    (P_SCALE), else times 1: a negative or zero scale gets the same gradients as the oracle."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", fused)
    plan_module.clear_memos()
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=333, D=128, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 333, 333, device="cuda")
    check_gradients(q, k, v, bm=bm, fused=fused, scale=scale)


@pytest.fixture
def fused_backward(monkeypatch):
    """Plan the fused Gluon backward (plan.GLUON_FUSED)."""
    monkeypatch.setattr(plan_module, "GLUON_FUSED", True)
    plan_module.clear_memos()
    yield
    plan_module.clear_memos()


@pytest.mark.parametrize("D, Dv, dtype", [(64, 64, torch.bfloat16), (128, 128, torch.float16),
                                           (80, 48, torch.float32)])
def test_fused_backwards_first_kernel_writes_delta_and_zeroes_the_sum(D, Dv, dtype):
    """The fused backward's first kernel (template backward_delta), under the interpreter:
    delta = rowsum(dO out) - dLSE in float32 and every row of the float32 dQ sum zeroed, at an
    odd length, head dims that need padding, and out in a transposed layout."""
    B, H, L = 2, 3, 77
    gen = torch.Generator().manual_seed(D)
    out = torch.randn(B, L, H, Dv, generator=gen).to(dtype).transpose(1, 2)
    dout = torch.randn(B, H, L, Dv, generator=gen).to(dtype)
    dlse = torch.randn(B, H, L, generator=gen)
    for grad_lse in (None, dlse):
        delta = torch.full((B, H, L), float("nan"))
        dq_sum = torch.full((B, H, L, D), float("nan"))
        launch.run(backward_module.delta_spec(D, Dv, dtype), torch.device("cpu"),
                   dict(out=out, dout=dout, dlse=grad_lse, delta=delta, dq=dq_sum))
        want = (out.double() * dout.double()).sum(-1) - (0 if grad_lse is None else dlse.double())
        torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5)
        assert (dq_sum == 0).all()


def test_fused_backward_runs_its_first_kernel_then_the_fused_one(as_if_hopper, fused_backward, monkeypatch):
    """The fused path on CPU tensors, its Gluon kernels not launched (they need sm_90): the
    first kernel writes delta (with the LSE's gradient) and the zeroed dQ sum, then the fused
    kernel gets both, and dQ is the sum rounded."""
    monkeypatch.setattr(backward_module, "_addressable", lambda tensors, dtype: True)
    real_run, seen = launch.run, []

    def run(spec, device, inputs, **kwargs):
        seen.append((spec.template, dict(inputs)))
        if spec.template == "forward_gluon":       # (any finite output will do)
            inputs["out"].normal_(generator=torch.Generator().manual_seed(0))
            inputs["lse"].zero_()
        if spec.template in ("forward_gluon", "backward_gluon"):
            return None
        return real_run(spec, device, inputs, **kwargs)
    monkeypatch.setattr(launch, "run", run)
    q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=2, L=200, D=64, dtype=torch.bfloat16))
    out, lse = flex_attention(q, k, v, kernel_options=GLUON, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    dq = torch.autograd.grad([out, lse], q, [dout, dlse])[0]
    assert [template for template, _ in seen] == ["forward_gluon", "backward_delta", "backward_gluon"]
    first, fused = seen[1][1], seen[2][1]
    want = (out.double() * dout.double()).sum(-1) - dlse.double()
    torch.testing.assert_close(first["delta"].double(), want, rtol=1e-5, atol=1e-5)
    assert fused["delta"] is first["delta"] and fused["dq"] is first["dq"]
    assert fused["dq"].dtype == torch.float32 and (fused["dq"] == 0).all() and (dq == 0).all()


@needs_hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_cases_match_the_oracle(fused_backward, name):
    """The fused kernel on every case (a learned captured tensor, and 128 query rows at head
    dim 128, keep the two kernels)."""
    q, k, v, score, bm, options = case_inputs(name, device="cuda")
    check_gradients(q, k, v, score, bm, options,
                    fused=not name.startswith("learned") and name != "causal_d128_m128")


@needs_hopper
@pytest.mark.parametrize("mods", ["none", "causal", "softcap", "alibi"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_grid_matches_the_oracle(fused_backward, mods, D, dtype):
    B, H, Hkv, L = (1, 4, 2, 1000) if dtype == torch.bfloat16 else (2, 2, 1, 517)
    q, k, v = make_qkv(B=B, H=H, Hkv=Hkv, L=L, D=D, dtype=dtype, device="cuda")
    score = {"softcap": M.tanh_softcap(20.0), "alibi": alibi_bias(H, "cuda")}.get(mods)
    bm = create_block_mask(M.causal_mask, None, None, L, L, device="cuda") \
        if mods in ("causal", "alibi") else None
    check_gradients(q, k, v, score, bm, fused=True)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128])
def test_fused_dead_rows_and_long_odd_length(fused_backward, D):
    q, k, v = make_qkv(B=1, H=2, L=400, D=D, dtype=torch.bfloat16, device="cuda")

    def late(b, h, q_idx, kv_idx):
        return (q_idx >= 150) & (kv_idx <= q_idx)
    bm = create_block_mask(late, None, None, 400, 400, device="cuda")
    dq, dk, dv = check_gradients(q, k, v, bm=bm, fused=True)
    assert (dq[:, :, :150] == 0).all()
    q, k, v = make_qkv(B=1, H=2, Hkv=1, L=4097, D=D, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 4097, 4097, device="cuda")
    check_gradients(q, k, v, bm=bm, fused=True)
