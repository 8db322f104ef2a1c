"""Mods and call sites written for torch's FlexAttention run unchanged through flexgen.

Each test restates, in its own words, a construct that real client code uses
(attention-gym's masks and mods, PyTorch's own FlexAttention tests) and checks
flexgen against the float64 oracle, forward and, where torch defines one, backward
(gradients of q, k, v and of captured tensors that require grad). Where torch's
eager ``flex_attention`` runs on CPU, the same mod must give the same answer there.
The constructs that cannot become a kernel must fail with a ``flexgen.FlexgenError``
that names the mod, the construct and the fix.

Shapes are small and the mods few (every distinct mod is a kernel to run in the
interpreter and to compile for sm_90).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen import AuxRequest, FlexgenError, InputError, TraceError, create_block_mask, flex_attention
from flexgen.reference import dense_mask, flex_attention_reference, per_element
from conftest import check, hf_t5_bucket, make_qkv

tfa = pytest.importorskip("torch.nn.attention.flex_attention")
aten = torch.ops.aten


def torch_eager(q, k, v, score_mod=None, mask_mod=None, **kwargs):
    """torch's own flex_attention, eager on CPU (its reference path), forward only."""
    B, H, L, _ = q.shape
    block_mask = None if mask_mod is None else tfa.create_block_mask(
        mask_mod, B, H, L, k.shape[2], device="cpu", BLOCK_SIZE=16)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")          # ("flex_attention called without torch.compile")
        return tfa.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score_mod,
                                  block_mask=block_mask, **kwargs)


def run(q, k, v, score_mod=None, mask_mod=None, learned=(), *, grad=True, enable_gqa=False,
        compare_torch=True, atol=None):
    """flexgen forward (and backward) against the float64 oracle; and against torch eager."""
    leaves = [q, k, v, *learned]
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, q.shape[0], q.shape[1], q.shape[2], k.shape[2], device="cpu", BLOCK_SIZE=16)
    out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
    ref = flex_attention_reference(q, k.expand(q.shape[0], *k.shape[1:]),
                                   v.expand(q.shape[0], *v.shape[1:]), score_mod, mask_mod,
                                   enable_gqa=enable_gqa)
    check(out, ref, atol=atol)
    if grad:
        d_out = torch.randn_like(out)
        got = torch.autograd.grad(out, leaves, d_out)
        want = torch.autograd.grad(ref, leaves, d_out.double())
        for name, a, b in zip(["dq", "dk", "dv"] + [f"captured{i}" for i in range(len(learned))],
                              got, want):
            assert a.shape == b.shape, name
            scale = 1.0 + float(b.abs().max())
            torch.testing.assert_close(a.double() / scale, b.double() / scale, atol=2e-4, rtol=0,
                                       msg=lambda m, name=name: f"{name}: {m}")
    if compare_torch:
        theirs = torch_eager(q, k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:]),
                             score_mod, mask_mod, enable_gqa=enable_gqa)
        torch.testing.assert_close(out.detach(), theirs, atol=1e-4, rtol=1e-4)
    return out


def assert_error(fn, kind, *words):
    with pytest.raises(kind) as info:
        fn()
    msg = str(info.value)
    assert "Fix:" in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in: {msg}"
    return msg


# --- constructs on traced values -------------------------------------------------------------

def test_tensor_constructors_on_traced_values():
    """x.new_ones / new_zeros / new_full / new_tensor and torch.*_like give scalars of torch's dtype."""
    def constructors(score, b, h, q_idx, kv_idx):
        two = q_idx.new_ones(()) * 2                       # int32 like q_idx
        zero = b.new_zeros(b.shape)
        quarter = torch.full_like(score, 0.25)
        return (score * torch.ones_like(score) + score.new_full((), 0.5) * two + zero
                + quarter * torch.zeros_like(kv_idx) + kv_idx.new_full((), 3, dtype=torch.float32)
                + score.new_tensor(1.5) * (q_idx - kv_idx) * 0.01 + quarter)

    run(*make_qkv(L=40, D=16), constructors)


def test_casts_and_dtype_methods():
    """.to(dtype), .to(other.dtype), .bool(), .long(), .int(), .float() follow torch's rules."""
    def casts(score, b, h, q_idx, kv_idx):
        rel = (q_idx - kv_idx).to(torch.float32) * 0.05
        return (score + rel + (q_idx > kv_idx).long() - (q_idx % 3).bool().int()
                + kv_idx.float() * 0.01 + (score > 0).to(score.dtype) * 0.5)

    run(*make_qkv(L=40, D=16), casts)


def test_aten_ops_and_functional_activations():
    """torch.ops.aten overloads, F.silu / F.gelu, torch.tan / erf and 1 / (...) (whose derivative
    has only integers above the line), keyed by the function objects."""
    def activations(score, b, h, q_idx, kv_idx):
        rel = aten.sub.Tensor(q_idx, kv_idx)
        return (aten.add.Tensor(F.silu(score), aten.mul.Tensor(rel, 0.01))
                + F.gelu(score, approximate="tanh") * 0.5 + torch.tan(score * 0.1)
                + torch.erf(score) * 0.25 + 1 / (score + 10))

    run(*make_qkv(L=40, D=16), activations)


def test_constant_derivative_of_the_score():
    """score * 2 (PyTorch's _times_two): d mod / d score is the number 2 in the backward kernel."""
    run(*make_qkv(L=40, D=16), lambda score, b, h, q_idx, kv_idx: score * 2)


def test_shifts_and_bitwise_ops_on_indices():
    """>> and << on indices (Morton codes, block ids), with & and | of ints and bools."""
    def morton_block_mask(b, h, q_idx, kv_idx):
        same_block = (q_idx >> 3) == (kv_idx >> 3)
        interleaved = ((q_idx | (q_idx << 1)) & 0x33) >= ((kv_idx | (kv_idx << 1)) & 0x33)
        return same_block | interleaved | (kv_idx < (1 << 2))

    run(*make_qkv(L=40, D=16), mask_mod=morton_block_mask, grad=False)


def test_scalar_tensors_without_item():
    """0-d captured tensors as numbers and as an index, in both mods; a 0-d learned temperature."""
    limit, which = torch.tensor(30, dtype=torch.int64), torch.tensor(1)
    table = torch.randn(3, 40)
    temperature = torch.tensor(0.7, requires_grad=True)

    def scalars(score, b, h, q_idx, kv_idx):
        return score * temperature + table[which, q_idx] + torch.where(q_idx < limit, 0.0, -1.0)

    def offset_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + limit - 25

    run(*make_qkv(L=40, D=16), scalars, offset_mask, learned=(temperature,))


def test_item_of_a_captured_tensor_is_read_at_each_call():
    """limit.item() in a mod is a constant of the trace: after an in-place update of the tensor
    the next call traces again and sees the new value (no stale memoized trace)."""
    limit = torch.tensor(10)

    def item_mask(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < limit.item(), score, score - 5.0)

    q, k, v = make_qkv(L=32, D=16)
    for value in (10, 20):
        limit.fill_(value)
        check(flex_attention(q, k, v, item_mask), flex_attention_reference(q, k, v, item_mask))


def test_chained_and_partial_indexing():
    """bias[b][q_idx], bias[0][b, h][q_idx], intervals[id][0], x[b].sum(dim=-1) (reduced on the
    host), and a learned bias reached through a chain of indexing."""
    B, H, L = 2, 2, 40
    bias = torch.randn(B, L, requires_grad=True)
    nested = torch.randn(2, B, H, L)
    x = torch.randn(B, 5)
    image = torch.arange(L) // 14
    intervals = torch.tensor([[0, 20], [10, 40], [25, 40]])

    def chained(score, b, h, q_idx, kv_idx):
        return score + bias[b][q_idx] + nested[0][b, h][kv_idx] + x[b].sum(dim=-1) * 0.1

    def cross_attention(b, h, q_idx, kv_idx):
        interval = intervals[image[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    run(*make_qkv(B=B, H=H, L=L, D=16), chained, cross_attention, learned=(bias,))


def test_rows_reduced_per_element():
    """A partly indexed captured tensor combined with traced values, then reduced: a distance
    (.pow(2).sum(-1).sqrt()), torch.dot, .amax(), a slice next to a position (points[q_idx, 1:],
    which torch's eager path refuses: oracle only); a learned row receives its gradient."""
    L = 40
    points = torch.randn(L, 3)
    rope = torch.randn(L, 4, requires_grad=True)

    def rows(score, b, h, q_idx, kv_idx):
        dist = (points[q_idx] - points[kv_idx]).pow(2).sum(-1).sqrt()
        return (score - dist + 0.1 * torch.dot(rope[q_idx], rope[kv_idx]) + (rope[kv_idx] * 0.5).amax()
                + points[q_idx, 1:].sum() * 0.1)

    run(*make_qkv(L=L, D=16), rows, learned=(rope,), compare_torch=False)


def test_row_membership_mask():
    """attention-gym's top-k tile mask, (topk[b, h, tile] == kv_tile.unsqueeze(-1)).any(dim=-1),
    or a distance over a row: rows in a mask_mod (the block classifier and the kernel)."""
    topk = torch.tensor([[[[0, 2], [1, 0], [2, 1]], [[2, 2], [0, 1], [1, 2]]]])

    points = torch.randn(40, 3)

    def topk_tiles(b, h, q_idx, kv_idx):
        selected = topk[b, h, q_idx // 16]
        near = (points[q_idx] - points[kv_idx]).abs().amax() < 1.5
        return (selected == (kv_idx // 16).unsqueeze(-1)).any(dim=-1) | near

    q, k, v = make_qkv(L=40, D=16)
    run(q, k, v, mask_mod=topk_tiles, grad=False)
    # Under torch.compile the tracer runs inside dynamo: rows must trace there too.
    block_mask = create_block_mask(topk_tiles, 1, 2, 40, 40, device="cpu", BLOCK_SIZE=16)
    compiled = torch.compile(flex_attention, backend="eager", fullgraph=True)
    check(compiled(q, k, v, block_mask=block_mask), flex_attention_reference(q, k, v, mask_mod=topk_tiles))


def test_kv_batch_of_one_broadcast_with_gqa():
    """key / value of batch 1 against a query batch of 2 (and 4 query heads over 2): dk, dv are
    summed over the query batch, a captured bias gets its gradient."""
    q, _, _ = make_qkv(B=2, H=4, L=40, D=16)
    _, k, v = make_qkv(B=1, H=2, L=40, D=16)
    bias = torch.randn(2, 40, requires_grad=True)

    def batch_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, kv_idx]

    run(q, k, v, batch_bias, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, learned=(bias,),
        enable_gqa=True)


def test_few_queries_take_the_decode_kernel_unchanged():
    """Decode-sized calls (3 queries) with a 0-d offset mask and per-position biases."""
    offset = torch.tensor(20, dtype=torch.int32)
    kv_bias, q_bias = torch.randn(45), torch.randn(3)

    def biases(score, b, h, q_idx, kv_idx):
        return score + kv_bias[kv_idx] + q_bias[q_idx]

    q, k, v = make_qkv(B=2, H=4, Hkv=2, L=3, Lkv=45, D=16)
    run(q, k, v, biases, lambda b, h, q_idx, kv_idx: kv_idx >= q_idx + offset, grad=False,
        enable_gqa=True)


def test_torch_decoding_masks_of_one_query_a_block():
    """torch's decoding tests build masks with BLOCK_SIZE=(1, n): the decode kernel reads them
    (at most 16 queries, no gradient); a call that needs the forward or the backward kernels
    names the mask's block size, not a kernel option the caller never set."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx + 60 >= kv_idx

    q, k, v = make_qkv(B=1, H=2, L=4, Lkv=64, D=16)
    mask = torch_block_mask(causal, 1, 1, 4, 64, device="cpu", BLOCK_SIZE=(1, 16))
    check(flex_attention(q, k, v, block_mask=mask), flex_attention_reference(q, k, v, mask_mod=causal,
                                                                             dtype=torch.float64), q.dtype)
    with pytest.raises(InputError, match=r"block_mask.BLOCK_SIZE: .*query block.*backward.*got 1"):
        flex_attention(q.requires_grad_(), k, v, block_mask=mask).sum().backward()
    wide = torch_block_mask(causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=(1, 16))
    with pytest.raises(InputError, match=r"block_mask.BLOCK_SIZE: .*forward kernel.*got 1"):
        flex_attention(k, k, v, block_mask=wide)


def test_aten_index_and_numpy_scalars():
    """torch.ops.aten.index(t, [h, kv_idx]) is t[h, kv_idx] (PyTorch's tests spell loads so; a
    None leaves a dim whole), and numpy scalars (np.float32, np.int64) act as the Python numbers
    torch takes them for (they once raised a TraceError, aten.index an AttributeError)."""
    np = pytest.importorskip("numpy")
    bias = torch.randn(2, 40)
    slopes = np.geomspace(0.5, 0.05, 2).astype(np.float32)

    def loads(score, b, h, q_idx, kv_idx):
        return (score * np.float32(0.5) + aten.index(bias, [h, kv_idx])
                + aten.index(bias, [None, q_idx])[h] + (q_idx - kv_idx) * slopes[1])

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= np.int64(12)) & (aten.index.Tensor(bias, [h, kv_idx]) > -1.5)

    q, k, v = make_qkv(L=40, D=16)
    run(q, k, v, loads, window)
    # Under torch.compile dynamo hands numpy scalars over as 0-d arrays.
    compiled = torch.compile(flex_attention, backend="eager", fullgraph=True)
    check(compiled(q.detach(), k.detach(), v.detach(), loads),
          flex_attention_reference(q.detach(), k.detach(), v.detach(), loads))


def test_rounding_and_more_activations():
    """torch.round (halves to even, exact next to a half and past 2**23), trunc, frac, fix,
    clamp_min / clamp_max, log10, integer fmod and F.hardtanh, relu6, hardsigmoid,
    hardswish, softsign, mish, selu, celu: as torch computes them, with their gradients."""
    edge = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 8388609.0, -3.7,
                         2.4999998, 16777216.0, -1.0000001] * 4)
    rounded, truncated, fractions = torch.round(edge), torch.trunc(edge), torch.frac(edge)

    def rounding(b, h, q_idx, kv_idx):
        x = edge[kv_idx]
        exact = ((torch.round(x) == rounded[kv_idx]) & (x.trunc() == truncated[kv_idx])
                 & (torch.frac(x) == fractions[kv_idx]) & (torch.fix(x) == truncated[kv_idx]))
        return exact & (torch.fmod(q_idx - kv_idx, 5) != -3)

    def activations(score, b, h, q_idx, kv_idx):
        x = score * 3
        return (F.hardtanh(x, -2.0, 0.5) + F.relu6(x) + F.hardsigmoid(x) + F.hardswish(x)
                + F.softsign(x) + F.mish(x) + F.selu(x) + F.celu(x, 0.5) + x.clamp_min(-0.5)
                + torch.clamp_max(x, 0.7) + torch.log10(q_idx + 1.0) * 0.1)

    q, k, v = make_qkv(L=48, D=16)
    run(q, k, v, activations, rounding)
    assert_error(lambda: flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: torch.fmod(score, 0.3)),
                 TraceError, "fmod of float values", "torch.remainder")


def test_small_captured_tensors_met_whole_and_searchsorted():
    """A small captured tensor met whole by a traced value broadcasts into a row, as in torch:
    (offsets <= q_idx).sum(), torch.searchsorted(offsets, q_idx, right=True) and
    torch.bucketize (document ids from the offsets alone, no per-token table); .to(other)
    still casts. A large one used whole is still an error that says to index it."""
    offsets = torch.tensor([0, 10, 30, 48])
    per_batch = torch.tensor([[0, 20, 25, 48], [0, 5, 40, 48]], dtype=torch.int32)
    edges = torch.tensor([-0.5, 0.0, 0.7])
    table = torch.randn(48, 48)

    def documents(b, h, q_idx, kv_idx):
        same = torch.searchsorted(offsets, q_idx, right=True) == torch.bucketize(kv_idx, offsets, right=True)
        return (same & (q_idx >= kv_idx)) | ((per_batch[b] <= q_idx).sum() == (per_batch[b] <= kv_idx).sum())

    def buckets(score, b, h, q_idx, kv_idx):
        return (score + torch.bucketize(score, edges) * 0.3 + torch.searchsorted(per_batch[b], kv_idx) * 0.1
                + (q_idx - kv_idx).to(edges) * 0.01)

    q, k, v = make_qkv(B=2, L=48, D=16)
    run(q, k, v, buckets, documents)
    assert_error(lambda: flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score + table),
                 TraceError, "shape [48, 48] was used as a value", "index it")
    # A one-element offset (gpt-fast's input_pos, not input_pos[0]) left as a row: the fix says so.
    pos = torch.tensor([5])
    assert_error(lambda: flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score + q_idx + pos),
                 TraceError, "shape [1], not indexed", "0-d tensor (pos[0], not pos)")


def test_integer_compared_with_a_number_beyond_int32():
    """A window of 10**10, 1e12 or sys.maxsize that means "no limit": the comparison holds
    for every position, as in torch. Kept as a comparison, the lowering rewrote it to
    kv_idx - q_idx + 9999999999 >= 0, which wraps in int32: rows were masked silently.
    An integer constant beyond int32 in arithmetic is a TraceError, no longer a Triton error."""
    import sys

    def unlimited(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx < 10 ** 10) & (q_idx - kv_idx <= 1e12) & (-3e9 < kv_idx) & (q_idx >= kv_idx)

    def nan_window(score, b, h, q_idx, kv_idx):
        return torch.where(q_idx - kv_idx != float("nan"), score, score - 1.0)

    q, k, v = make_qkv(L=48, D=16)
    run(q, k, v, nan_window, unlimited)
    # sys.maxsize: torch's eager reference compares in int64 (int32 tensors wrap the scalar).
    maxsize = create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx < sys.maxsize) & (q_idx >= kv_idx),
                                1, 2, 48, 48, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=maxsize),
                               torch_eager(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))
    assert_error(lambda: flex_attention(q, k, v, lambda score, b, h, q_idx, kv_idx: score + (q_idx * 2654435761) % 7),
                 TraceError, "2654435761 does not fit in int32")


# --- call sites ------------------------------------------------------------------------------

def test_return_aux_lse_and_max_scores():
    """return_aux=AuxRequest(lse=..., max_scores=...): the natural-log LSE and each row's largest
    modded score (float32, -inf for a fully masked row), as torch's AuxOutput."""
    def double(score, b, h, q_idx, kv_idx):
        return score * 2

    def first_rows_dead(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx >= 3)

    q, k, v = make_qkv(L=40, D=16)
    block_mask = create_block_mask(first_rows_dead, 1, 2, 40, 40, device="cpu", BLOCK_SIZE=16)
    out, aux = flex_attention(q, k, v, double, block_mask, return_aux=AuxRequest(lse=True, max_scores=True))
    ref, ref_lse = flex_attention_reference(q, k, v, double, first_rows_dead, return_lse=True)
    check(out, ref, lse=aux.lse, ref_lse=ref_lse)
    scores = per_element(double, 1, 2, 40, 40, "cpu", (q.double() @ k.double().transpose(-1, -2)) / 4)
    ref_max = scores.masked_fill(~dense_mask(first_rows_dead, 1, 2, 40, 40), float("-inf")).amax(-1)
    assert aux.max_scores.dtype == torch.float32 and not aux.max_scores.requires_grad
    assert torch.equal(torch.isneginf(aux.max_scores), torch.isneginf(ref_max))
    live = ~torch.isneginf(ref_max)
    torch.testing.assert_close(aux.max_scores[live].double(), ref_max[live], atol=1e-4, rtol=1e-5)
    assert flex_attention(q, k, v, double, block_mask, return_aux=AuxRequest())[1] == (None, None)
    assert_error(lambda: flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True)),
                 InputError, "return_aux")


def test_output_keeps_the_query_stride_order():
    """Queries laid out [B, L, H, D] or [L, B, H, D] (permuted views) give outputs in that order."""
    def order(t):
        return sorted(range(4), key=lambda d: (-t.stride(d), d))

    for layout in ((0, 2, 1, 3), (2, 0, 1, 3)):
        q, k, v = (t.permute(*layout).contiguous().permute(*[layout.index(d) for d in range(4)])
                   for t in make_qkv(B=2, L=40, D=16))
        out = flex_attention(q, k, v)
        assert order(out) == order(q), layout
        check(out, flex_attention_reference(q, k, v))


def test_torch_kernel_options_are_checked():
    """torch's own kernel options are accepted with torch's types; FORCE_USE_FLEX_ATTENTION asks for
    the non-decode kernel; wrong values and unknown keys are InputErrors naming them."""
    q, k, v = make_qkv(L=40, D=16)
    plain = flex_attention(q, k, v)
    forced = flex_attention(q, k, v, kernel_options={"FORCE_USE_FLEX_ATTENTION": True,
                                                     "PRESCALE_QK": False, "waves_per_eu": 0})
    torch.testing.assert_close(forced, plain)
    assert_error(lambda: flex_attention(q, k, v, kernel_options={"PRESCALE_QK": "yes"}),
                 InputError, "PRESCALE_QK", "True or False")
    assert_error(lambda: flex_attention(q, k, v, kernel_options={"kpack": 2.5}), InputError, "kpack")
    assert_error(lambda: flex_attention(q, k, v, kernel_options={"BACKEND": "TRITON",
                                                                 "FORCE_USE_FLEX_ATTENTION": True}),
                 InputError, "BACKEND", "FORCE_USE_FLEX_ATTENTION")
    assert_error(lambda: flex_attention(q, k, v, kernel_options={"BLOCK_SIZE_Q": 64}),
                 InputError, "BLOCK_SIZE_Q")


def test_every_torch_argument_is_accepted():
    """Each argument torch's create_block_mask, create_mask, flex_attention and
    BlockMask.from_kv_blocks take is one flexgen's take (a call site passing torch 2.13's
    compute_dq_write_order raised a TypeError): the deterministic-backward schedule of torch's
    FLASH backend is accepted and not needed, the mask is the same."""
    import inspect
    for name in ("create_block_mask", "create_mask", "flex_attention"):
        theirs = inspect.signature(getattr(tfa, name)).parameters
        ours = inspect.signature(getattr(flexgen, name)).parameters
        assert set(theirs) - {"mod_fn"} <= set(ours), (name, set(theirs) - set(ours))
    theirs = inspect.signature(tfa.BlockMask.from_kv_blocks).parameters
    assert set(theirs) <= set(inspect.signature(flexgen.BlockMask.from_kv_blocks).parameters)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    plain = create_block_mask(causal, 1, 2, 64, 64, device="cpu", BLOCK_SIZE=16)
    ordered = create_block_mask(causal, 1, 2, 64, 64, device="cpu", BLOCK_SIZE=16,
                                compute_dq_write_order=True, dq_kv_order=False)
    assert torch.equal(ordered.to_dense(), plain.to_dense())
    lists = (plain.kv_num_blocks, plain.kv_indices, plain.full_kv_num_blocks, plain.full_kv_indices)
    rebuilt = flexgen.BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=16, mask_mod=causal, dq_kv_order=True)
    assert torch.equal(rebuilt.to_dense(), plain.to_dense())


def test_oracle_and_create_mask_evaluate_mods_per_element():
    """Chained indexing means what it means in torch (vmap per element) in the oracle's dense
    mask and in create_mask, also for Q_LEN != KV_LEN (a broadcast evaluation took row 0)."""
    image = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    intervals = torch.tensor([[0, 7], [1, 7], [7, 12]])

    def vision_cross(b, h, q_idx, kv_idx):
        interval = intervals[image[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    theirs = tfa.create_mask(vision_cross, 1, 1, 12, 9, device="cpu")
    assert torch.equal(dense_mask(vision_cross, 1, 1, 12, 9), theirs)
    assert torch.equal(flexgen.create_mask(vision_cross, 1, 1, 12, 9, device="cpu"), theirs)


def test_functions_spelled_as_tensor_methods():
    """Every torch function the tracer takes also works in its method spelling (x.log1p() as
    torch.log1p(x): the methods fall back to the functions' table), with torch.lerp and
    torch.logaddexp / logaddexp2 written as their formulas."""
    bias = torch.randn(40)

    def methods(score, b, h, q_idx, kv_idx):
        rel = (q_idx - kv_idx).type_as(score) * 0.05
        return (score.lerp(score * 0.5 + rel, 0.25) + (score * 0.1).expm1() + score.abs().log1p()
                + (rel.square() + 1).reciprocal() + score.logaddexp(rel)
                + torch.logaddexp2(score, bias[q_idx]) * 0.5)

    run(*make_qkv(L=40, D=16), methods)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_relative_position_buckets(bidirectional):
    """A table read at T5's buckets (the host's bounds check once crashed in sympy on log(0)),
    with torch.div's 'trunc' rounding beside it."""
    table = torch.randn(32, 4)

    def t5(score, b, h, q_idx, kv_idx):
        step = torch.div(q_idx - kv_idx, 7, rounding_mode="trunc") * 0.01
        return score + table[hf_t5_bucket(kv_idx - q_idx, bidirectional), h] + step

    run(*make_qkv(B=1, H=4, L=150, D=16), t5)


def test_comparisons_with_infinities_in_captured_tensors():
    """A captured tensor may hold infinities (an additive mask of 0 / -inf): comparing its
    entries with +-inf (or torch.isinf) is kept, not folded as though every value were finite (the guard
    below once lowered to `score + bias`, -inf where the mod asks for -1e4), and
    logaddexp of two -inf is -inf (no NaN from -inf - -inf)."""
    bias = torch.zeros(48)
    bias[5::3] = float("-inf")
    ceiling = torch.zeros(48)
    ceiling[::4] = float("inf")

    def guarded(score, b, h, q_idx, kv_idx):
        finite = bias[kv_idx] > float("-inf")
        kept = torch.where(bias[kv_idx] == float("-inf"), -1e4, score + bias[kv_idx])
        capped = torch.where(ceiling[q_idx] >= float("inf"), kept * 0.5, kept)
        always = torch.where(bias[kv_idx] >= float("-inf"), 0.0, 1e4)     # true for every entry
        flagged = torch.where(torch.isinf(ceiling[q_idx]) & bias[kv_idx].isneginf(), 0.5, 0.0)
        return (torch.where(finite, capped, kept - 1.0) + always + flagged
                + torch.logaddexp(bias[q_idx] + score, score))

    def both_infinite(score, b, h, q_idx, kv_idx):
        return score + torch.logaddexp(bias[q_idx], bias[kv_idx])

    q, k, v = make_qkv(L=48, D=16)
    run(q, k, v, guarded)
    # Forward only: torch's derivative of logaddexp(-inf, -inf) is NaN, so is the oracle's.
    run(q.detach(), k.detach(), v.detach(), both_infinite, grad=False)


def test_nan_checks_on_captured_tensors():
    """A captured tensor may hold NaN, and a mod guards against it as torch code does:
    ``x != x``, ``x == x``, ``torch.isnan``, ``isfinite``. A float compared with itself is not
    folded as a difference (x - x is 0: ``x != x`` once lowered to False, the guard vanished
    and NaN reached the output); the guarded entries' gradients are exact too."""
    bias = torch.randn(48)
    bias[[5, 17, 30]] = float("nan")
    bias[9] = float("-inf")
    slopes = torch.randn(48).requires_grad_()

    def guarded(score, b, h, q_idx, kv_idx):
        x = bias[kv_idx]
        kept = torch.where(x != x, -1e4, score + x)
        kept = torch.where(torch.isnan(bias[q_idx]), kept * 0.5, kept)
        kept = torch.where(x.isfinite(), kept, kept - 1.0)
        return torch.where(x >= x, kept, kept + 2.0) + torch.where(x > x, 1e4, 0.0)

    def learned(score, b, h, q_idx, kv_idx):
        x = bias[kv_idx]
        # (Not slopes * x: where x is NaN, torch's gradient of where() is 0 * NaN for that branch.)
        return torch.where(x == x, score + slopes[kv_idx], score - slopes[q_idx])

    def no_nan_keys(b, h, q_idx, kv_idx):
        return ~torch.isnan(bias[kv_idx]) & (kv_idx <= q_idx + 8)

    q, k, v = make_qkv(L=48, D=16)
    run(q, k, v, guarded)
    run(q, k, v, learned, learned=(slopes,))
    run(q, k, v, None, no_nan_keys)
    # An integer compared with itself folds as before.
    from flexgen.frontend.lowering import lower
    from flexgen.frontend.trace import trace
    assert lower(trace(lambda b, h, q_idx, kv_idx: q_idx == q_idx, "mask_mod")).is_true


def test_float_comparisons_whose_difference_cancels_are_kept_as_written():
    """``x + 1 > x`` and ``2 * x > x`` compare as torch compares them: as a canonical difference
    sympy would decide them (1 > 0, x > 0), which an infinite entry (inf - inf is NaN) and a
    large one (x + 1 rounds to x in float32) contradict, silently. They stay comparisons of
    the two sides (expr.FloatCompare), in masks and on a score_mod's path, forward and backward."""
    bias = torch.randn(48)
    bias[[3, 20]] = float("inf")
    bias[7] = float("-inf")
    bias[11] = 3e7

    def above(b, h, q_idx, kv_idx):
        return (bias[kv_idx] + 1 > bias[kv_idx]) | (kv_idx == q_idx)

    def doubled(score, b, h, q_idx, kv_idx):
        return torch.where(bias[kv_idx] * 2 <= bias[kv_idx], score - 1.0, score)

    q, k, v = make_qkv(L=48, D=16)
    run(q, k, v, None, above)
    run(q, k, v, doubled)
    from flexgen.frontend.lowering import lower
    from flexgen.frontend.trace import trace
    assert "FloatCompare" in lower(trace(above, "mask_mod")).canonical
    # Integers still cancel (exact), and a float difference that loses no term is canonical.
    assert lower(trace(lambda b, h, q_idx, kv_idx: q_idx + 1 > q_idx, "mask_mod")).is_true
    assert "FloatCompare" not in lower(trace(lambda b, h, q_idx, kv_idx: bias[q_idx] > bias[kv_idx],
                                             "mask_mod")).canonical


# --- what cannot become a kernel: clear errors -------------------------------------------------

@torch.library.custom_op("flexgen_compat_test::fast_tanh", mutates_args=())
def fast_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(x, mask):
        return torch.where(mask, x, -float("inf"))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_unsupported_constructs_name_the_mod_construct_and_fix():
    """A custom operator, an autograd.Function with its own backward, a row too long to unroll
    and an unknown torch function: each a TraceError naming the mod, the construct and the fix."""
    q, k, v = make_qkv(L=32, D=16)
    wide = torch.randn(32, 256)

    def custom_op_softcap(score, b, h, q_idx, kv_idx):
        return 20 * fast_tanh(score / 20)

    def custom_backward(score, b, h, q_idx, kv_idx):
        return StraightThrough.apply(score, q_idx >= kv_idx)

    def long_row(score, b, h, q_idx, kv_idx):
        return score - (wide[q_idx] - wide[kv_idx]).pow(2).sum(-1)

    def cumulative(score, b, h, q_idx, kv_idx):
        return torch.cumsum(score, 0)

    def stacked(score, b, h, q_idx, kv_idx):
        return torch.stack([score, score * 2]).amax(0)

    assert_error(lambda: flex_attention(q, k, v, custom_op_softcap), TraceError, "custom_op_softcap",
                 "custom operator 'flexgen_compat_test::fast_tanh", "torch functions")
    assert_error(lambda: flex_attention(q, k, v, custom_backward), TraceError, "custom_backward",
                 "autograd.Function 'StraightThrough'", "custom backward")
    assert_error(lambda: flex_attention(q, k, v, long_row), TraceError, "long_row", "256 elements",
                 "more than the 64", "outside the mod")
    assert_error(lambda: flex_attention(q, k, v, cumulative), TraceError, "cumulative",
                 "cumsum", "not supported")
    # A list of traced values (torch.stack) names the mod too (it raised an AttributeError).
    assert_error(lambda: flex_attention(q, k, v, stacked), TraceError, "stacked", "stack",
                 "not supported")
    assert isinstance(TraceError("x"), FlexgenError)
