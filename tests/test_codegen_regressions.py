"""Regressions in generated code: ordinary mods that crashed a kernel (issue 15).

Each test is named for the failure class it pins down and runs the kernels
involved (forward, both backward kernels, decode, the block-mask kernel)
through the interpreter against the float64 oracle; the conftest compiles each
for sm_90, where the same code failed too. Lengths 128 / 256 fill their sparse
blocks (the kernels drop their bounds checks there: EVEN / EVEN_KV); 40 does not.
"""
from __future__ import annotations

import re

import pytest
import sympy
import torch

import flexgen
import flexgen.masks.mask_eval
from flexgen import create_block_mask, flex_attention
from flexgen.codegen.printer import cast, print_joint, print_snippet
from flexgen.frontend.expr import SCORE, derivative
from flexgen import decode_attention
from flexgen.reference import flex_attention_reference
from conftest import check, run_and_check

OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32}


def _grid(*shape, generator):
    """Multiples of 1/4 in [-1, 1]: scores exact in float32, so no clamp or floor ties differ."""
    return torch.randint(-4, 5, shape, generator=generator) / 4


def _check_gradients(score_mod, L, Lkv=None, mask_mod=None, block_size=32, tol=2e-5):
    """Forward and backward of ``flex_attention`` match torch autograd through the oracle."""
    g = torch.Generator().manual_seed(L)
    Lkv = Lkv or L
    q, k = _grid(1, 2, L, 32, generator=g), _grid(1, 2, Lkv, 32, generator=g)
    v = torch.randn(1, 2, Lkv, 32, generator=g)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = None if mask_mod is None else create_block_mask(mask_mod, 1, 2, L, Lkv, device="cpu",
                                                           BLOCK_SIZE=block_size)
    out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True,
                              kernel_options=OPTIONS)
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod, mask_mod, return_lse=True)
    check(out.detach(), ref.detach(), torch.float32, lse.detach(), ref_lse.detach())
    d_out = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v), allow_unused=True)
    want = torch.autograd.grad((ref * d_out.double()).sum(), (q, k, v), allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        b = torch.zeros(a.shape, dtype=torch.float64) if b is None else b
        assert not a.isnan().any(), f"{name}: NaN"
        err = (a.double() - b).abs().max().item()
        assert err <= tol * max(b.abs().max().item(), 1.0), f"{name}: max error {err:.3g}"


# --- d score_mod / d score folds to a whole number: `(-1).to(tl.float32)` -------------------

def _times_two(score, b, h, q_idx, kv_idx):
    return score * 2


def _negated(score, b, h, q_idx, kv_idx):
    return -score


def _doubled(score, b, h, q_idx, kv_idx):
    return score + score


def _doubled_with_bias(score, b, h, q_idx, kv_idx):
    return 2 * score + (q_idx - kv_idx) * 0.1


@pytest.mark.parametrize("L", [40, 128])
def test_backward_integer_derivative_score_times_two(L):
    _check_gradients(_times_two, L)


@pytest.mark.parametrize("L", [40, 128])
def test_backward_integer_derivative_negated_score(L):
    _check_gradients(_negated, L)


def test_backward_integer_derivative_score_plus_score():
    _check_gradients(_doubled, 45)


def test_backward_integer_derivative_with_position_bias():
    _check_gradients(_doubled_with_bias, 45)


def test_forward_literal_over_index_expression():
    """1.28 / (|kv_idx| + 1): the numerator printed as `(1).to(tl.float32)` in the forward."""
    def reciprocal_floor(score, b, h, q_idx, kv_idx):
        return torch.maximum(score, 1.28 / (torch.abs(kv_idx) + 1))

    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    run_and_check(q, k, v, reciprocal_floor, kernel_options=OPTIONS)
    _check_gradients(reciprocal_floor, 40)


LITERAL_METHOD_CALL = re.compile(r"(?<![\w.\])])\(?-?(\d+\.?\d*(e-?\d+)?|True|False)\)\.to\(")


@pytest.mark.parametrize("expr", [
    2 * SCORE, -SCORE, sympy.Integer(-1), sympy.Rational(32, 25) / (sympy.Symbol("kv_idx") + 1),
    sympy.Max(SCORE, sympy.Rational(32, 25) / (sympy.Symbol("kv_idx", integer=True) + 1)),
    sympy.true, sympy.Integer(3) * sympy.Rational(1, 10),
], ids=str)
def test_printer_never_calls_a_method_on_a_literal(expr):
    """No `(2).to(...)`: Triton has no methods on Python numbers (nor on constexprs)."""
    snippet = print_snippet(expr, "t_")
    d = derivative(expr, SCORE) if not isinstance(expr, sympy.logic.boolalg.Boolean) else sympy.Integer(0)
    joint = print_joint([expr, d], "j_")
    codes = [*snippet.lines, snippet.result, *joint.lines, *joint.results,
             *(cast(r, k, "float") for r, k in zip(joint.results, joint.kinds)),
             *(cast(r, k, "int") for r, k in zip(joint.results, joint.kinds))]
    for code in codes:
        assert not LITERAL_METHOD_CALL.search(code), code


# --- mods constant along kv, with lengths that fill their blocks (EVEN) ------------------------

def _constant(score, b, h, q_idx, kv_idx):
    return score * 0 + 1.0


def _by_query(score, b, h, q_idx, kv_idx):
    return q_idx * 0.1


def _by_head(score, b, h, q_idx, kv_idx):
    return h * 0.1


def _pinned(score, b, h, q_idx, kv_idx):
    return torch.clamp(score, 0.3, 0.3)


CONSTANT_ALONG_KV = [_constant, _by_query, _by_head, _pinned]


@pytest.mark.parametrize("L", [40, 128, 256])
@pytest.mark.parametrize("mod", CONSTANT_ALONG_KV, ids=lambda m: m.__name__.strip("_"))
def test_forward_score_mod_constant_along_kv(mod, L):
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    run_and_check(q, k, v, mod, kernel_options=OPTIONS)


@pytest.mark.parametrize("L", [40, 128])
@pytest.mark.parametrize("mod", CONSTANT_ALONG_KV, ids=lambda m: m.__name__.strip("_"))
def test_backward_score_mod_constant_along_kv(mod, L):
    _check_gradients(mod, L)


@pytest.mark.parametrize("mod", CONSTANT_ALONG_KV, ids=lambda m: m.__name__.strip("_"))
def test_decode_score_mod_constant_along_kv(mod):
    q, k, v = (torch.randn(2, 2, n, 32) for n in (3, 128, 128))
    out, lse = decode_attention(q, k, v, score_mod=mod, return_lse=True, q_offsets=0)
    ref, ref_lse = flex_attention_reference(q, k, v, mod, return_lse=True)
    check(out, ref, torch.float32, lse, ref_lse)


def _even_queries(b, h, q_idx, kv_idx):
    return q_idx % 2 == 0


def _early_keys(b, h, q_idx, kv_idx):
    return kv_idx % 3 != 1


def _first_head(b, h, q_idx, kv_idx):
    return h == 0


def _always(b, h, q_idx, kv_idx):
    return q_idx >= 0


MASKS = [_even_queries, _early_keys, _first_head, _always]


@pytest.mark.parametrize("L", [40, 128])
@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda m: m.__name__.strip("_"))
def test_masks_constant_along_an_axis_forward_and_backward(mask_mod, L):
    _check_gradients(_by_query, L, mask_mod=mask_mod)
    _check_gradients(None, L, mask_mod=mask_mod, block_size=64)


@pytest.mark.parametrize("mask_mod", MASKS, ids=lambda m: m.__name__.strip("_"))
def test_decode_masks_constant_along_an_axis(mask_mod):
    q, k, v = (torch.randn(2, 2, n, 32) for n in (5, 128, 128))
    out, lse = decode_attention(q, k, v, score_mod=_by_head, mask_mod=mask_mod, return_lse=True,
                                q_offsets=0)
    ref, ref_lse = flex_attention_reference(q, k, v, _by_head, mask_mod, return_lse=True)
    check(out, ref, torch.float32, lse, ref_lse)
    mask = create_block_mask(mask_mod, 2, 2, 5, 128, device="cpu", BLOCK_SIZE=32)
    out, lse = flex_attention(q, k, v, score_mod=_by_head, block_mask=mask, return_lse=True)
    check(out, ref, torch.float32, lse, ref_lse)


@pytest.mark.parametrize("mask_mod", MASKS[:3], ids=lambda m: m.__name__.strip("_"))
def test_block_mask_kernel_masks_constant_along_an_axis(mask_mod, monkeypatch):
    """The generated block-mask kernel (not the torch path) classifies such masks exactly."""
    monkeypatch.setattr(flexgen.masks.mask_eval, "TORCH_MAX_ELEMENTS", -1)
    mask = create_block_mask(mask_mod, 1, 2, 128, 96, device="cpu", BLOCK_SIZE=32)
    monkeypatch.undo()
    want = create_block_mask(mask_mod, 1, 2, 128, 96, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(mask.block_states(), want.block_states())


# --- constant sub-expressions: computed as torch computes them, never by sympy ---------------

CONSTANT_SUBEXPRESSIONS = {
    "sin_of_cancelled_position": lambda s, b, h, q, kv: s * torch.sin(q - q + 0.3),
    "max_with_constant_sin": lambda s, b, h, q, kv: torch.maximum(s, torch.sin(q - q + 0.3)),
    "log_of_negative": lambda s, b, h, q, kv: s + torch.log(q * 0 - 1.0),
    "max_with_log_of_negative": lambda s, b, h, q, kv: torch.maximum(s, torch.log(q * 0 - 1.0)),
    "compare_log_of_negative": lambda s, b, h, q, kv: torch.where(torch.log(q * 0 - 1.0) > 0, s, 0.0),
    "sqrt_of_negative": lambda s, b, h, q, kv: s + torch.sqrt(kv * 0 - 2.0),
    "power_of_negative": lambda s, b, h, q, kv: s + (kv * 0 - 2.0) ** 0.5,
    "max_with_log_of_zero": lambda s, b, h, q, kv: torch.maximum(s, torch.log(q * 0.0)),
    "min_with_rsqrt_of_zero": lambda s, b, h, q, kv: torch.minimum(s, torch.rsqrt(q * 0.0)),
    "min_with_one_over_zero": lambda s, b, h, q, kv: torch.minimum(s, 1.0 / (q * 0.0)),
    "tanh_of_score_over_zero": lambda s, b, h, q, kv: torch.tanh(s / (q - q)),
    "float_remainder_by_zero": lambda s, b, h, q, kv: s + (q * 0.0 + 3.0) % (kv * 0.0),
    "remainder_by_inf": lambda s, b, h, q, kv: s + (q * 0.0 + 3.0) % float("inf"),
    "overflow_minus_overflow": lambda s, b, h, q, kv: s + (torch.exp(q * 0 + 100.0)
                                                           - torch.exp(q * 0 + 100.0)),
    "sin_of_inf": lambda s, b, h, q, kv: s + torch.sin(q * 0 + float("inf")),
    "sigmoid_of_minus_inf": lambda s, b, h, q, kv: s + torch.sigmoid(q * 0.0 - float("inf")),
    "compare_nan": lambda s, b, h, q, kv: torch.where((q * 0 + float("nan")) > 0, s, 1.0),
    "max_with_nan": lambda s, b, h, q, kv: torch.maximum(s, q * 0 + float("nan")),
}


@pytest.mark.parametrize("name", CONSTANT_SUBEXPRESSIONS)
def test_constant_subexpressions_fold_like_torch(name):
    """sympy raised 'not comparable' / 'Cannot convert expression to float' (or printed
    AccumBounds) on these; they must give what torch gives, NaN and inf included."""
    mod = CONSTANT_SUBEXPRESSIONS[name]
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    out, lse = flex_attention(q, k, v, score_mod=mod, return_lse=True, kernel_options=OPTIONS)
    ref, ref_lse = flex_attention_reference(q, k, v, mod, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4, equal_nan=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("name", ["sin_of_cancelled_position", "max_with_constant_sin",
                                  "max_with_log_of_zero", "min_with_rsqrt_of_zero"])
def test_constant_subexpressions_differentiate(name):
    _check_gradients(CONSTANT_SUBEXPRESSIONS[name], 40)


def test_integer_division_by_constant_zero_is_a_trace_error():
    """torch raises for an integer // or % by zero; so does flexgen, naming the mod."""
    def divides_by_zero(score, b, h, q_idx, kv_idx):
        return score + q_idx // (kv_idx - kv_idx)

    q = torch.randn(1, 1, 20, 16)
    with pytest.raises(flexgen.TraceError, match="divides_by_zero.*always 0"):
        flex_attention(q, q, q, score_mod=divides_by_zero)


def test_every_traced_op_folds():
    """Each op the converter knows has a torch computation for constant operands."""
    from flexgen.frontend import expr
    ops = {name[3:] for name in dir(expr._Converter) if name.startswith("op_")} - {"var", "const", "param", "load"}
    foldable = set(expr._FOLD) | set(expr._FOLD_IN_NODE_DTYPE) | set(expr._FOLD_LOGICAL)
    assert ops <= foldable, ops - foldable


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L", [40, 128])
def test_integer_score_mod_with_partial_and_full_blocks(dtype, L):
    """A score_mod with an integer value (``q_idx``) in the forward's one loop over both block
    lists: the mask's branch made the score float inside it only, which sm_90's compile
    rejects (a value may not change type in a branch); found by the fuzzer."""
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(1, 2, L, 32, generator=g).to(dtype) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, L, L,
                           device="cpu", BLOCK_SIZE=32)
    assert int(bm.kv_num_blocks.sum()) and int(bm.full_kv_num_blocks.sum())   # both lists visited
    run_and_check(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: q_idx * 0 + (kv_idx % 3),
                  block_mask=bm, kernel_options=OPTIONS)


@pytest.mark.parametrize("cap", [1e4, 300.0])
def test_exact_tanh_near_zero(cap):
    """A soft-cap much larger than the scores: tanh's arguments near 0, where the exact
    tanh's ``1 - exp(-2|x|)`` cancelled (cap 1e4: 3% relative error in float32); the
    series takes over there."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 70, 32, generator=g) for _ in range(3))
    bm = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 70, 70,
                           device="cpu", BLOCK_SIZE=32)
    run_and_check(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap),
                  block_mask=bm, kernel_options=OPTIONS)


# --- a division split by sympy, then rounded in float: silently off at exact multiples ------

_PAD = torch.tensor([4, 0, 3])


def _chunks_after_padding(b, h, q_idx, kv_idx):
    """Llama 4's chunked attention under left padding (transformers' chunked_overlay): two
    floor divisions sharing a loaded term, which the common-subexpression pass took out of
    both (-pad / 6), leaving each a float floor of a float sum: (10 - 4) // 6 came out 0."""
    pad = _PAD[b]
    return ((kv_idx - pad) // 6 == (q_idx - pad) // 6) & (q_idx >= kv_idx)


def _tenths_clamped(b, h, q_idx, kv_idx):
    """A distance in tenths compared at an exact value: torch divides the integer difference
    once; q / 10 - kv / 10 in float32 lands on either side of 0.5."""
    return torch.clamp((q_idx - kv_idx) / 10.0, -1.0, 1.0) > 0.5


def _tenths_truncated(b, h, q_idx, kv_idx):
    t = (q_idx - kv_idx) / 10.0
    return torch.where(t < 0, torch.ceil(t), torch.floor(t)) == 0


@pytest.mark.parametrize("mask_mod", [_chunks_after_padding, _tenths_clamped, _tenths_truncated])
@pytest.mark.parametrize("L", [40, 128])
def test_divisions_of_integers_round_as_torch(mask_mod, L):
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(3, 2, L, 32, generator=g) for _ in range(3))
    bm = create_block_mask(mask_mod, 3, None, L, L, device="cpu", BLOCK_SIZE=32)
    run_and_check(q, k, v, block_mask=bm, kernel_options=OPTIONS)
    _check_gradients(None, L, mask_mod=lambda b, h, q_idx, kv_idx: mask_mod(b % 3, h, q_idx, kv_idx))


def test_a_division_by_a_float_constant_stays_float():
    """0.05 is 3602879701896397 / 2**56 to sympy: multiplied in float (as torch does), never
    made an integer fraction that int32 cannot hold."""
    _check_gradients(lambda score, b, h, q_idx, kv_idx: score + torch.floor(q_idx * 0.05) + kv_idx * 0.05
                     - q_idx * 0.05, 40)


def test_a_block_bounded_through_divisions_is_not_called_empty():
    """The block classifier's interval bounds of (kv + 14 - pad) // 6 went through the same
    split terms in float64 and ended one below an exact multiple: a block holding the one key
    a query keeps was called empty (Llama 4's decode step under left padding: the query's
    output was the zero of an empty row). Classified by bounds alone here: one query, six keys."""
    pad, q_offset, kv_offset = torch.tensor([4, 0, 7]), torch.tensor(19), torch.tensor(14)

    def chunk_of_a_decode_step(b, h, q_idx, kv_idx):     # offsets as transformers passes them
        return (kv_idx + kv_offset - pad[b]) // 6 == (q_idx + q_offset - pad[b]) // 6

    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    want = torch_block_mask(chunk_of_a_decode_step, 3, None, 1, 6, device="cpu")
    bm = create_block_mask(chunk_of_a_decode_step, 3, None, 1, 6, device="cpu")
    assert torch.equal(bm.kv_num_blocks + bm.full_kv_num_blocks, want.kv_num_blocks + want.full_kv_num_blocks)
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(3, 2, 1, 32, generator=g), torch.randn(3, 2, 6, 32, generator=g), torch.randn(3, 2, 6, 32, generator=g)
    for backend in ("AUTO", "TRITON"):
        run_and_check(q, k, v, block_mask=bm, kernel_options={"BACKEND": backend})


# --- int64 captured tensors: ids that differ only above bit 31 ---------------------------------

def _ids_equal_in_int32(L: int) -> torch.Tensor:
    """Three documents whose int64 ids agree in their low 32 bits (HF's packed-sequence ids and
    left padding are int64). The kernels read them as int32 once: one document, silently."""
    ids = torch.full((L,), 7, dtype=torch.int64)
    ids[L // 3:] += 2 ** 32
    ids[2 * L // 3:] -= 3 * 2 ** 33
    return ids


@pytest.mark.parametrize("L", [40, 128])
def test_int64_ids_that_differ_above_bit_31_stay_distinct(L):
    ids = _ids_equal_in_int32(L)

    def same_document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    def other_documents_down(score, b, h, q_idx, kv_idx):
        return torch.where(ids[q_idx] == ids[kv_idx], score, score - 3.0)

    dense = flexgen.create_mask(same_document, 1, 1, L, L, device="cpu")
    assert torch.equal(dense[0, 0], ids[:, None] == ids[None, :])
    _check_gradients(None, L, mask_mod=same_document)
    _check_gradients(other_documents_down, L)
    # The decode path (two queries at the end of the sequence) and a mask kept by its kernel.
    g = torch.Generator().manual_seed(L + 1)
    q, k, v = torch.randn(1, 2, 2, 32, generator=g), torch.randn(1, 2, L, 32, generator=g), \
        torch.randn(1, 2, L, 32, generator=g)
    out, lse = decode_attention(q, k, v, score_mod=other_documents_down, return_lse=True,
                                q_offsets=L - 2)
    ref, ref_lse = flex_attention_reference(
        q, k, v, lambda s, b, h, q_idx, kv_idx: other_documents_down(s, b, h, q_idx + L - 2, kv_idx),
        return_lse=True)
    check(out, ref, torch.float32, lse, ref_lse)


def test_an_int64_element_compared_beyond_int32_is_not_decided_at_trace_time():
    """``q_idx - kv_idx < 10**10`` is True for every int32 value and is decided when traced;
    an element of an int64 tensor can exceed it, so that comparison is refused instead."""
    big = torch.tensor([2 ** 40, 3], dtype=torch.int64)
    with pytest.raises(flexgen.TraceError, match="10000000000"):
        create_block_mask(lambda b, h, q_idx, kv_idx: big[kv_idx % 2] < 10 ** 10, 1, 1, 8, 8,
                          device="cpu")
    window = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 10 ** 10, 1, 1, 8, 8,
                               device="cpu")
    assert window.full_kv_num_blocks.sum() == 1


@pytest.mark.parametrize("L", [40, 128])
def test_float64_tables_computed_in_float64(L):
    """Unix timestamps (1.7e9 s) in a float64 tensor: float32 holds them to 128 s, so the
    kernels' differences of neighbours were 0 or 128 where torch's are a few seconds."""
    g = torch.Generator().manual_seed(L)
    seconds = 1.7e9 + torch.cumsum(torch.rand(L, generator=g, dtype=torch.float64) * 10, 0)
    scale = torch.tensor([0.05, 0.2], dtype=torch.float64, requires_grad=True)

    def decay_by_time(score, b, h, q_idx, kv_idx):
        return score - (seconds[q_idx] - seconds[kv_idx]).abs() * scale[h]

    def within_a_minute(b, h, q_idx, kv_idx):
        return (seconds[q_idx] - seconds[kv_idx]).abs() < 60.0

    _check_gradients(decay_by_time, L, mask_mod=within_a_minute)
    dense = flexgen.create_mask(within_a_minute, 1, 1, L, L, device="cpu")
    assert torch.equal(dense[0, 0], (seconds[:, None] - seconds[None, :]).abs() < 60.0)
    # The learned float64 scale's gradient, against autograd through the oracle.
    q, k, v = (torch.randn(1, 2, L, 32, generator=g) for _ in range(3))
    got = torch.autograd.grad(flex_attention(q, k, v, score_mod=decay_by_time).sum(), scale)[0]
    want = torch.autograd.grad(flex_attention_reference(q, k, v, decay_by_time).sum(), scale)[0]
    assert got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-4 * max(want.abs().max().item(), 1.0)
