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

A block mask is read with logical positions: the kv blocks listed for the
query block of ``q_idx // Q_BLOCK`` are visited (its ``Q_LEN`` must exceed
every query position, its ``KV_LEN`` cover every sequence). Inside visited
blocks the mask_mod is applied element-wise (full blocks too: for a few
queries that costs nothing next to reading K/V). ``mask_mod=`` without a
block mask applies the mask element-wise to every key.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import launch
from ..runtime.checks import may_cache
from ..runtime.poison import poison

CPU_SPLITS = 2                   # splits under the interpreter: small, but the merge always runs
MIN_TILES_PER_SPLIT = 2          # a split reads at least this many BLOCK_N tiles
MAX_SPLITS = 64
DEEP_STAGES = 3                  # pipeline stages of a decode kernel that has an SM to itself
MAX_REPLAYS = 16                 # per plan: replay_key -> [split launch, merge launch]
_MEMO_MAX = 512


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# --- block masks ---------------------------------------------------------------------------
_VISITS: dict = {}


def _listed(kv_lists, nkv: int) -> torch.Tensor:
    """bool [B', H', NQ, NKV]: whether a block is in the partial or the full list of its row.

    Entries past a row's count go to a spare column, so every write a position gets writes
    the same value: one plain scatter, the same under torch's deterministic mode.
    """
    num, idx, full_num, full_idx = kv_lists
    arange = torch.arange(nkv, device=idx.device)
    listed = torch.zeros((*idx.shape[:3], nkv + 1), dtype=torch.bool, device=idx.device)
    for n, i in ((num, idx), (full_num, full_idx)):
        listed.scatter_(-1, torch.where(arange < n[..., None], i.long(), nkv), True)
    return listed[..., :nkv]


def visit_lists(kv_lists, group: int):
    """(indices [B', H', NQ, NKV] int32, cumulative counts [B', H', NQ, NKV + 1] int32).

    The kv blocks a query block visits (partial or full, from the mask's kv lists), in
    increasing order, and the running count of them, from which the kernel reads both
    how many listed blocks lie below a sequence's length and whether a block is
    listed. A mask with one list per query head is combined over each GQA group (a
    block is visited if any head of the group needs it; mask_mod then decides per
    head). O(number of blocks). Remembered per list tensors (their identity and
    version, so an in-place change is seen), except while a CUDA graph is captured:
    the graph must then hold the computation itself.
    """
    key = (None if not may_cache(kv_lists[0].device)
           else (tuple((id(t), t._version) for t in kv_lists), group))
    hit = None if key is None else _VISITS.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], kv_lists)):
        return hit[1]
    mB, mH, nq, nkv = kv_lists[1].shape
    visit = _listed(kv_lists, nkv)
    if mH > 1 and group > 1:
        visit = visit.view(mB, mH // group, group, nq, nkv).any(2)
    order = torch.sort((~visit).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    cum = torch.zeros(*visit.shape[:3], nkv + 1, dtype=torch.int32, device=visit.device)
    cum[..., 1:] = visit.to(torch.int32).cumsum(-1)
    result = (order.contiguous(), cum)
    if key is not None:
        if len(_VISITS) >= _MEMO_MAX:
            _VISITS.clear()
        # The entry holds the list tensors: their ids are not reused while it lives.
        _VISITS[key] = (tuple(kv_lists), result)
    return result


# --- launch configuration --------------------------------------------------------------------
_SPLITS: dict = {}                 # (device, programs, kv_tiles) -> splits
SHORT_SPLIT_TILES = 32             # below this many tiles per split, one program per SM


def choose_splits(device: torch.device, programs: int, kv_tiles: int) -> int:
    """How many programs share one sequence's keys (split-K).

    ``programs`` is the number of (batch, kv head, query tile) work items and
    ``kv_tiles`` the longest sequence in BLOCK_N tiles. On a GPU: as many splits
    as make two programs per SM, no more (a partial second wave costs a whole
    program's time), except where that would leave splits shorter than
    SHORT_SPLIT_TILES tiles: one program per SM then, which then runs a deeper
    pipeline (``DecodePlan.deep_spec``). No split shorter than MIN_TILES_PER_SPLIT tiles, at
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
            sms, programs = launch.sm_count(device), max(1, programs)
            splits = max(1, 2 * sms // programs)
            if kv_tiles < SHORT_SPLIT_TILES * splits:
                splits = max(1, sms // programs)
            splits = min(splits, cap)
        if len(_SPLITS) >= 4096:
            _SPLITS.clear()
        _SPLITS[key] = splits
    return splits


def decode_geometry(device, G, Lq, D, sparse_q):
    """(q_tile, block_m, block_n, num_warps, num_stages) for a query tile of G heads."""
    gp = next_pow2(G)
    if Lq <= 16:
        q_tile = next_pow2(Lq)
    else:
        q_tile = max(1, (64 if device.type == "cuda" and D > 128 else 128) // gp)
    q_tile = min(q_tile, max(1, 128 // gp))
    if sparse_q is not None:
        q_tile = min(q_tile, sparse_q)
    block_m = max(16, gp * q_tile)
    if device.type != "cuda":
        # The interpreter's cost is per operation: few, large tiles.
        return q_tile, block_m, 64, 4, 1
    if D > 128:
        # Head dim 256 (H200, bench_decode --sweep, Gemma's 16 query / 8 KV heads, B 1-64, 8k and
        # 32k keys): 64-key tiles, 8 warps and three stages were the fastest or within 1% in every
        # case, contiguous and paged, 1.02-1.48x the 32-key tiles, 4 warps and two stages that
        # were here (results/bench_decode_h200_20261129_d256_sweep.json).
        return q_tile, block_m, 64, 8, 3
    # Two stages where several programs share an SM: on the H100 (bench_decode --sweep,
    # q_len=1, GQA 4, D=128) three were 1-11% slower from B=8 up (B=64, 8k keys: 788 -> 710
    # us with two). One program per SM runs DecodePlan.deep_spec's three instead.
    warps = 8 if block_m >= 128 else 4
    return q_tile, block_m, 64, warps, 2


def deep_stages(device, head_dim: int, stages: int, options) -> int:
    """Pipeline stages for a decode kernel whose programs each have an SM to themselves.

    Nothing else hides such a program's load latency: a deeper pipeline (H100, B=1, 8k
    keys, 16 splits: 34.4 us with two stages, 29.7 with three). Past D=128 decode_geometry
    gives three already; a caller's num_stages holds either way.
    """
    if options.num_stages is not None:
        return options.num_stages
    return DEEP_STAGES if device.type == "cuda" and head_dim <= 128 else stages


def _alone(device, programs: int, num_splits: int) -> bool:
    """Whether every program of a launch gets an SM to itself (then: ``deep_stages``)."""
    return device.type == "cuda" and programs * num_splits <= launch.sm_count(device)



# --- running -------------------------------------------------------------------------------
_CONSTANTS: dict = {}


def constant(value: int, device) -> torch.Tensor:
    """A cached one-element int32 tensor (the kernel broadcasts it with stride 0).

    Filled on the device, not copied from the host: a copy from pageable memory is refused
    inside a CUDA graph capture (``torch.cuda.graph``: a serving loop's step captured by
    hand), where nothing is cached (``may_cache``) and each call makes its constants anew. Under
    a dispatch mode (FakeTensorMode, make_fx's tracing) neither: a fake constant kept would
    reach later real calls, a real one kept would meet fake tensors."""
    if torch._C._len_torch_dispatch_stack():
        return torch.full((1,), value, dtype=torch.int32, device=device)
    key = (value, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 4096:
            _CONSTANTS.clear()
        t = torch.full((1,), value, dtype=torch.int32, device=device)
        if may_cache(device):
            _CONSTANTS[key] = t
    return t


@dataclass
class _Launch:
    """What the decode template's ``arguments`` reads besides the tensors ``_swapped`` lists."""
    seq: tuple
    page_table: object
    visit: object
    num_splits: int
    q_tile: int
    page_size: int
    sparse_q: int
    sparse_kv: int


def _swapped(plan: _Launch, query, key, value, out, lse, o_part, l_part) -> tuple:
    """The split kernel's leading tensor arguments, as its module's ``arguments`` orders them
    (the outputs stand in for the partials when there is one split, the kv lengths for the
    query starts when queries end their sequences and for the packed queries' first rows,
    the query for a contiguous page table)."""
    kv, qs, ql = plan.seq
    single = plan.num_splits == 1
    return (query, key, value, out, lse, out if single else o_part, lse if single else l_part,
            kv, kv if qs is None else qs, ql, query if plan.page_table is None else plan.page_table, kv)


def run_decode(plan, query, key, value, score_buffers, mask_buffers, kv_lists,
               kv_lengths, q_offsets, q_lengths, page_table, scale: float, max_kv_len: int,
               out_strides=None, bias=None, q_rows=None, longest=0):
    """Launch a planned decode call: (out [B, Hq, Lq, Dv], lse [B, Hq, Lq]).

    ``kv_lengths`` / ``q_lengths`` are int32 tensors of B values or of one value shared
    by all, ``q_offsets`` such a tensor or None (the queries end their sequences),
    ``page_table`` an int32 [B, pages] tensor or None, ``kv_lists`` the block mask's
    four kv lists or None, ``max_kv_len`` a host bound on the lengths (for the split count),
    ``out_strides`` the output's layout (default contiguous), ``bias`` the sigmoid's bias
    for a plan of sigmoid kernels (``sigmoid_attention``; its lse is then not written).

    ``q_rows`` (int32 [B + 1], the sequences' first rows): packed queries ``[total_q, Hq, D]``,
    the longest ``longest`` rows; returns (out [total_q, Hq, Dv], lse [Hq, total_q]).
    """
    if q_rows is not None:
        return _run_packed(plan, query, key, value, score_buffers, mask_buffers, kv_lists, kv_lengths,
                           q_offsets, q_lengths, page_table, scale, q_rows, longest)
    B, Hq, Lq, _ = query.shape
    Dv = value.shape[-1]
    device = query.device
    if not plan.has_block_mask:
        visit = None
    else:
        idx, cum = visit_lists(kv_lists, plan.group)
        Hkv = Hq // plan.group
        # [B, Hkv, ...] views: a broadcast batch or head gets stride 0.
        visit = (idx.expand(B, Hkv, *idx.shape[2:]), cum.expand(B, Hkv, *cum.shape[2:]))
    if key.shape[0] == 1 and B > 1 and page_table is None:
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    S = plan.num_splits or choose_splits(device, plan.programs, -(-max(1, max_kv_len) // plan.block_n))
    spec = plan.deep_spec if _alone(device, plan.programs, S) else plan.spec
    if out_strides is None:
        out = torch.empty(B, Hq, Lq, Dv, dtype=query.dtype, device=device)
    else:
        out = torch.empty_strided((B, Hq, Lq, Dv), out_strides, dtype=query.dtype, device=device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=device)
    o_part = l_part = None
    if S > 1:
        o_part = torch.empty(B, Hq, Lq, S, Dv, dtype=torch.float32, device=device)
        l_part = torch.empty(B, Hq, Lq, S, dtype=torch.float32, device=device)
    poison(out, lse, o_part, l_part)
    args = _Launch((kv_lengths, q_offsets, q_lengths), page_table, visit, S, plan.q_tile,
                   plan.page_size, plan.sparse_q, plan.sparse_kv)
    # A call like an earlier one (same replay key) relaunches that call's kernels with its
    # new tensors only: no arguments() and no per-argument classes (launch.Replay). The key
    # holds what the launches read besides the swapped tensors and what the plan fixes.
    replay_key = (query.stride(), key.stride(), value.stride(), out.stride(),
                  *((t.shape[0], t.stride(0)) if t is not None else None for t in args.seq),
                  None if page_table is None else page_table.stride(0), S, float(scale),
                  tuple(map(id, score_buffers)), tuple(map(id, mask_buffers)),
                  None if visit is None else tuple(map(id, visit)), bias)
    slot = plan.replays.get(replay_key)
    if slot is None:
        if len(plan.replays) >= MAX_REPLAYS:
            plan.replays.clear()
        # The slot holds the launch, which holds the buffers: their ids are not reused.
        slot = plan.replays[replay_key] = [None, None]
    swapped = _swapped(args, query, key, value, out, lse, o_part, l_part)
    if slot[0] is None or not slot[0](*swapped):
        slot[0] = launch.run(spec, device, dict(
            q=query, k=key, v=value, out=out, lse=lse, o_part=o_part, l_part=l_part, seq=args.seq,
            page_table=page_table, visit=visit, score_buffers=score_buffers,
            mask_buffers=mask_buffers, scale=scale, q_tile=plan.q_tile, num_splits=S,
            page_size=plan.page_size, sparse_q=plan.sparse_q, sparse_kv=plan.sparse_kv,
            **({} if bias is None else {"bias": bias})), replay=swapped)
    if S > 1 and (slot[1] is None or not slot[1](o_part, l_part, out, lse)):
        slot[1] = launch.run(plan.merge_spec, device,
                             dict(o_part=o_part, l_part=l_part, out=out, lse=lse),
                             replay=(o_part, l_part, out, lse))
    return out, lse


def packed_view(t, num_seqs: int, longest: int):
    """[total, H, D] (or [H, total] for an LSE) as the [num_seqs, H, longest, D] view the decode
    kernel addresses (batch stride 0: its Q_ROWS give each sequence's first row)."""
    if t.dim() == 2:
        return t.as_strided((num_seqs, t.shape[0], longest), (0, t.stride(0), t.stride(1)))
    return t.as_strided((num_seqs, t.shape[1], longest, t.shape[2]), (0, t.stride(1), t.stride(0), t.stride(2)))


def _run_packed(plan, query, key, value, score_buffers, mask_buffers, kv_lists, kv_lengths, q_offsets,
                q_lengths, page_table, scale, q_rows, longest):
    """run_decode for packed queries ``[total_q, Hq, D]``: one split (the output is written in
    place, no merge), the kernel addressing views ``packed_view`` makes."""
    total_q, Hq, _ = query.shape
    B = q_rows.shape[0] - 1
    device = query.device
    visit = None
    if plan.has_block_mask:
        idx, cum = visit_lists(kv_lists, plan.group)
        Hkv = Hq // plan.group
        visit = (idx.expand(B, Hkv, *idx.shape[2:]), cum.expand(B, Hkv, *cum.shape[2:]))
    out = torch.empty(total_q, Hq, value.shape[-1], dtype=query.dtype, device=device)
    lse = torch.empty(Hq, total_q, dtype=torch.float32, device=device)
    poison(out, lse)
    if total_q:
        launch.run(plan.spec, device, dict(
            q=packed_view(query, B, longest), k=key, v=value, out=packed_view(out, B, longest),
            lse=packed_view(lse, B, longest), o_part=None, l_part=None,
            seq=(kv_lengths, q_offsets, q_lengths), page_table=page_table, visit=visit,
            score_buffers=score_buffers, mask_buffers=mask_buffers, scale=scale, q_tile=plan.q_tile,
            num_splits=1, page_size=plan.page_size, sparse_q=plan.sparse_q, sparse_kv=plan.sparse_kv,
            q_rows=q_rows))
    return out, lse


def clear_memos() -> None:
    _VISITS.clear()
    _SPLITS.clear()
    _CONSTANTS.clear()
