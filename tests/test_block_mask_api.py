"""torch's BlockMask API on ``flexgen.BlockMask``: code written for torch's mask keeps working.

Where a behaviour is claimed to match torch's, the same mask is built with
``torch.nn.attention.flex_attention`` (its CPU create_block_mask runs without
compiling) and the fields are compared; where flexgen's result feeds a kernel, the
output is compared with the float64 oracle. Lengths are odd where blocks may be
ragged, and multiples of the block size where torch's lists must be equal bit for bit
(torch never calls a ragged block full; flexgen does when every position in the
sequence is kept, which is why the odd-length comparisons are of the computed blocks).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch._dynamo.testing
import torch.utils._pytree as pytree
from torch.nn.attention import flex_attention as tfa

import flexgen
from flexgen import BlockMask, create_block_mask, create_mask, decode_attention, flex_attention
from flexgen.errors import InputError, TraceError
from flexgen.masks import torch_compat
from flexgen.masks.torch_compat import LIST_NAMES
from flexgen.mods import causal_mask, document_mask, doc_ids_from_lengths, sliding_window
from flexgen.reference import flex_attention_reference

from conftest import check, make_qkv

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

CPU = "cpu"


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def per_head_window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx <= 20 + 30 * h) & (kv_idx - q_idx <= 10 * b)


DOC = doc_ids_from_lengths([40, 7, 61, 52])                  # 160 tokens
MODS = {"causal": causal, "per_head_window": per_head_window, "document": document_mask(DOC)}


def torch_mask(mod, B, H, Q, KV, block=32, **kw):
    return tfa.create_block_mask(mod, B, H, Q, KV, device=CPU, BLOCK_SIZE=block, **kw)


def assert_lists_equal(ours, theirs, names=LIST_NAMES):
    for name in names:
        got, want = getattr(ours, name), getattr(theirs, name)
        if want is None:
            assert got is None, name
            continue
        assert got.dtype == torch.int32 and got.shape == want.shape, (name, got.shape, want.shape)
        assert torch.equal(got, want), name


def oracle_check(q, k, v, block_mask, mask_mod, **kw):
    out, lse = flex_attention(q, k, v, block_mask=block_mask, return_lse=True, **kw)
    ref, ref_lse = flex_attention_reference(q, k, v, mask_mod=mask_mod, return_lse=True,
                                            enable_gqa=kw.get("enable_gqa", False))
    check(out, ref, q.dtype, lse, ref_lse)


# ---------------------------------------------------------------------------------- fields

@pytest.mark.parametrize("name", list(MODS))
def test_lists_as_tuple_shape_numel_sparsity_match_torch(name):
    """At lengths that are multiples of the block size every list equals torch's, and so
    do as_tuple (positions of the torch installed), shape, numel and sparsity."""
    mod = MODS[name]
    B, H = (2, 3) if name == "per_head_window" else (None, None)
    ours, theirs = create_block_mask(mod, B, H, 96, 160, device=CPU, BLOCK_SIZE=32), \
        torch_mask(mod, B, H, 96, 160)
    assert_lists_equal(ours, theirs)
    assert ours.shape == theirs.shape and ours.numel() == theirs.numel()
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    for flatten in (True, False):
        mine, torch_tuple = ours.as_tuple(flatten), theirs.as_tuple(flatten)
        assert len(mine) == len(torch_tuple)
        for a, b in zip(mine, torch_tuple):
            if isinstance(b, torch.Tensor):
                assert torch.equal(a, b)
            elif callable(b):
                assert a is mod and b is mod
            else:
                assert a == b
    seq, *_ = ours.as_tuple(flatten=False)
    assert seq == (96, 160)


@pytest.mark.parametrize("Q,KV", [(67, 131), (203, 45)])
def test_odd_lengths_compute_the_blocks_torch_computes(Q, KV):
    """Ragged blocks: the same blocks are visited (so the same sparsity, torch's meaning:
    whole blocks over numel, which can go below 0 for short masks); flexgen's full blocks
    include torch's (torch calls no ragged block full)."""
    ours, theirs = create_block_mask(per_head_window, 2, 3, Q, KV, device=CPU, BLOCK_SIZE=32), \
        torch_mask(per_head_window, 2, 3, Q, KV)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    full = ours.block_states() == 2
    torch_full = tfa.BlockMask.from_kv_blocks(theirs.full_kv_num_blocks, theirs.full_kv_indices).to_dense()
    assert not (torch_full.bool() & ~full).any()
    short = create_block_mask(causal, 1, 1, 20, 20, device=CPU, BLOCK_SIZE=32)
    assert short.sparsity() == pytest.approx(torch_mask(causal, 1, 1, 20, 20).sparsity())
    assert short.sparsity() < 0 and "sparsity=-156.00%" in repr(short)


def test_separate_full_blocks_false_matches_torch():
    """Every visited block partial, as torch's (the argument is torch 2.13's; under 2.11,
    torch's lists without full blocks); flexgen's full lists are empty ones."""
    ours = create_block_mask(per_head_window, 2, 3, 67, 131, device=CPU, BLOCK_SIZE=32,
                             separate_full_blocks=False)
    if "separate_full_blocks" in inspect.signature(tfa.create_block_mask).parameters:
        theirs = torch_mask(per_head_window, 2, 3, 67, 131, separate_full_blocks=False)
    else:
        visited = torch_mask(per_head_window, 2, 3, 67, 131).to_dense()
        theirs = tfa.BlockMask.from_kv_blocks(*torch_compat.ordered(visited), BLOCK_SIZE=32,
                                              mask_mod=per_head_window, seq_lengths=(67, 131))
    assert theirs.full_kv_num_blocks is None
    assert_lists_equal(ours, theirs, ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"))
    for name in ("full_kv_num_blocks", "full_q_num_blocks"):
        assert getattr(ours, name).abs().sum() == 0
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    q, k, v = make_qkv(2, 3, 67, 16, Lkv=131)
    oracle_check(q, k, v, ours, per_head_window)
    oracle_check(q, k, v, theirs, per_head_window)          # torch's, without full lists


# ---------------------------------------------------------------------------------- from_kv_blocks

def random_lists(B, H, nq, nkv):
    """Disjoint random partial / full blocks and their torch-layout lists, the listed
    entries of each row in a random order (from_kv_blocks must not rely on sorting)."""
    states = torch.randint(0, 3, (B, H, nq, nkv))
    lists = []
    for value in (1, 2):
        num, idx = torch_compat.ordered((states == value).to(torch.int32))
        keys = torch.rand(idx.shape) + (torch.arange(nkv) >= num[..., None])   # listed first
        lists += [num, torch.gather(idx, -1, keys.argsort(-1)).to(torch.int32)]
    return states, lists


def test_from_kv_blocks_matches_torch_and_runs():
    states, (num, idx, fnum, fidx) = random_lists(2, 1, 5, 4)
    ours = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=16)
    theirs = tfa.BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=16)
    assert_lists_equal(ours, theirs)
    assert ours.seq_lengths == theirs.seq_lengths == (80, 64) and ours.BLOCK_SIZE == (16, 16)
    assert ours.mask_mod is flexgen.noop_mask
    assert torch.equal(ours.block_states(), states.to(torch.int8))
    # no full lists: none (empty ones for the kernels); no q lists with compute_q_blocks=False
    partial_only = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(16, 16), seq_lengths=(77, 61))
    assert_lists_equal(partial_only, tfa.BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16),
                       ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"))
    assert partial_only.full_kv_num_blocks.sum() == 0 and partial_only.full_q_num_blocks.sum() == 0
    no_q = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=16, seq_lengths=(77, 61),
                                    compute_q_blocks=False)
    assert no_q.q_indices is None and no_q.full_q_num_blocks is None

    # In flex_attention: noop_mask inside partial blocks, so a position is kept where its
    # block is listed; the q lists of a compute_q_blocks=False mask are made per call
    # (the backward kernels read them).
    visited = states > 0

    def listed(b, h, q_idx, kv_idx):
        return visited[b, 0, q_idx // 16, kv_idx // 16]

    q, k, v = (t.requires_grad_() for t in make_qkv(2, 2, 77, 16, Lkv=61))
    out = flex_attention(q, k, v, block_mask=no_q)
    ref = flex_attention_reference(q, k, v, mask_mod=listed)
    check(out, ref, q.dtype)
    d_out = torch.randn(out.shape)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref * d_out.double()).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, name=name: f"d{name}: {m}")
    q, k, v = (t.detach() for t in (q, k, v))
    # lists with fewer leading dims broadcast (here: batch row 1's lists for every row)
    flat = BlockMask.from_kv_blocks(num[1, 0], idx[1, 0], fnum[1, 0], fidx[1, 0], BLOCK_SIZE=16,
                                    seq_lengths=(77, 61))
    assert flat.shape == (77, 61)
    oracle_check(q, k, v, flat, lambda b, h, q_idx, kv_idx: listed(1, h, q_idx, kv_idx))


def test_from_kv_blocks_errors():
    num, idx = torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 3, dtype=torch.int32)
    with pytest.raises(InputError, match="both or neither"):
        BlockMask.from_kv_blocks(num, idx, num)
    with pytest.raises(InputError, match="kv_indices: expected an integer tensor"):
        BlockMask.from_kv_blocks(num, idx.float())
    with pytest.raises(InputError, match=r"one count per row"):
        BlockMask.from_kv_blocks(num[..., :1], idx)
    with pytest.raises(InputError, match="BLOCK_SIZE"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=100)


def test_from_kv_blocks_refuses_blocks_past_the_keys():
    """The kernels trust the entries each row counts (at lengths that are multiples of the
    blocks they read keys and the mods' captured tensors without bounds checks): an entry
    naming a block past the keys, or a count past a row's entries, is refused; the padding
    after a row's count is never read, whatever it holds."""
    num = torch.tensor([[[2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 2, 99], [1, -5, 7]]]], dtype=torch.int32)
    assert BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16).seq_lengths == (32, 48)
    with pytest.raises(InputError, match=r"kv_indices: expected blocks 0 \.\. 1 among each row's first "
                                         r"kv_num_blocks entries"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(32, 20))
    with pytest.raises(InputError, match=r"kv_indices: expected blocks 0 \.\. 2"):
        BlockMask.from_kv_blocks(num, torch.tensor([[[[0, 3, 1], [1, 0, 0]]]], dtype=torch.int32),
                                 BLOCK_SIZE=16)
    with pytest.raises(InputError, match="kv_num_blocks: expected counts from 0 to the rows' 3 entries"):
        BlockMask.from_kv_blocks(torch.tensor([[[4, 1]]], dtype=torch.int32), idx, BLOCK_SIZE=16)
    with pytest.raises(InputError, match=r"full_kv_indices: expected blocks 0 \.\. 2"):
        BlockMask.from_kv_blocks(num, idx, num, torch.tensor([[[[0, -1, 0], [2, 0, 0]]]], dtype=torch.int32),
                                 BLOCK_SIZE=16)
    # A mask's own slices and crops are not checked again (no device sync: the decode step's
    # slice runs inside a captured CUDA graph).
    mask = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16)
    assert mask[:, :, 1].kv_num_blocks.tolist() == [[[1]]] and mask._adjust(16, 16).seq_lengths == (16, 16)


# ---------------------------------------------------------------------------------- indexing

INDICES = [0, -1, (1, 2), (slice(None), slice(None), 2), (slice(0, 2), slice(1, 3)),
           (slice(None), slice(None), torch.tensor([1, 4])), (slice(None), slice(None, None, 2)),
           (1, slice(None), slice(3, None))]


@pytest.mark.parametrize("index", INDICES, ids=[repr(i) for i in INDICES])
def test_getitem_matches_torch(index):
    ours, theirs = create_block_mask(per_head_window, 2, 3, 160, 96, device=CPU, BLOCK_SIZE=32), \
        torch_mask(per_head_window, 2, 3, 160, 96)
    mine, torch_slice = ours[index], theirs[index]
    assert_lists_equal(mine, torch_slice)
    assert mine.seq_lengths == torch_slice.seq_lengths and mine.BLOCK_SIZE == torch_slice.BLOCK_SIZE
    assert mine.shape == torch_slice.shape
    assert torch_compat.is_sliced_placeholder(mine.mask_mod)


def test_getitem_differences_from_torch_are_errors_or_kept_dims():
    bm = create_block_mask(causal, 2, None, 96, 96, device=CPU, BLOCK_SIZE=32)
    # a 0-d index keeps its dim like an int (torch drops it, leaving lists no kernel reads)
    assert_lists_equal(bm[:, :, torch.tensor(2)], bm[:, :, 2])
    with pytest.raises(InputError, match="batch index from -2 to 1"):
        bm[2]
    with pytest.raises(InputError, match="head index from -1 to 0"):
        bm[0, 1]                                  # H=None: one head
    with pytest.raises(InputError, match="ints, slices or integer tensors"):
        bm[..., 0]
    with pytest.raises(InputError, match="at most 3 indices"):
        bm[0, 0, 0, 0]


def test_sliced_mask_mod_must_be_assigned():
    bm = create_block_mask(causal, None, None, 96, 96, device=CPU, BLOCK_SIZE=32)
    q, k, v = make_qkv(1, 2, 1, 16, Lkv=96)
    for sliced in (bm[:, :, 1], torch_mask(causal, None, None, 96, 96)[:, :, 1]):
        sliced.seq_lengths = (1, 96)
        with pytest.raises(InputError, match=r"assign one built from the ORIGINAL mask's mod"):
            flex_attention(q, k, v, block_mask=sliced)
    with pytest.raises(InputError, match="mask_mod assigned after slicing"):
        bm[0].mask_mod(0, 0, 0, 0)


# ---------------------------------------------------------------------------------- decoding

def offset_mod(mod, offset):
    def shifted(b, h, q_idx, kv_idx):
        return mod(b, h, q_idx + offset, kv_idx)
    return shifted


@pytest.mark.parametrize("torch_built", [False, True])
def test_decode_pattern(torch_built):
    """torch's decode loop: slice the query block of the position, give the slice an offset
    mod and seq_lengths (1, L), attend one query to the whole cache (odd L, GQA; the
    offset a captured 0-d tensor as in gpt-fast, or an int)."""
    L, B = 203, 2
    base = sliding_window(50) if not torch_built else causal
    bm = torch_mask(base, None, None, L, L) if torch_built else \
        create_block_mask(base, None, None, L, L, device=CPU, BLOCK_SIZE=32)
    _, k, v = make_qkv(B, 2, L, 16)
    for pos in (0, 63, 64, 202):
        q = torch.randn(B, 4, 1, 16)
        offset = torch.tensor(pos) if pos != 63 else pos
        mask = bm[:, :, pos // bm.BLOCK_SIZE[0]]
        mask.mask_mod = offset_mod(bm.mask_mod, offset)
        mask.seq_lengths = (1, L)
        oracle_check(q, k, v, mask, mask.mask_mod, enable_gqa=True)
        if not torch_built:
            out = decode_attention(q, k, v, block_mask=mask, enable_gqa=True, q_offsets=0)
            ref = flex_attention_reference(q, k, v, mask_mod=mask.mask_mod, enable_gqa=True)
            check(out, ref, q.dtype)
    with pytest.raises(InputError, match="pass q_offsets=0"):
        decode_attention(q, k, v, block_mask=mask, enable_gqa=True)


def test_decode_step_compiles_once():
    """gpt-fast's compiled decode step (the position a tensor): one graph for every step."""
    L = 203
    bm = create_block_mask(causal, None, None, L, L, device=CPU, BLOCK_SIZE=32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def step(q, k, v, input_pos):
        mask = bm[:, :, input_pos // bm.BLOCK_SIZE[0]]
        mask.mask_mod = offset_mod(bm.mask_mod, input_pos[0])
        mask.seq_lengths = (1, L)
        return flex_attention(q, k, v, block_mask=mask)

    torch._dynamo.reset()
    _, k, v = make_qkv(2, 2, L, 16)
    for pos in (5, 100, 202):
        q = torch.randn(2, 2, 1, 16)
        ref = flex_attention_reference(q, k, v, mask_mod=offset_mod(causal, pos))
        check(step(q, k, v, torch.tensor([pos])), ref, q.dtype)
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------- _adjust

def test_adjust_crops_like_torch_and_errors_like_torch():
    ours, theirs = create_block_mask(causal, 2, 1, 200, 200, device=CPU, BLOCK_SIZE=32), \
        torch_mask(causal, 2, 1, 200, 200)
    small, torch_small = ours._adjust(100, 101), theirs._adjust(100, 101)
    assert_lists_equal(small, torch_small)
    assert small.seq_lengths == (100, 101) and small.mask_mod is causal
    # torch 2.13 keeps the lengths asked for (2.11 rounds them up to whole blocks)
    assert torch_small.seq_lengths in ((100, 101), (128, 128))

    q, k, v = make_qkv(2, 2, 100, 16, Lkv=101)
    for mask, Lq, Lkv in ((ours, 100, 101), (theirs, 100, 101)):
        with pytest.raises(InputError, match=r"_adjust\(q_len, kv_len\)"):
            flex_attention(q, k, v, block_mask=mask)
    with pytest.raises(ValueError, match=r"_adjust\(q_len, kv_len\)"):      # torch's own
        tfa.flex_attention(q, k, v, block_mask=theirs)
    longer = make_qkv(2, 2, 230, 16)
    with pytest.raises(InputError, match="create_block_mask") as info:
        flex_attention(*longer, block_mask=ours)
    assert "_adjust" not in str(info.value)
    with pytest.raises(ValueError, match="create a new block mask"):
        tfa.flex_attention(*longer, block_mask=theirs)
    oracle_check(q, k, v, small, causal)


def test_adjust_non_square_crop_keeps_only_blocks_inside():
    """Cropping a causal 256 x 256 mask to 256 x 128 (torch 2.13's _adjust indexes past the
    crop here): the upper-left blocks of every state, and the right attention."""
    bm = create_block_mask(causal, None, None, 256, 256, device=CPU, BLOCK_SIZE=64)
    crop = bm._adjust(256, 128)
    assert torch.equal(crop.block_states(), bm.block_states()[..., :2])
    assert crop.kv_indices.shape[-1] == 2 and (crop.kv_indices < 2).all()
    q, k, v = make_qkv(1, 2, 256, 16, Lkv=128)
    oracle_check(q, k, v, crop, causal)
    with pytest.raises(InputError, match="_adjust crops"):
        bm._adjust(300, 100)


# ---------------------------------------------------------------------------------- pytree

def test_pytree_flatten_unflatten_and_tree_map():
    bm = create_block_mask(causal, 2, 1, 67, 131, device=CPU, BLOCK_SIZE=32)
    leaves, spec = pytree.tree_flatten(bm)
    assert len(leaves) == 8 and all(isinstance(t, torch.Tensor) for t in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, BlockMask) and back.mask_mod is causal
    assert back.seq_lengths == (67, 131) and back.BLOCK_SIZE == (32, 32)
    copied = pytree.tree_map(torch.clone, bm)
    assert_lists_equal(copied, bm)
    assert copied.kv_indices.data_ptr() != bm.kv_indices.data_ptr()
    # equal specs for the same shapes and mod; a mask without q lists has four leaves
    assert pytree.tree_flatten(create_block_mask(causal, 2, 1, 67, 131, device=CPU, BLOCK_SIZE=32))[1] == spec
    assert pytree.tree_flatten(create_block_mask(per_head_window, 2, 1, 67, 131, device=CPU,
                                                 BLOCK_SIZE=32))[1] != spec
    no_q = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, compute_q_blocks=False)
    assert len(pytree.tree_leaves(no_q)) == 4 and pytree.tree_map(torch.clone, no_q).q_indices is None


def test_compile_takes_a_mask_argument_without_recompiling():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def attend(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask)

    torch._dynamo.reset()
    q, k, v = make_qkv(1, 2, 67, 16)
    window = sliding_window(20)
    for _ in range(2):                      # a new mask of the same shapes and mod each time
        bm = create_block_mask(window, 1, 1, 67, 67, device=CPU, BLOCK_SIZE=32)
        ref = flex_attention_reference(q, k, v, mask_mod=window)
        check(attend(q, k, v, bm), ref, q.dtype)
    assert counter.frame_count == 1


def test_api_runs_under_compile_fullgraph():
    """Each addition traces without a graph break (as torch's do), and computes what it
    computes eagerly."""
    bm = create_block_mask(per_head_window, 2, 3, 67, 131, device=CPU, BLOCK_SIZE=32)
    lut = torch.rand(67, 131) > 0.5
    cases = {
        "slice": (lambda m: m[:, 1:, 2], bm),
        "adjust": (lambda m: m._adjust(40, 100), bm),
        "from_kv": (lambda n, i: BlockMask.from_kv_blocks(n, i, BLOCK_SIZE=32), bm.kv_num_blocks,
                    bm.kv_indices),
        "no_full": (lambda: create_block_mask(causal, 1, 1, 67, 67, device=CPU, BLOCK_SIZE=32,
                                              separate_full_blocks=False),),
        "create_mask": (lambda: create_mask(lambda b, h, q, kv: lut[q][kv], 1, 2, 67, 131, device=CPU),),
    }
    for name, (fn, *args) in cases.items():
        torch._dynamo.reset()
        got, want = torch.compile(fn, fullgraph=True, backend="eager")(*args), fn(*args)
        if isinstance(want, BlockMask):
            assert_lists_equal(got, want)
            assert got.seq_lengths == want.seq_lengths, name
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects")
def test_export_with_a_mask_input_and_output(strict):
    """torch.export of a module taking a BlockMask (torch's BlockMask is refused there:
    torch does not register it as a pytree node) and of one returning a sliced mask."""

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, block_mask):
            return flex_attention(q, k, v, block_mask=block_mask), block_mask[:, :, 1]

    q, k, v = make_qkv(1, 2, 67, 16)
    bm = create_block_mask(causal, 1, 1, 67, 67, device=CPU, BLOCK_SIZE=32)
    program = torch.export.export(Attend(), (q, k, v, bm), strict=strict)
    fresh = make_qkv(1, 2, 67, 16)
    out, sliced = program.module()(*fresh, create_block_mask(causal, 1, 1, 67, 67, device=CPU,
                                                             BLOCK_SIZE=32))
    check(out, flex_attention_reference(*fresh, mask_mod=causal), q.dtype)
    assert isinstance(sliced, BlockMask)
    assert_lists_equal(sliced, bm[:, :, 1])


# ---------------------------------------------------------------------------------- create_mask

LUT = torch.rand(37, 53) > 0.5
TAB = torch.randn(3, 37, 53)
BIAS = torch.rand(2, 3, 53) > 0.5
CREATE_MASK_MODS = {
    "causal": causal,
    "captured": lambda b, h, q_idx, kv_idx: BIAS[b, h, kv_idx] | (q_idx == kv_idx),
    "document": document_mask(doc_ids_from_lengths([10, 30, 13])),
    # scalar-only: chained indexing reads LUT[q][kv] per element (broadcast grids cannot)
    "chained_index": lambda b, h, q_idx, kv_idx: LUT[q_idx][kv_idx],
    "where": lambda b, h, q_idx, kv_idx: torch.where(h == 1, q_idx >= kv_idx, q_idx <= kv_idx + 5),
    "torch_noop": tfa.noop_mask,
    "score_inf": lambda s, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, s, -float("inf")),
    "score_table": lambda s, b, h, q_idx, kv_idx: torch.where(TAB[h, q_idx, kv_idx] > 0, s, -float("inf")),
    "score_softcap": lambda s, b, h, q_idx, kv_idx: 30 * torch.tanh(s / 30),
}


@pytest.mark.parametrize("name", list(CREATE_MASK_MODS))
def test_create_mask_matches_torch(name):
    mod = CREATE_MASK_MODS[name]
    ours, theirs = create_mask(mod, 2, 3, 37, 53, device=CPU), tfa.create_mask(mod, 2, 3, 37, 53, device=CPU)
    assert ours.dtype == torch.bool and ours.shape == theirs.shape == (2, 3, 37, 53)
    assert torch.equal(ours, theirs)
    assert create_mask(mod, None, None, 5, 4, device=CPU).shape == (1, 1, 5, 4)


def test_create_mask_errors_and_large_masks_in_chunks(monkeypatch):
    with pytest.raises(TraceError, match="expected it to return a bool.*float32"):
        create_mask(lambda b, h, q, kv: (q - kv).float(), 1, 1, 4, 4, device=CPU)
    with pytest.raises(TraceError, match="expected it to return a bool.*int32"):
        create_mask(lambda b, h, q, kv: q - kv, 1, 1, 4, 4, device=CPU)
    with pytest.raises(TraceError, match="score_mod.*got a bool"):
        create_mask(lambda s, b, h, q, kv: q >= kv, 1, 1, 4, 4, device=CPU)
    with pytest.raises(TraceError, match="4 or 5"):
        create_mask(lambda b, h, q: q, 1, 1, 4, 4, device=CPU)

    def branchy(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return q_idx == q_idx
        return q_idx != q_idx

    with pytest.raises(TraceError, match="branchy.*torch.where"):
        create_mask(branchy, 1, 1, 4, 4, device=CPU)
    # Evaluated a few query rows at a time when large: the same mask
    monkeypatch.setattr(torch_compat, "ROWS_BUDGET", 2 * 3 * 53 * 4)
    mod = CREATE_MASK_MODS["chained_index"]
    assert torch.equal(create_mask(mod, 2, 3, 37, 53, device=CPU), tfa.create_mask(mod, 2, 3, 37, 53, device=CPU))


# ---------------------------------------------------------------------------------- meta

def test_meta_masks_have_torchs_shapes():
    """torch's create_block_mask works on meta (shapes only); so does flexgen's."""
    ours, theirs = create_block_mask(causal, 2, 3, 67, 131, device="meta", BLOCK_SIZE=32), \
        tfa.create_block_mask(causal, 2, 3, 67, 131, device="meta", BLOCK_SIZE=32)
    for name in LIST_NAMES:
        got, want = getattr(ours, name), getattr(theirs, name)
        assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype, name
    assert ours.shape == theirs.shape and "device=meta" in repr(ours)
    assert ours[:, :, 1].kv_indices.shape == theirs[:, :, 1].kv_indices.shape
    with pytest.raises(InputError, match="meta"):
        ours.sparsity()
    assert create_mask(causal, 2, 1, 5, 7, device="meta").shape == (2, 1, 5, 7)
