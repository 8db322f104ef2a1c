"""The Gluon forward kernel (``kernel_options={"BACKEND": "gluon"}``, sm_90).

``templates/forward_gluon.py.jinja`` renders from the forward kernel's spec fields and the
same printed mod snippets: a TMA producer warp fills a K/V ring guarded by mbarriers, two
consumer warpgroups (64 query rows each) run async wgmma and the online softmax (or, for
sigmoid_attention, the sigmoid weights: the template's ``activation`` switch). Gluon does
not run in Triton's interpreter, so on CPU this file checks the choice and its refusals, the
rendered source (a snapshot) and that every variant the tests render compiles for sm_90
(with the installed Triton: CI runs it on 3.6 and on the newest). The oracle comparisons
need an sm_90 GPU and are skipped elsewhere.
"""
from __future__ import annotations

import contextlib
import re

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen import mods as M
from flexgen.codegen import cache
from flexgen.errors import InputError
from flexgen.reference import sigmoid_attention_reference
from flexgen.frontend.trace import trace_cached
from flexgen.kernels.forward import broadcast_lists
from flexgen.masks.block_mask import mask_inputs
from flexgen.runtime import aot
from flexgen.runtime import plan as plan_module
from flexgen.runtime.options import parse_options

import conftest
from conftest import make_qkv, run_and_check

GLUON = {"BACKEND": "gluon"}
gluon_unavailable = plan_module.gluon_unavailable
ON_HOPPER = (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
             and plan_module.gluon_refusal("cuda", (9, 0), torch.bfloat16, 64, 64) is None)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="needs an sm_90 GPU and Triton's Gluon")


@contextlib.contextmanager
def planned_as_if_on_hopper():
    """Plan Gluon kernels for CPU tensors (rendering and the sm_90 compile need no GPU)."""
    unavailable = plan_module.gluon_unavailable
    plan_module.gluon_unavailable = lambda query, D, Dv: None
    plan_module.clear_memos()
    try:
        yield
    finally:
        plan_module.gluon_unavailable = unavailable
        plan_module.clear_memos()


@pytest.fixture
def as_if_hopper():
    with planned_as_if_on_hopper():
        yield


# ------------------------------------------------------------------------- the choice

def test_backend_values_are_kept():
    assert parse_options({"BACKEND": "gluon"}).BACKEND == "gluon"
    assert parse_options({"BACKEND": "tl"}).BACKEND == "tl"
    assert parse_options({"BACKEND": "tl"}).text == "BACKEND=tl"


def test_auto_and_tl_plan_the_tl_kernel_on_cpu():
    q, k, v = make_qkv(L=200, D=64, dtype=torch.bfloat16)
    for options in (None, {"BACKEND": "tl"}):
        assert flexgen.api.plan(q, k, v, kernel_options=options).spec.template == "forward"


def test_auto_picks_gluon_for_large_calls_only(as_if_hopper):
    """Where the Gluon kernel can run, AUTO takes it for calls of at least GLUON_MIN_SCORES
    scores and no tiles of the caller's; "tl" never does."""
    big = make_qkv(B=1, H=64, L=4096, D=64, dtype=torch.bfloat16)
    small = make_qkv(B=1, H=2, L=300, D=64, dtype=torch.bfloat16)
    plan = flexgen.api.plan(*big)
    assert plan.spec.template == "forward_gluon" and plan.tl_spec.template == "forward"
    assert plan.pointer_spec.template == "forward" and not plan.pointer_spec.use_tma
    assert flexgen.api.plan(*small).spec.template == "forward"
    assert flexgen.api.plan(*big, kernel_options={"BACKEND": "tl"}).spec.template == "forward"
    assert flexgen.api.plan(*big, kernel_options={"BLOCK_N": 64}).spec.template == "forward"
    assert flexgen.api.plan(*small, kernel_options=GLUON).spec.template == "forward_gluon"


def test_auto_takes_gluon_from_fewer_scores_at_head_dim_128(as_if_hopper):
    """Between GLUON_MIN_SCORES_D128 and GLUON_MIN_SCORES scores AUTO takes the Gluon kernel
    at head dims 128 and 256, captured tensors or not (plan.gluon_min_scores); at head dim 64
    the tl kernel; below GLUON_MIN_SCORES_D128 the tl kernel everywhere."""
    L = 4096
    assert plan_module.GLUON_MIN_SCORES_D128 <= 16 * L * L < plan_module.GLUON_MIN_SCORES
    bias = torch.randn(16)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    causal = create_block_mask(M.causal_mask, None, None, L, L, device="cpu")

    def template(D, **kwargs):
        q, k, v = make_qkv(B=1, H=16, L=L, D=D, dtype=torch.bfloat16)
        return flexgen.api.plan(q, k, v, **kwargs).spec.template

    assert template(128, block_mask=causal) == "forward_gluon"
    assert template(128, score_mod=M.alibi(16)) == "forward_gluon"
    assert template(128, score_mod=head_bias) == "forward_gluon"
    assert template(64, block_mask=causal) == "forward"
    assert template(64, score_mod=head_bias, kernel_options=GLUON) == "forward_gluon"
    assert template(256, score_mod=head_bias) == "forward_gluon"
    q, k, v = make_qkv(B=1, H=16, L=L // 4, D=128, dtype=torch.bfloat16)
    assert 16 * (L // 4) ** 2 < plan_module.GLUON_MIN_SCORES_D128
    assert flexgen.api.plan(q, k, v, score_mod=head_bias).spec.template == "forward"


def test_auto_keeps_tl_for_narrow_bands_at_head_dim_64(as_if_hopper):
    """AUTO's exception (plan.GLUON_MIN_BAND_D64): a sliding window at head dim 64 keeps the
    tl kernel; the same window at 128, a causal mask at 64 and BACKEND "gluon" do not."""
    L = 4096
    masks = {name: create_block_mask(mod, None, None, L, L, device="cpu")
             for name, mod in (("window", M.sliding_window(1024)), ("wide", M.sliding_window(4096)),
                               ("causal", M.causal_mask))}

    def template(D, mask, options=None):
        q, k, v = make_qkv(B=1, H=64, L=L, D=D, dtype=torch.bfloat16)
        return flexgen.api.plan(q, k, v, block_mask=masks[mask], kernel_options=options).spec.template

    assert template(64, "window") == "forward"
    assert template(64, "window", GLUON) == "forward_gluon"
    assert template(128, "window") == "forward_gluon"
    assert template(64, "wide") == "forward_gluon"
    assert template(64, "causal") == "forward_gluon"


def test_cpu_tensors_are_refused_with_the_reason():
    q, k, v = make_qkv(L=200, D=64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="CUDA GPUs only"):
        flex_attention(q, k, v, kernel_options=GLUON)


@pytest.mark.parametrize("args, words", [
    (("cuda", (8, 0), torch.bfloat16, 64, 64), "sm_90"),
    (("cuda", (10, 0), torch.bfloat16, 64, 64), "sm_90"),
    (("cuda", (9, 0), torch.float32, 64, 64), "float16 / bfloat16"),
    (("cuda", (9, 0), torch.float16, 24, 24), "from 33 to 256"),
    (("cuda", (9, 0), torch.float16, 320, 320), "from 33 to 256"),
    (("cuda", (9, 0), torch.float16, 128, 64), "equal head dims"),
])
def test_refusals_name_the_reason(args, words):
    assert words in plan_module.gluon_refusal(*args)


def test_supported_calls_are_accepted():
    for dtype in (torch.float16, torch.bfloat16):
        for D in (64, 128, 256, 48, 80, 96):      # (the last three padded: 64, 128, 128)
            assert plan_module.gluon_refusal("cuda", (9, 0), dtype, D, D) is None


def test_a_triton_without_the_gluon_api_declines(monkeypatch):
    """A Triton whose Gluon lacks a piece the kernel uses is refused with its name, never a
    compiler traceback."""
    from flexgen.codegen import gluon
    monkeypatch.setattr(gluon, "gluon_api_missing", lambda: "gl.warp_specialize")
    why = plan_module.gluon_refusal("cuda", (9, 0), torch.bfloat16, 128, 128)
    assert "gl.warp_specialize" in why and "Triton" in why


def test_the_installed_triton_has_the_gluon_api():
    """CI's Triton versions (3.6 and the newest) both carry what the kernel uses."""
    from flexgen.codegen.gluon import gluon_api_missing
    assert gluon_api_missing() is None


def test_block_sizes_it_cannot_tile_are_refused(as_if_hopper):
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(InputError, match="Q_BLOCK 64"):
        flexgen.api.plan(q, k, v, block_mask=bm, kernel_options=GLUON)


def test_head_dim_256_and_padded_head_dims_plan_their_tiles(as_if_hopper):
    """At head dim 256 the K / V ring's slots hold 64 keys, two deep (128 query rows and two
    128-key slots would not fit in shared memory: BLOCK_N 128 is refused, saying why); a padded
    head dim plans as its padded width and keeps its own in the spec; the backward keeps the tl
    kernels (the Gluon ones take 64 or 128), under BACKEND "gluon" a refusal naming the head dim."""
    q, k, v = make_qkv(L=256, D=256, dtype=torch.bfloat16)
    spec = flexgen.api.plan(q, k, v, kernel_options=GLUON).spec
    assert (spec.template, spec.block_n, spec.num_stages) == ("forward_gluon", 64, 2)
    # A padded head dim keeps its own in the spec (the template pads its tiles: HEAD_COLS).
    spec96 = flexgen.api.plan(*make_qkv(L=256, D=96, dtype=torch.bfloat16), kernel_options=GLUON).spec
    assert (spec96.qk_head, spec96.v_head, spec96.block_n, spec96.num_stages) == (96, 96, 128, 2)
    assert "HEAD_COLS = 128" in cache.source(spec96)
    for options in ({"BLOCK_N": 128}, {"num_stages": 3}):
        with pytest.raises(InputError, match="more shared memory"):
            flexgen.api.plan(q, k, v, kernel_options=dict(GLUON, **options))
    call = flexgen.api.plan(q, k, v)
    bw = plan_module.plan_backward(call, q, k, v, ())
    assert "64 or 128" in plan_module.gluon_backward_spec(call, q, k, v, bw.dkdv)[1]
    q.requires_grad_()
    with pytest.raises(InputError, match="head dim 256"):
        flex_attention(q, k, v, kernel_options=GLUON).sum().backward()


def test_a_head_dim_tma_cannot_step_is_refused_naming_it(as_if_hopper):
    """36 bf16 values are 72-byte rows: TMA steps multiples of 16 bytes (the tl kernel runs it)."""
    q, k, v = make_qkv(L=256, D=36, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="head dim 36 .72-byte rows"):
        flexgen.api.plan(q, k, v, kernel_options=GLUON)
    assert flexgen.api.plan(q, k, v).spec.template == "forward"


def sigmoid_plan(q, k, v, score_mod=None, block_mask=None, options=None, enable_gqa=False):
    """sigmoid_attention's plan of a call (what ``flexgen.sigmoid_attention`` launches)."""
    from flexgen.api import _mods, check_scale
    return plan_module.plan_sigmoid(q, k, v, *_mods(score_mod, block_mask), check_scale(None, q.shape[-1]),
                                    enable_gqa, parse_options(options).text)


def test_sigmoid_attention_takes_gluon_as_softmax_does(as_if_hopper):
    """sigmoid_attention's forward takes the Gluon kernel by flex_attention's rule (AUTO from
    GLUON_MIN_SCORES scores without tiles of the caller's, or BACKEND "gluon"), its sigmoid
    form; the tl sigmoid kernel stays at hand, and the backward stays tl."""
    big = make_qkv(B=1, H=64, L=4096, D=64, dtype=torch.bfloat16)
    small = make_qkv(B=1, H=2, L=300, D=64, dtype=torch.bfloat16)
    plan = sigmoid_plan(*big)
    assert (plan.spec.template, plan.spec.activation) == ("forward_gluon", "sigmoid")
    assert (plan.tl_spec.template, plan.tl_spec.activation) == ("forward", "sigmoid")
    assert not plan.pointer_spec.use_tma and plan.pointer_spec.activation == "sigmoid"
    for options in (None, {"BACKEND": "tl"}, {"BLOCK_N": 64}):
        tl_plan = sigmoid_plan(*(small if options is None else big), options=options)
        assert (tl_plan.spec.template, tl_plan.spec.activation) == ("forward", "sigmoid")
    assert sigmoid_plan(*small, options=GLUON).spec.template == "forward_gluon"
    source = flexgen.sigmoid_kernel_source(*small, kernel_options=GLUON)
    kernel = source.split("@gluon.jit(do_not_specialize")[1].split('"""')[0]
    assert "SIGMOID_BIAS" in kernel and "EXACT_SIGMOID" in kernel and "LSE" not in kernel
    assert "tanh.approx.f32" in source and not re.search(r"\b(m_i|l_i|alpha)\s*=", source)
    # The Gluon dK/dV kernel is softmax only: BACKEND "gluon" names the forward kernel here.
    dkdv = flexgen.sigmoid_kernel_source(*small, kernel_options=GLUON, part="dkdv")
    assert "@triton.jit" in dkdv and "# activation: sigmoid" in dkdv


def test_sigmoid_attention_declines_gluon_with_the_reason(as_if_hopper):
    q, k, v = make_qkv(L=256, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(InputError, match="Q_BLOCK 64"):
        flexgen.sigmoid_attention(q, k, v, block_mask=bm, kernel_options=GLUON)
    plan_module.clear_memos()
    with pytest.MonkeyPatch.context() as mp:      # the real refusal on CPU tensors
        mp.setattr(plan_module, "gluon_unavailable", gluon_unavailable)
        with pytest.raises(InputError, match="CUDA GPUs only"):
            flexgen.sigmoid_attention(q, k, v, kernel_options=GLUON)


# ------------------------------------------------------------------------- source and sm_90

def alibi_bias(H, device="cpu"):
    slopes = torch.linspace(0.1, 0.8, H, device=device)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return score_mod


def doc_mask(L, device="cpu"):
    doc = torch.arange(L, device=device) // 97

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
    return mask_mod


# (name, D, dtype, H, Hkv, Lq, Lkv, score_mod, mask_mod, BLOCK_SIZE)
CASES = {
    "dense_d128_bf16": (128, torch.bfloat16, 4, 4, 256, 256, None, None, None),
    "causal_d64_fp16": (64, torch.float16, 4, 4, 300, 300, None, M.causal_mask, 128),
    "alibi_document_gqa_d128": (128, torch.bfloat16, 4, 2, 300, 333, "alibi", "doc", 128),
    "softcap_sliding_d64_kv64": (64, torch.bfloat16, 2, 1, 257, 200, M.tanh_softcap(20.0),
                                 M.sliding_window(100), (128, 64)),
    # Mods constant along the keys: their results are columns, broadcast to the score tile.
    "row_only_mods_d64": (64, torch.float16, 2, 2, 300, 300, "row_bias", "first_rows", 128),
    # A relative-position table exactly the size the call needs: proven loads at clamped
    # positions (bounds_check.proven_loads), ragged tails at both ends.
    "relbias_causal_gqa_d64": (64, torch.bfloat16, 4, 2, 300, 333, "relbias", M.causal_mask, 128),
    # Lengths that are multiples of the blocks (EVEN_KV): partial tiles mask with mask_mod alone.
    "document_even_gqa_d64": (64, torch.bfloat16, 4, 2, 512, 512, None, "doc", 128),
    "causal_even_d128": (128, torch.bfloat16, 2, 2, 512, 512, None, M.causal_mask, 128),
    # Head dim 256: 64-key slots, two deep.
    "alibi_causal_gqa_d256": (256, torch.bfloat16, 4, 2, 300, 333, "alibi", M.causal_mask, 128),
    # Padded head dims: 96 in 128 columns, 40 in 64 (TMA zero-fills the padding, clips the stores).
    "softcap_document_d96": (96, torch.bfloat16, 2, 2, 300, 300, M.tanh_softcap(20.0), "doc", 128),
    "causal_gqa_d40_fp16": (40, torch.float16, 4, 2, 257, 257, None, M.causal_mask, 128),
    # An integer-valued score_mod (positions only; the Gluon fuzz's find: it did not compile).
    "integer_score_causal_d64": (64, torch.float16, 2, 2, 300, 300, "integer_score", M.causal_mask, 128),
    # A constant score_mod (uniform weights over a document): a literal broadcast to the
    # score tile's layout (the Gluon fuzz's find too).
    "uniform_document_d128": (128, torch.bfloat16, 2, 2, 300, 300, "uniform", "doc", 128),
    # float64 timestamps in the score_mod and the mask_mod: float64 arithmetic on the tiles.
    "seconds_d64": (64, torch.bfloat16, 2, 2, 300, 300, "seconds", "seconds", 128),
}


def seconds_mods(L, device="cpu"):
    """(score_mod, mask_mod) reading float64 Unix timestamps: their differences are computed
    in float64 (a float32 element holds them to 128 s), then the score is float32 again."""
    seconds = 1.7e9 + torch.arange(L, device=device, dtype=torch.float64) * 3.5

    def decay_by_time(score, b, h, q_idx, kv_idx):
        return score - (seconds[q_idx] - seconds[kv_idx]).abs() * 0.01

    def within_ten_minutes(b, h, q_idx, kv_idx):
        return (seconds[q_idx] - seconds[kv_idx]).abs() < 600.0
    return decay_by_time, within_ten_minutes


def row_bias(score, b, h, q_idx, kv_idx):
    return q_idx * 0.01 + h


def integer_score(score, b, h, q_idx, kv_idx):
    return (q_idx - kv_idx) // 64


def uniform(score, b, h, q_idx, kv_idx):
    return torch.zeros_like(score)


def first_rows(b, h, q_idx, kv_idx):
    return q_idx < 250


def relative_bias(H, Lq, Lkv, device="cpu", learned=False):
    """A relative-position table exactly the size the call needs (``learned``: wanting a gradient)."""
    table = torch.linspace(-1.0, 1.0, H * (Lq + Lkv - 1), device=device).reshape(H, -1).sin()
    table.requires_grad_(learned)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + Lkv - 1]
    return score_mod


def case_inputs(name, device="cpu"):
    D, dtype, H, Hkv, Lq, Lkv, score, mask, block = CASES[name]
    q, k, v = make_qkv(B=2, H=H, Hkv=Hkv, L=Lq, Lkv=Lkv, D=D, dtype=dtype, device=device)
    if isinstance(score, str):
        score = {"alibi": lambda: alibi_bias(H, device), "row_bias": lambda: row_bias,
                 "relbias": lambda: relative_bias(H, Lq, Lkv, device), "integer_score": lambda: integer_score,
                 "uniform": lambda: uniform, "seconds": lambda: seconds_mods(max(Lq, Lkv), device)[0]}[score]()
    mask = first_rows if mask == "first_rows" else mask
    mask = seconds_mods(max(Lq, Lkv), device)[1] if mask == "seconds" else mask
    mask = doc_mask(max(Lq, Lkv), device) if mask == "doc" else mask
    bm = None if mask is None else create_block_mask(mask, None, None, Lq, Lkv, device=device,
                                                     BLOCK_SIZE=block)
    return q, k, v, score, bm


def gluon_launch(name, sigmoid=False):
    """(spec, args, constexprs) of the Gluon forward launch of case ``name`` (flex_attention's,
    or with ``sigmoid`` sigmoid_attention's), as the runtime would make them."""
    return gluon_forward_launch(*case_inputs(name), sigmoid=sigmoid)


def gluon_forward_launch(q, k, v, score, bm, sigmoid=False, scale=0.125, write_max=True):
    """``gluon_launch`` for these inputs and mods (CPU tensors, planned as if on Hopper:
    ``as_if_hopper``); ``write_max`` False: a call not asking for the max scores."""
    if sigmoid:
        spec = sigmoid_plan(q, k, v, score, bm, GLUON, enable_gqa=True).spec
    else:
        spec = flexgen.api.plan(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True,
                                kernel_options=GLUON).spec
    assert spec.template == "forward_gluon" and spec.activation == ("sigmoid" if sigmoid else "softmax")
    module = cache.load(spec, interpret=False)
    B, H, Lq, _ = q.shape
    _, _, lists, block_size, _ = mask_inputs(bm)
    sparse = None if bm is None else (*broadcast_lists(lists[:4], B, H), *block_size)
    out = torch.empty(B, H, Lq, v.shape[3], dtype=q.dtype)
    lse = None if sigmoid else torch.empty(B, H, Lq)
    score_buffers = () if score is None else trace_cached(score, "score_mod").buffers
    mask_buffers = () if bm is None else trace_cached(bm.mask_mod, "mask_mod").buffers
    _, args, constexprs = module.arguments(
        q=q, k=k, v=v, out=out, lse=lse, sparse=sparse, score_buffers=score_buffers,
        mask_buffers=mask_buffers, scale=scale, max_scores=lse if write_max else None,
        **({"bias": -3.5} if sigmoid else {}))
    return spec, args, constexprs


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_kernel_compiles_for_sm90(as_if_hopper, name):
    """Each variant compiles to a cubin for sm_90 with the installed Triton, with the
    argument types of a real launch (Gluon TMA descriptors, block lists, captured tensors)."""
    spec, args, constexprs = gluon_launch(name)
    conftest.skip_outside_aot_sample(spec)
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    if name.startswith("softcap"):     # bf16: the one-instruction tanh
        assert "tanh.approx.f32" in compiled.asm["ptx"]
    if name == "causal_d64_fp16":   # the ping-pong schedule (off by default) compiles too
        assert aot.compile_launch(spec, args, dict(constexprs, PINGPONG=True)).asm.get("cubin")
        # A grid of many waves takes its programs row by row (launch.block_major): that order too.
        assert constexprs["BLOCK_MAJOR"]
        assert aot.compile_launch(spec, args, dict(constexprs, BLOCK_MAJOR=False)).asm.get("cubin")
    # Hopper's asynchronous matrix instructions and TMA copies, not a fallback.
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_sigmoid_kernel_compiles_for_sm90(as_if_hopper, name):
    """sigmoid_attention's Gluon kernel (the same cases) compiles for sm_90, its weights from
    tanh.approx.f32 as the GPU runs them (EXACT_SIGMOID off), with no LSE argument."""
    spec, args, constexprs = gluon_launch(name, sigmoid=True)
    conftest.skip_outside_aot_sample(spec)
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "tanh.approx.f32" in ptx
    names = cache.load(spec, interpret=False).KERNEL.arg_names
    assert "SIGMOID_BIAS" in names and "LSE" not in names and "MAX" not in names


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
@pytest.mark.parametrize("launch_kwargs, flag", [({"write_max": False}, "WRITE_MAX"),
                                                 ({"scale": -0.125}, "SCALE_POSITIVE")],
                         ids=["no_max_scores", "negative_scale"])
def test_gluon_launch_flags_compile_for_sm90(as_if_hopper, launch_kwargs, flag):
    """The flags the cases above always set, off as real launches turn them: most calls ask for
    no max scores (WRITE_MAX), and a negative scale scales the scores, not the row maxima
    (SCALE_POSITIVE, read without a score_mod: this case has none)."""
    spec, args, constexprs = gluon_forward_launch(*case_inputs("causal_d64_fp16"), **launch_kwargs)
    assert constexprs[flag] is False
    conftest.skip_outside_aot_sample(spec)
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx


# ------------------------------------------------------------------------- on the GPU

@needs_hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_cases_match_the_oracle(name):
    q, k, v, score, bm = case_inputs(name, device="cuda")
    run_and_check(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True, kernel_options=GLUON)


@needs_hopper
@pytest.mark.parametrize("D, dtype", [(64, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16),
                                      (128, torch.float16), (256, torch.bfloat16), (96, torch.bfloat16)])
@pytest.mark.parametrize("mods", ["none", "causal", "alibi_causal", "softcap_prefix", "document"])
@pytest.mark.parametrize("shape", [(1, 2, 2, 128, 128), (2, 4, 2, 300, 333), (1, 4, 1, 517, 200)])
def test_gluon_grid_matches_the_oracle(D, dtype, mods, shape):
    B, H, Hkv, Lq, Lkv = shape
    q, k, v = make_qkv(B=B, H=H, Hkv=Hkv, L=Lq, Lkv=Lkv, D=D, dtype=dtype, device="cuda")
    score, mask = None, None
    if mods == "causal":
        mask = M.causal_mask
    elif mods == "alibi_causal":
        score, mask = alibi_bias(H, "cuda"), M.causal_mask
    elif mods == "softcap_prefix":
        score, mask = M.tanh_softcap(30.0), M.prefix_lm(64)
    elif mods == "document":
        doc = torch.arange(max(Lq, Lkv), device="cuda") // 61

        def mask(b, h, q_idx, kv_idx):
            return doc[q_idx] == doc[kv_idx]
    bm = None if mask is None else create_block_mask(mask, None, None, Lq, Lkv, device="cuda")
    run_and_check(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True, kernel_options=GLUON)


@needs_hopper
@pytest.mark.parametrize("D", [64, 128, 256, 80])
def test_gluon_dead_rows_are_zero_with_lse_minus_inf(D):
    """Rows no key is allowed for: output exactly 0 and LSE -inf, as the tl kernel gives;
    sigmoid_attention's rows exactly 0 too."""
    q, k, v = make_qkv(B=1, H=2, L=400, D=D, dtype=torch.bfloat16, device="cuda")

    def late(b, h, q_idx, kv_idx):
        return (q_idx >= 150) & (kv_idx <= q_idx)
    bm = create_block_mask(late, None, None, 400, 400, device="cuda")
    out, lse = run_and_check(q, k, v, block_mask=bm, kernel_options=GLUON)
    assert torch.isneginf(lse[:, :, :150]).all() and (out[:, :, :150] == 0).all()
    out = flexgen.sigmoid_attention(q, k, v, block_mask=bm, kernel_options=GLUON)
    assert (out[:, :, :150] == 0).all()
    ref = sigmoid_attention_reference(q, k, v, mask_mod=bm)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@needs_hopper
def test_gluon_matches_the_tl_kernel_and_writes_max_scores():
    q, k, v = make_qkv(B=1, H=4, L=1000, D=128, dtype=torch.bfloat16, device="cuda")
    bm = create_block_mask(M.causal_mask, None, None, 1000, 1000, device="cuda")
    outs = {}
    for backend in ("gluon", "tl"):
        outs[backend] = flex_attention(q, k, v, block_mask=bm, return_aux=flexgen.AuxRequest(
            lse=True, max_scores=True), kernel_options={"BACKEND": backend})
    (og, aux_g), (ot, aux_t) = outs["gluon"], outs["tl"]
    torch.testing.assert_close(og.float(), ot.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(aux_g.lse, aux_t.lse, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(aux_g.max_scores, aux_t.max_scores, atol=1e-3, rtol=1e-4)


@needs_hopper
@pytest.mark.parametrize("name", sorted(CASES))
def test_gluon_sigmoid_cases_match_the_oracle(name):
    """sigmoid_attention's Gluon forward (tanh.approx on the GPU) against the float64 oracle,
    and against its tl kernel."""
    q, k, v, score, bm = case_inputs(name, device="cuda")
    outs = {backend: flexgen.sigmoid_attention(q, k, v, score_mod=score, block_mask=bm, bias=-2.5,
                                               enable_gqa=True, kernel_options={"BACKEND": backend})
            for backend in ("gluon", "tl")}
    ref = sigmoid_attention_reference(q, k, v, score, bm, bias=-2.5, enable_gqa=True)
    # The sum is not normalized: its rounding error grows with the number of weighted values
    # (bf16 weights into the PV product, a bf16 output), not with the sum, which random signs
    # keep small. So the bound scales with Σ_j p_j |v_j| (the oracle on |v|), ~2^-8 of it.
    magnitude = sigmoid_attention_reference(q, k, v.abs(), score, bm, bias=-2.5, enable_gqa=True)
    for backend, out in outs.items():
        assert not out.isnan().any()
        excess = (out.double() - ref).abs() - (2e-2 + 4e-3 * magnitude)
        assert excess.max() <= 0, f"{name} {backend}: error over its bound by {excess.max().item():.3g}"
    torch.testing.assert_close(outs["gluon"].float(), outs["tl"].float(), atol=1e-2, rtol=1e-2)


@needs_hopper
def test_gluon_forward_feeds_the_tl_backward():
    """A training step with the Gluon forward: its output and LSE feed the tl backward, and
    the gradients are those of a tl forward."""
    grads = {}
    for backend in ("gluon", "tl"):
        torch.manual_seed(3)
        q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=4, Hkv=2, L=700, D=64,
                                                        dtype=torch.bfloat16, device="cuda"))
        bm = create_block_mask(M.causal_mask, None, None, 700, 700, device="cuda")
        out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                             kernel_options={"BACKEND": backend})
        out.float().pow(2).sum().backward()
        grads[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for g, t in zip(grads["gluon"], grads["tl"]):
        torch.testing.assert_close(g.float(), t.float(), atol=3e-2, rtol=3e-2)


def _compile_fails(monkeypatch):
    """Make every Gluon launch fail as a Triton whose Gluon API changed would."""
    from triton.compiler.errors import CompilationError
    from flexgen.runtime import launch
    real = launch.run

    def run(spec, device, inputs, **kwargs):
        if spec.template == "forward_gluon":
            raise CompilationError("kernel.py", None, "gl.warp_specialize() got an unexpected keyword")
        return real(spec, device, inputs, **kwargs)
    monkeypatch.setattr(launch, "run", run)


def test_a_gluon_compile_error_under_auto_falls_back_to_tl(as_if_hopper, monkeypatch):
    monkeypatch.setattr(plan_module, "GLUON_MIN_SCORES", 0)
    _compile_fails(monkeypatch)
    q, k, v = make_qkv(B=1, H=2, L=80, D=64, dtype=torch.bfloat16)
    plan = flexgen.api.plan(q, k, v)
    assert plan.spec.template == "forward_gluon"
    run_and_check(q, k, v)
    assert plan.spec.template == "forward" and plan.tl_spec is None
    run_and_check(q, k, v)                     # later calls go straight to the tl kernel


def test_a_gluon_compile_error_under_backend_gluon_says_so(as_if_hopper, monkeypatch):
    _compile_fails(monkeypatch)
    q, k, v = make_qkv(B=1, H=2, L=80, D=64, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="compile error with Triton"):
        flex_attention(q, k, v, kernel_options=GLUON)
    with pytest.raises(InputError, match="compile error with Triton"):
        flexgen.sigmoid_attention(q, k, v, kernel_options=GLUON)


def test_a_sigmoid_gluon_compile_error_under_auto_falls_back_to_tl(as_if_hopper, monkeypatch):
    """sigmoid_attention's plan falls back as flex_attention's does: to its tl sigmoid kernel,
    for good (the softmax plan of the same call keeps its own choice)."""
    monkeypatch.setattr(plan_module, "GLUON_MIN_SCORES", 0)
    _compile_fails(monkeypatch)
    q, k, v = make_qkv(B=1, H=2, L=80, D=64, dtype=torch.bfloat16)
    bm = create_block_mask(M.causal_mask, None, None, 80, 80, device="cpu")
    plan = sigmoid_plan(q, k, v, block_mask=bm)
    assert plan.spec.template == "forward_gluon"
    for _ in range(2):                        # the second call goes straight to the tl kernel
        out = flexgen.sigmoid_attention(q, k, v, block_mask=bm)
        assert (plan.spec.template, plan.spec.activation) == ("forward", "sigmoid")
        assert plan.tl_spec is None
        ref = sigmoid_attention_reference(q, k, v, mask_mod=bm)
        torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert flexgen.api.plan(q, k, v, block_mask=bm).spec.template == "forward_gluon"



DEBUG_COMPILE = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_forward_gluon as T
from flexgen.codegen import debug
assert debug.DEBUG
T.plan_module.gluon_unavailable = lambda query, D, Dv: None
T.test_gluon_kernel_compiles_for_sm90(None, "alibi_document_gqa_d128")
source = T.flexgen.kernel_source(*T.case_inputs("alibi_document_gqa_d128")[:3], enable_gqa=True,
    score_mod=T.case_inputs("alibi_document_gqa_d128")[3], block_mask=T.case_inputs("alibi_document_gqa_d128")[4],
    kernel_options=T.GLUON)
assert "tl.device_assert(" in source and "debug=True" in source
print("debug ok")
"""


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_gluon_kernel_compiles_in_debug_mode(tmp_path):
    """FLEXGEN_DEBUG=1 (read at import: a subprocess): the Gluon kernel asserts captured-tensor
    reads in bounds, as main's kernels do, and still compiles for sm_90."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    # (this compile is the test: not left to a sampled run's choice)
    env = dict(os.environ, FLEXGEN_DEBUG="1", FLEXGEN_CACHE_DIR=str(tmp_path / "kernels"),
               FLEXGEN_TEST_AOT_SAMPLE="1")
    code = DEBUG_COMPILE.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=str(tmp_path))
    assert done.returncode == 0 and "debug ok" in done.stdout, done.stderr[-3000:]


@needs_hopper
def test_replayed_gluon_launches_match_fresh_ones(monkeypatch):
    """A repeated call replays the Gluon forward with copies of its TMA descriptors over the
    new tensors (and the backward its kernels): the outputs and gradients equal those of
    launches made without replays."""
    from flexgen.runtime import launch
    monkeypatch.setattr(launch, "RECORDED", None)       # (the suite's AOT record)
    mask = create_block_mask(M.causal_mask, None, None, 512, 512, device="cuda")
    inputs = [make_qkv(B=2, H=4, Hkv=2, L=512, D=128, dtype=torch.bfloat16, device="cuda")
              for _ in range(2)]

    def run(i):
        q, k, v = (t.clone().requires_grad_() for t in inputs[i])
        out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=GLUON)
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    replays = []
    real_replay, real_run = launch.Replay.launch, launch.run
    monkeypatch.setattr(launch.Replay, "launch", lambda self, *t: replays.append(self) or real_replay(self, *t))
    run(0)
    replayed = run(1)
    assert len(replays) == 3               # the forward, dQ and dK/dV kernels
    monkeypatch.setattr(launch, "run", lambda *a, **kw: real_run(*a, **{**kw, "replay": ()}))
    for plan in plan_module._ATTENTION.values():
        plan.replays.clear()
    fresh = run(1)
    for name, a, b in zip(("out", "dq", "dk", "dv"), replayed, fresh):
        assert torch.equal(a, b), name
