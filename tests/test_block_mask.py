"""``create_block_mask``: block lists against the dense mask, fields, memory.

The block state of every (batch, head, query block, kv block) is derived
here independently from ``flexgen.reference.dense_mask``: empty when no
position inside the sequence is kept, full when every one is, partial
otherwise. flexgen decides most blocks from sympy interval bounds and the
rest with a generated kernel; both must agree with the dense picture.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils._python_dispatch

import flexgen
from flexgen import BlockMask, and_masks, create_block_mask, create_mask, flex_attention, or_masks
from flexgen import mods as M
from flexgen.reference import dense_mask

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

EMPTY, PARTIAL, FULL = 0, 1, 2


def expected_states(mask_mod, B, H, Q_LEN, KV_LEN, q_block, kv_block):
    """int8 [B, H, NQ, NKV] block states computed from the dense mask."""
    dense = dense_mask(mask_mod, B, H, Q_LEN, KV_LEN).to(torch.int32)
    nq, nkv = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    padded = torch.zeros(B, H, nq * q_block, nkv * kv_block, dtype=torch.int32)
    padded[..., :Q_LEN, :KV_LEN] = dense
    valid = torch.zeros(nq * q_block, nkv * kv_block, dtype=torch.int32)
    valid[:Q_LEN, :KV_LEN] = 1
    kept = padded.view(B, H, nq, q_block, nkv, kv_block).sum((3, 5))
    total = valid.view(nq, q_block, nkv, kv_block).sum((1, 3))
    states = torch.full_like(kept, PARTIAL, dtype=torch.int8)
    states[kept == 0] = EMPTY
    states[kept == total] = FULL
    return states


def lists_from_states(states, value):
    """(count, sorted indices) of the entries equal to ``value`` along the last dim."""
    hit = states == value
    return hit.sum(-1), [[[torch.nonzero(row).flatten().tolist() for row in head] for head in batch]
                         for batch in hit]


def check_lists(num, idx, states, value):
    """A (num_blocks, indices) pair lists exactly the blocks in ``state``, in increasing order."""
    count, expected = lists_from_states(states, value)
    assert num.dtype == torch.int32 and idx.dtype == torch.int32
    assert torch.equal(num.long(), count)
    n = idx.shape[-1]
    assert ((idx >= 0) & (idx < n)).all(), "padding indices must stay in range"
    for b, batch in enumerate(expected):
        for h, head in enumerate(batch):
            for m, row in enumerate(head):
                assert idx[b, h, m, :len(row)].tolist() == row, (b, h, m)


def check_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE):
    mask = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=BLOCK_SIZE)
    qb, kvb = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    Bn, Hn = B or 1, H or 1
    states = expected_states(mask_mod, Bn, Hn, Q_LEN, KV_LEN, qb, kvb)
    nq, nkv = states.shape[-2:]
    assert isinstance(mask, BlockMask)
    assert mask.shape == (Bn, Hn, Q_LEN, KV_LEN)
    assert mask.seq_lengths == (Q_LEN, KV_LEN) and mask.BLOCK_SIZE == (qb, kvb)
    assert mask.mask_mod is mask_mod and mask.device == torch.device("cpu")
    shapes = {
        "kv_num_blocks": (Bn, Hn, nq), "kv_indices": (Bn, Hn, nq, nkv),
        "full_kv_num_blocks": (Bn, Hn, nq), "full_kv_indices": (Bn, Hn, nq, nkv),
        "q_num_blocks": (Bn, Hn, nkv), "q_indices": (Bn, Hn, nkv, nq),
        "full_q_num_blocks": (Bn, Hn, nkv), "full_q_indices": (Bn, Hn, nkv, nq),
    }
    for name, shape in shapes.items():
        assert tuple(getattr(mask, name).shape) == shape, name
    assert torch.equal(mask.block_states(), states), "block states differ from the dense mask"
    check_lists(mask.kv_num_blocks, mask.kv_indices, states, PARTIAL)
    check_lists(mask.full_kv_num_blocks, mask.full_kv_indices, states, FULL)
    # the transposed lists: per kv block, its query blocks
    check_lists(mask.q_num_blocks, mask.q_indices, states.transpose(-1, -2), PARTIAL)
    check_lists(mask.full_q_num_blocks, mask.full_q_indices, states.transpose(-1, -2), FULL)
    assert torch.equal(mask.to_dense(), (states > 0).to(torch.int32))
    # torch's meaning: elements of the [B, H, Q_LEN, KV_LEN] shape not computed, whole blocks
    computed = int((states > 0).sum()) * qb * kvb
    assert mask.sparsity() == pytest.approx(100.0 * (1 - computed / (Bn * Hn * Q_LEN * KV_LEN)))
    return mask


DOC = M.doc_ids_from_lengths([17, 1, 60, 33, 89])            # 200 tokens
DOC_B = torch.stack([M.doc_ids_from_lengths([100, 100]), M.doc_ids_from_lengths([3, 150, 47])])
PREFIX_B = torch.tensor([0, 77], dtype=torch.int32)
BIAS_KEEP = torch.rand(2, 3, 200) > 0.3


def modular(b, h, q_idx, kv_idx):
    return (q_idx % 7) == (kv_idx % 7) | (kv_idx // 50 == q_idx // 50)


def dilated(b, h, q_idx, kv_idx):
    return ((q_idx - kv_idx) % (h + 2) == 0) & (kv_idx <= q_idx)


def per_head_window(b, h, q_idx, kv_idx):
    return abs(q_idx - kv_idx) <= 8 + 40 * h - 10 * b


def captured_bool(b, h, q_idx, kv_idx):
    return BIAS_KEEP[b, h, kv_idx] | (q_idx == kv_idx)


def constant_rows(b, h, q_idx, kv_idx):
    # Constant indices (decided on the host by flexgen.masks.bounds) next to a position.
    return BIAS_KEEP[1, 2, kv_idx] & BIAS_KEEP[0, 1, q_idx]


def nothing(b, h, q_idx, kv_idx):
    return q_idx < 0


MASKS = {
    "causal": (M.causal_mask, None, None),
    "sliding_window": (M.sliding_window(23), None, None),
    "two_sided_window": (M.sliding_window(30, causal=False), None, None),
    "prefix_lm": (M.prefix_lm(41), None, None),
    "prefix_lm_per_batch": (M.prefix_lm(PREFIX_B), 2, None),
    "document": (M.document_mask(DOC), None, None),
    "document_per_batch": (M.document_mask(DOC_B), 2, None),
    "causal_and_document": (and_masks(M.causal_mask, M.document_mask(DOC)), None, None),
    "window_or_sink": (or_masks(M.sliding_window(16), lambda b, h, q_idx, kv_idx: kv_idx < 4), None, None),
    "modular": (modular, None, None),
    "dilated_per_head": (dilated, None, 3),
    "per_batch_and_head": (per_head_window, 2, 3),
    "captured_bool": (captured_bool, 2, 3),
    "constant_rows": (constant_rows, None, None),
    "nothing": (nothing, None, None),
    "noop": (flexgen.noop_mask, None, None),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("Q_LEN,KV_LEN,BLOCK_SIZE", [(200, 200, 32), (67, 200, 16), (200, 131, (64, 16))])
def test_block_lists_match_dense_mask(name, Q_LEN, KV_LEN, BLOCK_SIZE):
    mask_mod, B, H = MASKS[name]
    check_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)


@pytest.mark.parametrize("path", ["bounds_first", "every_block", "first_build"])
@pytest.mark.parametrize("name", list(MASKS))
def test_sync_free_classification_matches(name, path, monkeypatch):
    """The GPU's paths (the dense block-mask kernel classifying every undecided block in
    place, no nonzero() and so no host sync; for small grids every block, no bounds; on a
    mask's first build in the process, every block with torch ops; the lists kernel from
    the second build on) give the lists of the CPU's path."""
    import contextlib
    from flexgen.masks import builder
    from flexgen.runtime import launch
    mask_mod, B, H = MASKS[name]
    original = launch.run
    want = create_block_mask(mask_mod, B, H, 200, 131, device="cpu", BLOCK_SIZE=(64, 16))
    monkeypatch.setattr(builder, "SYNC_FREE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(builder, "EVERY_MAX_ELEMENTS", 0 if path == "bounds_first" else 2 ** 28)
    monkeypatch.setattr(builder, "_BUILT", set())
    if path == "first_build":
        def refuse(*args, **kwargs):
            raise AssertionError("a kernel launched on a mask's first build")
        monkeypatch.setattr(launch, "run", refuse)
    with builder.compile_on_first_build() if path == "every_block" else contextlib.nullcontext():
        got = [create_block_mask(mask_mod, B, H, 200, 131, device="cpu", BLOCK_SIZE=(64, 16))]
    if path != "every_block":
        # The second build launches the lists kernel, which the first left to torch ops.
        monkeypatch.setattr(launch, "run", original)
        got.append(create_block_mask(mask_mod, B, H, 200, 131, device="cpu", BLOCK_SIZE=(64, 16)))
    for mask in got:
        for a, b in zip(want.as_tuple(), mask.as_tuple()):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), name


class _InterpretedReplay:
    """A ``launch.Replay`` stand-in for the CPU: launches the recorded inputs again through the
    interpreter with the fresh tensors swapped in by identity, as the driver's replay swaps
    their addresses (or declines, ``declines``)."""

    def __init__(self, run, spec, device, inputs, fresh, declines):
        self.run, self.spec, self.device, self.inputs = run, spec, device, inputs
        self.fresh, self.declines, self.calls = fresh, declines, 0

    def __call__(self, *tensors) -> bool:
        if self.declines():
            return False
        swap = {id(old): new for old, new in zip(self.fresh, tensors)}

        def swapped(value):
            if isinstance(value, (list, tuple)):
                return type(value)(swapped(v) for v in value)
            return swap.get(id(value), value) if isinstance(value, torch.Tensor) else value
        self.run(self.spec, self.device, {k: swapped(v) for k, v in self.inputs.items()})
        self.calls += 1
        return True


def _replaying_launches(monkeypatch, declining=None) -> list:
    """The CPU as a GPU for the builder, its launches run through the interpreter and each one
    asked for a replay giving an ``_InterpretedReplay`` (which declines where its template is
    ``declining``): the list they are appended to."""
    from flexgen.masks import builder
    from flexgen.runtime import launch
    monkeypatch.setattr(builder, "SYNC_FREE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(builder, "_BUILT", set())
    monkeypatch.setattr(builder, "_REPLAYS", {})
    monkeypatch.setattr(builder, "_SEEN", set())
    replays, original = [], launch.run

    def run(spec, device, inputs, replay=(), **kwargs):
        original(spec, device, inputs, **kwargs)
        if replay:
            replays.append(_InterpretedReplay(original, spec, device, inputs, replay,
                                              lambda: spec.template == declining))
            return replays[-1]
        return None
    monkeypatch.setattr(launch, "run", run)
    return replays


def _documents(ids):
    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
    return mask_mod


@pytest.mark.parametrize("decline", [None, "classify", "fill"])
def test_a_repeated_build_replays_its_two_launches(decline, monkeypatch):
    """On a GPU a build that was two launches (every block by the dense kernel, then the lists
    kernel) is made again from their replays: new captured tensors of the same shapes, new
    outputs, nothing else recomputed; a replay that declines falls back to the build's own
    path. The CPU stands in, its replays relaunching through the interpreter."""
    from flexgen.masks import builder
    gen = torch.Generator().manual_seed(3)
    docs = [torch.sort(torch.randint(0, 5, (2, 200), generator=gen), dim=1).values.int() for _ in range(3)]
    assert not torch.equal(docs[1], docs[2])
    want = [create_block_mask(_documents(d), 2, None, 200, 131, device="cpu", BLOCK_SIZE=(64, 16)) for d in docs]
    replays = _replaying_launches(monkeypatch, {"classify": "block_mask", "fill": "block_lists"}.get(decline))
    builds, own_build = [], builder._build
    monkeypatch.setattr(builder, "_build", lambda *a: builds.append(a) or own_build(*a))
    got = [create_block_mask(_documents(d), 2, None, 200, 131, device="cpu", BLOCK_SIZE=(64, 16))
           for d in (docs[0], docs[0], docs[1], docs[2])]
    for a, b in zip(want, got[1:]):
        for x, y in zip(a.as_tuple(), b.as_tuple()):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y)
    # The first build ran torch ops, the second the two kernels (kept), the others replayed them.
    assert [r.spec.template for r in replays[:2]] == ["block_mask", "block_lists"]
    if decline is None:
        assert len(builds) == 2 and [r.calls for r in replays] == [2, 2]
    elif decline == "classify":
        assert len(builds) == 4
    else:
        assert len(builds) == 2 and replays[0].calls == 2


def test_builds_of_new_keys_make_no_replays(monkeypatch):
    """A loop whose every build is new (a decode step's longer cache) keeps no replays and makes
    none: a key's launches are kept from its second build on."""
    from flexgen.masks import builder
    ids = torch.sort(torch.randint(0, 5, (2, 300), generator=torch.Generator().manual_seed(4)), dim=1).values.int()
    replays = _replaying_launches(monkeypatch)
    with builder.compile_on_first_build():       # (the kernels from the first build on)
        for kv_len in (129, 130, 131, 132):
            create_block_mask(_documents(ids), 2, None, 1, kv_len, device="cpu", BLOCK_SIZE=(64, 16))
    assert replays == [] and builder._REPLAYS == {}
    create_block_mask(_documents(ids), 2, None, 1, 132, device="cpu", BLOCK_SIZE=(64, 16))
    assert [r.spec.template for r in replays] == ["block_mask", "block_lists"] and len(builder._REPLAYS) == 1


def test_default_block_size_and_single_block():
    mask = check_mask(M.causal_mask, 1, 1, 67, 67, 128)
    assert mask.BLOCK_SIZE == (128, 128)
    # one ragged block: the diagonal makes it partial
    assert mask.kv_num_blocks.tolist() == [[[1]]] and mask.full_kv_num_blocks.tolist() == [[[0]]]


def test_causal_block_structure():
    mask = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert mask.kv_num_blocks[0, 0].tolist() == [1, 1, 1, 1]          # the diagonal blocks
    assert mask.full_kv_num_blocks[0, 0].tolist() == [0, 1, 2, 3]     # everything below it
    assert mask.kv_indices[0, 0, :, 0].tolist() == [0, 1, 2, 3]
    assert mask.full_kv_indices[0, 0, 3, :3].tolist() == [0, 1, 2]
    assert mask.q_num_blocks[0, 0].tolist() == [1, 1, 1, 1]
    assert mask.full_q_num_blocks[0, 0].tolist() == [3, 2, 1, 0]
    assert mask.sparsity() == pytest.approx(100 * 6 / 16)


def test_repr_and_to_string():
    mask = create_block_mask(M.causal_mask, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    text = repr(mask)
    assert text.startswith("BlockMask(shape=(B=1, H=1, Q_LEN=256, KV_LEN=256)")
    assert "BLOCK_SIZE=(64, 64)" in text and "sparsity=37.50%" in text and "causal_mask" in text
    assert mask.to_string().splitlines() == ["░   ", "█░  ", "██░ ", "███░"]
    big = create_block_mask(M.causal_mask, None, None, 4096, 4096, device="cpu", BLOCK_SIZE=64)
    assert "\n" not in repr(big)     # no picture for large masks, but the header is there
    assert len(big.to_string(max_blocks=8).splitlines()) == 9


def test_to_device_keeps_lists():
    mask = create_block_mask(M.sliding_window(40), 1, 2, 130, 130, device="cpu", BLOCK_SIZE=32)
    moved = mask.to("cpu")
    assert moved.seq_lengths == mask.seq_lengths and moved.BLOCK_SIZE == mask.BLOCK_SIZE
    assert torch.equal(moved.block_states(), mask.block_states())


@pytest.mark.parametrize("name", ["causal", "document_per_batch", "per_batch_and_head", "modular"])
def test_create_mask_is_dense_mask(name):
    mask_mod, B, H = MASKS[name]
    dense = create_mask(mask_mod, B, H, 67, 131, device="cpu")
    assert dense.dtype == torch.bool and dense.shape == (B or 1, H or 1, 67, 131)
    assert torch.equal(dense, dense_mask(mask_mod, B or 1, H or 1, 67, 131))


def test_create_mask_of_score_mod():
    def inf_mask(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx, score, -float("inf"))

    assert torch.equal(create_mask(inf_mask, 1, 1, 20, 20, device="cpu"),
                       create_mask(M.causal_mask, 1, 1, 20, 20, device="cpu"))


def test_partial_blocks_of_a_noop_mask_are_visited():
    """A mask_mod that keeps everything adds no mask code, but the forward and both
    backward kernels still visit its partial blocks (lists from torch or built by hand
    may list blocks as partial under noop_mask)."""
    from flexgen.reference import flex_attention_reference

    states = torch.tensor([[[[1, 0, 2], [0, 1, 1], [2, 2, 0]]]], dtype=torch.int8)
    mask = BlockMask.from_states(states, (16, 16), flexgen.noop_mask, (41, 37))
    visited = states[0, 0] > 0

    def listed(b, h, q_idx, kv_idx):
        return visited[q_idx // 16, kv_idx // 16]

    q, k, v = (torch.randn(1, 1, n, 16, requires_grad=True) for n in (41, 37, 37))
    out = flexgen.flex_attention(q, k, v, block_mask=mask)
    ref = flex_attention_reference(q, k, v, mask_mod=listed)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    d_out = torch.randn(out.shape)
    got = torch.autograd.grad((out * d_out).sum(), (q, k, v))
    want = torch.autograd.grad((ref * d_out.double()).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_create_mask_rejects_a_float_mask_mod_like_every_entry_point():
    """It evaluated the mod with torch and cast floats to bool; create_block_mask refuses them."""
    def signed_distance(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) * 1.0

    for entry in (create_mask, create_block_mask):
        with pytest.raises(flexgen.TraceError, match="mask_mod 'signed_distance'.*return a bool"):
            entry(signed_distance, 1, 1, 8, 8, device="cpu")


def test_new_lengths_reuse_the_mask_kernel(monkeypatch):
    def odd_band(b, h, q_idx, kv_idx):   # needs the element kernel (undecided blocks)
        return ((q_idx + kv_idx) % 5 != 0) & (abs(q_idx - kv_idx) < 30)

    # Undecided blocks go to the kernel, not to torch ops, whatever their number.
    monkeypatch.setattr(flexgen.masks.mask_eval, "TORCH_MAX_ELEMENTS", -1)
    launched = []
    run = flexgen.runtime.launch.run
    monkeypatch.setattr(flexgen.runtime.launch, "run", lambda spec, *a, **k: launched.append(spec.key) or
                        run(spec, *a, **k))
    check_mask(odd_band, None, None, 100, 100, 32)
    n = len(flexgen.codegen.cache._MODULES)
    check_mask(odd_band, None, None, 173, 211, 32)
    assert len(flexgen.codegen.cache._MODULES) == n
    assert len(launched) == 2 and launched[0] == launched[1]


@pytest.mark.parametrize("shape", [(1, 1, 7, 5), (2, 3, 5, 7), (2, 1, 1, 6), (1, 2, 6, 1), (1, 1, 1, 1),
                                   (1, 1, 40, 33)])
def test_lists_layout_and_padding(shape):
    """Every field, padding included, is what a stable sort of "not in this state" gives
    (torch's layout): int32, each list contiguous and 16-byte aligned (the layout the
    ``flexgen::block_mask`` op's output has, fake or real)."""
    states = torch.randint(0, 3, shape, dtype=torch.int8)
    mask = BlockMask.from_states(states, (16, 16), None, (16 * shape[2], 16 * shape[3]))

    def reference(rows, value):
        hit = rows == value
        order = torch.sort((~hit).to(torch.int8), dim=-1, stable=True).indices
        return hit.sum(-1, dtype=torch.int32), order.to(torch.int32).contiguous()

    transposed = states.transpose(-1, -2)
    expected = {"kv": reference(states, PARTIAL), "full_kv": reference(states, FULL),
                "q": reference(transposed, PARTIAL), "full_q": reference(transposed, FULL)}
    for prefix, (num, idx) in expected.items():
        for name, want in ((f"{prefix}_num_blocks", num), (f"{prefix}_indices", idx)):
            got = getattr(mask, name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert got.stride() == want.stride(), (name, got.stride(), want.stride())
            assert torch.equal(got, want), name
            assert got.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned"


def random_hits(shape, gen):
    """int32 [2, *shape] flags, each row at its own density (none, all and between)."""
    density = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0])[torch.randint(0, 5, (2, *shape[:-1], 1), generator=gen)]
    hit = (torch.rand((2, *shape), generator=gen) < density).to(torch.int32)
    if shape[-2] > 2:     # an all-set and an all-clear column too
        hit[0, ..., 0], hit[1, ..., -1] = 1, 0
    return hit


def lists_by_kernel(hit, block=1024):
    """The lists kernel's four stacked lists (``Layout.stacked``) of ``hit``: interpreted on
    the CPU, in chunks of ``block``, into a buffer of -7s (so an unwritten element shows)."""
    from flexgen.masks import builder
    from flexgen.runtime import launch
    lay = builder.layout(*hit.shape[1:])
    out = torch.full((lay.size,), -7, dtype=torch.int32)
    launch.run(builder.lists_spec(), hit.device, dict(hits=hit, out=out, n_kv=lay.n_kv, n_q=lay.n_q,
                                                      n_idx=lay.n_idx, block=block))
    return lay.stacked(out)


@pytest.mark.parametrize("shape,block", [
    ((1, 1, 1, 1), 1024), ((2, 3, 5, 7), 1024), ((1, 2, 13, 1), 1024), ((2, 1, 1, 9), 1024),
    # Lists past one chunk (the default's loop, 1024 lanes a chunk, at small sizes: the
    # interpreter runs a program in ~3 ms, and a list past 1024 needs ~2000 programs).
    ((2, 3, 5, 7), 4), ((1, 2, 21, 35), 16), ((2, 1, 19, 33), 16),
])
def test_lists_kernel_matches_torch_ops(shape, block):
    """The GPU's lists kernel (one launch, ``fill_lists`` there) writes what the CPU's torch
    ops write, counts and padding included, bit for bit: rows of every density, B and H
    above 1, NQ != NKV, lists longer than the chunk the kernel scans them in."""
    from flexgen.masks import builder
    gen = torch.Generator().manual_seed(sum(shape) * block)
    hit = random_hits(shape, gen)
    lay = builder.layout(*shape)
    want = lay.stacked(builder.fill_lists(hit))
    for name, a, b in zip(("kv counts", "q counts", "kv indices", "q indices"), want,
                          lists_by_kernel(hit, block)):
        assert torch.equal(a, b), name


def test_fill_lists_launches_the_lists_kernel_from_the_second_call(monkeypatch):
    """On a GPU (the CPU standing in) the process's first fill_lists uses torch ops (no
    kernel to compile for one mask), every later one launches the lists kernel, one
    spec for every shape; both write the CPU's lists."""
    from flexgen.masks import builder
    from flexgen.runtime import launch
    gen = torch.Generator().manual_seed(0)
    hits = [random_hits(shape, gen) for shape in ((2, 1, 9, 7), (2, 1, 9, 7), (1, 3, 4, 11))]
    want = [builder.fill_lists(h) for h in hits]
    monkeypatch.setattr(builder, "SYNC_FREE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(builder, "_BUILT", set())
    launched, original = [], launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: launched.append(spec.key) or
                        original(spec, *a, **k))
    for i, (h, w) in enumerate(zip(hits, want)):
        lay = builder.layout(*h.shape[1:])
        for a, b in zip(lay.stacked(builder.fill_lists(h)), lay.stacked(w)):
            assert torch.equal(a, b)
        assert launched == [builder.lists_spec().key] * i


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("Q_LEN,KV_LEN,BLOCK_SIZE", [(200, 200, 32), (67, 200, 16), (200, 131, (64, 16))])
def test_flags_decide_what_bounds_decide(name, Q_LEN, KV_LEN, BLOCK_SIZE):
    """bounds.block_flags (what create_block_mask uses) decides what bounds.classify decides."""
    from flexgen.masks import bounds
    from flexgen.frontend.lowering import buffer_map, lower
    from flexgen.frontend.trace import trace

    mask_mod, B, H = MASKS[name]
    Bn, Hn = B or 1, H or 1
    qb, kvb = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    traced = trace(mask_mod, "mask_mod")
    lowered, buffers, cpu = lower(traced), buffer_map(traced), torch.device("cpu")
    states = bounds.classify(lowered.expr, Bn, Hn, Q_LEN, KV_LEN, qb, kvb, buffers, cpu)
    full = torch.empty(states.shape, dtype=torch.int32)
    _, empty = bounds.block_flags(lowered.expr, Bn, Hn, Q_LEN, KV_LEN, qb, kvb, buffers, cpu, out=full)
    assert torch.equal(full.bool(), states == bounds.FULL)
    assert torch.equal(empty.expand(states.shape), states == bounds.EMPTY)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The torch ops a call issues (views and allocations aside: they launch nothing on a GPU)."""

    HOST_ONLY = {"view", "select", "slice", "transpose", "detach", "expand", "unbind", "split", "alias",
                 "permute", "as_strided", "unsqueeze", "empty", "promote_types"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.HOST_ONLY:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# Ops of create_block_mask at 4096 tokens, 128-blocks (2026-11-23; before then 47, 65 and 113,
# and 71 for the document mask while flexgen.masks.bounds checked its b index on the device).
@pytest.mark.parametrize("name,most", [("causal", 27), ("sliding_window", 42), ("document", 37)])
def test_mask_build_op_counts(name, most):
    """A mask built per training step is host-bound on a GPU, where every op is a launch:
    no more ops than these."""
    L = 4096
    mod = {"causal": M.causal_mask, "sliding_window": M.sliding_window(1024),
           "document": M.document_mask(M.doc_ids_from_lengths([1000, 1, 900, 77, 2118])[None])}[name]
    B = 1 if name == "document" else None
    create_block_mask(mod, B, None, L, L, device="cpu")           # traced, lowered, compiled once
    flexgen.masks.builder._LISTS.clear()      # (a mask capturing no tensor would come back built)
    with _CountOps() as counted:
        create_block_mask(mod, B, None, L, L, device="cpu")
    assert len(counted.ops) <= most, counted.ops


def test_a_mask_capturing_no_tensor_is_built_once_per_size(monkeypatch):
    """Its lists are a function of its program and the sizes: a loop that builds it at every
    step gets the same lists back (nothing built), as does another function of the same
    program; other sizes, a mask reading a tensor (whose values may change), or a build under
    a tensor mode (fake tensors planning shapes) are built."""
    from torch._subclasses import FakeTensorMode
    from flexgen.runtime import ops

    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < 100)

    with FakeTensorMode():
        fake = create_block_mask(window, None, None, 300, 300, device="cpu")
    first = create_block_mask(window, None, None, 300, 300, device="cpu")
    assert type(first.kv_indices) is torch.Tensor and type(fake.kv_indices) is not torch.Tensor
    built, build = [], ops.call_block_mask
    monkeypatch.setattr(ops, "call_block_mask", lambda *a: built.append(a) or build(*a))
    again = create_block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 100),
                              None, None, 300, 300, device="cpu")
    assert built == [] and again.kv_indices.data_ptr() == first.kv_indices.data_ptr()
    # the eight tensors themselves (no views made again: transformers builds its mask per step)
    assert all(getattr(again, n) is getattr(first, n) for n in flexgen.masks.block_mask.LIST_NAMES)
    assert again.mask_mod is not first.mask_mod
    other = create_block_mask(window, 2, None, 300, 300, device="cpu")
    assert other.kv_indices.data_ptr() != first.kv_indices.data_ptr()
    check_mask(window, 2, None, 300, 300, 128)
    limit = torch.tensor(100)
    reading = [create_block_mask(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < limit),
                                 None, None, 300, 300, device="cpu") for _ in range(2)]
    assert reading[0].kv_indices.data_ptr() != reading[1].kv_indices.data_ptr()
    flexgen.clear_caches()
    assert create_block_mask(window, None, None, 300, 300, device="cpu").kv_indices.data_ptr() \
        != first.kv_indices.data_ptr()


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, time
    import torch
    from flexgen import create_block_mask
    from flexgen.mods import doc_ids_from_lengths, document_mask

    torch.manual_seed(0)
    L = 32768

    def random_doc_ids(n):
        lengths = []
        while sum(lengths) < n:
            lengths.append(int(torch.randint(1, 3000, ()).item()))
        lengths[-1] -= sum(lengths) - n
        return doc_ids_from_lengths(lengths)

    # warm up: imports, tracing machinery, the block-mask kernel of this mod
    create_block_mask(document_mask(random_doc_ids(300)), None, None, 300, 300, device="cpu")
    ids = random_doc_ids(L)

    def status_kib(field):
        with open("/proc/self/status") as f:
            return int(next(l for l in f if l.startswith(field + ":")).split()[1])

    # ru_maxrss (KiB on Linux) is a high-water mark that the imports have already
    # raised: a build that stays under it would read as zero growth. So the peak
    # (VmHWM) is also reset to the current RSS first, and measured from there.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    rss_before = status_kib("VmRSS")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    mask = create_block_mask(document_mask(ids), None, None, L, L, device="cpu")
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grow_mib = (after - before) / 1024
    peak_mib = (status_kib("VmHWM") - rss_before) / 1024 if reset else grow_mib
    assert tuple(mask.kv_indices.shape) == (1, 1, 256, 256)
    print(f"RESULT growth_mib={grow_mib:.1f} peak_over_current_mib={peak_mib:.1f} "
          f"seconds={seconds:.2f} sparsity={mask.sparsity():.2f}")
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units are Linux's")
def test_large_document_mask_memory(tmp_path):
    """A 32768 x 32768 document mask never materializes the dense mask (1 GiB as bool)."""
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")][-1]
    print(line)
    values = dict(kv.split("=") for kv in line.split()[1:])
    assert float(values["growth_mib"]) < 200, line
    assert float(values["peak_over_current_mib"]) < 200, line
    assert float(values["seconds"]) < 120, line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B,H,Q_LEN,KV_LEN", [(2, None, 1000, 777), (1, 3, 512, 512)])
def test_gpu_mask_builds_replayed_with_new_tensors(B, H, Q_LEN, KV_LEN, monkeypatch):
    """A training loop's mask over new document ids each step: from the third build on (the
    first makes no replay, the second keeps the kernels') the build is the two kernels'
    replays with the step's tensors, without a sync, and gives the CPU's lists."""
    from flexgen.masks import builder
    from flexgen.runtime import launch
    monkeypatch.setattr(launch, "RECORDED", None)     # (the suite records launches: never replayed)
    monkeypatch.setattr(builder, "_REPLAYS", {})
    monkeypatch.setattr(builder, "_SEEN", set())
    builds, own_build = [], builder._build
    monkeypatch.setattr(builder, "_build", lambda *a: builds.append(a) or own_build(*a))
    gen = torch.Generator().manual_seed(B * 7 + Q_LEN)
    steps = [torch.sort(torch.randint(0, 6, (B, max(Q_LEN, KV_LEN)), generator=gen), dim=1).values.int()
             for _ in range(5)]

    def mask_for(ids):
        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx - kv_idx >= h * 8 - 16)
        return mask_mod
    for i, ids in enumerate(steps):
        cuda = ids.cuda()
        if i == 4:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = create_block_mask(mask_for(cuda), B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=(64, 32))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = create_block_mask(mask_for(ids), B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=(64, 32))
        for a, b in zip(got.as_tuple(), want.as_tuple()):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.cpu(), b), (i, H)
    # (The first build launches the kernels at once where a previous process compiled them.)
    assert len([b for b in builds if b[-2].type == "cuda"]) <= 2 and len(builder._REPLAYS) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mask_build_and_attention_do_not_sync():
    """A mask built on the GPU, then attention forward and backward, read nothing back to the
    host (a sync per mask stalled Hugging Face training steps); the lists are the CPU's."""
    q, k, v = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for _ in range(2):      # compile first: the check is about the warm path
        mask = create_block_mask(M.sliding_window(100), None, None, 1000, 1000, device="cuda")
        flex_attention(q, k, v, block_mask=mask).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mask = create_block_mask(M.sliding_window(100), None, None, 1000, 1000, device="cuda")
        flex_attention(q, k, v, block_mask=mask).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = create_block_mask(M.sliding_window(100), None, None, 1000, 1000, device="cpu")
    for a, b in zip(mask.as_tuple(), want.as_tuple()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["sliding_window", "document"])
def test_gpu_first_mask_build_compiles_nothing_and_does_not_sync(name, monkeypatch):
    """A process's first build of a mask on the GPU classifies its blocks and fills its lists
    with torch ops: no kernel launched (none to compile), nothing read back to the host; the
    second build launches the block-mask kernel and the lists kernel. A first build whose
    kernels need no compile (``launch.ready``) launches them, reading nothing back either.
    All give the CPU's lists."""
    from flexgen.masks import builder
    from flexgen.runtime import launch
    ids = M.doc_ids_from_lengths([300, 1, 450, 249])

    def mod_on(device):
        return M.sliding_window(101) if name == "sliding_window" else M.document_mask(ids.to(device))

    mod = mod_on("cuda")
    with builder.compile_on_first_build():      # traced and lowered first (the check is the build's)
        create_block_mask(mod, None, None, 1000, 1000, device="cuda")
    monkeypatch.setattr(builder, "_BUILT", set())
    # (a mask capturing no tensor, the window, would come back from the lists' memo unbuilt)
    monkeypatch.setattr(builder, "_LISTS", {})
    launched, original = [], launch.run
    monkeypatch.setattr(launch, "run", lambda spec, *a, **k: launched.append(spec.template) or
                        original(spec, *a, **k))
    real_ready = launch.ready
    monkeypatch.setattr(launch, "ready", lambda *a: False)     # as in a process with no kernels

    def synced_build():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return create_block_mask(mod, None, None, 1000, 1000, device="cuda")
        finally:
            torch.cuda.set_sync_debug_mode(0)

    first = synced_build()
    assert launched == []
    builder._LISTS.clear()
    second = create_block_mask(mod, None, None, 1000, 1000, device="cuda")
    assert launched == ["block_mask", "block_lists"]
    monkeypatch.setattr(launch, "ready", real_ready)            # the kernels are loaded now
    monkeypatch.setattr(builder, "_BUILT", set())
    builder._LISTS.clear()
    third = synced_build()
    assert launched == ["block_mask", "block_lists"] * 2
    want = create_block_mask(mod_on("cpu"), None, None, 1000, 1000, device="cpu")
    for a, b, c, d in zip(first.as_tuple(), second.as_tuple(), third.as_tuple(), want.as_tuple()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.cpu(), d) and torch.equal(b.cpu(), d) and torch.equal(c.cpu(), d)
