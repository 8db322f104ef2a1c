"""The one-kernel backward (``kernel_options={"DQ_ATOMIC": True}``) against the float64 oracle.

With DQ_ATOMIC the dK/dV kernel also computes dQ: every (query tile, kv tile)
pair adds its dS K into a float32 dQ with atomic adds (a TMA reduce-add on
Hopper; the interpreter, which has none, takes element atomics), and the
captured tensors' gradients are scattered there too; no dQ kernel runs. The
cases are test_backward.py's (odd lengths, GQA, dead rows, a gradient of the
LSE, learned tensors, a padded head dim, bf16), run through this path, each
checked against torch autograd on the reference; the launched kernels also
compile for sm_90 (the TMA variants to ``cp.reduce.async.bulk``).
"""
from __future__ import annotations

import os

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

import pytest  # noqa: E402
import torch  # noqa: E402

import flexgen.api  # noqa: E402
from flexgen import aot, create_block_mask, flex_attention, launch  # noqa: E402
from flexgen import mods as M  # noqa: E402
from flexgen.errors import FlexgenError  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402
import conftest  # noqa: E402
from conftest import assert_module_launches_compile, launches_of  # noqa: E402
from test_backward import CASES, _check, _gen, _inputs  # noqa: E402

ATOMIC = {"DQ_ATOMIC": True}
ATOMIC_CASES = [c for c in CASES if c.id in {
    "no_mod", "causal_gqa", "document", "alibi_learned_slopes", "softcap_d80",
    "relative_bias_learned", "t5_bias_learned_gqa", "fully_masked_rows", "cross_lengths_dv32",
    "learned_biases_and_lse", "bf16_causal"}]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(flexgen.api, "POISON", True)


def _backward_parts(start: int) -> list:
    return [(s.part, s.dq_atomic) for s, _, _ in launch.RECORDED[start:] if s.template == "backward"]


def _grads(case, options):
    """(flexgen's gradients, the reference's) for one case of test_backward.py."""
    q, k, v, learned = _inputs(case)
    Lkv = case.Lkv or case.L
    mask_mod = case.mask() if case.mask else None
    score_mod = case.score(learned) if case.score else None
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, case.B, None, case.L, Lkv, device="cpu", BLOCK_SIZE=32)
    g = _gen(11)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=case.Hq != case.Hkv, return_lse=True,
                              kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **options})
    d_out = torch.randn(out.shape, generator=g)
    d_lse = torch.randn(lse.shape, generator=g) if case.with_lse else None
    loss = (out.float() * d_out).sum()
    ref_out, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod,
                                                enable_gqa=case.Hq != case.Hkv, return_lse=True)
    ref_loss = (ref_out * d_out.double()).sum()
    if d_lse is not None:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * d_lse).sum()
        ref_loss = ref_loss + (torch.where(ref_lse.isinf(), 0.0, ref_lse) * d_lse.double()).sum()
    leaves = [q, k, v, *learned.values()]
    start = len(launch.RECORDED)
    got = torch.autograd.grad(loss, leaves)
    parts = _backward_parts(start)
    want = torch.autograd.grad(ref_loss, leaves)
    return got, want, ["dq", "dk", "dv", *learned], parts


@pytest.mark.parametrize("case", ATOMIC_CASES, ids=[c.id for c in ATOMIC_CASES])
def test_gradients_match_reference(case):
    got, want, names, parts = _grads(case, ATOMIC)
    assert parts == [("dkdv", True)]          # one kernel: no dQ kernel ran
    for name, a, b in zip(names, got, want):
        _check(f"{case.id} {name}", a, b, case.tol)


@pytest.mark.parametrize("case_id", ["causal_gqa", "softcap_d80", "learned_biases_and_lse"])
def test_tma_variant_matches_reference(case_id):
    """The TMA kernels with DQ_ATOMIC (on CPU the dQ reduce runs as element atomics)."""
    case, = [c for c in CASES if c.id == case_id]
    case = type(case)(**{**case.__dict__, "dtype": torch.bfloat16, "tol": 3e-2})
    got, want, names, parts = _grads(case, {**ATOMIC, "USE_TMA": True})
    assert parts == [("dkdv", True)]
    assert launch.RECORDED[-1][0].use_tma
    for name, a, b in zip(names, got, want):
        _check(f"{case.id} tma {name}", a, b, case.tol)


def test_only_query_needs_grad_runs_the_dq_kernel():
    """Without dK / dV to compute, the dq kernel alone is the cheaper path."""
    case, = [c for c in CASES if c.id == "causal_gqa"]
    q, k, v, _ = _inputs(case)
    k, v = k.detach(), v.detach()
    mask = create_block_mask(M.causal_mask, None, None, case.L, case.L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                         kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, **ATOMIC})
    d_out = torch.randn(out.shape, generator=_gen(3))
    start = len(launch.RECORDED)
    dq, = torch.autograd.grad(out, [q], grad_outputs=d_out)
    assert _backward_parts(start) == [("dq", False)]
    ref = flex_attention_reference(q, k, v, None, M.causal_mask, enable_gqa=True)
    want, = torch.autograd.grad(ref, [q], grad_outputs=d_out.double())
    _check("dq", dq, want, case.tol)


def test_deterministic_mode_runs_the_two_kernels():
    """torch.use_deterministic_algorithms(True): atomic sums vary in their last bits, so no."""
    case, = [c for c in CASES if c.id == "no_mod"]
    try:
        torch.use_deterministic_algorithms(True)
        got, want, names, parts = _grads(case, ATOMIC)
    finally:
        torch.use_deterministic_algorithms(False)
    assert parts == [("dq", False), ("dkdv", False)]
    for name, a, b in zip(names, got, want):
        _check(f"deterministic {name}", a, b, case.tol)


def test_bad_value_is_a_clear_error():
    q = torch.randn(1, 1, 8, 16, requires_grad=True)
    with pytest.raises(FlexgenError, match="DQ_ATOMIC"):
        flex_attention(q, q, q, kernel_options={"DQ_ATOMIC": "yes"})


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_tma_kernel_compiles_to_a_tma_reduce():
    L = 130
    q, k, v = (torch.randn(1, 2, L, 80).to(torch.bfloat16).requires_grad_() for _ in range(3))
    mask = create_block_mask(M.causal_mask, None, None, L, L, device="cpu")
    with aot.recording() as launches:
        out = flex_attention(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask,
                             kernel_options={**ATOMIC, "USE_TMA": True})
        out.backward(torch.randn(out.shape).to(out.dtype))
    (spec, args, constexprs), = [la for la in launches if la[0].template == "backward"]
    assert spec.dq_atomic and spec.use_tma
    ptx = aot.compile_launch(spec, args, constexprs).asm["ptx"]
    assert "cp.reduce.async.bulk.tensor" in ptx and ".add" in ptx


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_every_launched_kernel_compiles_for_sm90():
    assert_module_launches_compile(__name__, {"forward", "backward"})
    used = {(s.part, s.dq_atomic, s.use_tma) for s, _, _ in launches_of(__name__)
            if s.template == "backward"}
    assert used >= {("dkdv", True, False), ("dkdv", True, True)}
