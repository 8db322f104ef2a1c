"""Attention for a handful of query tokens per sequence: decoding, contiguous or paged.

``decode_attention`` computes the same ``softmax(mask(score_mod(q kᵀ · scale))) v``
as ``flex_attention``, organised for 1 to 16 queries per sequence (it also
takes any query length, which the paged cache uses for chunked prefill):

- the query heads that share a KV head (GQA) form one tile of
  ``group * q_tile`` rows (padded to >= 16, the smallest ``tl.dot``), so each
  K/V byte is read once for all of them;
- the keys of each sequence are split across programs (split-K, the number
  of splits from the GPU's SM count, the batch and the length); each split
  writes a normalized partial output and its LSE, and a second small kernel
  (``decode_merge``) combines them;
- K/V come from contiguous ``[B, Hkv, L, D]`` tensors or, with a page table,
  from a paged cache ``[pages, page_size, Hkv, D]`` (``flexgen.kernels.paged``): the
  kernel maps each logical key position to its page; mods only ever see
  logical positions.

Positions the mods see: ``kv_idx`` counts the tokens of the sequence;
``q_idx`` is ``q_offsets[b] + i`` for query ``i``. By default the queries are
the last tokens of the sequence (``q_offsets = kv_lengths - q_lengths``), as in
decoding; ``flex_attention`` passes ``q_offsets=0`` (torch's convention:
``q_idx`` is ``0 .. Lq-1`` and the block mask is built for ``(Lq, Lkv)``).

A ``BlockMask`` is read with logical positions: the kv blocks listed for the
query block of ``q_idx // Q_BLOCK`` are visited (its ``Q_LEN`` must exceed
every query position, its ``KV_LEN`` cover every sequence). Inside visited
blocks the mask_mod is applied element-wise (full blocks too: for a few
queries that costs nothing next to reading K/V). ``mask_mod=`` without a
block mask applies the mask element-wise to every key.
"""
from __future__ import annotations

import operator
import os
import weakref

import torch

from ..runtime import launch
from ..masks.block_mask import BlockMask
from ..codegen.cache import source
from ..runtime.checks import DTYPES, check_buffers, check_heads, check_scale, check_tensor
from ..errors import expected
from ..frontend.bounds_check import check_decode_indices
from ..frontend.lowering import lower
from ..codegen.spec import dot_precision, kernel_spec, mod_fields
from ..frontend.trace import trace_cached as _trace

MAX_DECODE_QUERIES = 16          # use_decode_path's limit on queries per sequence
CPU_SPLITS = 2                   # splits under the interpreter: small, but the merge always runs
MIN_TILES_PER_SPLIT = 2          # a split reads at least this many BLOCK_N tiles
MAX_SPLITS = 64
DEEP_STAGES = 3                  # pipeline stages of a decode kernel that has an SM to itself
OPTION_KEYS = {"BLOCK_N", "num_warps", "num_stages", "NUM_SPLITS"}
# Options meant for the forward kernel or for torch's kernels: accepted, ignored here.
IGNORED_OPTIONS = {"BLOCK_M", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS",
                   "OUTPUT_LOGSUMEXP", "FORCE_USE_FLEX_ATTENTION", "WRITE_DQ", "BACKEND",
                   "USE_TMA", "num_consumer_groups", "num_buffers_warp_spec"}


def _poison() -> bool:
    # Read per call (not at import) so a test can switch it on after importing flexgen.
    return os.environ.get("FLEXGEN_POISON") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def use_decode_path(query, key, value=None) -> bool:
    """Whether ``flex_attention`` should hand this call to ``decode_attention``.

    True for at most ``MAX_DECODE_QUERIES`` (16) query tokens per sequence when
    no gradient is needed (decode_attention has no backward).
    """
    if not few_queries(query):
        return False
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (query, key, value)):
        return False
    return True


def few_queries(query) -> bool:
    """``use_decode_path`` without its gradient test: a 4-D tensor of at most
    ``MAX_DECODE_QUERIES`` queries per sequence (for flex_attention, which has made that test)."""
    return isinstance(query, torch.Tensor) and query.dim() == 4 and query.shape[2] <= MAX_DECODE_QUERIES


# --- checks ----------------------------------------------------------------------------
def _host_ints(t, B):
    """The B values of a CPU tensor / list / int, or None for a CUDA tensor (never read back: no sync)."""
    if isinstance(t, torch.Tensor):
        if t.device.type == "cuda":
            return None
        values = [int(x) for x in t.reshape(-1).tolist()]
    elif isinstance(t, int):
        values = [t]
    else:
        values = [int(x) for x in t]
    return values * B if len(values) == 1 else values


def _per_sequence(name, value, B, device, fix):
    """``value`` (int, list of B ints, or an integer tensor [B]) as an int32 tensor [B] on ``device``."""
    if isinstance(value, bool):
        raise expected(name, "an int, a list of ints or an integer tensor [B]", repr(value), fix)
    if isinstance(value, int):
        return torch.full((B,), value, dtype=torch.int32, device=device)
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1 \
                or value.numel() not in (1, B):
            raise expected(name, f"an integer tensor of shape [{B}]",
                           f"dtype {value.dtype}, shape {list(value.shape)}", fix)
        return value.to(device=device, dtype=torch.int32).reshape(-1).expand(B).contiguous()
    try:
        values = [int(x) for x in value]
    except (TypeError, ValueError):
        raise expected(name, f"an int, a list of {B} ints or an integer tensor [{B}]",
                       type(value).__name__, fix) from None
    if len(values) != B:
        raise expected(name, f"{B} values (one per sequence)", len(values), fix)
    return torch.tensor(values, dtype=torch.int32, device=device)


# --- block masks ---------------------------------------------------------------------------
def _visit_lists(block_mask: BlockMask, group: int):
    """(indices [B', H', NQ, NKV] int32, cumulative counts [B', H', NQ, NKV + 1] int32).

    The kv blocks a query block visits (partial or full), in increasing order,
    and the running count of them, from which the kernel reads both how many
    listed blocks lie below a sequence's length and whether a block is listed.
    A mask with one list per query head is combined over each GQA group (a
    block is visited if any head of the group needs it; mask_mod then decides
    per head). Computed once per mask and group size, O(number of blocks).
    """
    per_mask = _mask_memo(block_mask)
    heads = block_mask.kv_num_blocks.shape[1]
    key = ("visit", group if heads > 1 else 1)
    hit = per_mask.get(key)
    if hit is None:
        visit = block_mask.block_states() != 0
        mB, mH, nq, nkv = visit.shape
        if mH > 1 and group > 1:
            visit = visit.view(mB, mH // group, group, nq, nkv).any(2)
        order = torch.sort((~visit).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        cum = torch.zeros(*visit.shape[:3], nkv + 1, dtype=torch.int32, device=visit.device)
        cum[..., 1:] = visit.to(torch.int32).cumsum(-1)
        hit = per_mask[key] = (order.contiguous(), cum)
    return hit


def _check_block_mask(block_mask, B, Hq, device):
    if not isinstance(block_mask, BlockMask):
        raise expected("block_mask", "a flexgen BlockMask (from flexgen.create_block_mask) or None",
                       type(block_mask).__name__, "build it with flexgen.create_block_mask")
    mB, mH = block_mask.kv_num_blocks.shape[:2]
    if mB not in (1, B) or mH not in (1, Hq):
        raise expected("block_mask", f"batch 1 or {B} and heads 1 or {Hq}", f"batch {mB}, heads {mH}",
                       "create the mask with B and H of the query (or None to broadcast)")
    if block_mask.device != device:
        raise expected("block_mask", f"a mask on {device} like the query", block_mask.device,
                       f"block_mask.to('{device}')")


# --- launch configuration --------------------------------------------------------------------
_SMS: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


_SPLITS: dict = {}                 # (device, programs, kv_tiles) -> splits
SHORT_SPLIT_TILES = 32             # below this many tiles per split, one program per SM


def choose_splits(device: torch.device, programs: int, kv_tiles: int) -> int:
    """How many programs share one sequence's keys (split-K).

    ``programs`` is the number of (batch, kv head, query tile) work items and
    ``kv_tiles`` the longest sequence in BLOCK_N tiles. On a GPU: as many splits
    as make two programs per SM, no more (a partial second wave costs a whole
    program's time), except where that would leave splits shorter than
    SHORT_SPLIT_TILES tiles: one program per SM then, which then runs a deeper
    pipeline (``deep_spec``). No split shorter than MIN_TILES_PER_SPLIT tiles, at
    most MAX_SPLITS. Paged keys the same, since their page entries are loaded a
    tile ahead and their K/V loads pipeline. (H100, B=1, Hkv=8, CUDA graphs:
    contiguous 8k keys, 16 splits 29.7 us, 33 splits 36.4; 128k, 33 splits 207 us,
    16 splits 227; paged 8k, 16 splits 30.2 us, 33 splits 36.9; 32k 69.6 / 75.9.)
    Under the interpreter: CPU_SPLITS for up to 16 work items, else 1.
    Memoized (the SM count is the device's).
    """
    key = (device, programs, kv_tiles)
    splits = _SPLITS.get(key)
    if splits is None:
        if device.type != "cuda":
            # The interpreter runs programs one after another: splits only add work, except
            # that they keep the merge path exercised on decode-sized calls.
            splits = max(1, min(CPU_SPLITS if programs <= 16 else 1, kv_tiles))
        else:
            cap = max(1, min(MAX_SPLITS, kv_tiles // MIN_TILES_PER_SPLIT))
            sms, programs = _sm_count(device), max(1, programs)
            splits = max(1, 2 * sms // programs)
            if kv_tiles < SHORT_SPLIT_TILES * splits:
                splits = max(1, sms // programs)
            splits = min(splits, cap)
        if len(_SPLITS) >= 4096:
            _SPLITS.clear()
        _SPLITS[key] = splits
    return splits


def _geometry(device, G, Lq, D, sparse_q):
    """(q_tile, block_m, block_n, num_warps, num_stages) for a query tile of G heads."""
    gp = _next_pow2(G)
    if Lq <= MAX_DECODE_QUERIES:
        q_tile = _next_pow2(Lq)
    else:
        q_tile = max(1, (64 if device.type == "cuda" and D > 128 else 128) // gp)
    q_tile = min(q_tile, max(1, 128 // gp))
    if sparse_q is not None:
        q_tile = min(q_tile, sparse_q)
    block_m = max(16, gp * q_tile)
    if device.type != "cuda":
        # The interpreter's cost is per operation: few, large tiles.
        return q_tile, block_m, 64, 4, 1
    # Two stages where several programs share an SM: on the H100 (bench_decode --sweep,
    # q_len=1, GQA 4, D=128) three were 1-11% slower from B=8 up (B=64, 8k keys: 788 -> 710
    # us with two). One program per SM runs _Static.deep_spec's three instead.
    block_n = 64 if D <= 128 else 32
    warps = 8 if block_m >= 128 and D <= 128 else 4
    return q_tile, block_m, block_n, warps, 2


def _deep_stages(device, head_dim: int, stages: int, kernel_options) -> int:
    """Pipeline stages for a decode kernel whose programs each have an SM to themselves.

    Nothing else hides such a program's load latency: a deeper pipeline (H100, B=1, 8k
    keys, 16 splits: 34.4 us with two stages, 29.7 with three). Not past D=128, where
    two stages are what fits in shared memory; a caller's num_stages holds either way.
    """
    if kernel_options and "num_stages" in kernel_options:
        return kernel_options["num_stages"]
    return DEEP_STAGES if device.type == "cuda" and head_dim <= 128 else stages


def _alone(device, programs: int, num_splits: int) -> bool:
    """Whether every program of a launch gets an SM to itself (then: ``_deep_stages``)."""
    return device.type == "cuda" and programs * num_splits <= _sm_count(device)


def _options(kernel_options, opts: dict, sparse_kv) -> dict:
    for k, v in (kernel_options or {}).items():
        if k in IGNORED_OPTIONS:
            continue
        if k not in OPTION_KEYS:
            raise expected("kernel_options", f"keys among {sorted(OPTION_KEYS)}", repr(k),
                           "remove the key or fix its spelling")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise expected(f"kernel_options[{k!r}]", "a positive int", repr(v), "pass an int")
        opts[k] = v
    if sparse_kv is not None:
        opts["BLOCK_N"] = min(opts["BLOCK_N"], sparse_kv)
    n = opts["BLOCK_N"]
    if n < 16 or n & (n - 1) or (sparse_kv is not None and sparse_kv % n):
        raise expected("kernel_options['BLOCK_N']", "a power of two >= 16"
                       + (f" dividing the sparse block {sparse_kv}" if sparse_kv else ""), n,
                       "use 64 (or 32 / 128)")
    return opts


_CONSTANTS: dict = {}


def _constant(value: int, device) -> torch.Tensor:
    """A cached one-element int32 tensor (the kernel broadcasts it with stride 0)."""
    key = (value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = torch.tensor([value], dtype=torch.int32, device=device)
    return t


def _lengths_arg(name, value, B, device, fix):
    """``value`` as the kernel reads it: a cached constant, or an int32 tensor [B] (views kept)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _constant(value, device)
    if isinstance(value, torch.Tensor) and value.dtype == torch.int32 and value.dim() == 1 \
            and value.shape[0] == B and value.device == device:
        return value                   # already what the kernel reads: no copy, no launch
    return _per_sequence(name, value, B, device, fix)


# --- the plan -----------------------------------------------------------------------------
class _Plan:
    """Everything one call needs: the two specs and the launch inputs (outputs aside)."""
    __slots__ = ("spec", "merge_spec", "seq", "page_table", "visit", "score_buffers",
                 "mask_buffers", "scale", "q_tile", "num_splits", "page_size", "sparse_q", "sparse_kv",
                 "static", "replay_key")


class _Static:
    """The half of a plan that depends only on the static inputs (``_static_key``), memoized.

    Holds no tensor a caller could mutate or reassign: the page table, the lengths and
    the captured buffers are taken from each call; ``visit`` are views of lists derived
    from the block mask (the memo entry lives with the mask and is dropped when one of
    its list fields is reassigned).
    """
    __slots__ = ("refs", "spec", "deep_spec", "merge_spec", "q_tile", "page_size", "capacity", "programs",
                 "block_n", "num_splits", "visit", "mask_lengths", "sparse_q", "sparse_kv", "replays")


_STATIC: dict = {}                                   # key -> _Static, calls without a block mask
_MASK_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # mask -> (fields, memo)
MAX_STATIC = 256
MAX_REPLAYS = 16                                     # per static entry: replay_key -> [split, merge]


def _mask_memo(block_mask: BlockMask) -> dict:
    """A memo dict that lives as long as ``block_mask``, emptied when a field decode reads is reassigned."""
    fields = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
              block_mask.full_kv_indices, block_mask.BLOCK_SIZE, block_mask.seq_lengths,
              block_mask.mask_mod)
    hit = _MASK_MEMO.get(block_mask)
    if hit is None or not all(map(operator.is_, hit[0], fields)):
        hit = _MASK_MEMO[block_mask] = (fields, {})
    return hit[1]


def _static_key(query, key, value, page_table, kv_lengths, score_traced, mask_traced,
                enable_gqa, kernel_options, num_splits):
    """Everything ``_static`` reads, hashable; None where an argument is not (no memo: the slow path checks it)."""
    try:
        k = (type(query), query.shape, query.dtype, query.device, query.stride(-1),
             type(key), key.shape, key.dtype, key.device, key.stride(-1),
             type(value), value.shape, value.dtype, value.device, value.stride(-1),
             None if page_table is None else (type(page_table), page_table.shape, page_table.dtype,
                                              page_table.device, kv_lengths is None),
             id(score_traced), id(mask_traced), bool(enable_gqa),
             None if kernel_options is None else tuple((n, type(v), v) for n, v in kernel_options.items()),
             type(num_splits), num_splits, dot_precision(query))
        hash(k)
    except Exception:  # noqa: BLE001 - anything odd takes the checked path, which explains it
        return None
    return k


def _static(query, key, value, score_traced, mask_traced, block_mask, mask_mod, enable_gqa,
            page_table, kv_lengths, kernel_options, num_splits) -> _Static:
    """Check the static inputs and decide the kernels (the memoized half of ``_plan``)."""
    paged = page_table is not None
    kv_layout = "[pages, page_size, Hkv, D] (a paged cache)" if paged else "[B, Hkv, L, D]"
    check_tensor("query", query, "[B, H, L, D]")
    check_tensor("key", key, kv_layout)
    check_tensor("value", value, kv_layout)
    if not (query.dtype == key.dtype == value.dtype):
        raise expected("key/value", f"the query's dtype {query.dtype}",
                       f"key {key.dtype}, value {value.dtype}", "convert all three to one dtype")
    device = query.device
    if not (device == key.device == value.device):
        raise expected("key/value", f"the query's device {device}",
                       f"key on {key.device}, value on {value.device}", "move all three to one device")
    B, Hq, Lq, D = query.shape
    Dv = value.shape[-1]
    if paged:
        _, page_size, Hkv, Dk = key.shape
        if value.shape[:3] != key.shape[:3]:
            raise expected("value", f"a cache shaped like the key's {list(key.shape[:3])} + [Dv]",
                           list(value.shape), "pass the value cache of the same PagedKVCache")
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 \
                or page_table.shape[0] != B or page_table.dtype not in (torch.int32, torch.int64):
            got = (f"shape {list(page_table.shape)}, dtype {page_table.dtype}"
                   if isinstance(page_table, torch.Tensor) else type(page_table).__name__)
            raise expected("page_table", f"an int32 tensor [{B}, max_pages_per_seq]", got,
                           "pass PagedKVCache.page_table rows for the batch")
        if page_table.device != device:
            raise expected("page_table", f"a tensor on {device}", page_table.device,
                           f"page_table.to('{device}')")
        if kv_lengths is None:
            raise expected("kv_lengths", "the length of each cached sequence with a page_table", None,
                           "pass kv_lengths (PagedKVCache.attention does it for you)")
        capacity = page_table.shape[1] * page_size
    else:
        if key.shape[0] != B or value.shape[0] != B:
            raise expected("key/value batch", f"batch {B} like query",
                           f"{key.shape[0]} and {value.shape[0]}", "give query, key and value one batch size")
        if key.shape[1:3] != value.shape[1:3]:
            raise expected("value", f"the key's heads and length {tuple(key.shape[1:3])}",
                           tuple(value.shape[1:3]), "key and value must come from the same positions")
        _, Hkv, capacity, Dk = key.shape
        page_size = 1
    if Dk != D:
        raise expected("key.shape[-1]", f"the query's head dim {D}", Dk,
                       "query and key need the same head dim (value's may differ)")
    check_heads(Hq, Hkv, enable_gqa)
    G = Hq // Hkv

    score = None if score_traced is None else lower(score_traced)
    mask, visit, sparse_q, sparse_kv, mask_lengths = None, None, None, None, None
    if block_mask is not None:
        if mask_mod is not None:
            raise expected("mask_mod", "None when a block_mask is given (its mask_mod is used)",
                           getattr(mask_mod, "__name__", mask_mod), "pass only one of them")
        _check_block_mask(block_mask, B, Hq, device)
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        mask_lengths = block_mask.seq_lengths
        idx, cum = _visit_lists(block_mask, G)
        # [B, Hkv, ...] views: a broadcast batch or head gets stride 0.
        visit = (idx.expand(B, Hkv, *idx.shape[2:]), cum.expand(B, Hkv, *cum.shape[2:]))
    if mask_traced is not None:
        mask = lower(mask_traced)

    q_tile, block_m, block_n, warps, stages = _geometry(device, G, Lq, max(D, Dv), sparse_q)
    opts = _options(kernel_options, dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages),
                    sparse_kv)
    if num_splits is None:
        num_splits = opts.get("NUM_SPLITS")
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise expected("num_splits", "a positive int or None (automatic)", repr(num_splits), "pass an int")

    st = _Static()
    st.refs = tuple(None if t is None else weakref.ref(t) for t in (score_traced, mask_traced))
    def decode_spec(stages):
        return kernel_spec(
            "decode",
            **mod_fields(score, mask),
            qk_head=D, v_head=Dv, dtype=DTYPES[query.dtype],
            has_block_mask=block_mask is not None,
            block_m=block_m, block_n=opts["BLOCK_N"],
            num_warps=opts["num_warps"], num_stages=stages,
            dot_precision=dot_precision(query),
        )

    st.spec = decode_spec(opts["num_stages"])
    deep = _deep_stages(device, max(D, Dv), opts["num_stages"], kernel_options)
    st.deep_spec = st.spec if deep == opts["num_stages"] else decode_spec(deep)
    st.merge_spec = kernel_spec(
        "decode_merge", v_head=Dv, dtype=DTYPES[query.dtype],
        block_m=64 if device.type != "cuda" else 16, num_warps=4)
    st.q_tile, st.page_size, st.capacity = q_tile, page_size, capacity
    st.programs = B * Hkv * -(-Lq // q_tile)
    st.block_n, st.num_splits, st.visit, st.mask_lengths = opts["BLOCK_N"], num_splits, visit, mask_lengths
    st.sparse_q = sparse_q or 16
    st.sparse_kv = sparse_kv or opts["BLOCK_N"]
    st.replays = {}
    return st


def _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, kv_lengths, page_table,
          mask_mod, q_offsets, q_lengths, num_splits, kernel_options, max_kv_len,
          host_lengths=None, score_traced=None) -> _Plan:
    if score_traced is None and score_mod is not None:
        score_traced = _trace(score_mod, "score_mod")
    if block_mask is not None:
        mask_traced = block_mask.traced() if isinstance(block_mask, BlockMask) else None
    else:
        mask_traced = None if mask_mod is None else _trace(mask_mod, "mask_mod")

    # The static half: checked and decided once per combination of shapes, dtypes,
    # device, mods and options (the memo of a block mask lives with the mask).
    memo_key = None
    if block_mask is None or (mask_mod is None and isinstance(block_mask, BlockMask)):
        memo_key = _static_key(query, key, value, page_table, kv_lengths, score_traced, mask_traced,
                               enable_gqa, kernel_options, num_splits)
    memo = None
    if memo_key is not None:
        memo = _STATIC if block_mask is None else _mask_memo(block_mask)
    st = None if memo is None else memo.get(memo_key)
    if st is not None:
        score_ref, mask_ref = st.refs
        # The traces' ids are in the key: a dead trace's id may have been reused.
        if (score_ref is not None and score_ref() is not score_traced) or \
                (mask_ref is not None and mask_ref() is not mask_traced):
            st = None
    if st is None:
        st = _static(query, key, value, score_traced, mask_traced, block_mask, mask_mod, enable_gqa,
                     page_table, kv_lengths, kernel_options, num_splits)
        if memo is not None:
            if len(memo) >= MAX_STATIC:
                memo.clear()
            memo[memo_key] = st

    # The per-call half: whatever a caller may change between calls with the same shapes.
    device = query.device
    B, _, Lq, D = query.shape
    scale = check_scale(scale, D)
    if score_traced is not None:
        check_buffers(score_traced, device)
    if mask_traced is not None:
        check_buffers(mask_traced, device)
    if page_table is not None:
        # Converted on every call, never cached: the table changes in place as sequences grow.
        if page_table.dtype != torch.int32:
            page_table = page_table.to(torch.int32)
        if page_table.stride(1) != 1:
            page_table = page_table.contiguous()
    capacity = st.capacity

    # Per-sequence lengths and query positions, as the kernel reads them (no work per call
    # when they are ints or int32 tensors already on the device).
    fix_len = "pass one length per sequence (ints, a list or an int32 tensor [B])"
    kv = _lengths_arg("kv_lengths", capacity if kv_lengths is None else kv_lengths, B, device, fix_len)
    ql = _lengths_arg("q_lengths", Lq if q_lengths is None else q_lengths, B, device, fix_len)
    qs = None if q_offsets is None else _lengths_arg("q_offsets", q_offsets, B, device, fix_len)
    if host_lengths is not None:
        # The caller (PagedKVCache) knows the lengths on the host: check them without a sync.
        host_kv, host_ql = host_lengths
    else:
        host_kv = None if kv_lengths is None else _host_ints(kv_lengths, B)
        host_ql = None if q_lengths is None else _host_ints(q_lengths, B)
    # (None with the default: every sequence is `capacity` keys long / Lq queries.)
    kv_max = capacity if kv_lengths is None else (None if host_kv is None else max(host_kv))
    if kv_lengths is not None and host_kv is not None and (min(host_kv) < 0 or kv_max > capacity):
        raise expected("kv_lengths", f"lengths from 0 to {capacity} (the "
                       + ("page table's capacity" if page_table is not None else "key's length") + ")",
                       f"{min(host_kv)} .. {kv_max}", "clip the lengths or give a longer cache")
    if q_lengths is not None and host_ql is not None and (min(host_ql) < 0 or max(host_ql) > Lq):
        raise expected("q_lengths", f"counts from 0 to {Lq} (the query's length)",
                       f"{min(host_ql)} .. {max(host_ql)}", "pad the query to the longest count")
    # Captured tensors indexed out of bounds raise here, as torch would (frontend/bounds_check.py).
    check_decode_indices(score_traced, mask_traced, query.shape[:3], q_offsets, host_ql, host_kv, kv_max,
                         capacity)
    if max_kv_len is None:
        max_kv_len = capacity if kv_max is None else kv_max

    if block_mask is not None:
        mQ, mKV = st.mask_lengths
        if kv_max is not None and kv_max > mKV:
            raise expected("block_mask", f"a mask whose KV_LEN covers the longest sequence ({kv_max})",
                           f"KV_LEN={mKV}", "build the mask for the cache's logical length")
        q_end = _query_end(q_offsets, q_lengths, B, Lq, kv_max, host_ql)
        if q_end is not None and q_end > mQ:
            raise expected("block_mask", "a mask whose Q_LEN exceeds every query position "
                           f"(q_idx runs up to {q_end - 1})", f"Q_LEN={mQ}",
                           "build the mask for the cache's logical length (PagedKVCache.block_mask)")

    num_splits = st.num_splits
    if num_splits is None:
        num_splits = choose_splits(device, st.programs, -(-max(1, max_kv_len) // st.block_n))

    plan = _Plan()
    plan.spec = st.deep_spec if _alone(device, st.programs, num_splits) else st.spec
    plan.merge_spec = None if num_splits == 1 else st.merge_spec
    plan.seq, plan.page_table, plan.visit = (kv, qs, ql), page_table, st.visit
    plan.score_buffers = () if score_traced is None else score_traced.buffers
    plan.mask_buffers = () if mask_traced is None else mask_traced.buffers
    plan.scale, plan.q_tile, plan.num_splits, plan.page_size = scale, st.q_tile, num_splits, st.page_size
    plan.sparse_q, plan.sparse_kv = st.sparse_q, st.sparse_kv
    plan.static = st
    # What the launches read besides the tensors a replay swaps in (_swapped) and what
    # `st` fixes (shapes, dtypes, mods, options, block-mask lists, tiles): equal keys,
    # equal kernel arguments. The captured buffers stay in the replayed launch, so
    # their ids cannot be reused while it lives.
    plan.replay_key = (
        query.stride(), key.stride(), value.stride(), kv.shape[0], kv.stride(0),
        None if qs is None else (qs.shape[0], qs.stride(0)), ql.shape[0], ql.stride(0),
        None if page_table is None else page_table.stride(0), num_splits, float(scale),
        tuple(map(id, plan.score_buffers)), tuple(map(id, plan.mask_buffers)))
    return plan


def _swapped(plan: _Plan, query, key, value, out, lse, o_part, l_part) -> tuple:
    """The split kernel's leading tensor arguments, as its module's ``arguments`` orders them
    (the outputs stand in for the partials when there is one split, the kv lengths for the
    query starts when queries end their sequences, the query for a contiguous page table)."""
    kv, qs, ql = plan.seq
    single = plan.num_splits == 1
    return (query, key, value, out, lse, out if single else o_part, lse if single else l_part,
            kv, kv if qs is None else qs, ql, query if plan.page_table is None else plan.page_table)


def _query_end(q_offsets, q_lengths, B, Lq, kv_max, host_ql):
    """One past the largest query position (max of q_offsets + q_lengths), or None when not on the host."""
    if q_offsets is None:
        # The default positions (each sequence's last tokens): q_offsets + q_lengths = kv_lengths.
        return None if q_lengths is not None and host_ql is None else kv_max
    host_qs = _host_ints(q_offsets, B)
    if host_qs is None:
        return None
    if q_lengths is None:
        return max(host_qs) + Lq
    return None if host_ql is None else max(s + q for s, q in zip(host_qs, host_ql))


def decode_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                     enable_gqa=False, return_lse=False, kv_lengths=None, page_table=None, *,
                     mask_mod=None, q_offsets=None, q_lengths=None, num_splits=None,
                     kernel_options=None, max_kv_len=None, _host_lengths=None, _score_traced=None):
    """Attention of a few query tokens per sequence against a (possibly paged) KV cache.

    query ``[B, Hq, Lq, D]`` (Lq from 1 to 16 is the decode case; any Lq works).
    Contiguous: key ``[B, Hkv, L, D]``, value ``[B, Hkv, L, Dv]``. Paged (with
    ``page_table`` ``[B, max_pages]`` int32 of physical page ids): key / value
    are caches ``[pages, page_size, Hkv, D]``, logical position ``n`` of
    sequence ``b`` is slot ``n % page_size`` of page ``page_table[b, n // page_size]``.

    ``kv_lengths`` ``[B]``: keys per sequence (default: all ``L``; required
    when paged). ``q_lengths`` ``[B]``: valid queries per sequence (default
    ``Lq``; the rows after them get zeros and LSE = -inf). ``q_offsets``
    ``[B]`` (or an int): ``q_idx`` of query 0 (default ``kv_lengths -
    q_lengths``: the queries are the sequence's last tokens). Lengths may be
    ints, lists or integer tensors; CUDA tensors are not read back (no sync),
    so their values are not checked.

    ``score_mod(score, b, h, q_idx, kv_idx)`` and the mask (``block_mask`` for
    logical positions, or ``mask_mod`` applied element-wise) work as in
    ``flex_attention``; ``h`` is the query head, ``b`` the batch row. Hq must
    be a multiple of Hkv with ``enable_gqa=True``. ``num_splits`` overrides the
    split-K count. ``max_kv_len`` is a host-side upper bound on the lengths
    (only used to choose the split count when the lengths live on the GPU).

    Returns ``out [B, Hq, Lq, Dv]`` in the query's dtype, with ``return_lse``
    also the natural-log LSE ``[B, Hq, Lq]`` float32 (-inf and zeros for a
    query that sees no key). Forward only: no autograd.

    Private, for flexgen's own callers: ``_host_lengths`` (the lengths as host
    ints, from PagedKVCache) and ``_score_traced`` (score_mod's trace, from
    flex_attention, which traced it already to choose this path).
    """
    plan = _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, kv_lengths, page_table,
                 mask_mod, q_offsets, q_lengths, num_splits, kernel_options, max_kv_len, _host_lengths,
                 _score_traced)
    B, Hq, Lq, _ = query.shape
    Dv = value.shape[-1]
    device = query.device
    out = torch.empty(B, Hq, Lq, Dv, dtype=query.dtype, device=device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=device)
    S = plan.num_splits
    o_part = l_part = None
    if S > 1:
        o_part = torch.empty(B, Hq, Lq, S, Dv, dtype=torch.float32, device=device)
        l_part = torch.empty(B, Hq, Lq, S, dtype=torch.float32, device=device)
    if _poison():
        for t in (out, lse, o_part, l_part):
            if t is not None:
                t.fill_(float("nan"))
    # A call like an earlier one (same replay_key) relaunches that call's kernels with
    # its new tensors only: no arguments() and no per-argument classes (launch.Replay).
    # (launch.run gives no Replay under the interpreter: there the slots stay empty.)
    replays = plan.static.replays
    slot = replays.get(plan.replay_key)
    if slot is None:
        if len(replays) >= MAX_REPLAYS:
            replays.clear()
        slot = replays[plan.replay_key] = [None, None]
    swapped = _swapped(plan, query, key, value, out, lse, o_part, l_part)
    if slot[0] is None or not slot[0](*swapped):
        slot[0] = launch.run(plan.spec, device, query, key, value, out, lse, o_part, l_part, plan.seq,
                             plan.page_table, plan.visit, plan.score_buffers, plan.mask_buffers,
                             plan.scale, plan.q_tile, S, plan.page_size, plan.sparse_q, plan.sparse_kv,
                             replay=len(swapped))
    if S > 1 and (slot[1] is None or not slot[1](o_part, l_part, out, lse)):
        slot[1] = launch.run(plan.merge_spec, device, o_part, l_part, out, lse, replay=4)
    return (out, lse) if return_lse else out


def decode_kernel_source(query, key, value, score_mod=None, block_mask=None, scale=None,
                         enable_gqa=False, kv_lengths=None, page_table=None, *, mask_mod=None,
                         q_offsets=None, q_lengths=None, kernel_options=None) -> str:
    """The generated module source ``decode_attention`` would run for these arguments (nothing is launched)."""
    plan = _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, kv_lengths, page_table,
                 mask_mod, q_offsets, q_lengths, None, kernel_options, None)
    return source(plan.spec)
