"""The backward kernels' TMA variant against the float64 oracle and the pointer kernels.

When the forward kernel of a call uses TMA (``kernel_options={"USE_TMA": True}``,
or the default for long 16-bit GPU calls), both backward kernels do too: the
dK/dV kernel loads q and dO (its inner loop) and k, v through host tensor
descriptors, the dQ kernel k and v (its inner loop) and q, dO, out, and both
store dQ / dK / dV through descriptors; LSE and delta stay pointer loads.
Where a tensor of the call cannot back a descriptor (the upstream gradient
autograd hands over is often expanded or strided; a head dim whose contiguous
gradient rows are not 16-byte multiples), that call runs the pointer kernels.

As in test_backward.py: CPU tensors through the Triton interpreter (which
emulates descriptors), 32-wide tiles, odd lengths, outputs poisoned with NaN
(conftest), and every launch compiled for sm_90 by the conftest, where the
descriptors become TMA copies.
"""
from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import flexgen
import flexgen.api
from flexgen import create_block_mask, flex_attention, kernel_source
from flexgen.runtime import aot
from flexgen.runtime import launch
from flexgen import mods as M
from flexgen.reference import flex_attention_reference
import conftest
from conftest import assert_module_launches_compile, launches_of
import test_backward

TMA = {"USE_TMA": True}
TILES = {"BLOCK_M": 32, "BLOCK_N": 32}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(flexgen.runtime.poison, "ENABLED", True)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


_check = test_backward._check   # no NaN; max error within tol of the largest gradient


def _recorded():
    """(forward specs, backward specs, backward launches) recorded so far in this test."""
    recorded = launch.RECORDED or []
    forward = [s for s, _, _ in recorded if s.template == "forward"]
    backward = [(s, a) for s, a, _ in recorded if s.template == "backward"]
    return forward, backward


def _run(q, k, v, options, *, score_mod=None, block_mask=None, d_out=None, learned=(),
         enable_gqa=False, expect_tma=None):
    """Forward and backward through flexgen; returns the gradients of q, k, v and ``learned``.

    ``d_out`` is the upstream gradient (any tensor autograd accepts). ``expect_tma``:
    whether both backward kernels must have used descriptors (None: not checked).
    """
    start = len(launch.RECORDED)
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa,
                         kernel_options={**TILES, **(options or {})})
    grads = torch.autograd.grad(out, [q, k, v, *learned], grad_outputs=d_out)
    recorded = launch.RECORDED[start:]
    backward = [(s, a) for s, a, _ in recorded if s.template == "backward"]
    assert [s.part for s, _ in backward] == ["dq", "dkdv"]
    if expect_tma is not None:
        for spec, args in backward:
            assert spec.use_tma is expect_tma, spec.part
            descriptors = sum(isinstance(a, TensorDescriptor) for a in args)
            assert descriptors == (6 if expect_tma else 0), (spec.part, descriptors)
    return grads


def _reference(q, k, v, d_out, score_mod=None, mask_mod=None, learned=(), enable_gqa=False):
    out = flex_attention_reference(q, k, v, score_mod, mask_mod, enable_gqa=enable_gqa)
    return torch.autograd.grad(out, [q, k, v, *learned], grad_outputs=d_out.double())


def _leaves(B, Hq, Hkv, L, Lkv, D, Dv, dtype=torch.float32, seed=0, q_scale=1.0):
    g = _gen(seed)
    q = torch.randn(B, Hq, L, D, generator=g) * q_scale
    k = torch.randn(B, Hkv, Lkv, D, generator=g)
    v = torch.randn(B, Hkv, Lkv, Dv, generator=g)
    return tuple(t.to(dtype).requires_grad_() for t in (q, k, v))


# --- against the oracle and the pointer kernels -------------------------------------------

DOCS = torch.stack([M.doc_ids_from_lengths([20, 5, 24]), M.doc_ids_from_lengths([33, 16])])


@dataclasses.dataclass
class Case(test_backward.Case):
    """test_backward's case, with head dim 32 by default and leading dead rows."""
    D: int = 32
    dead_rows: int = 0              # rows 0 .. dead_rows-1 see no key


# Head dim 32 unless the case is about head dims (the sm_90 compile of fp32 kernels, which
# dominates this file's time, grows with it); D=80 runs in 128 lanes.
CASES = [
    Case("no_mod_d64", B=2, L=37, D=64),
    Case("causal", mask=lambda: M.causal_mask, L=77),
    Case("document", mask=lambda: M.document_mask(DOCS), B=2, L=49),
    Case("relative_bias_learned", mask=lambda: M.causal_mask,
         score=lambda t: M.relative_position_bias(t["table"], 45), learned={"table": (2, 89)}),
    Case("gqa_4_2_causal", mask=lambda: M.causal_mask, Hq=4, Hkv=2, L=53),
    Case("gqa_8_1_alibi", score=lambda t: M.alibi(num_heads=8), Hq=8, Hkv=1, L=35),
    Case("lq_lt_lkv_dv16", mask=lambda: M.causal_lower_right(33, 70), L=33, Lkv=70, Dv=16),
    # Rows 0..36 see no key: query block 0 is absent from the lists, rows 32..36 are dead
    # inside a partial block. Zero gradients there, no NaN anywhere.
    Case("lq_gt_lkv_dead_rows", mask=lambda: M.causal_lower_right(70, 33), L=70, Lkv=33,
         dead_rows=37),
    Case("softcap_causal_d80_bf16", mask=lambda: M.causal_mask, score=lambda t: M.tanh_softcap(2.0),
         D=80, L=41, q_scale=3.0, dtype=torch.bfloat16, tol=3e-2),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_reference_and_pointer_kernels(case):
    Lkv = case.Lkv or case.L
    q, k, v = _leaves(case.B, case.Hq, case.Hkv, case.L, Lkv, case.D, case.Dv or case.D,
                      case.dtype, seed=zlib.crc32(case.id.encode()), q_scale=case.q_scale)
    g = _gen(7)
    learned = {name: torch.randn(shape, generator=g).requires_grad_()
               for name, shape in case.learned.items()}
    mask_mod = case.mask() if case.mask else None
    score_mod = case.score(learned) if case.score else None
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, case.B, None, case.L, Lkv, device="cpu", BLOCK_SIZE=32)
    d_out = torch.randn(case.B, case.Hq, case.L, case.Dv or case.D, generator=g).to(case.dtype)
    gqa = case.Hq != case.Hkv
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, d_out=d_out,
                  learned=list(learned.values()), enable_gqa=gqa)

    got = _run(q, k, v, TMA, expect_tma=True, **kwargs)
    forward, _ = _recorded()
    assert forward[-1].use_tma
    want = _reference(q, k, v, d_out, score_mod, mask_mod, list(learned.values()), gqa)
    names = ["dq", "dk", "dv", *learned]
    for name, a, b in zip(names, got, want):
        _check(f"{case.id} {name}", a, b, case.tol)

    # The same TMA forward, the pointer backward: an upstream gradient whose rows are not
    # 16-byte multiples apart cannot back a descriptor.
    strided = torch.empty(*d_out.shape[:3], d_out.shape[3] + 1, dtype=d_out.dtype)[..., :-1]
    pointer = _run(q, k, v, TMA, expect_tma=False, **{**kwargs, "d_out": strided.copy_(d_out)})
    forward, _ = _recorded()
    assert forward[-1].use_tma
    for name, a, b in zip(names, got, pointer):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m: f"{case.id} {name}: {m}")

    if case.dead_rows:
        assert (got[0][:, :, :case.dead_rows] == 0).all()
        assert (got[0][:, :, case.dead_rows:] != 0).any()


# --- tensors TMA cannot address: the pointer kernels for that call -------------------------
# (Every case above also runs its pointer backward from an upstream gradient with 132-byte
# rows.) These use the kernels of the "causal" case: fp32, head dim 32, 32-wide blocks.

def _causal(L):
    return create_block_mask(M.causal_mask, 1, None, L, L, device="cpu", BLOCK_SIZE=32)


def _check_fallback(d_out, expect_tma=False, L=37):
    """USE_TMA with this upstream gradient: a TMA forward; backward kernels with or without
    descriptors as expected; gradients right either way."""
    q, k, v = _leaves(1, 2, 2, L, L, 32, 32)
    mask = _causal(L)
    got = _run(q, k, v, TMA, block_mask=mask, d_out=d_out, expect_tma=expect_tma)
    forward, _ = _recorded()
    assert forward[-1].use_tma
    for name, a, b in zip("qkv", got, _reference(q, k, v, d_out, mask_mod=M.causal_mask)):
        _check(f"d{name}", a, b, 2e-5)


def test_expanded_grad_out_falls_back():
    """out.sum().backward() hands over an all-zero-stride gradient."""
    _check_fallback(torch.ones(()).expand(1, 2, 37, 32))


def test_grad_out_broadcast_over_heads_falls_back():
    """A zero stride on a stepped dim only (the last dim contiguous): still the pointer kernels."""
    _check_fallback(torch.randn(1, 1, 37, 32).expand(1, 2, 37, 32))


def test_misaligned_grad_out_falls_back():
    n = 2 * 37 * 32
    flat = torch.randn(n + 4)
    shift = (16 - flat.data_ptr() % 16) % 16 // 4 + 1
    d_out = flat[shift:shift + n].view(1, 2, 37, 32)
    assert d_out.data_ptr() % 16 != 0
    _check_fallback(d_out)


def test_transposed_grad_out_uses_tma():
    """[B, L, H, D] storage seen as [B, H, L, D]: not contiguous, but TMA addresses it."""
    d_out = torch.randn(1, 37, 2, 32).transpose(1, 2)
    assert not d_out.is_contiguous()
    _check_fallback(d_out, expect_tma=True)


def test_gradient_rows_not_16_byte_multiples_fall_back():
    """fp16, head dim 20 cut from 24-wide rows: q, k, v (48-byte rows) and the output
    suit TMA, the contiguous dq and dk flexgen allocates (40-byte rows) do not."""
    g = _gen(3)
    q, k = (torch.randn(1, 2, 37, 24, generator=g).half()[..., :20].requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 37, 32, generator=g).half().requires_grad_()
    d_out = torch.randn(1, 2, 37, 32, generator=g).half()
    got = _run(q, k, v, TMA, d_out=d_out, expect_tma=False)
    forward, _ = _recorded()
    assert forward[-1].use_tma
    for name, a, b in zip("qkv", got, _reference(q, k, v, d_out)):
        _check(f"d{name}", a, b, 4e-3)


# --- options and sources ------------------------------------------------------------------

def test_use_tma_false_and_the_cpu_default_run_the_pointer_backward():
    L = 37
    q, k, v = _leaves(1, 2, 2, L, L, 32, 32)
    d_out = torch.randn(1, 2, L, 32)
    a = _run(q, k, v, {"USE_TMA": False}, block_mask=_causal(L), d_out=d_out, expect_tma=False)
    b = _run(q, k, v, None, block_mask=_causal(L), d_out=d_out, expect_tma=False)   # CPU: only when asked
    forward, _ = _recorded()
    assert not any(spec.use_tma for spec in forward)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_pointer_sources_unchanged_when_off():
    L = 64
    q = torch.randn(1, 2, L, 80, dtype=torch.bfloat16, requires_grad=True)
    mask = create_block_mask(M.causal_mask, 1, 2, L, L, device="cpu", BLOCK_SIZE=32)
    table = torch.randn(2, 2 * L - 1, requires_grad=True)
    score_mod = M.relative_position_bias(table, L)
    for part in ("dq", "dkdv"):
        plain = kernel_source(q, q, q, score_mod=score_mod, block_mask=mask, part=part)
        off = kernel_source(q, q, q, score_mod=score_mod, block_mask=mask, part=part,
                            kernel_options={"USE_TMA": False})
        on = kernel_source(q, q, q, score_mod=score_mod, block_mask=mask, part=part, kernel_options=TMA)
        assert off == plain
        assert "TensorDescriptor" not in plain and ".load([" not in plain and "stride_qm" in plain
        assert on != plain and "TensorDescriptor" in on
        assert "stride_qm" not in on and "stride_kn" not in on and "tl.load(q_base" not in on
        # LSE and delta stay pointer loads; captured-buffer gradients stay atomics.
        assert "tl.load(LSE + row_base" in on or "tl.load(lse_base" in on
        if part == "dq":
            assert "K.load([off_z, off_hkv, start_n, 0])" in on and "DQ.store(" in on
            assert "tl.atomic_add(" in on
        else:
            assert "Q.load([off_z, off_h, start_m, 0])" in on
            assert "DOUT.load([off_z, off_h, start_m, 0])" in on
            assert "DK.store(" in on and "DV.store(" in on


# --- ahead-of-time compile for sm_90 --------------------------------------------------------

@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_tma_backward_kernels_compile_to_tma_copies():
    L = 130
    q, k, v = _leaves(1, 2, 2, L, L, 80, 80, torch.bfloat16)
    mask = create_block_mask(M.causal_mask, 1, None, L, L, device="cpu")
    with aot.recording() as launches:
        out = flex_attention(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask, kernel_options=TMA)
        out.backward(torch.randn(out.shape).to(out.dtype))
    backward = [launch for launch in launches if launch[0].template == "backward"]
    assert [spec.part for spec, _, _ in backward] == ["dq", "dkdv"]
    for spec, args, constexprs in backward:
        assert spec.use_tma
        assert sum(aot._arg_type(a).startswith("tensordesc<bf16[1, 1, ") for a in args) == 6
        compiled = aot.compile_launch(spec, args, constexprs)
        assert compiled.asm.get("cubin")
        assert "cp.async.bulk.tensor" in compiled.asm["ptx"], spec.part
        ttgir = compiled.asm["ttgir"]
        assert "async_tma_copy_global_to_local" in ttgir, spec.part
        assert "async_tma_copy_local_to_global" in ttgir, spec.part


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_every_launched_kernel_compiles_for_sm90():
    """Each distinct kernel launched above, TMA backward and pointer fall-backs, compiles."""
    assert_module_launches_compile(__name__, {"forward", "backward"})
    used = {(s.part, s.use_tma) for s, _, _ in launches_of(__name__) if s.template == "backward"}
    assert used >= {("dq", True), ("dkdv", True), ("dq", False), ("dkdv", False)}
