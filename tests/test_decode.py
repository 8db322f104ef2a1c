"""flexgen.kernels.decode.decode_attention on contiguous K/V, against the float64 oracle.

Runs on CPU through the Triton interpreter. Every output is poisoned with
NaN before the launch (FLEXGEN_POISON=1, partial split buffers included), and
every element is compared: rows past a sequence's valid queries must be
exact zeros with LSE = -inf. The oracle is ``flex_attention_reference`` run
per sequence on that sequence's keys, with the mods shifted so that they see
the same positions as the kernel (``q_idx = q_offset + i``, ``b`` the batch
row). The last test compiles every kernel these tests launched for sm_90.
"""
from __future__ import annotations

import os

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flexgen import create_block_mask  # noqa: E402
import flexgen  # noqa: E402
from flexgen.api import decode_attention, decode_kernel_source  # noqa: E402
from flexgen.errors import FlexgenError, InputError  # noqa: E402
from flexgen.mods import alibi, causal_mask, sliding_window, tanh_softcap  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402
from flexgen.runtime import plan as P  # noqa: E402
from flexgen.runtime.options import parse_options  # noqa: E402
from conftest import assert_module_launches_compile  # noqa: E402

def gen(seed):
    return torch.Generator().manual_seed(seed)


def inputs(B, Hq, Hkv, Lq, L, D=32, Dv=None, dtype=torch.float32, seed=0):
    g = gen(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, L, Dv or D, generator=g).to(dtype)
    return q, k, v


def shifted(mod, b0, q0, kind):
    """``mod`` seen from one sequence: batch row ``b0``, query positions from ``q0``."""
    if mod is None:
        return None
    if kind == "score":
        return lambda s, b, h, q, kv: mod(s, b + b0, h, q + q0, kv)
    return lambda b, h, q, kv: mod(b + b0, h, q + q0, kv)


def reference(q, k, v, score_mod=None, mask_mod=None, kv_lengths=None, q_offsets=None,
              q_lengths=None, scale=None):
    """(out, lse) in float64, sequence by sequence, rows past q_lengths zero / -inf."""
    B, Hq, Lq, _ = q.shape
    L = k.shape[2]
    out = torch.zeros(B, Hq, Lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), -math.inf, dtype=torch.float64)
    for b in range(B):
        n = L if kv_lengths is None else int(kv_lengths[b])
        ql = Lq if q_lengths is None else int(q_lengths[b])
        q0 = (n - ql) if q_offsets is None else int(q_offsets[b] if not isinstance(q_offsets, int) else q_offsets)
        if ql == 0:
            continue
        if n == 0:                 # no key at all: the reference cannot take an empty key
            continue
        o, l_ = flex_attention_reference(
            q[b:b + 1, :, :ql], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
            score_mod=shifted(score_mod, b, q0, "score"), mask_mod=shifted(mask_mod, b, q0, "mask"),
            scale=scale, enable_gqa=True, return_lse=True, dtype=torch.float64)
        out[b, :, :ql], lse[b, :, :ql] = o[0], l_[0]
    return out, lse


def assert_matches(got, want, tol):
    out, lse = got
    want_out, want_lse = want
    assert not out.isnan().any() and not lse.isnan().any(), "an element was never written"
    torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)


# --- GQA decode -------------------------------------------------------------------------
GQA_CASES = [
    # (group, q_len, score_mod, mask_mod)
    (1, 1, None, None),
    (1, 5, tanh_softcap(2.0), causal_mask),
    (4, 1, alibi(8), None),
    (4, 3, None, sliding_window(40)),
    (4, 16, tanh_softcap(3.0), causal_mask),
    (8, 1, None, causal_mask),
    (8, 2, alibi(16), sliding_window(50)),
    (8, 16, None, sliding_window(33)),
]


@pytest.mark.parametrize("group,q_len,score_mod,mask_mod", GQA_CASES,
                         ids=[f"gqa{g}-q{q}-{getattr(s, '__name__', 'none')}-{getattr(m, '__name__', 'none')}"
                              for g, q, s, m in GQA_CASES])
def test_gqa_decode_mixed_lengths(group, q_len, score_mod, mask_mod):
    Hkv = 2
    q, k, v = inputs(3, Hkv * group, Hkv, q_len, 190, seed=group * 100 + q_len)
    lengths = [190, 77, q_len + 3]
    got = decode_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=True,
                           return_lse=True, kv_lengths=torch.tensor(lengths, dtype=torch.int32))
    assert got[0].shape == (3, Hkv * group, q_len, 32) and got[0].dtype == torch.float32
    assert_matches(got, reference(q, k, v, score_mod, mask_mod, kv_lengths=lengths), 1e-5)


def test_default_positions_are_the_last_tokens():
    """Without lengths the queries are the last Lq of L keys: q_idx = L - Lq + i."""
    q, k, v = inputs(2, 4, 2, 4, 100, seed=1)
    got = decode_attention(q, k, v, mask_mod=causal_mask, enable_gqa=True, return_lse=True)
    assert_matches(got, reference(q, k, v, None, causal_mask), 1e-5)


@pytest.mark.parametrize("num_splits", [1, 3, 9])
def test_split_counts_agree(num_splits):
    """One split writes the output directly; more go through the LSE merge (9 > tiles: empty splits)."""
    q, k, v = inputs(2, 8, 2, 2, 300, seed=2)
    lengths = [300, 70]
    got = decode_attention(q, k, v, score_mod=tanh_softcap(4.0), enable_gqa=True, return_lse=True,
                           kv_lengths=lengths, num_splits=num_splits)
    assert_matches(got, reference(q, k, v, tanh_softcap(4.0), kv_lengths=lengths), 1e-5)


def test_split_counts_on_a_gpu(monkeypatch):
    """Two programs per SM, one where splits would be short (contiguous or paged); never splits under
    MIN_TILES_PER_SPLIT tiles or over MAX_SPLITS (the SM count is faked: no GPU here)."""
    from flexgen.kernels import decode
    monkeypatch.setattr(decode.launch, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "_SPLITS", {})
    gpu = torch.device("cuda", 0)
    assert decode.choose_splits(gpu, 8, 128) == 16                  # B=1, Hkv=8, 8k keys / 64
    assert decode.choose_splits(gpu, 8, 2048) == 33                 # 128k keys: long splits, 2 per SM
    assert decode.choose_splits(gpu, 8, 6) == 6 // decode.MIN_TILES_PER_SPLIT
    assert decode.choose_splits(gpu, 1, 4096) == min(132, decode.MAX_SPLITS)
    assert decode.choose_splits(gpu, 512, 128) == 1                  # B=64: the batch fills the GPU


def test_one_program_per_sm_runs_the_deeper_pipeline(monkeypatch):
    """Three stages where each program has an SM to itself, else two; past D=128 the tiles'
    own (three: 64-key tiles, 8 warps), and a caller's num_stages holds (the SM count is faked:
    no GPU here)."""
    from flexgen.kernels import decode
    monkeypatch.setattr(decode.launch, "sm_count", lambda device: 132)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [decode._alone(gpu, 8, s) for s in (16, 17)] == [True, False]   # 8 x 16 = 128 <= 132
    assert not decode._alone(cpu, 1, 1)
    none, four = parse_options(None), parse_options({"num_stages": 4})
    assert decode.deep_stages(gpu, 128, 2, none) == decode.DEEP_STAGES
    assert decode.deep_stages(gpu, 256, 2, none) == 2
    assert decode.deep_stages(gpu, 128, 2, four) == 4
    assert decode.deep_stages(cpu, 64, 1, none) == 1
    assert decode.decode_geometry(gpu, 2, 1, 256, None) == (1, 16, 64, 8, 3)
    assert decode.decode_geometry(gpu, 4, 1, 128, None) == (1, 16, 64, 4, 2)


def test_flex_attention_convention_with_block_mask():
    """q_offsets=0 and a BlockMask for (Lq, Lkv): what flex_attention's dispatch passes.

    The mask is per batch and per query head (so the GQA group's lists are combined).
    """
    B, Hq, Hkv, Lq, L = 2, 8, 2, 3, 260

    def per_head_window(b, h, q_idx, kv_idx):
        end = L - Lq + q_idx           # the queries sit at the end, in a mask written by hand
        return (kv_idx <= end) & (end - kv_idx < 20 + 30 * h + 50 * b)

    q, k, v = inputs(B, Hq, Hkv, Lq, L, seed=3)
    mask = create_block_mask(per_head_window, B, Hq, Lq, L, device="cpu", BLOCK_SIZE=32)
    got = decode_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True, q_offsets=0)
    want = flex_attention_reference(q, k, v, mask_mod=per_head_window, enable_gqa=True,
                                    return_lse=True, dtype=torch.float64)
    assert_matches(got, want, 1e-5)


def test_block_mask_query_tile_across_two_query_blocks():
    """Queries at positions 12..19 straddle two 16-row query blocks of a logical mask."""
    B, Hq, Hkv, Lq = 2, 4, 2, 8
    lengths = [20, 23]
    q, k, v = inputs(B, Hq, Hkv, Lq, 23, seed=4)

    def stripes(b, h, q_idx, kv_idx):   # rows 0..15 and 16..31 see different kv blocks
        return ((q_idx // 16 == 0) & (kv_idx < 16)) | ((q_idx // 16 == 1) & (kv_idx >= 4) & (kv_idx <= q_idx))

    mask = create_block_mask(stripes, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    got = decode_attention(q, k, v, block_mask=mask, enable_gqa=True, return_lse=True,
                           kv_lengths=lengths, q_offsets=[12, 12], num_splits=2)
    assert_matches(got, reference(q, k, v, None, stripes, kv_lengths=lengths, q_offsets=[12, 12]), 1e-5)


def test_dead_rows_padding_and_empty_sequences():
    """Padding queries, a sequence with no keys and fully masked rows: zeros and LSE = -inf."""
    q, k, v = inputs(3, 4, 2, 4, 90, seed=5)

    def late_only(b, h, q_idx, kv_idx):
        return kv_idx > q_idx - 2 + 1000 * (q_idx % 2)   # odd query positions see nothing

    lengths, q_lengths = [90, 0, 50], [4, 2, 1]
    out, lse = decode_attention(q, k, v, mask_mod=late_only, enable_gqa=True, return_lse=True,
                                kv_lengths=lengths, q_lengths=q_lengths, q_offsets=[0, 0, 7])
    want = reference(q, k, v, None, late_only, kv_lengths=lengths, q_offsets=[0, 0, 7],
                     q_lengths=q_lengths)
    assert_matches((out, lse), want, 1e-5)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    assert (out[2, :, 1:] == 0).all() and torch.isneginf(lse[2, :, 1:]).all()


def test_captured_buffers_and_value_head_dim():
    """A score_mod reading bias[h, kv_idx] (h is the query head, per row), a mask reading doc[b, kv_idx]."""
    B, Hq, Hkv, Lq, L = 2, 8, 2, 2, 120
    q, k, v = inputs(B, Hq, Hkv, Lq, L, D=32, Dv=48, seed=6)
    bias = torch.randn(Hq, L, generator=gen(7))
    doc = torch.tensor([[0] * 50 + [1] * 70, [2] * 100 + [3] * 20], dtype=torch.int32)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    def same_doc(b, h, q_idx, kv_idx):
        return doc[b, kv_idx] == doc[b, q_idx]

    got = decode_attention(q, k, v, score_mod=biased, mask_mod=same_doc, enable_gqa=True,
                           return_lse=True, scale=0.3)
    assert got[0].shape == (B, Hq, Lq, 48)
    assert_matches(got, reference(q, k, v, biased, same_doc, scale=0.3), 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    q, k, v = inputs(2, 8, 2, 1, 200, D=64, dtype=dtype, seed=8)
    lengths = [200, 131]
    got = decode_attention(q, k, v, score_mod=tanh_softcap(5.0), mask_mod=sliding_window(64),
                           enable_gqa=True, return_lse=True, kv_lengths=lengths)
    assert got[0].dtype == dtype
    assert_matches(got, reference(q, k, v, tanh_softcap(5.0), sliding_window(64), kv_lengths=lengths), 1e-2)


def test_flex_attention_picks_the_decode_kernel_by_shape_alone():
    """At most 16 queries per sequence take the decode kernel, with or without gradients
    (the backward works from its LSE like the forward kernel's), so the answer never depends
    on requires_grad; BACKEND decides either way."""

    def kernel(q, k, **options):
        return P.plan_attention(q, k, k, "", (), "", (), (), (), (), 0.2, False,
                                parse_options(options or None).text).kernel
    q16, q17, k = torch.randn(1, 4, 16, 32), torch.randn(1, 4, 17, 32), torch.randn(1, 4, 100, 32)
    assert kernel(q16, k) == "decode" and kernel(q17, k) == "forward"
    assert kernel(q16, k, BACKEND="TRITON") == "forward"
    assert kernel(q17, k, BACKEND="TRITON_DECODE") == "decode"
    assert isinstance(P.plan_attention(q16, k, k, "", (), "", (), (), (), (), 0.2, False, "").decode,
                      P.DecodePlan)
    q, kk, v = inputs(1, 4, 2, 3, 90, seed=4)
    mask = create_block_mask(causal_mask, None, None, 3, 90, device="cpu", BLOCK_SIZE=32)
    plain = flexgen.flex_attention(q, kk, v, score_mod=tanh_softcap(3.0), block_mask=mask, enable_gqa=True)
    graded = flexgen.flex_attention(q.clone().requires_grad_(), kk, v, score_mod=tanh_softcap(3.0),
                                    block_mask=mask, enable_gqa=True)
    assert torch.equal(plain, graded.detach())


def test_input_errors():
    q, k, v = inputs(2, 4, 2, 1, 50)
    with pytest.raises(InputError, match="enable_gqa"):
        decode_attention(q, k, v)
    with pytest.raises(InputError, match="kv_lengths"):
        decode_attention(q, k, v, enable_gqa=True, kv_lengths=[10, 51])
    with pytest.raises(InputError, match="kv_lengths"):
        decode_attention(q, k, v, enable_gqa=True, kv_lengths=[10])
    with pytest.raises(InputError, match="mask_mod"):
        mask = create_block_mask(causal_mask, None, None, 1, 50, device="cpu")
        decode_attention(q, k, v, enable_gqa=True, block_mask=mask, mask_mod=causal_mask)
    with pytest.raises(InputError, match="Q_LEN"):
        # default positions are 49: a mask for one query row does not cover them
        decode_attention(q, k, v, enable_gqa=True, block_mask=mask)
    with pytest.raises(InputError, match="page_table"):
        decode_attention(q, k.view(2, 50, 2, 32), v.view(2, 50, 2, 32), enable_gqa=True,
                         page_table=torch.zeros(3, 4), kv_lengths=[1, 1])
    with pytest.raises(FlexgenError, match="kernel_options"):
        decode_attention(q, k, v, enable_gqa=True, kernel_options={"BLOK_N": 32})


def test_flex_attention_checks_short_queries_like_long_ones():
    """The decode dispatch skips forward planning, not flex_attention's own checks."""
    from flexgen import flex_attention
    q, k, v = inputs(1, 2, 2, 4, 50)
    mask = create_block_mask(causal_mask, None, None, 8, 50, device="cpu")
    with pytest.raises(InputError, match="Q_LEN=4"):
        flex_attention(q, k, v, block_mask=mask)
    with pytest.raises(InputError, match="dtype"):
        flex_attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(InputError, match="query"):
        flex_attention("q", k, v)
    with pytest.raises(FlexgenError, match="score_mod"):
        flex_attention(q, k, v, score_mod=lambda score: score)


def test_repeated_calls_follow_what_changes_between_them(monkeypatch):
    """The plan's static half is memoized; lengths, captured values and errors are per call.

    Same shapes and mods every call (a decode loop): lengths grown in place in the
    same tensor (the split count follows them), a captured tensor updated in place,
    and a bad length after good calls still raises.
    """
    from flexgen.kernels import decode
    B, Hq, Hkv, L = 2, 4, 2, 200
    q, k, v = inputs(B, Hq, Hkv, 1, L, seed=9)
    bias = torch.zeros(Hq, L)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h, kv_idx]

    lengths = torch.tensor([30, 20], dtype=torch.int32)
    splits = set()
    choose = decode.choose_splits
    monkeypatch.setattr(decode, "choose_splits", lambda *a: splits.add(choose(*a)) or choose(*a))
    for step, (n0, n1) in enumerate([(30, 20), (31, 21), (150, 90), (151, 91)]):
        lengths[0], lengths[1] = n0, n1                      # in place, like a serving loop
        bias.normal_(generator=gen(20 + step))               # in place: the kernel reads it
        got = decode_attention(q, k, v, score_mod=biased, mask_mod=causal_mask, enable_gqa=True,
                               return_lse=True, kv_lengths=lengths)
        assert_matches(got, reference(q, k, v, biased, causal_mask, kv_lengths=[n0, n1]), 1e-5)
    assert splits == {1, 2}            # one 64-key tile: no split; three tiles: the merge runs
    with pytest.raises(InputError, match="kv_lengths"):
        decode_attention(q, k, v, score_mod=biased, mask_mod=causal_mask, enable_gqa=True,
                         kv_lengths=[L + 1, 3])
    with pytest.raises(InputError, match="scale"):
        decode_attention(q, k, v, score_mod=biased, mask_mod=causal_mask, enable_gqa=True,
                         kv_lengths=lengths, scale=True)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("offsets", [None, 5])
def test_swapped_tensors_are_the_split_kernels_leading_arguments(paged, splits, offsets):
    """A replayed decode launch swaps in the tensors ``decode._swapped`` lists: they must be
    the split kernel's first arguments, in its module's order, in every layout."""
    from flexgen.codegen import cache
    from flexgen.kernels import decode
    from flexgen.runtime.plan import plan_decode
    B, Hq, Hkv, L, P = 2, 4, 2, 64, 16
    q, k, v = inputs(B, Hq, Hkv, 1, L, seed=3)
    lengths = torch.tensor([40, 64], dtype=torch.int32)
    table = None
    if paged:   # [pages, page_size, Hkv, D] caches and a table of shuffled pages
        k = k.view(B, Hkv, L // P, P, -1).permute(0, 2, 3, 1, 4).reshape(-1, P, Hkv, k.shape[-1])
        v = v.view(B, Hkv, L // P, P, -1).permute(0, 2, 3, 1, 4).reshape(-1, P, Hkv, v.shape[-1])
        table = torch.randperm(B * L // P, generator=gen(4)).view(B, -1).to(torch.int32)
    plan = plan_decode(q, k, v, None, None, None, True, parse_options({"NUM_SPLITS": splits}),
                              paged=paged, page_table_shape=None if table is None else table.shape)
    out, lse = torch.empty(B, Hq, 1, 32), torch.empty(B, Hq, 1)
    o_part, l_part = torch.empty(B, Hq, 1, splits, 32), torch.empty(B, Hq, 1, splits)
    module = cache.load(plan.spec, interpret=True)
    seq = (lengths, None if offsets is None else decode.constant(offsets, q.device), decode.constant(1, q.device))
    launch = decode._Launch(seq, table, None, splits, plan.q_tile, plan.page_size, plan.sparse_q,
                            plan.sparse_kv)
    _, args, _ = module.arguments(q=q, k=k, v=v, out=out, lse=lse, o_part=o_part, l_part=l_part,
                                  seq=seq, page_table=table, visit=None, score_buffers=(),
                                  mask_buffers=(), scale=0.1, q_tile=plan.q_tile, num_splits=splits,
                                  page_size=plan.page_size, sparse_q=plan.sparse_q,
                                  sparse_kv=plan.sparse_kv)
    swapped = decode._swapped(launch, q, k, v, out, lse, o_part, l_part)
    assert [a is b for a, b in zip(args, swapped)] == [True] * len(swapped)
    assert not isinstance(args[len(swapped)], torch.Tensor)   # what follows is fixed by replay_key


def test_a_repeated_call_replays_its_launches(monkeypatch):
    """Replays stand in for the GPU's (launch.run returns none under the interpreter): a call
    like an earlier one relaunches with its new tensors; anything replay_key holds launches
    anew; a replay that declines (new alignment, say) falls back to a launch."""
    from flexgen.kernels import decode
    from flexgen.runtime import launch

    class FakeReplay:
        def __init__(self, template):
            self.template, self.seen, self.accept = template, [], True

        def __call__(self, *tensors):
            self.seen.append(tensors)
            return self.accept

    launched = []

    def fake_run(spec, device, inputs, replay=(), **kwargs):
        launched.append(FakeReplay(spec.template))
        assert len(replay) == (12 if spec.template == "decode" else 4)     # decode._swapped
        return launched[-1]

    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr(P, "_DECODE", {})             # no fake replay outlives the test
    B, Hq, Hkv, L = 2, 4, 2, 200
    q, k, v = inputs(B, Hq, Hkv, 1, L, seed=5)
    lengths = torch.tensor([150, 200], dtype=torch.int32)

    def call(query, **kw):
        return decode_attention(query, k, v, enable_gqa=True, kv_lengths=kw.pop("kv", lengths),
                                num_splits=kw.pop("splits", 2), **kw)

    call(q)
    assert [r.template for r in launched] == ["decode", "decode_merge"]
    split, merge = launched
    q2 = torch.randn_like(q)
    lengths2 = torch.tensor([160, 199], dtype=torch.int32)      # another tensor, same layout
    out = call(q2, kv=lengths2)
    assert len(launched) == 2
    assert split.seen[-1][0] is q2 and split.seen[-1][7] is lengths2 and split.seen[-1][3] is out
    assert merge.seen[-1][2] is out
    call(q2, scale=0.5)
    call(q2, splits=3)
    call(q2, q_offsets=3)                                       # given positions: another constexpr
    assert [r.template for r in launched[2:]] == ["decode", "decode_merge"] * 3
    n = len(launched)
    split.accept = False
    call(q)
    assert [r.template for r in launched[n:]] == ["decode"]     # the merge still replays


def test_visit_lists_follow_the_mask_lists():
    """The decode kernel's visit lists, derived from a mask's kv lists, are remembered per list
    tensors and recomputed for other tensors or after an in-place change."""
    from flexgen.kernels.decode import visit_lists
    mask = create_block_mask(causal_mask, None, None, 64, 256, device="cpu", BLOCK_SIZE=16)
    other = create_block_mask(sliding_window(20), None, None, 64, 256, device="cpu", BLOCK_SIZE=16)
    lists = [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices]
    others = [other.kv_num_blocks, other.kv_indices, other.full_kv_num_blocks, other.full_kv_indices]
    first = visit_lists(lists, 1)
    assert visit_lists(lists, 1) is first
    again = visit_lists(others, 1)
    assert again is not first and not torch.equal(again[1], first[1])
    for mine, theirs in zip(lists, others):
        mine.copy_(theirs)                                   # in place: a new version
    changed = visit_lists(lists, 1)
    assert changed is not first and all(torch.equal(a, b) for a, b in zip(changed, again))


def test_plan_memo_is_bounded(monkeypatch):
    from flexgen.kernels import decode
    from flexgen.runtime import launch
    monkeypatch.setattr(launch, "run", lambda *args, **kwargs: None)
    monkeypatch.setattr(P, "_MEMO_MAX", 4)
    for n in range(1, 11):
        q, k, v = inputs(1, 2, 2, n, 40, seed=n)
        decode_attention(q, k, v)
        assert len(P._DECODE) <= 4


def test_kernel_source_names_the_mods():
    q, k, v = inputs(1, 4, 2, 1, 64)
    text = decode_kernel_source(q, k, v, score_mod=tanh_softcap(7.0), mask_mod=causal_mask, enable_gqa=True)
    assert "flexgen_decode_" in text and "_tanh" in text and "q_idx" in text


def test_every_launched_kernel_compiles_for_sm90():
    """Ahead-of-time compile (triton.compile for sm_90) of each distinct kernel launched above."""
    assert_module_launches_compile(__name__, {"decode", "decode_merge"})


@pytest.mark.parametrize("name, value", [("BLOCK_M", 48), ("BLOCK_M", 8), ("BLOCK_M", 1000), ("BLOCK_M", 256),
                                         ("BLOCK_N", 24), ("BLOCK_N", 256), ("BLOCK_M", 32), ("BLOCK_N", 32)])
def test_tile_options_are_checked_alike_at_decode_and_forward_lengths(name, value):
    """16 queries take the decode kernel, 17 the forward one: a tile option is accepted or
    refused alike at both (a power of two >= 16 dividing the sparse block, 128 without a mask)."""
    k = v = torch.randn(1, 2, 64, 16)
    outcomes = []
    for Lq in (16, 17):
        q = torch.randn(1, 2, Lq, 16)
        try:
            flexgen.flex_attention(q, k, v, kernel_options={name: value})
            outcomes.append("ok")
        except InputError as err:
            assert name in str(err) and "dividing the sparse block 128" in str(err)
            outcomes.append("refused")
    assert outcomes[0] == outcomes[1] == ("ok" if value == 32 else "refused")
