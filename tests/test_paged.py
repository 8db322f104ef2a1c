"""flexgen.kernels.paged.PagedKVCache: writing, page bookkeeping and attention through page tables.

CPU, Triton interpreter. Free pages are shuffled before use, so every page
table is non-contiguous and out of order. Attention outputs are poisoned
with NaN before each launch (FLEXGEN_POISON=1) and compared element by
element with ``flex_attention_reference`` (float64) on the same keys and
values gathered into contiguous tensors, with the mods seeing the same
logical positions (``q_idx = length - q_len + i``). The cached keys and values
themselves are compared with what was appended. The last test compiles every
kernel these tests launched for sm_90.
"""
from __future__ import annotations

import os

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flexgen import create_block_mask  # noqa: E402
from flexgen.errors import FlexgenError, InputError  # noqa: E402
from flexgen.mods import alibi, causal_mask, sliding_window, tanh_softcap  # noqa: E402
from flexgen.kernels.paged import CacheFullError, PagedKVCache  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402
from conftest import assert_module_launches_compile  # noqa: E402

def make_cache(page_size, num_pages=64, Hkv=2, D=32, max_batch=4, max_pages=None, dtype=torch.float32,
               seed=0, v_head_dim=None):
    cache = PagedKVCache(num_pages=num_pages, page_size=page_size, num_kv_heads=Hkv, head_dim=D,
                         max_batch=max_batch, max_pages_per_seq=max_pages or num_pages, dtype=dtype,
                         device="cpu", v_head_dim=v_head_dim)
    random.Random(seed).shuffle(cache._free_pages)    # pages handed out in a scrambled order
    return cache


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Tracker:
    """What was appended per slot, to check the cache's content and build the oracle's inputs."""

    def __init__(self, cache):
        self.cache, self.k, self.v = cache, {}, {}

    def append(self, slots, k, v, counts=None):
        self.cache.append(slots, k, v, counts=counts)
        for b, s in enumerate(slots):
            n = k.shape[2] if counts is None else counts[b]
            self.k[s] = torch.cat([self.k.get(s, k[b, :, :0]), k[b, :, :n]], 1)
            self.v[s] = torch.cat([self.v.get(s, v[b, :, :0]), v[b, :, :n]], 1)

    def check_content(self, slots):
        for s in slots:
            k, v = self.cache.gather(s)
            assert torch.equal(k, self.k[s].to(self.cache.dtype)), f"slot {s}: cached keys differ"
            assert torch.equal(v, self.v[s].to(self.cache.dtype)), f"slot {s}: cached values differ"
            pages = self.cache.pages(s)
            assert len(pages) == -(-self.k[s].shape[1] // self.cache.page_size)


def shifted(mod, b0, q0, kind):
    if mod is None:
        return None
    if kind == "score":
        return lambda s, b, h, q, kv: mod(s, b + b0, h, q + q0, kv)
    return lambda b, h, q, kv: mod(b + b0, h, q + q0, kv)


def reference(cache, slots, q, score_mod=None, mask_mod=None, q_lengths=None):
    """(out, lse) in float64 from each slot's gathered keys; the queries are its last tokens."""
    B, Hq, Lq, _ = q.shape
    out = torch.zeros(B, Hq, Lq, cache.v_head_dim, dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), -math.inf, dtype=torch.float64)
    for b, s in enumerate(slots):
        k, v = cache.gather(s)
        n = k.shape[1]
        ql = Lq if q_lengths is None else q_lengths[b]
        if ql == 0:
            continue
        o, l_ = flex_attention_reference(
            q[b:b + 1, :, :ql], k[None], v[None], score_mod=shifted(score_mod, b, n - ql, "score"),
            mask_mod=shifted(mask_mod, b, n - ql, "mask"), enable_gqa=True, return_lse=True,
            dtype=torch.float64)
        out[b, :, :ql], lse[b, :, :ql] = o[0], l_[0]
    return out, lse


def assert_matches(got, want, tol=1e-5):
    out, lse = got
    assert not out.isnan().any() and not lse.isnan().any(), "an element was never written"
    torch.testing.assert_close(out.double(), want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want[1], rtol=1e-4, atol=1e-4)


# (page size, GQA group, score_mod, mask, mask given as a logical BlockMask)
PAGED_CASES = [
    (16, 4, alibi(8), causal_mask, False),
    (16, 8, tanh_softcap(3.0), causal_mask, True),
    (64, 8, tanh_softcap(2.0), sliding_window(48), True),
    (64, 1, None, sliding_window(30), False),
    (128, 4, alibi(8), sliding_window(70), True),
    (128, 1, tanh_softcap(4.0), causal_mask, False),
]


@pytest.mark.parametrize("page_size,group,score_mod,mask_mod,as_block_mask", PAGED_CASES,
                         ids=[f"page{p}-gqa{g}-{getattr(s, '__name__', 'none')}-{m.__name__}-"
                              f"{'blockmask' if bm else 'maskmod'}" for p, g, s, m, bm in PAGED_CASES])
def test_prefill_then_decode(page_size, group, score_mod, mask_mod, as_block_mask):
    """A padded batch of prompts of mixed lengths, then decode steps that cross page boundaries."""
    Hkv, D = 2, 32
    Hq = Hkv * group
    cache = make_cache(page_size, num_pages=3 * -(-260 // page_size) + 2, seed=page_size + group)
    track = Tracker(cache)
    slots = [cache.add_sequence() for _ in range(3)]
    lengths = [page_size + 1, 37, 1] if page_size < 128 else [200, 128, 1]
    L = max(lengths)
    seed = 10 * page_size + group
    track.append(slots, randn(3, Hkv, L, D, seed=seed), randn(3, Hkv, L, D, seed=seed + 1), counts=lengths)
    track.check_content(slots)
    mods = dict(score_mod=score_mod)
    if as_block_mask:
        mods["block_mask"] = cache.block_mask(mask_mod, BLOCK_SIZE=(32, 64))
    else:
        mods["mask_mod"] = mask_mod
    q = randn(3, Hq, L, D, seed=seed + 2)
    got = cache.attention(q, slots, return_lse=True, q_lengths=lengths, **mods)
    assert_matches(got, reference(cache, slots, q, score_mod, mask_mod, q_lengths=lengths))

    # Decode: steps of 1 and 2 tokens; slot order reversed (the table rows are gathered).
    order = slots[::-1]
    for step, n_new in enumerate((1, 2, 1)):
        s = seed + 10 + step
        track.append(order, randn(3, Hkv, n_new, D, seed=s), randn(3, Hkv, n_new, D, seed=s + 100))
        q = randn(3, Hq, n_new, D, seed=s + 200)
        got = cache.attention(q, order, return_lse=True, **mods)
        assert_matches(got, reference(cache, order, q, score_mod, mask_mod))
    track.check_content(slots)


def test_chunked_prefill_attends_to_the_cached_prefix():
    """A prompt in chunks of 40, 30 (> 16 queries) and 5 tokens: each chunk sees the prefix and itself."""
    Hkv, Hq, D = 2, 8, 32
    cache = make_cache(16, num_pages=16, seed=3)
    slot = cache.add_sequence()
    full_k, full_v, full_q = (randn(1, n, 75, D, seed=i) for i, n in enumerate((Hkv, Hkv, Hq)))
    block_mask = cache.block_mask(causal_mask, BLOCK_SIZE=16)
    start = 0
    for chunk in (40, 30, 5):
        end = start + chunk
        cache.append([slot], full_k[:, :, start:end], full_v[:, :, start:end])
        got = cache.attention(full_q[:, :, start:end], [slot], score_mod=tanh_softcap(5.0),
                              block_mask=block_mask, return_lse=True)
        want_out, want_lse = flex_attention_reference(
            full_q[:, :, :end], full_k[:, :, :end], full_v[:, :, :end], tanh_softcap(5.0), causal_mask,
            enable_gqa=True, return_lse=True, dtype=torch.float64)
        assert_matches(got, (want_out[:, :, start:end], want_lse[:, :, start:end]))
        start = end
    assert cache.length(slot) == 75 and len(cache.pages(slot)) == 5


@pytest.mark.parametrize("with_block_mask", [False, True])
def test_mixed_step_packed_equals_separate_calls(with_block_mask):
    """One packed step in which slots decode a token, prefill a chunk after their prefix, start
    a prompt, or sit out (0 rows): the same rows as one call per slot."""
    Hkv, Hq, D = 2, 4, 32
    cache = make_cache(8, num_pages=32, max_pages=8, seed=5)
    slots = [cache.add_sequence() for _ in range(4)]
    for i, (s, n) in enumerate(zip(slots, (20, 9, 0, 13))):
        if n:
            cache.append([s], randn(1, Hkv, n, D, seed=10 + i), randn(1, Hkv, n, D, seed=20 + i))
    new = [1, 7, 5, 0]
    cache.append(slots, randn(4, Hkv, 7, D, seed=30), randn(4, Hkv, 7, D, seed=31), counts=new)
    q = randn(sum(new), Hq, D, seed=32)
    bias = randn(4, seed=33)

    def per_slot(score, b, h, q_idx, kv_idx):
        return score + bias[b]

    mask = dict(block_mask=cache.block_mask(causal_mask, BLOCK_SIZE=16)) if with_block_mask else \
        dict(mask_mod=causal_mask)
    out, lse = cache.attention(q, slots, score_mod=per_slot, q_lengths=new, return_lse=True, **mask)
    assert out.shape == (13, Hq, D) and lse.shape == (Hq, 13)
    start = 0
    for b, (s, n) in enumerate(zip(slots, new)):
        if n:
            bias_b = bias[b:b + 1]

            def one(score, b_, h, q_idx, kv_idx):
                return score + bias_b[b_]

            want, want_lse = cache.attention(q[start:start + n].transpose(0, 1)[None], [s], score_mod=one,
                                             return_lse=True, **mask)
            # (a separate call may split its keys: sums in another order)
            torch.testing.assert_close(out[start:start + n], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[:, start:start + n], want_lse[0], atol=1e-5, rtol=1e-5)
        start += n
    with pytest.raises(InputError, match="q_lengths.*summing"):
        cache.attention(q, slots, q_lengths=[1, 7, 5, 1], mask_mod=causal_mask)


def test_appending_across_page_boundaries():
    cache = make_cache(16, num_pages=12, seed=4)
    track = Tracker(cache)
    a, b = cache.add_sequence(), cache.add_sequence()
    for i, (na, nb) in enumerate([(15, 3), (1, 13), (1, 0), (16, 17), (17, 1), (3, 30)]):
        L = max(na, nb)
        track.append([a, b], randn(2, 2, L, 32, seed=i), randn(2, 2, L, 32, seed=i + 50), counts=[na, nb])
        track.check_content([a, b])
    assert (cache.length(a), cache.length(b)) == (53, 64)
    assert not set(cache.pages(a)) & set(cache.pages(b))
    assert cache.num_free_pages == 12 - 4 - 4
    assert cache.lengths.tolist()[:2] == [53, 64]


def test_free_reuse_and_full_cache():
    """A full cache raises CacheFullError and changes nothing; freed pages serve a new sequence."""
    Hkv, Hq, D = 2, 4, 32
    cache = make_cache(16, num_pages=6, max_batch=2, seed=5)
    track = Tracker(cache)
    a, b = cache.add_sequence(), cache.add_sequence()
    track.append([a, b], randn(2, Hkv, 48, D, seed=1), randn(2, Hkv, 48, D, seed=2))   # 3 pages each
    assert cache.num_free_pages == 0
    with pytest.raises(CacheFullError, match="free pages"):
        cache.append([a], randn(1, Hkv, 1, D, seed=3), randn(1, Hkv, 1, D, seed=4))
    with pytest.raises(CacheFullError, match="slot"):
        cache.add_sequence()
    assert isinstance(CacheFullError("x"), FlexgenError)
    assert cache.length(a) == 48 and len(cache.pages(a)) == 3         # nothing changed
    old_pages = set(cache.pages(a))
    cache.free(a)
    assert cache.num_free_pages == 3
    c = cache.add_sequence()
    track.k.pop(a), track.v.pop(a)
    track.append([c], randn(1, Hkv, 30, D, seed=5), randn(1, Hkv, 30, D, seed=6))
    assert set(cache.pages(c)) < old_pages                              # freed pages, reused
    track.check_content([b, c])
    q = randn(2, Hq, 3, D, seed=7)
    got = cache.attention(q, [c, b], mask_mod=causal_mask, return_lse=True)
    assert_matches(got, reference(cache, [c, b], q, None, causal_mask))
    # all or nothing: b and c need a page each; the one free page is not enough for both
    with pytest.raises(CacheFullError):
        cache.append([b, c], randn(2, Hkv, 17, D, seed=8), randn(2, Hkv, 17, D, seed=9), counts=[1, 17])
    assert cache.num_free_pages == 1 and cache.length(b) == 48 and cache.length(c) == 30


def test_page_table_grows_in_place_between_steps():
    """Slots 0 .. B-1 read the table through views kept between calls: pages appended in
    place (every 16 tokens here) are seen, and so is a table the user reassigns."""
    Hkv, Hq, D = 2, 4, 32
    cache = make_cache(16, num_pages=24, max_batch=2, seed=7)
    track = Tracker(cache)
    slots = [cache.add_sequence(), cache.add_sequence()]
    assert slots == [0, 1]
    track.append(slots, randn(2, Hkv, 14, D, seed=1), randn(2, Hkv, 14, D, seed=2), counts=[14, 9])
    block_mask = cache.block_mask(causal_mask, BLOCK_SIZE=16)
    for step in range(7):                          # 14 -> 21 and 9 -> 16 tokens: new pages
        if step == 4:
            cache.page_table = cache.page_table.clone()   # a new table object: views are renewed
        track.append(slots, randn(2, Hkv, 1, D, seed=10 + step), randn(2, Hkv, 1, D, seed=30 + step))
        q = randn(2, Hq, 1, D, seed=50 + step)
        for mods in (dict(block_mask=block_mask), dict(mask_mod=causal_mask, score_mod=alibi(Hq))):
            got = cache.attention(q, slots, return_lse=True, **mods)
            assert_matches(got, reference(cache, slots, q, mods.get("score_mod"), causal_mask))
    assert [cache.length(s) for s in slots] == [21, 16] and len(cache.pages(0)) == 2


def test_user_page_table_changed_in_place():
    """decode_attention on a caller's int64 page table: converted on every call, never cached,
    so pages moved (and the table rewritten in place) between two calls are followed."""
    from flexgen.api import decode_attention
    Hkv, Hq, D = 2, 4, 32
    cache = make_cache(16, num_pages=12, max_batch=2, seed=8)
    track = Tracker(cache)
    slots = [cache.add_sequence(), cache.add_sequence()]
    track.append(slots, randn(2, Hkv, 40, D, seed=1), randn(2, Hkv, 40, D, seed=2), counts=[40, 23])
    q = randn(2, Hq, 1, D, seed=3)
    want = reference(cache, slots, q, tanh_softcap(3.0), causal_mask)
    table = cache.page_table[:2].long()
    lengths = torch.tensor([40, 23], dtype=torch.int32)

    def run():
        return decode_attention(q, cache.k_cache, cache.v_cache, score_mod=tanh_softcap(3.0),
                                mask_mod=causal_mask, enable_gqa=True, return_lse=True,
                                kv_lengths=lengths, page_table=table)
    assert_matches(run(), want)
    # Move slot 0's first page to a free page, in place in the table and the caches.
    old, new = int(table[0, 0]), cache._free_pages[-1]
    for c in (cache.k_cache, cache.v_cache):
        c[new] = c[old]
        c[old] = 0
    table[0, 0] = new
    assert_matches(run(), want)


def test_decode_step_reads_nothing_back(monkeypatch):
    """append + attention on a warm cache never read a tensor back to the host (a GPU sync)."""
    from flexgen.runtime import launch
    Hkv, Hq, D = 2, 4, 32
    cache = make_cache(16, num_pages=16, max_batch=3, seed=9)
    slots = [cache.add_sequence() for _ in range(3)]
    cache.append(slots, randn(3, Hkv, 14, D, seed=1), randn(3, Hkv, 14, D, seed=2), counts=[14, 3, 8])
    block_mask = cache.block_mask(causal_mask, BLOCK_SIZE=16)
    k1, v1, q = randn(3, Hkv, 1, D, seed=3), randn(3, Hkv, 1, D, seed=4), randn(3, Hq, 1, D, seed=5)
    for order in (slots, slots[::-1]):            # warm: the mask's visit lists are built once
        cache.attention(q, order, score_mod=tanh_softcap(3.0), block_mask=block_mask)

    def read_back(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")
    monkeypatch.setattr(launch, "run", lambda *args, **kwargs: None)
    for name in ("item", "tolist", "__int__", "__index__", "__bool__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read_back)
    for _ in range(4):                             # crosses a page boundary (14 -> 18 tokens)
        for order in (slots, slots[::-1]):
            cache.append(order, k1, v1)
            cache.attention(q, order, score_mod=tanh_softcap(3.0), block_mask=block_mask)
            cache.attention(q, order, mask_mod=causal_mask)


def test_half_precision_cache():
    """float32 inputs written into a bfloat16 cache (rounded as torch rounds), Dv != D."""
    Hkv, Hq, D, Dv = 2, 8, 32, 16
    cache = make_cache(64, num_pages=8, dtype=torch.bfloat16, seed=6, v_head_dim=Dv)
    track = Tracker(cache)
    slots = [cache.add_sequence(), cache.add_sequence()]
    track.append(slots, randn(2, Hkv, 70, D, seed=1), randn(2, Hkv, 70, Dv, seed=2), counts=[70, 9])
    track.check_content(slots)
    q = randn(2, Hq, 1, D, seed=3).to(torch.bfloat16)
    got = cache.attention(q, slots, score_mod=alibi(Hq), mask_mod=sliding_window(50), return_lse=True)
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (2, Hq, 1, Dv)
    assert_matches(got, reference(cache, slots, q, alibi(Hq), sliding_window(50)), tol=1e-2)


def test_input_errors():
    cache = make_cache(16, num_pages=8, max_pages=2)
    a = cache.add_sequence()
    with pytest.raises(CacheFullError, match="max_pages_per_seq"):
        cache.append([a], randn(1, 2, 33, 32, seed=0), randn(1, 2, 33, 32, seed=1))
    with pytest.raises(InputError, match="key"):
        cache.append([a], randn(1, 3, 4, 32, seed=0), randn(1, 3, 4, 32, seed=1))
    with pytest.raises(InputError, match="query"):
        cache.attention(randn(1, 4, 1, 32, seed=2), [a])                   # nothing cached yet
    with pytest.raises(InputError, match="slot"):
        cache.append([3], randn(1, 2, 1, 32, seed=0), randn(1, 2, 1, 32, seed=1))
    with pytest.raises(InputError, match="distinct"):
        cache.append([a, a], randn(2, 2, 1, 32, seed=0), randn(2, 2, 1, 32, seed=1))
    with pytest.raises(InputError, match="page_size"):
        PagedKVCache(8, 0, 2, 32, 2, 2, device="cpu")
    cache.append([a], randn(1, 2, 5, 32, seed=0), randn(1, 2, 5, 32, seed=1))
    small = create_block_mask(causal_mask, None, None, 4, 4, device="cpu")   # 4 positions < 5 cached
    with pytest.raises(InputError, match="block_mask"):
        cache.attention(randn(1, 4, 1, 32, seed=2), [a], block_mask=small)
    cache.free(a)
    with pytest.raises(InputError, match="free"):
        cache.attention(randn(1, 4, 1, 32, seed=2), [a])


# (page size, with a block mask): BLOCK_N is 64 under the interpreter, so pages of 16 take the
# per-key gather, 64 one entry per tile, 128 one entry for two tiles.
SPLIT_CASES = [(16, False), (64, False), (128, False), (16, True), (64, True), (128, True)]


@pytest.mark.parametrize("page_size,with_block_mask", SPLIT_CASES,
                         ids=[f"page{p}-{'blockmask' if m else 'dense'}" for p, m in SPLIT_CASES])
def test_splits_read_only_their_pages(page_size, with_block_mask):
    """The kernel loads each tile's table entries one tile ahead: splits that start and end at
    any tile (some empty), lengths that end inside a tile or on a tile's end, sparse blocks
    whose second tile lies past the sequence. Every table entry past a sequence's pages and
    every unused slot of its last page point at NaN keys and values: one read unmasked, and
    the output is NaN."""
    from flexgen.api import decode_attention
    Hkv, group, D = 2, 4, 32
    lengths = [3 * page_size + 70, 64, 1]
    B, W = len(lengths), max(-(-n // page_size) for n in lengths)
    num_pages = sum(-(-n // page_size) for n in lengths) + 1
    nan_page = num_pages - 1
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(page_size)).tolist()
    wide = torch.full((B, W + 3), nan_page, dtype=torch.int32)   # entries past a row: NaN page too
    k_cache = torch.full((num_pages, page_size, Hkv, D), math.nan)
    v_cache = torch.full((num_pages, page_size, Hkv, D), math.nan)
    k = randn(B, Hkv, max(lengths), D, seed=page_size + 1)
    v = randn(B, Hkv, max(lengths), D, seed=page_size + 2)
    for b, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            page = order.pop()
            wide[b, i] = page
            rows = slice(i * page_size, min(n, (i + 1) * page_size))
            k_cache[page, :rows.stop - rows.start] = k[b, :, rows].transpose(0, 1)
            v_cache[page, :rows.stop - rows.start] = v[b, :, rows].transpose(0, 1)
    table = wide[:, :W]                                          # a view: rows W + 3 apart
    q = randn(B, Hkv * group, 1, D, seed=page_size + 3)
    mods = dict(score_mod=tanh_softcap(3.0))
    mask_mod = None
    if with_block_mask:
        mask_mod = sliding_window(100)
        mods["block_mask"] = create_block_mask(mask_mod, None, None, W * page_size, W * page_size,
                                               device="cpu", BLOCK_SIZE=(16, 128))
    want_out = torch.zeros(B, Hkv * group, 1, D, dtype=torch.float64)
    want_lse = torch.zeros(B, Hkv * group, 1, dtype=torch.float64)
    for b, n in enumerate(lengths):
        o, l_ = flex_attention_reference(
            q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], score_mod=shifted(mods["score_mod"], b, n - 1, "score"),
            mask_mod=shifted(mask_mod, b, n - 1, "mask"), enable_gqa=True, return_lse=True, dtype=torch.float64)
        want_out[b], want_lse[b] = o[0], l_[0]
    for splits in (1, 3, 8):
        got = decode_attention(q, k_cache, v_cache, enable_gqa=True, return_lse=True, kv_lengths=lengths,
                               page_table=table, num_splits=splits, **mods)
        assert_matches(got, (want_out, want_lse))


def test_every_launched_kernel_compiles_for_sm90():
    """Ahead-of-time compile (triton.compile for sm_90) of each distinct kernel launched above."""
    assert_module_launches_compile(__name__, {"decode", "decode_merge", "paged_write"})
