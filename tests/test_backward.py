"""Gradients of flexgen.flex_attention against torch autograd on the float64 oracle.

Each case runs ``flex_attention`` forward and backward on CPU tensors (the
Triton interpreter) with a random upstream gradient, and compares dQ, dK, dV
(and the gradients of captured tensors that require grad) with
``torch.autograd`` through ``flexgen.reference.flex_attention_reference``
computed in float64 from the same float32 inputs. Outputs, dQ / dK / dV and
delta are poisoned with NaN before each launch, so an element a kernel fails
to write fails the comparison. Every kernel a test launches, the backward
ones included, is also compiled ahead of time for sm_90 by the suite's
conftest (``compile_recorded``), so a kernel that only the GPU compiler
rejects fails here too.

Sizes are small and tiles 32 wide (the interpreter's cost is per operation,
the ahead-of-time compile's per tile size), and lengths odd so tails are
partial.
"""
from __future__ import annotations

import contextlib
import os
import zlib

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

from dataclasses import dataclass, field  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import flexgen  # noqa: E402
import flexgen.api  # noqa: E402
import flexgen.runtime.launch  # noqa: E402
from flexgen import create_block_mask, flex_attention  # noqa: E402
from flexgen import mods as M  # noqa: E402
from flexgen import GradientError  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    # flexgen reads FLEXGEN_POISON at import, which another test module may
    # have done first: set the switch itself as well.
    monkeypatch.setattr(flexgen.runtime.poison, "ENABLED", True)


def _backward_launches() -> int:
    """Backward kernels launched so far in this test (conftest records every launch)."""
    recorded = flexgen.runtime.launch.RECORDED or []
    return sum(spec.template == "backward" for spec, _, _ in recorded)


@dataclass
class Case:
    id: str
    mask: object = None             # mask_mod factory (no arguments), or None for no block mask
    score: object = None            # score_mod factory: learned tensors dict -> score_mod, or None
    learned: dict = field(default_factory=dict)   # name -> (shape, init scale) of tensors to train
    B: int = 1
    Hq: int = 2
    Hkv: int = 2
    L: int = 45
    Lkv: int | None = None
    D: int = 64
    Dv: int | None = None
    q_scale: float = 1.0
    dtype: torch.dtype = torch.float32
    with_lse: bool = False          # the loss also depends on the returned LSE
    tol: float = 2e-5               # max error, relative to the largest reference gradient


def _gen(seed):
    return torch.Generator().manual_seed(seed)


DOCS = torch.stack([M.doc_ids_from_lengths([20, 5, 24]), M.doc_ids_from_lengths([33, 16])])


def _learned_biases(t):
    temperature, q_bias, kv_bias = t["temperature"], t["q_bias"], t["kv_bias"]

    def learned_biases(score, b, h, q_idx, kv_idx):
        # A 0-d tensor, a [H, Lq] table read along rows, a [Lkv] table read along
        # columns, and a clamp (Heaviside derivative).
        return torch.clamp(score * temperature, -2.0, 2.0) + q_bias[h, q_idx] + kv_bias[kv_idx]

    return learned_biases


def _score_kills_rows(score, b, h, q_idx, kv_idx):
    return torch.where(kv_idx + 7 <= q_idx, score, -float("inf"))


CASES = [
    Case("no_mod", B=2, L=37),
    Case("causal_gqa", mask=lambda: M.causal_mask, Hq=4, Hkv=2, L=77),
    Case("sliding_window", mask=lambda: M.sliding_window(20), L=70),
    Case("document", mask=lambda: M.document_mask(DOCS), B=2, L=49),
    Case("alibi", mask=lambda: M.causal_mask, score=lambda t: M.alibi(num_heads=4), Hq=4, Hkv=1),
    Case("alibi_learned_slopes", mask=lambda: M.causal_mask,
         score=lambda t: M.alibi(slopes=t["slopes"]), learned={"slopes": ((2,), 0.5)}, L=53),
    Case("softcap_d80", score=lambda t: M.tanh_softcap(2.0), D=80, L=50, q_scale=3.0),
    Case("relative_bias_learned", mask=lambda: M.causal_mask,
         score=lambda t: M.relative_position_bias(t["table"], 45),
         learned={"table": ((2, 89), 1.0)}),
    Case("t5_bias_learned_gqa", score=lambda t: M.t5_relative_bias(t["table"], 8, 20),
         learned={"table": ((4, 8), 1.0)}, Hq=4, Hkv=2, L=41),
    Case("d128_causal", mask=lambda: M.causal_mask, D=128, L=39),
    # Rows 0..6 see no key at all: zero gradients there, and no NaN anywhere.
    Case("fully_masked_rows", mask=lambda: M.causal(-7), L=40),
    # The same rows dead through the score_mod alone (-inf scores, no block mask).
    Case("score_mod_kills_rows", score=lambda t: _score_kills_rows, L=40),
    Case("cross_lengths_dv32", mask=lambda: M.causal_lower_right(33, 70), L=33, Lkv=70, Dv=32),
    Case("learned_biases_and_lse", mask=lambda: M.causal_mask, score=_learned_biases,
         learned={"temperature": ((), 1.0), "q_bias": ((2, 45), 1.0), "kv_bias": ((48,), 1.0)},
         with_lse=True),
    Case("bf16_causal", mask=lambda: M.causal_mask, dtype=torch.bfloat16, L=41, tol=3e-2),
    # Lengths that are multiples of the blocks: the kernels drop their bounds checks (EVEN).
    Case("even_no_mod_gqa", Hq=4, Hkv=2, L=64),
    Case("even_fully_masked_rows", mask=lambda: M.causal(-7), L=64),
    Case("even_alibi_learned_slopes", mask=lambda: M.sliding_window(24),
         score=lambda t: M.alibi(slopes=t["slopes"]), learned={"slopes": ((2,), 0.5)}, L=96),
]


def _inputs(case: Case):
    g = _gen(zlib.crc32(case.id.encode()))     # the same inputs in every process (str hash is salted)
    Lkv = case.Lkv or case.L
    q = torch.randn(case.B, case.Hq, case.L, case.D, generator=g) * case.q_scale
    k = torch.randn(case.B, case.Hkv, Lkv, case.D, generator=g)
    v = torch.randn(case.B, case.Hkv, Lkv, case.Dv or case.D, generator=g)
    q, k, v = (t.to(case.dtype).requires_grad_() for t in (q, k, v))
    learned = {}
    for name, (shape, scale) in case.learned.items():
        init = torch.rand(shape, generator=g) if name in ("slopes", "temperature") else \
            torch.randn(shape, generator=g)
        learned[name] = (init * scale).requires_grad_()
    return q, k, v, learned


def _check(name, got, want, tol):
    assert got is not None, f"{name}: no gradient"
    assert not got.isnan().any(), f"{name}: NaN in the gradient"
    want = want.to(torch.float64)
    err = (got.to(torch.float64) - want).abs().max().item()
    ref = want.abs().max().item()
    assert err <= tol * max(ref, 1.0), f"{name}: max error {err:.3g}, largest gradient {ref:.3g}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_reference(case):
    q, k, v, learned = _inputs(case)
    Lkv = case.Lkv or case.L
    mask_mod = case.mask() if case.mask else None
    score_mod = case.score(learned) if case.score else None
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, case.B, None, case.L, Lkv, device="cpu", BLOCK_SIZE=32)
    options = {"BLOCK_M": 32, "BLOCK_N": 32}
    g = _gen(7)

    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=case.Hq != case.Hkv, return_lse=True,
                              kernel_options=options)
    d_out = torch.randn(out.shape, generator=g)
    d_lse = torch.randn(lse.shape, generator=g) if case.with_lse else None
    loss = (out.float() * d_out).sum()
    if d_lse is not None:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * d_lse).sum()
    leaves = [q, k, v, *learned.values()]
    got = torch.autograd.grad(loss, leaves)
    if flexgen.runtime.launch.RECORDED is not None:
        assert _backward_launches() == 2        # dQ, then dK / dV
        evens = [cx["EVEN"] for spec, _, cx in flexgen.runtime.launch.RECORDED[-2:]]
        assert evens == [case.id.startswith("even_")] * 2

    ref_out, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod,
                                                enable_gqa=case.Hq != case.Hkv, return_lse=True)
    ref_loss = (ref_out * d_out.double()).sum()
    if d_lse is not None:
        ref_loss = ref_loss + (torch.where(ref_lse.isinf(), 0.0, ref_lse) * d_lse.double()).sum()
    want = torch.autograd.grad(ref_loss, leaves)

    for name, a, b in zip(["dq", "dk", "dv", *learned], got, want):
        _check(f"{case.id} {name}", a, b, case.tol)
    if case.id in ("fully_masked_rows", "score_mod_kills_rows", "even_fully_masked_rows"):
        assert torch.isneginf(lse[:, :, :7]).all()
        assert (got[0][:, :, :7] == 0).all()


@pytest.mark.parametrize("case", [c for c in CASES if c.id in ("causal_gqa", "document")],
                         ids=["causal_gqa", "document"])
def test_grids_in_row_order_match_reference(case, monkeypatch):
    """The attention grids take their programs block-major where a grid is a few waves
    (``launch.block_major``: the small grids here, as on an H100) and row by row above that;
    row order, forced here, gives the same gradients (batch 2, GQA)."""
    monkeypatch.setattr(flexgen.runtime.launch, "BLOCK_MAJOR_WAVES", 0)
    test_gradients_match_reference(case)
    if flexgen.runtime.launch.RECORDED is not None:
        assert [cx["BLOCK_MAJOR"] for _, _, cx in flexgen.runtime.launch.RECORDED[-3:]] == [False] * 3


def test_block_major_up_to_eight_waves():
    cpu = torch.device("cpu")
    sms = flexgen.runtime.launch.CPU_SMS
    assert flexgen.runtime.launch.block_major(8 * sms, cpu)
    assert not flexgen.runtime.launch.block_major(8 * sms + 1, cpu)


def test_only_some_inputs_require_grad():
    """Gradients come back for exactly the tensors that require them (here: value and a bias)."""
    g = _gen(3)
    q, k = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 40, 32, generator=g, requires_grad=True)
    bias = torch.randn(2, generator=g, requires_grad=True)

    def head_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    out = flex_attention(q, k, v, score_mod=head_bias, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    out.sum().backward()
    ref_v = v.detach().clone().requires_grad_()
    flex_attention_reference(q, k, ref_v, head_bias).sum().backward()
    _check("dv", v.grad, ref_v.grad, 2e-5)
    # The per-head bias shifts every score of a row alike: softmax ignores it.
    assert bias.grad is not None and bias.grad.abs().max() < 1e-4
    assert q.grad is None and k.grad is None


def test_backward_sources_use_the_transposed_lists_and_scatter():
    """The dK/dV kernel walks q_num_blocks / q_indices; learned buffers are scattered atomically."""
    q = torch.randn(1, 2, 64, 32, requires_grad=True)
    table = torch.randn(2, 127, requires_grad=True)
    mask = create_block_mask(M.causal_mask, 1, 2, 64, 64, device="cpu", BLOCK_SIZE=32)
    score_mod = M.relative_position_bias(table, 64)
    dkdv = flexgen.kernel_source(q, q, q, score_mod=score_mod, block_mask=mask, part="dkdv")
    dq = flexgen.kernel_source(q, q, q, score_mod=score_mod, block_mask=mask, part="dq")
    assert "Q_NUM_BLKS" in dkdv and "FULL_Q_IDX" in dkdv and "atomic_add" not in dkdv
    assert "tl.atomic_add(" in dq and "sbuf0_grad_ptr" in dq


def _floor_score(score, b, h, q_idx, kv_idx):
    return torch.floor(score)


def _sign_score(score, b, h, q_idx, kv_idx):
    return score * torch.sign(score)


W = torch.rand(2, requires_grad=True)
TABLE = torch.randn(8)


def _learned_index(score, b, h, q_idx, kv_idx):
    return score + TABLE[(W[h] * 3).to(torch.int32)]


def _floored_bias(score, b, h, q_idx, kv_idx):
    return score + torch.floor(W[h])


@pytest.mark.parametrize("mod, words", [
    (_floor_score, ["'_floor_score'", "the score", "floor(score)"]),
    (_sign_score, ["'_sign_score'", "sign(score)"]),
    (_learned_index, ["'_learned_index'", "captured0", "index", "shape [2]"]),
    (_floored_bias, ["'_floored_bias'", "floor(captured0[h])"]),
])
def test_non_differentiable_mods_raise_before_running(mod, words, monkeypatch):
    launches = []
    monkeypatch.setattr(flexgen.runtime.launch, "run", lambda *a, **k: launches.append(a))
    q = torch.randn(1, 2, 20, 16, requires_grad=True)
    with pytest.raises(GradientError) as info:
        flex_attention(q, q, q, score_mod=mod)
    assert isinstance(info.value, flexgen.FlexgenError)
    for word in words:
        assert word in str(info.value)
    assert launches == []
    # Without gradients the same mod runs.
    with torch.no_grad():
        flex_attention(q, q, q, score_mod=mod)
    assert len(launches) == 1


def test_float_remainder_differentiates_like_torch():
    def wrapped(score, b, h, q_idx, kv_idx):
        return score % 1.5

    g = _gen(5)
    q, k, v = (torch.randn(1, 1, 33, 16, generator=g, requires_grad=True) for _ in range(3))
    out = flex_attention(q, k, v, score_mod=wrapped, kernel_options={"BLOCK_M": 32, "BLOCK_N": 32})
    d_out = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    ref = flex_attention_reference(q, k, v, wrapped)
    want = torch.autograd.grad((ref * d_out.double()).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        _check(f"d{name}", a, b, 2e-4)


@pytest.mark.once       # an example's plumbing: 90 s of interpreter a pass (its kernels are recorded)
def test_train_small_model_example():
    """examples/train_small_model.py: first-step gradients match the reference, the loss falls."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "train_small_model.py"
    spec = importlib.util.spec_from_file_location("train_small_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()      # asserts both


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_gradients_match_reference_on_gpu(case):
    """The same cases compiled for the GPU with its default tiles, in bfloat16.

    (float32 would take the GPU's full-precision dot, which Triton compiles
    slowly and runs on the CUDA cores: not a configuration worth the test time.)
    """
    q, k, v, learned = (t for t in _inputs(case))
    q, k, v = (t.detach().cuda().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    learned = {n: t.detach().cuda().requires_grad_() for n, t in learned.items()}
    Lkv = case.Lkv or case.L
    mask_mod = case.mask() if case.mask else None
    if case.id == "document":
        mask_mod = M.document_mask(DOCS.cuda())
    score_mod = case.score(learned) if case.score else None
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, case.B, None, case.L, Lkv, device="cuda")
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                              enable_gqa=case.Hq != case.Hkv, return_lse=True)
    g = torch.Generator(device="cuda").manual_seed(7)
    d_out = torch.randn(out.shape, generator=g, device="cuda")
    leaves = [q, k, v, *learned.values()]
    got = torch.autograd.grad((out.float() * d_out).sum(), leaves)
    ref = flex_attention_reference(q, k, v, score_mod, mask_mod, enable_gqa=case.Hq != case.Hkv)
    want = torch.autograd.grad((ref * d_out.double()).sum(), leaves)
    # A learned buffer's gradient sums dZ * d mod / d buffer over every score, terms that
    # cancel (each row's dZ sums to zero), while the bf16 output that delta is computed from
    # shifts every row alike: its error relative to the sum is larger than dq's (measured up
    # to 3.3% on alibi_learned_slopes over input seeds, same before and after kernel changes).
    for name, a, b in zip(["dq", "dk", "dv", *learned], got, want):
        _check(f"{case.id} {name}", a.cpu(), b.cpu(), 3e-2 if name in ("dq", "dk", "dv") else 5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_larger_gradients_on_gpu(dtype, D):
    """Several sparse blocks per sequence, a learned bias, GQA, half precision."""
    g = _gen(11)
    B, Hq, Hkv, L = 2, 4, 2, 1000
    q, k, v = (torch.randn(B, h, L, D, generator=g).cuda().to(dtype).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    table = (torch.randn(Hq, 2 * L - 1, generator=g) * 0.5).cuda().requires_grad_()
    score_mod = M.compose_score_mods(M.tanh_softcap(30.0), M.relative_position_bias(table, L))
    mask = create_block_mask(M.sliding_window(300), None, None, L, L, device="cuda")
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
    d_out = torch.randn(out.shape, generator=g).cuda().to(dtype)
    leaves = [q, k, v, table]
    got = torch.autograd.grad((out * d_out).sum(), leaves)
    ref = flex_attention_reference(q, k, v, score_mod, M.sliding_window(300), enable_gqa=True)
    want = torch.autograd.grad((ref * d_out.double()).sum(), leaves)
    for name, a, b in zip(["dq", "dk", "dv", "table"], got, want):
        _check(f"D={D} {dtype} {name}", a.cpu(), b.cpu(), 2e-2)


@pytest.mark.parametrize("tiles", [(32, 32), (32, 16), (16, 32)], ids=["square", "tall", "wide"])
def test_relative_bias_gradient_sums_every_diagonal(tiles):
    """A gradient indexed by q_idx - kv_idx is summed per tile diagonal before its atomics
    (the tile rotated along its longer side, each diagonal before or after its wrap): every
    diagonal of square, tall and wide dQ tiles, both signs, a ragged length and a document
    mask's partial tiles, against the float64 oracle."""
    B, H, L, D = 2, 2, 83, 16
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * L - 1, requires_grad=True)
    docs = torch.arange(L) // 29

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]

    def same_doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    mask = create_block_mask(same_doc, 1, 1, L, L, device="cpu", BLOCK_SIZE=32)
    out = flex_attention(q, k, v, score_mod=relative, block_mask=mask,
                         kernel_options={"BLOCK_M2": tiles[0], "BLOCK_N2": tiles[1]})
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, table), d_out)
    q64, k64, v64, t64 = (t.detach().double().requires_grad_() for t in (q, k, v, table))
    ref = flex_attention_reference(q64, k64, v64, lambda s, b, h, qi, kv: s + t64[h, qi - kv + L - 1],
                                   same_doc)
    want = torch.autograd.grad(ref, (q64, t64), d_out.double())
    for name, g, w in zip(("dq", "table"), got, want):
        _check(f"{tiles} {name}", g, w, 1e-4)


def test_deterministic_mode_sums_buffer_gradients_in_fixed_point(monkeypatch):
    """Under torch.use_deterministic_algorithms(True) a learned buffer's gradient is summed
    in int64 fixed point (order-independent, so reproducible bit for bit on a GPU, where
    the atomics race); it matches the float64 oracle like the fast path does, and the
    fast path stays the default."""
    from flexgen.runtime import launch
    B, H, L, D = 1, 2, 72, 32
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    table = torch.randn(H, 2 * L, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L]

    specs = []
    run = launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: specs.append(spec) or run(spec, *a, **k))
    grads = {}
    for deterministic in (False, True):
        with _deterministic(deterministic):
            out = flex_attention(q, k, v, score_mod=relative)
            grads[deterministic] = torch.autograd.grad(out.square().sum(), (q, table))
    assert [s.deterministic for s in specs if getattr(s, "part", None) == "dq"] == [False, True]
    q64, k64, v64, t64 = (t.detach().double().requires_grad_() for t in (q, k, v, table))
    ref = flex_attention_reference(q64, k64, v64, lambda s, b, h, qi, kv: s + t64[h, qi - kv + L])
    want = torch.autograd.grad(ref.square().sum(), (q64, t64))
    for got in grads.values():
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


class _deterministic:
    def __init__(self, on):
        self.on = on

    def __enter__(self):
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.on)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_mode_is_bitwise_reproducible_on_gpu(deterministic):
    """Run to run on the GPU, under use_deterministic_algorithms: every gradient, the learned
    tables' included, is bitwise identical. (Without it, the tables' float atomics may
    differ in their last bits; the test only reports how often.)"""
    g = _gen(12)
    B, Hq, Hkv, L, D = 2, 8, 2, 2048, 128
    q, k, v = (torch.randn(B, h, L, D, generator=g).cuda().to(torch.bfloat16).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    table = (torch.randn(Hq, 2 * L - 1, generator=g) * 0.5).cuda().requires_grad_()
    slopes = torch.rand(Hq, generator=g).cuda().requires_grad_()
    score_mod = M.compose_score_mods(M.relative_position_bias(table, L), M.alibi(slopes=slopes))
    mask = create_block_mask(M.causal_mask, None, None, L, L, device="cuda")
    d_out = torch.randn(B, Hq, L, D, generator=g).cuda().to(torch.bfloat16)
    runs = []
    with _deterministic(deterministic):
        for _ in range(3):
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True)
            runs.append(torch.autograd.grad((out * d_out).sum(), (q, k, v, table, slopes)))
    same = [all(torch.equal(a, b) for a, b in zip(run, runs[0])) for run in runs[1:]]
    if deterministic:
        assert all(same), "a deterministic backward differed between runs"
    else:
        print(f"fast path: {sum(same)}/{len(same)} repeated runs bitwise equal")


def test_a_backward_call_keys_its_kernels_replays_once(monkeypatch):
    """A backward call's two or three kernels share one entry of the plan's replays (its key
    taken once) and one signature of the call's tensors (taken at the first replay); a call
    like it replays each kernel by name, one whose tensors Triton would specialize otherwise
    (another dtype) launches anew. Fake launches stand in for the GPU's."""
    from types import SimpleNamespace
    from flexgen.kernels import backward as kernels
    from flexgen.runtime import launch
    launched, replayed, signatures = [], [], []

    class FakeReplay:
        def __init__(self, fresh):
            self.signature = launch.fresh_signature(fresh)

        def launch(self, *tensors):
            replayed.append(tensors)
            return True

    def fake_run(spec, device, inputs, tune_blocks=None, replay=(), origins=()):
        launched.append(spec.kernel_name)
        return FakeReplay(replay)
    monkeypatch.setattr(launch, "run", fake_run)
    plan = SimpleNamespace(replays={})
    lists = tuple(torch.zeros(1, 1, 2, dtype=torch.int32) for _ in range(8))
    specs = [SimpleNamespace(kernel_name=name) for name in ("dq", "dkdv")]

    def call(dtype=torch.float32):
        fresh = tuple(torch.randn(1, 2, 8, 4, dtype=dtype) for _ in range(3)) + (None,)
        run = kernels._Launcher(plan, fresh, fresh, (), (), lists, None)
        for spec in specs:
            run(spec, dict)
        return fresh
    call()
    assert launched == ["dq", "dkdv"] and len(plan.replays) == 1
    real = launch.fresh_signature
    monkeypatch.setattr(launch, "fresh_signature", lambda t: signatures.append(t) or real(t))
    fresh = call()
    assert launched == ["dq", "dkdv"] and replayed == [fresh, fresh] and len(signatures) == 1
    call(torch.float16)
    assert launched == ["dq", "dkdv"] * 2 and len(replayed) == 2 and len(plan.replays) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_tma", [False, True])
def test_replayed_backward_launches_match_fresh_ones_on_gpu(use_tma, monkeypatch):
    """A backward like an earlier one replays its kernels with the call's own tensors swapped
    in (inputs, outputs, the learned table's accumulator; TMA descriptors copied with the new
    base): its gradients are the ones a launch without replays gives. A new mask at another
    address, or a new captured tensor, launches anew."""
    from flexgen.runtime import plan as P
    monkeypatch.setattr(flexgen.runtime.launch, "RECORDED", None)     # (the suite's AOT record)
    g = _gen(21)
    B, H, L, D = 2, 4, 1024, 64
    docs = torch.cat([M.doc_ids_from_lengths([300, 724]), M.doc_ids_from_lengths([1000, 24])]).view(2, L).cuda()
    masks = [create_block_mask(M.document_mask(docs), B, None, L, L, device="cuda"),
             create_block_mask(M.causal_mask, None, None, L, L, device="cuda")]
    tables = [(torch.randn(H, 2 * L - 1, generator=g) * 0.5).cuda().requires_grad_() for _ in range(2)]
    options = {"USE_TMA": use_tma}

    def grads(seed, mask, table):
        gen = _gen(seed)
        q, k, v, d_out = (torch.randn(B, H, L, D, generator=gen).cuda().to(torch.bfloat16)
                          for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = flex_attention(q, k, v, score_mod=M.relative_position_bias(table, L), block_mask=mask,
                             kernel_options=options)
        return torch.autograd.grad(out, (q, k, v, table), d_out)

    calls = [(1, 0, 0), (2, 0, 0), (3, 1, 0), (4, 1, 1), (5, 1, 1)]
    replays = []
    real_replay = flexgen.runtime.launch.Replay.launch
    flexgen.runtime.launch.Replay.launch = lambda self, *t: replays.append(self) or real_replay(self, *t)
    try:
        replayed = [grads(seed, masks[m], tables[t]) for seed, m, t in calls]
    finally:
        flexgen.runtime.launch.Replay.launch = real_replay
    # Calls 2 and 5 repeat calls 1 and 4: forward, dQ and dK/dV replayed.
    assert len(replays) == 6, len(replays)
    launches = []
    real_run = flexgen.runtime.launch.run
    for plan in P._ATTENTION.values():
        plan.replays.clear()
    for (seed, m, t), want_from in zip(calls, replayed):
        flexgen.runtime.launch.run = lambda *a, **kw: launches.append(a[0]) or real_run(*a, **{**kw, "replay": ()})
        try:
            fresh = grads(seed, masks[m], tables[t])
        finally:
            flexgen.runtime.launch.run = real_run
        for name, a, b in zip(("dq", "dk", "dv", "table"), want_from, fresh):
            if name == "table":     # float atomics: the order of the adds may differ
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda msg: f"{name}: {msg}")
            else:
                assert torch.equal(a, b), f"call {seed}: {name} differs from a fresh launch"
    assert launches


def test_eager_gradients_take_the_ops_implementations_without_the_op():
    """An eager call that wants gradients runs the custom op's forward and backward
    implementations through a plain autograd.Function (the op's autograd wrapper flattens
    every argument, ~0.3 ms a call); its outputs and gradients equal the op's, which a
    dispatch mode (and torch.compile) sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=gen) for _ in range(3))
    bias = torch.randn(2, generator=gen)
    grad = torch.randn(1, 2, 70, 16, generator=gen)
    bm = create_block_mask(M.causal_mask, None, None, 70, 70, BLOCK_SIZE=32)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        qq, kk, vv, bb = leaves
        with mode:
            out, lse = flex_attention(qq, kk, vv, score_mod=lambda s, b, h, qi, ki: s + bb[h],
                                      block_mask=bm, return_lse=True)
        name = out.grad_fn.name()
        (out * grad).sum().backward()
        return name, out.detach(), lse.detach(), [t.grad for t in leaves]

    eager_fn, *eager = run(contextlib.nullcontext())
    op_fn, *op = run(Passthrough())
    assert "EagerAttention" in eager_fn and "EagerAttention" not in op_fn
    torch.testing.assert_close(eager[:2], op[:2], rtol=0, atol=0)
    torch.testing.assert_close(eager[2], op[2], rtol=1e-6, atol=1e-6)


def test_torch_func_grad_and_vjp():
    """torch.func.grad (over the inputs and a captured tensor) and torch.func.vjp give the
    gradients autograd gives; their saved tensors are functorch wrappers, which the backward
    hands to the op (whose dispatch unwraps them) rather than to the kernels. Both match the
    float64 reference."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=gen) for _ in range(3))
    bias = torch.randn(2, 70, 70, generator=gen)
    bm = create_block_mask(M.causal_mask, None, None, 70, 70, BLOCK_SIZE=32)

    def loss(q, bias, attention=flex_attention):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]
        return attention(q, k, v, score_mod=score_mod, block_mask=bm).pow(2).sum()

    dq, dbias = torch.func.grad(loss, argnums=(0, 1))(q, bias)
    qq, bb = q.clone().requires_grad_(), bias.clone().requires_grad_()
    loss(qq, bb).backward()
    assert torch.equal(dq, qq.grad) and torch.equal(dbias, bb.grad)
    q64, b64 = q.double().requires_grad_(), bias.double().requires_grad_()
    loss(q64, b64, lambda *a, **kw: flex_attention_reference(*a[:3], kw["score_mod"],
                                                             mask_mod=M.causal_mask)).backward()
    torch.testing.assert_close(dq.double(), q64.grad, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(dbias.double(), b64.grad, atol=2e-4, rtol=2e-4)

    out, vjp = torch.func.vjp(lambda q: flex_attention(q, k, v, block_mask=bm), q)
    (dq,) = vjp(torch.ones_like(out))
    qq = q.clone().requires_grad_()
    flex_attention(qq, k, v, block_mask=bm).sum().backward()
    assert torch.equal(dq, qq.grad)
