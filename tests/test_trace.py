"""Tracing rules and input checks: what fails, and how it says so.

Everything a user can get wrong must raise a ``flexgen.FlexgenError``
(``TraceError`` for a mod, ``InputError`` for an argument) whose message names
the mod or the argument and says how to fix it: never a raw Triton or sympy
traceback. The dtype every traced node gets follows torch's promotion
(indices int32, the score float32, comparisons bool), checked here on the
graph and, for a few cases, end to end against the oracle.
"""
from __future__ import annotations

import math

import pytest
import torch

import flexgen
from flexgen import FlexgenError, InputError, TraceError, create_block_mask, flex_attention
from flexgen.frontend.trace import trace
from conftest import make_qkv, run_and_check
from flexgen.reference import flex_attention_reference

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def assert_trace_error(mod, kind, *words):
    """Tracing ``mod`` raises TraceError naming the mod, with a fix and ``words``."""
    with pytest.raises(TraceError) as info:
        trace(mod, kind)
    msg = str(info.value)
    name = getattr(mod, "__name__", type(mod).__name__)
    assert f"'{name}'" in msg, f"the message must name the mod: {msg}"
    assert kind in msg and "Fix:" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


# --- untraceable constructs -----------------------------------------------------------------

def test_python_if_on_traced_value():
    def if_mask(b, h, q_idx, kv_idx):
        if q_idx >= kv_idx:
            return q_idx >= 0
        return q_idx < 0

    msg = assert_trace_error(if_mask, "mask_mod", "torch.where", "if q_idx >= kv_idx")
    assert "test_trace.py" in msg, "the message must point at the user's line"


@pytest.mark.parametrize("spelling", ["and", "or", "not", "bool"])
def test_python_logic_on_traced_value(spelling):
    def logic_mask(b, h, q_idx, kv_idx):
        if spelling == "and":
            return (q_idx >= kv_idx) and (kv_idx >= 0)
        if spelling == "or":
            return (q_idx >= kv_idx) or (kv_idx >= 0)
        if spelling == "not":
            return not (q_idx >= kv_idx)
        return bool(q_idx >= kv_idx)

    assert_trace_error(logic_mask, "mask_mod", "&", "|")


def test_python_control_flow_in_score_mod():
    def clamp_score(score, b, h, q_idx, kv_idx):
        return score if score < 10 else 10.0

    assert_trace_error(clamp_score, "score_mod", "torch.where")


@pytest.mark.parametrize("make", [
    lambda: (lambda score, b, h, q_idx, kv_idx: torch.lgamma(score)),
    lambda: (lambda score, b, h, q_idx, kv_idx: torch.cumsum(score, 0)),
    lambda: (lambda score, b, h, q_idx, kv_idx: torch.softmax(score, -1)),
], ids=["lgamma", "cumsum", "softmax"])
def test_unsupported_torch_function(make):
    mod = make()
    assert_trace_error(mod, "score_mod", "not supported")


def test_unsupported_tensor_method():
    def item_mod(score, b, h, q_idx, kv_idx):
        return score.item()

    assert_trace_error(item_mod, "score_mod", ".item")


@pytest.mark.parametrize("spelling", ["method", "function"])
def test_in_place_op(spelling):
    def in_place(score, b, h, q_idx, kv_idx):
        if spelling == "method":
            return score.add_(1)
        return torch.mul_(score, 2) if hasattr(torch, "mul_") else torch.relu_(score)

    assert_trace_error(in_place, "score_mod", "in-place")


def test_math_module_on_traced_value():
    def math_exp(score, b, h, q_idx, kv_idx):
        return math.exp(score)

    assert_trace_error(math_exp, "score_mod", "torch")


@pytest.mark.parametrize("what", ["iterate", "index", "int", "range"])
def test_other_python_uses_of_traced_values(what):
    def misuse(score, b, h, q_idx, kv_idx):
        if what == "iterate":
            return sum(x for x in score)
        if what == "index":
            return score[0]
        if what == "int":
            return score + int(q_idx)
        return score + len(range(q_idx))

    assert_trace_error(misuse, "score_mod")


@pytest.mark.parametrize("kind,mod,arity", [
    ("mask_mod", lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx, 4),
    ("score_mod", lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 5),
    ("score_mod", lambda score: score, 5),
])
def test_wrong_arity(kind, mod, arity):
    msg = assert_trace_error(mod, kind, f"{arity} arguments")
    assert "q_idx" in msg


def test_not_callable():
    with pytest.raises(TraceError, match="callable"):
        trace(42, "score_mod")


def test_mask_returning_non_bool():
    def distance_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    assert_trace_error(distance_mask, "mask_mod", "bool", "comparison")


def test_mask_returning_float():
    def float_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) * 1.0

    assert_trace_error(float_mask, "mask_mod", "bool")


def test_score_mod_returning_bool():
    def bool_score(score, b, h, q_idx, kv_idx):
        return score > 0

    assert_trace_error(bool_score, "score_mod", "mask_mod", "torch.where")


def test_float_index_into_captured_tensor():
    bias = torch.randn(64)

    def float_index(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx / 2]

    assert_trace_error(float_index, "score_mod", "//")


@pytest.mark.parametrize("index", ["slice", "none", "tensor", "float 0-d tensor"])
def test_bad_index_kinds(index):
    bias = torch.randn(4, 64)
    idx = {"slice": slice(None), "none": None, "tensor": torch.tensor([1]),
           "float 0-d tensor": torch.tensor(1.0)}[index]

    def bad_index(score, b, h, q_idx, kv_idx):
        return score + bias[idx, kv_idx]

    assert_trace_error(bad_index, "score_mod", "index")


def test_captured_tensor_wrong_rank_unindexed():
    bias = torch.randn(4)

    def unindexed(score, b, h, q_idx, kv_idx):
        return score + bias

    assert_trace_error(unindexed, "score_mod", "[4]", "bias[h, q_idx]")


def test_captured_tensor_partly_indexed_used_as_a_value():
    table = torch.randn(4, 8)

    def one_index(score, b, h, q_idx, kv_idx):
        return score + table[h]

    assert_trace_error(one_index, "score_mod", "partly indexed", "shape [8] left", "bias[b][q_idx]")


def test_captured_tensor_too_many_indices():
    table = torch.randn(4, 8)

    def three_indices(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx, kv_idx]

    assert_trace_error(three_indices, "score_mod", "3 indices", "at most 2")


def test_captured_complex_tensor():
    c = torch.ones(4, dtype=torch.complex64)

    def complex_mod(score, b, h, q_idx, kv_idx):
        return score + c[h]

    assert_trace_error(complex_mod, "score_mod", "complex")


def test_float_bitwise_ops():
    def float_and(b, h, q_idx, kv_idx):
        return (q_idx * 0.5) & (kv_idx >= 0)

    def float_invert(score, b, h, q_idx, kv_idx):
        return ~score

    assert_trace_error(float_and, "mask_mod", "&")
    assert_trace_error(float_invert, "score_mod", "~")


def test_where_with_non_bool_condition():
    def where_int(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx, score, 0.0)

    assert_trace_error(where_int, "score_mod", "condition")


def test_mod_raising_its_own_error_is_wrapped():
    def broken(score, b, h, q_idx, kv_idx):
        return score + {}["missing"]

    msg = assert_trace_error(broken, "score_mod", "KeyError")
    assert "missing" in msg


def test_unknown_python_value_combined():
    def with_string(score, b, h, q_idx, kv_idx):
        return score + "1"

    assert_trace_error(with_string, "score_mod", "str")


def test_trace_errors_surface_through_the_api():
    """The API raises the TraceError before anything is rendered or launched."""
    q, k, v = make_qkv(B=1, H=1, L=32)

    def bad_score(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else 0.0

    def bad_mask(b, h, q_idx, kv_idx):
        return (q_idx > kv_idx) or (kv_idx == 0)

    n = len(flexgen.codegen.cache._MODULES)
    with pytest.raises(TraceError, match="bad_score"):
        flex_attention(q, k, v, score_mod=bad_score)
    with pytest.raises(TraceError, match="bad_mask"):
        create_block_mask(bad_mask, 1, 1, 32, 32, device="cpu")
    with pytest.raises(TraceError, match="bad_score"):
        flexgen.kernel_source(q, k, v, score_mod=bad_score)
    assert len(flexgen.codegen.cache._MODULES) == n
    assert issubclass(TraceError, FlexgenError)


# --- dtype promotion ------------------------------------------------------------------------

IDX = torch.arange(5, dtype=torch.int32)
FBUF = torch.randn(5, dtype=torch.float64)
I8BUF = torch.arange(5, dtype=torch.int8)
BBUF = torch.tensor([True, False, True, False, True])
I64_0D = torch.tensor(3)
F16_0D = torch.tensor(0.5, dtype=torch.float16)

PROMOTION = [
    ("q_idx - kv_idx", lambda s, b, h, q, kv: q - kv, torch.int32),
    ("(2*q + 1) // 3", lambda s, b, h, q, kv: (2 * q + 1) // 3, torch.int32),
    ("q % 7", lambda s, b, h, q, kv: q % 7, torch.int32),
    ("q ** 2", lambda s, b, h, q, kv: q ** 2, torch.int32),
    ("int / int", lambda s, b, h, q, kv: q / kv, torch.float32),
    ("int / 2", lambda s, b, h, q, kv: q / 2, torch.float32),
    ("torch.div floor", lambda s, b, h, q, kv: torch.div(q, 2, rounding_mode="floor"), torch.int32),
    ("int * float", lambda s, b, h, q, kv: q * 0.5, torch.float32),
    ("score + int", lambda s, b, h, q, kv: s + q, torch.float32),
    ("bool + 1", lambda s, b, h, q, kv: (q > kv) + 1, torch.int32),
    ("bool & bool", lambda s, b, h, q, kv: (q > kv) & (kv > 0), torch.bool),
    ("bool * bool", lambda s, b, h, q, kv: (q > kv) * (kv > 0), torch.bool),
    ("bool + bool", lambda s, b, h, q, kv: (q > kv) + (kv > 0), torch.bool),
    ("bool * int", lambda s, b, h, q, kv: (q > kv) * 3, torch.int32),
    ("abs(int)", lambda s, b, h, q, kv: abs(q - kv), torch.int32),
    ("floor(float)", lambda s, b, h, q, kv: torch.floor(s), torch.float32),
    ("exp(int)", lambda s, b, h, q, kv: torch.exp(q), torch.float32),
    ("int.to(float)", lambda s, b, h, q, kv: q.to(torch.float32), torch.float32),
    ("float.to(int64)", lambda s, b, h, q, kv: s.to(torch.int64), torch.int32),
    ("int.float()", lambda s, b, h, q, kv: q.float(), torch.float32),
    ("where(int, float)", lambda s, b, h, q, kv: torch.where(q > kv, q, 1.5), torch.float32),
    ("where(int, int)", lambda s, b, h, q, kv: torch.where(q > kv, q, 1), torch.int32),
    ("clamp int", lambda s, b, h, q, kv: torch.clamp(q - kv, min=0, max=4), torch.int32),
    ("minimum int", lambda s, b, h, q, kv: torch.minimum(q, kv), torch.int32),
    ("int64 buffer", lambda s, b, h, q, kv: IDX.long()[q], torch.int32),
    ("int8 buffer * idx", lambda s, b, h, q, kv: I8BUF[h] * q, torch.int32),
    ("float64 buffer", lambda s, b, h, q, kv: FBUF[q], torch.float32),
    ("bool buffer", lambda s, b, h, q, kv: BBUF[q], torch.bool),
    ("0-d int64 tensor + idx", lambda s, b, h, q, kv: q + I64_0D, torch.int32),
    ("0-d fp16 tensor * idx", lambda s, b, h, q, kv: q * F16_0D, torch.float32),
]


@pytest.mark.parametrize("mod,dtype", [p[1:] for p in PROMOTION], ids=[p[0] for p in PROMOTION])
def test_promotion(mod, dtype):
    """The traced dtype is what torch gives on int32 indices / a float32 score."""
    def wrapped(score, b, h, q_idx, kv_idx):
        return mod(score, b, h, q_idx, kv_idx)

    if dtype == torch.bool:
        traced = trace(lambda b, h, q_idx, kv_idx: mod(None, b, h, q_idx, kv_idx), "mask_mod")
    else:
        traced = trace(wrapped, "score_mod")
    assert traced.root.dtype == dtype
    # ... and it is torch's own result dtype on real tensors (collapsed to int32 / float32 / bool)
    idx = torch.arange(4, dtype=torch.int32)
    real = mod(torch.randn(4), idx, idx, idx, idx.flip(0))
    kind = real.dtype
    torch_dtype = torch.bool if kind == torch.bool else (
        torch.float32 if kind.is_floating_point else torch.int32)
    assert torch_dtype == dtype


def test_integer_semantics_end_to_end():
    """Floor division and modulo of negative numbers, and int/int true division, as torch."""
    def int_math(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return score + (d // 5) * 0.25 + (d % 3) - (d / 7) + torch.where(d > 0, 1, 0)

    q, k, v = make_qkv(B=1, H=1, L=40)
    run_and_check(q, k, v, score_mod=int_math)


def test_bool_arithmetic_follows_torch():
    """torch: bool + bool and bool * bool stay bool (logical or / and), so True + True is 1.

    A score_mod adding two comparisons must add 1 where both hold, as the
    oracle (plain torch) does, not 2; and ``mask_a * mask_b``, a common torch
    spelling of "and", is a valid mask_mod.
    """
    def two_bonuses(score, b, h, q_idx, kv_idx):
        return score + ((q_idx >= kv_idx) + (kv_idx < 20))

    def product_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) * (kv_idx >= 3)

    q, k, v = make_qkv(B=1, H=1, L=40)
    run_and_check(q, k, v, score_mod=two_bonuses)
    mask = create_block_mask(product_mask, None, None, 40, 40, device="cpu")
    run_and_check(q, k, v, block_mask=mask)


# --- bad API input ----------------------------------------------------------------------------

def raises_input_error(fn, *words):
    with pytest.raises(InputError) as info:
        fn()
    msg = str(info.value)
    assert isinstance(info.value, FlexgenError) and isinstance(info.value, ValueError)
    assert "Fix:" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


def test_wrong_rank():
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q[0], k, v), "query", "4-D")
    raises_input_error(lambda: flex_attention(q, k[0], v), "key", "4-D")
    raises_input_error(lambda: flex_attention(q, k, "v"), "value")


def test_mismatched_dtypes():
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q, k.bfloat16(), v), "key", "dtype")
    raises_input_error(lambda: flex_attention(q.double(), k.double(), v.double()), "query", "float64")


def test_head_dim_too_small():
    q, k, v = make_qkv(B=1, H=1, L=32, D=8)
    raises_input_error(lambda: flex_attention(q, k, v), "head dim", "8")


def test_mismatched_shapes():
    q, k, v = make_qkv(B=1, H=1, L=32)
    k2, v2 = make_qkv(B=2, H=1, L=32)[1:]
    raises_input_error(lambda: flex_attention(q, k2, v2), "batch")
    raises_input_error(lambda: flex_attention(q, k, v[:, :, :16]), "value")
    k3 = make_qkv(B=1, H=1, L=32, D=64)[1]
    raises_input_error(lambda: flex_attention(q, k3, v), "key.shape[-1]")


def test_non_contiguous_last_dim():
    # torch takes it (a column-major query), so flexgen does: the input is copied first.
    q, k, v = make_qkv(B=1, H=1, L=32)
    run_and_check(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)


def test_gqa_without_enable_gqa():
    q, k, v = make_qkv(B=1, H=4, Hkv=2, L=32)
    raises_input_error(lambda: flex_attention(q, k, v), "enable_gqa")
    q3 = make_qkv(B=1, H=3, L=32)[0]
    raises_input_error(lambda: flex_attention(q3, k, v, enable_gqa=True), "query heads")


def test_block_mask_for_other_lengths():
    q, k, v = make_qkv(B=1, H=1, L=67)
    mask = create_block_mask(causal, None, None, 130, 130, device="cpu")
    raises_input_error(lambda: flex_attention(q, k, v, block_mask=mask), "block_mask", "67", "130")


def test_block_mask_for_other_batch_or_heads():
    q, k, v = make_qkv(B=1, H=2, L=67)
    mask = create_block_mask(causal, 3, None, 67, 67, device="cpu")
    raises_input_error(lambda: flex_attention(q, k, v, block_mask=mask), "block_mask", "batch")


def test_block_mask_wrong_type():
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q, k, v, block_mask=causal), "block_mask",
                       "create_block_mask")


def test_kernel_options():
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q, k, v, kernel_options={"BLOCK_Q": 64}),
                       "kernel_options", "BLOCK_Q")
    raises_input_error(lambda: flex_attention(q, k, v, kernel_options={"BLOCK_M": 48}),
                       "BLOCK_M")
    raises_input_error(lambda: flex_attention(q, k, v, kernel_options={"num_warps": "4"}),
                       "num_warps")


def test_bad_scale():
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q, k, v, scale="0.1"), "scale")


def test_create_block_mask_arguments():
    raises_input_error(lambda: create_block_mask(causal, 1, 1, 0, 64, device="cpu"), "Q_LEN")
    raises_input_error(lambda: create_block_mask(causal, 1, 1, 64, 64.0, device="cpu"), "KV_LEN")
    raises_input_error(lambda: create_block_mask(causal, -1, 1, 64, 64, device="cpu"), "B")
    raises_input_error(lambda: create_block_mask(causal, 1, 1, 64, 64, device="cpu",
                                                 BLOCK_SIZE=100), "BLOCK_SIZE")
    raises_input_error(lambda: create_block_mask(causal, 1, 1, 64, 64, device="cpu",
                                                 BLOCK_SIZE=8), "BLOCK_SIZE")


@pytest.mark.skip(reason="needs a second device; CPU-only CI cannot place a captured tensor elsewhere")
def test_captured_tensor_on_another_device():  # pragma: no cover
    bias = torch.randn(4, device="cuda")
    q, k, v = make_qkv(B=1, H=1, L=32)
    raises_input_error(lambda: flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + bias[h]),
                       "captured tensor")


# --- the trace memo (trace_cached) ----------------------------------------------------------

def test_trace_cached_follows_what_the_mod_reads():
    """A repeated mod comes back from the memo; anything it reads that changes (a global, a
    closure cell, its code) traces it again."""
    from flexgen.frontend import trace as T

    scope = {"torch": torch, "SCALE": 2.0}
    exec("def scaled(score, b, h, q_idx, kv_idx):\n    return torch.tanh(score * SCALE)", scope)
    mod = scope["scaled"]
    first = T.trace_cached(mod, "score_mod")
    assert T.trace_cached(mod, "score_mod") is first
    scope["SCALE"] = 3.0                                    # a global rebound
    second = T.trace_cached(mod, "score_mod")
    assert second is not first and second.graph != first.graph
    assert T.trace_cached(mod, "score_mod") is second

    def make(x):
        def closed(score, b, h, q_idx, kv_idx):
            return score * x

        def rebind(value):
            nonlocal x
            x = value

        def drop():
            nonlocal x
            del x
        return closed, rebind, drop
    closed, rebind, drop = make(2.0)
    first = T.trace_cached(closed, "score_mod")
    assert T.trace_cached(closed, "score_mod") is first
    rebind(5.0)                                             # a closure cell rebound
    assert T.trace_cached(closed, "score_mod").graph != first.graph
    drop()                                                  # a cell emptied: the mod now fails
    with pytest.raises(TraceError):
        T.trace_cached(closed, "score_mod")

    def other(score, b, h, q_idx, kv_idx):
        return score - 1.0
    plain = T.trace_cached(other, "score_mod")
    other.__code__ = (lambda score, b, h, q_idx, kv_idx: score + 1.0).__code__
    assert T.trace_cached(other, "score_mod").graph != plain.graph  # new code, same function


def test_trace_cached_follows_helpers():
    """A helper the mod calls counts with what it reads (its globals too)."""
    from flexgen.frontend import trace as T

    scope = {"SCALE": 2.0}
    exec("def helper(s):\n    return s * SCALE\n"
         "def mod(score, b, h, q_idx, kv_idx):\n    return helper(score)", scope)
    mod = scope["mod"]
    first = T.trace_cached(mod, "score_mod")
    assert T.trace_cached(mod, "score_mod") is first
    scope["SCALE"] = 4.0
    assert T.trace_cached(mod, "score_mod").graph != first.graph


def test_a_fresh_mod_of_a_known_shape_takes_its_program_over_its_own_tensors(monkeypatch):
    """A mod made afresh per call (transformers' masks each forward, a document mask per batch)
    is not traced again when a mod of the same code, values and tensor kinds was: it gets that
    program over its own tensors, and the kernel reads them."""
    from flexgen.frontend import trace as T

    def document(doc, shift):
        def doc_mask(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx + shift)
        return doc_mask

    traced = []
    monkeypatch.setattr(T, "trace", lambda mod, kind, real=T.trace: traced.append(mod) or real(mod, kind))
    L = 96
    first_doc, second_doc = torch.arange(L) // 40, torch.arange(L) // 25
    offset = torch.zeros((), dtype=torch.int32)
    first = T.trace_cached(document(first_doc, offset), "mask_mod")
    mod = document(second_doc, torch.ones((), dtype=torch.int32))
    second = T.trace_cached(mod, "mask_mod")
    assert len(traced) == 1 and second.graph == first.graph
    assert second.buffers[0] is second_doc and second.buffers[1] is mod.__closure__[1].cell_contents
    q, k, v = make_qkv(B=1, H=2, L=L, D=16)
    bm = create_block_mask(mod, None, None, L, L)
    run_and_check(q, k, v, block_mask=bm)

    # What the trace reads differs: a value, a tensor's kind or layout, one tensor read twice.
    for other in (document(first_doc.to(torch.int16), offset), document(first_doc[:64], offset),
                  document(first_doc, 1), document(first_doc, -0.0), document(first_doc, 0.0)):
        T.trace_cached(other, "mask_mod")
    assert len(traced) == 6

    def pair(a, b):
        def two(score, b_, h, q_idx, kv_idx):
            return score + a[h] - b[h]
        return two
    x, y = torch.randn(2), torch.randn(2)
    assert len(T.trace_cached(pair(x, x), "score_mod").buffers) == 1
    assert len(T.trace_cached(pair(x, y), "score_mod").buffers) == 2   # traced: another shape
    assert len(traced) == 8


def test_the_shape_memo_keeps_no_tensor_alive():
    import gc
    import weakref
    from flexgen.frontend import trace as T

    def biased(bias):
        def bias_mod(score, b, h, q_idx, kv_idx):
            return score + bias[h]
        return bias_mod
    bias = torch.randn(3)
    alive = weakref.ref(bias)
    T.trace_cached(biased(bias), "score_mod")
    T._RECENT.clear()
    del bias
    gc.collect()
    assert alive() is None
    assert T.trace_cached(biased(torch.randn(3)), "score_mod").buffers[0].shape == (3,)


class _Config:
    scale = 2.0


def _stale_cases():
    """(name, mod, change): after ``change()`` the mod computes something else."""
    import types
    module = types.ModuleType("user_config")
    module.scale = 2.0

    def module_attr(score, b, h, q_idx, kv_idx):
        return score * module.scale

    def class_attr(score, b, h, q_idx, kv_idx):
        return score * _Config.scale

    def kw_default(score, b, h, q_idx, kv_idx, *, scale=2.0):
        return score * scale

    def default(score, b, h, q_idx, kv_idx, scale=2.0):
        return score * scale

    config = {"scale": 2.0}

    def held_dict(score, b, h, q_idx, kv_idx):
        return score * config["scale"]

    def set_kw():
        kw_default.__kwdefaults__["scale"] = 3.0

    def set_default():
        default.__defaults__ = (3.0,)

    def set_class():
        _Config.scale = 3.0

    return [("module attribute", module_attr, lambda: setattr(module, "scale", 3.0)),
            ("class attribute", class_attr, set_class),
            ("keyword-only default", kw_default, set_kw),
            ("default", default, set_default),
            ("a dict in a closure", held_dict, lambda: config.update(scale=3.0))]


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _stale_cases()])
def test_no_stale_trace_after_what_the_mod_reads_changes(case):
    """Whatever a mod reads — a module or class attribute, a default, a dict it holds —
    a change makes the next call trace it again (or the memo never kept it): the kernel
    computes with the new value, end to end."""
    name, mod, change = _stale_cases()[case]
    _Config.scale = 2.0
    q, k, v = make_qkv(B=1, H=1, L=24)
    first = flex_attention(q, k, v, score_mod=mod)
    change()
    again = flex_attention(q, k, v, score_mod=mod)
    want = flex_attention_reference(q, k, v, score_mod=lambda s, b, h, qi, kv: s * 3.0)
    torch.testing.assert_close(again.double(), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(first, again)
    _Config.scale = 2.0


def test_a_mask_mod_assigned_to_a_block_mask_is_the_one_that_runs():
    """torch's decode pattern: a mask built once, then given another mask_mod (an offset
    one, say): the kernels apply the mod the mask holds now, not the one it was built with."""
    q, k, v = make_qkv(B=1, H=2, L=64)
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, None, None, 64, 64,
                             device="cpu", BLOCK_SIZE=16)

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= 8) & (kv_idx - q_idx <= 8)

    before = flex_attention(q, k, v, block_mask=mask)
    mask.mask_mod = window                                   # every block is partial: it decides
    mask.full_kv_num_blocks = torch.zeros_like(mask.full_kv_num_blocks)
    mask.kv_num_blocks = torch.full_like(mask.kv_num_blocks, 4)
    after = flex_attention(q, k, v, block_mask=mask)
    want = flex_attention_reference(q, k, v, mask_mod=window)
    torch.testing.assert_close(after.double(), want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before, after)


def test_an_operator_is_lowered_only_when_it_is_the_very_op():
    """A user's own torch.library op named like a torch function (mylib::exp) is not
    torch's exp: flexgen refuses it by name and namespace instead of compiling exp."""
    lib = torch.library.Library("flexgen_test_ops", "FRAGMENT")
    lib.define("exp(Tensor x) -> Tensor")
    lib.impl("exp", lambda x: x * 2, "CompositeExplicitAutograd")

    def looks_like_exp(score, b, h, q_idx, kv_idx):
        return torch.ops.flexgen_test_ops.exp(score)

    msg = assert_trace_error(looks_like_exp, "score_mod", "flexgen_test_ops::exp", "custom operator")
    assert "exp" in msg


def test_kernel_options_of_the_wrong_kind():
    q, k, v = make_qkv(B=1, H=1, L=16)
    for bad, words in ((["BLOCK_M", 64], "dict"), ({"BACKEND": "INVALID"}, "BACKEND"),
                       ({"BLOCK_M": "64"}, "BLOCK_M"), ({"USE_TMA": 2}, "USE_TMA")):
        with pytest.raises(InputError, match=words):
            flex_attention(q, k, v, kernel_options=bad)
