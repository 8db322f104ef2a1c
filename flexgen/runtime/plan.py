"""The one planner: what a call launches, from shapes, dtypes, strides, devices and mods.

Every decision that shapes a launch is made here, as a pure function of what
describes the inputs — never of data pointers, values or object identities — so
the same code runs on real tensors (the ops' implementations) and on FakeTensors
(their fake implementations, inside torch.compile and torch.export):

- ``plan_attention``: checks a ``flex_attention`` call and picks its kernel (the
  forward kernel, or the split-K decode kernel for a few queries per sequence),
  its tiles and its spec;
- ``plan_backward``: the dQ and dK/dV kernels of a planned call;
- ``plan_decode``: the static half of a ``decode_attention`` / paged call (the split count,
  which follows each call's lengths, is chosen at launch: ``kernels.decode.run_decode``).

Plans are memoized on everything they read (bounded; ``clear_memos``). Mods
arrive as the tracer's program texts (``flexgen.frontend.trace``) plus their
captured tensors; a block mask as its eight lists, block size and lengths.

The input checks (``plan_checks``) and linear attention's planning (``plan_linear``) live in
their own modules; this one re-exports their names.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..codegen.spec import KernelSpec, dot_precision, kernel_spec, mod_fields, pad_head_dim
from ..errors import expected
from ..frontend.lowering import lower
from ..frontend.trace import TracedMod
from ..kernels.decode import decode_geometry, deep_stages, next_pow2
from . import launch, tuning
from .checks import DTYPES, check_heads, check_tensor
from .options import KernelOptions
from .plan_checks import Mask, check_captured, check_mask, check_qkv, check_varlen  # (re-exported)

MAX_DECODE_QUERIES = 16          # AUTO's limit on queries per sequence for the decode kernel
# The forward kernel loads Q, K, V and stores the output through TMA descriptors by default
# for fp16 / bf16 on GPUs that have TMA (sm_90+), for calls of at least TMA_MIN_SCORES score
# elements (B * Hq * Lq * Lkv, ~150 us of kernel at D=128): the H100 measured it 0-22% faster
# than pointer loads, but its four host descriptors cost ~40 us a call, more than it gains
# on a short kernel. USE_TMA=True / False decides either way.
TMA_MIN_SCORES = 2 ** 27
# AUTO picks the Gluon forward kernel on sm_90 where it can run and the caller set no tiles,
# for calls of at least GLUON_MIN_SCORES scores (B * Hq * Lq * Lkv): the H100 measured it
# 1.17-1.32x the tl kernel at 16 heads x 16k tokens and 1.13-1.36x at 8k, but its host path
# (four Gluon descriptors, ~200 us a call) lost to the tl kernel at 2k and in places at 4k
# (benchmarks/NOTES.md, "Gluon forward").
GLUON_AUTO = True
GLUON_MIN_SCORES = 2 ** 30
# Since launches replay (descriptors copied onto the new tensors) that host path costs what the
# tl kernel's does, and at head dim 128 an H200 measured the Gluon kernel faster from 2**28
# scores on: 16 heads, 8 x 2k and 16 x 1k tokens, 7-22% in every variant whose mods read no
# captured tensor (benchmarks/NOTES.md, 2026-11-27 fifth session). There AUTO takes it from
# GLUON_MIN_SCORES_D128. At head dim 64 it lost by 2-17% at those sizes. Where a mod reads
# captured tensors it ran 0.90x the tl kernel on 2026-11-27 (the small model's document mask and
# learned relative bias, 2 x 8 heads x 4k), and 1.00-1.95x since its loads read clamped positions
# (2026-11-30, 2**28 and 2**29 scores in four shapes: documents 1.21-1.41x, a relative bias
# 1.64-1.95x, a per-key bias 1.17-1.23x; benchmarks/NOTES.md, sixth session): such mods take it
# from GLUON_MIN_SCORES_D128 as well.
GLUON_MIN_SCORES_D128 = 2 ** 28
# At head dim 256 (64-key slots) an H200 measured the Gluon kernel 1.3-1.7x the tl kernel from
# 2**28 scores on (16 heads, 4k to 16k; full, causal, ALiBi, and a document mask reading captured
# ids: 1.29x at 4 x 2k), so AUTO takes it there from GLUON_MIN_SCORES_D128, captured tensors or not.
# Except at head dim 64 under a mask whose band of keys per query (``flexgen.masks.ranges``:
# a sliding window) is at most GLUON_MIN_BAND_D64 wide: each query tile then visits ~10 key
# tiles, too few for the Gluon kernel's warp-specialized pipeline to fill and drain at this
# head dim's short tiles. The H100 measured the one-loop tl kernel 15% faster there (16k, a
# 1024 window: 0.213 against 0.250 ms; at head dim 128 the Gluon kernel stays ahead, 0.315
# against 0.377), and the Gluon kernel 8-11% faster on full and causal rows at head dim 64.
GLUON_MIN_BAND_D64 = 2048
# The Gluon dK/dV kernel's query rows per step by head dim (BLOCK_M1 sets them): at 64 both
# warpgroups' Sᵀ and dPᵀ tiles of 128 queries fit in registers beside dK and dV, unless the
# score_mod computes a tile of both positions (ALiBi per element: 125 spilled stores at 128 rows,
# none at 64; taken as key and row terms, KernelSpec.score_terms, it computes none).
GLUON_DKDV_BLOCK_M = {64: 128, 128: 64}
# AUTO takes it (sm_90; the dQ kernel by its own rules below) where it steps 128 queries, for
# calls of at least GLUON_BACKWARD_MIN_SCORES scores (GLUON_BACKWARD_MIN_SCORES_D128 at head
# dim 128): the H100 measured it 1.12-1.31x the tl
# dK/dV kernel there (16k: full 3.47 against 4.98 ms, causal 1.88 against 2.33, softcap's
# backward 8.9 against 11.7), even on document and sliding-window masks, and 12% slower on
# ALiBi at 128 rows; at 64 rows it ties the tl kernel (benchmarks/NOTES.md, "Gluon dK/dV").
GLUON_BACKWARD_MIN_SCORES = 2 ** 30
# At head dim 128, AUTO takes the Gluon backward kernels by the same rules from this size on.
# Whole backward against the tl kernels' on an H200 (2026-11-30, sixth session; 2**29 and 2**28
# scores, 8 x 16 heads x 2k and 16 x 16 x 1k): the fused kernel full 1.14x / 1.13x, causal
# 1.10x / 1.05x, a 1024-key window 1.09x / 1.06x, ALiBi 1.19x / 1.14x; a document mask's two
# Gluon kernels 1.10x / 1.10x against the Gluon dK/dV with the tl dQ kernel. Before, the Gluon
# dK/dV kernel at 64 query rows alone took this size where the mods read captured tensors per
# element (a mask_mod's on the partial tiles, a score_mod's not taken as key and row terms): a
# learned relative bias rel[h, q - kv] under a document mask 1.21-1.25x from 2**24 to 2**30
# scores (the small model's attention, 2 x 8 heads x 4k: dK/dV 136 -> 86 us), a document mask
# 1.01-1.11x, a relative bias under a causal mask 1.05-1.15x, a per-key bias 1.08-1.15x
# (benchmarks/NOTES.md, 2026-11-30 third session). Below 2**28 such calls are bound by the
# host, and their wall time read 0.59-1.08x with it.
GLUON_BACKWARD_MIN_SCORES_D128 = 2 ** 28
# The Gluon dQ kernel's keys per step (BLOCK_N2 sets them; 64 where the score_mod computes a
# tile of both positions: ALiBi per element spilled at 128 and head dim 128). AUTO takes the kernel for calls
# of at least GLUON_BACKWARD_MIN_SCORES_D128 scores at head dim 128, and of GLUON_BACKWARD_MIN_SCORES
# at head dim 64 under a block mask where it steps 128 keys. The H100 measured (16k, dQ kernel alone): head dim 128 full
# 4.11 against the tl kernel's 4.98-5.13 ms, causal 2.13 against 2.67, softcap 5.47 against
# 6.13, ALiBi 4.42 (64 keys) against 5.04; head dim 64 causal 1.38 against 1.50, document 0.56
# against 0.74, but full 2.62 against 2.44, softcap 3.88 against 3.58, ALiBi 2.81 at 64 keys
# against 2.71; and under a narrow band (a 1024-key sliding window: 0.54 against 0.87) the
# whole step is bound by the host, where the Gluon launch (five descriptors) costs more than
# the tl one: forward + backward 1.05 ms against 0.85, so AUTO keeps the tl kernel there, as
# the forward does (GLUON_MIN_BAND_D64; benchmarks/NOTES.md, "Gluon dQ").
GLUON_DQ_BLOCK_N = {64: 128, 128: 128}
GLUON_DQ_AUTO = True
# Whether AUTO's rules above also give the Gluon dQ kernel a score_mod whose captured tensors
# want gradients (it adds them with atomics, as the tl kernel does; BACKEND "gluon" takes it).
# Off: on the H200 a learned relative bias's forward + backward took 60.9 ms with it against
# 13.2 for AUTO's (16k, 16 heads, D=64, causal), 6.49 against 2.21 (D=128, documents)
# (benchmarks/NOTES.md, "Gluon dQ scatters").
GLUON_DQ_SCATTERS = False
# The fused Gluon backward (part "fused": the dK/dV kernel also adds dS K into a float32 dQ
# through TMA reduce-adds, so S, dP and the mods are computed once per tile pair: five
# products where the two kernels take seven, and one recomputed tile where they take two).
# It can run where the Gluon dK/dV kernel can, no captured tensor wants a gradient (it
# scatters none) and the backward need not be deterministic (the adds come in any order).
# AUTO (GLUON_FUSED None) takes it
# - where the score_mod's derivative is not a constant (soft-capping: the mod and its
#   derivative are the costly part of a recomputed tile) and the mod reads no tile of both
#   positions (ALiBi-like mods spill in it): H100, whole backward at 16k, 13.1 against 14.4
#   ms at head dim 128, 8.25 against 9.47 at 64;
# - at head dim 128 with no score_mod (or one taken as key and row terms, ALiBi: its backward
#   at 16k 11.01 ms fused against 11.67 for the Gluon dQ and tl dK/dV kernels, H200), under no
#   mask or a mask_mod that reads no captured tensor: its warpgroups share one dSᵀ tile and
#   issue dQ's product before dK's there. H200,
#   whole backward at 16k against the two kernels: full 11.15 against 12.24 ms, causal 6.05
#   against 6.18, a 1024-key window 1.03 against 1.25, prefix LM even; a document mask (doc
#   ids read per position, in step across the warpgroups) 1.98 against 1.66. Where its grid
#   (a program per 128 keys of a KV head) is under GLUON_FUSED_MIN_WAVES waves, the two
#   kernels take it (BACKEND "gluon" fuses there): at Llama's training shape (16 over 8 KV
#   heads, 8k, causal; 3.9 waves) the fused kernel was behind them until its producer took
#   over the rows' statistics (H200: 1.64-1.67 ms against 1.58-1.61 before; 1.43-1.45 against
#   1.49-1.50 after, cuDNN 1.42); grids of fewer waves were not measured.
# At head dim 64 the two kernels stay ahead without a score_mod (full 6.70 against 6.64 ms,
# causal 3.42 against 3.37; a document mask fused 1.06 against 1.14). Measurements:
# benchmarks/NOTES.md, "Fused backward" and 2026-11-27. True: wherever it can run; False: never.
GLUON_FUSED = None
GLUON_FUSED_MIN_WAVES = 3.5
# Its query rows per step (BLOCK_M1 sets them): dQ's chunks beside dK and dV spill at 128.
GLUON_FUSED_BLOCK_M = {64: 64, 128: 64}
LARGE_SPARSE_BLOCK = 1 << 30     # torch's "no block mask" marker (_create_empty_block_mask)
_MEMO_MAX = 512


@dataclass
class AttentionPlan:
    """A checked ``flex_attention`` call: which kernel, with what, and its outputs."""
    kernel: str                  # "forward" or "decode"
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lkv: int
    D: int
    Dv: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    score: object                # LoweredMod or None
    mask: object                 # LoweredMod or None (None also for a mask that keeps everything)
    score_traced: object         # TracedMod or None (what plan_backward derives from)
    mask_info: Mask | None
    options: KernelOptions
    spec: KernelSpec | None = None           # the forward kernel (TMA where chosen)
    pointer_spec: KernelSpec | None = None   # its pointer variant, for inputs TMA cannot address
    tl_spec: KernelSpec | None = None        # the tl kernel where spec is the Gluon one (AUTO's pick)
    tune_blocks: tuple | None = None         # sparse block sizes the autotuner's tiles divide
    decode: object = None                    # DecodePlan for the decode kernel
    out_strides: tuple = ()                  # the output keeps the query's stride order
    use_tma: bool = False                    # the [B, H, L, D] tensors through TMA descriptors
    # (score_mod's, mask_mod's) captured-tensor loads proven in bounds for the call
    # (bounds_check.proven_loads): its kernels read them without checks.
    proven: tuple = ((), ())
    # Launch-time state that belongs to the plan: its replays and backward plans.
    replays: dict = field(default_factory=dict, repr=False)
    backward: dict = field(default_factory=dict, repr=False)


def _mask_info(block_lists, block_size, mask_lengths) -> Mask | None:
    if not block_lists:
        return None
    kv_num, kv_idx = block_lists[0], block_lists[1]
    return Mask(tuple(block_size), tuple(mask_lengths), kv_num.shape[0], kv_num.shape[1],
                kv_idx.shape[2], kv_idx.shape[3])


def _key(*tensors) -> tuple:
    """What a plan reads of tensors: shape, strides, dtype, device (never data or identity)."""
    # (t.shape is a torch.Size, a tuple: hashed and compared as one, without a copy.)
    return tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors)


def _allow_tf32(query) -> bool | None:
    """``torch.backends.cuda.matmul.allow_tf32`` for a query on a GPU (fp32 dots may take tf32:
    part of a plan's key), else None. Read as that attribute reads it, without its module's
    ``__getattr__`` (~0.5 us on the dev CPU, ~1.5 on the GPU machines' host: an eighth of a warm
    plan lookup)."""
    return torch._C._get_cublas_allow_tf32() if query.device.type == "cuda" else None


def _memo(cache: dict, key, make):
    try:
        hit = cache.get(key)
    except TypeError:            # symbolic sizes (dynamic shapes): plan without the memo
        return make()
    if hit is None:
        if len(cache) >= _MEMO_MAX:
            cache.clear()
        hit = cache[key] = make()
    return hit


# ---------------------------------------------------------------------------------- tiles

def tiles(kernel, options: KernelOptions, part: str, head_dim: int, dtype: str, device,
          sparse_q: int, sparse_kv: int) -> dict:
    """BLOCK_M, BLOCK_N, num_warps, num_stages for ``kernel`` (a name or names, as
    ``tuning.table_row`` takes them): the tuning table's, with the
    caller's choices on top, tiles dividing the sparse blocks."""
    opts = tuning.options(kernel, head_dim, dtype, device, sparse_q, sparse_kv)
    chosen = options.tiles(part)
    opts.update(chosen)
    names = {"dq": {"BLOCK_M": "BLOCK_M2", "BLOCK_N": "BLOCK_N2"},
             "dkdv": {"BLOCK_M": "BLOCK_M1", "BLOCK_N": "BLOCK_N1"}}.get(part, {})
    for k, sparse, side in (("BLOCK_M", sparse_q, "query"), ("BLOCK_N", sparse_kv, "key")):
        if k not in chosen and sparse % 16:
            # No tile of the kernel divides the mask's blocks: the mask is the thing to change
            # (torch's decoding masks take BLOCK_SIZE=(1, ...), which only the decode kernel reads).
            raise expected("block_mask.BLOCK_SIZE", f"a {side} block that is a multiple of 16 for "
                           f"this call ({'its backward' if part else 'the forward kernel'})", sparse,
                           "build the mask with BLOCK_SIZE=128 (or 64, 32, 16); a query block of 1 "
                           "serves calls of at most 16 queries without gradients (the decode kernel)")
        check_tile(names.get(k, k), opts[k], sparse)
    return opts


def check_tile(name: str, value: int, sparse: int) -> None:
    """A tile of a program (``name``: its kernel_options key) must be a power of two >= 16 dividing
    the sparse block (128 without a block mask): the same rule for every kernel, so a call is
    accepted or refused alike whichever kernel its shape takes."""
    if value < 16 or value & (value - 1) or sparse % value:
        raise expected(f"kernel_options[{name!r}]", f"a power of two >= 16 dividing the sparse block {sparse}",
                       value, "use 64 or 128 (or a smaller power of two)")


def _use_tma(options: KernelOptions, B, Hq, Lq, Lkv, dtype, device) -> bool:
    if options.USE_TMA is not None:
        return options.USE_TMA
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and B * Hq * Lq * Lkv >= TMA_MIN_SCORES)


def _tma_shapes_ok(query, key, value) -> bool:
    """Whether TMA can address these layouts (alignment of the bases is checked at launch)."""
    from ..codegen.spec import tma_layout_ok, has_tma
    if not has_tma(query.device):
        return False
    B, H, L, _ = query.shape
    Dv = value.shape[3]
    out = ((B, H, L, Dv), (H * L * Dv, L * Dv, Dv, 1))
    return (all(tma_layout_ok(t.shape, t.stride(), t.element_size()) for t in (query, key, value))
            and tma_layout_ok(out[0], out[1], query.element_size()))


def out_strides(query, Dv: int) -> tuple:
    """Strides of a [B, H, L, Dv] output laid out in the query's stride order (as torch does)."""
    shape = list(query.shape[:3]) + [Dv]
    order = sorted(range(4), key=lambda d: (query.stride(d), d), reverse=True)
    order.remove(3)
    order.append(3)              # the head dim stays innermost
    strides, step = [0] * 4, 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


# ---------------------------------------------------------------------------------- attention

_ATTENTION: dict = {}


def plan_attention(query, key, value, score_mod: str, score_buffers, mask_mod: str, mask_buffers,
                   block_lists, block_size, mask_lengths, scale, enable_gqa: bool, options: str,
                   want_max: bool = False, positions: tuple | None = None) -> AttentionPlan:
    """Check a ``flex_attention`` call and decide its kernel (memoized on what it reads).

    ``want_max``: the call also asks for each row's largest score (the forward kernel
    writes it; the decode kernel does not, so such calls take the forward kernel).
    ``positions``: where the kernels' mods see other positions than the call's shapes give
    (varlen's packed sequences), (b, h, q_idx, kv_idx) ranges holding all of them, for the
    proof of loads (``bounds_check.proven_loads``); the host's index check takes b's and h's
    from it (exact) and q_idx's and kv_idx's from the shapes, as before.
    """
    memo = (_key(query, key, value), score_mod, _key(*score_buffers), mask_mod, _key(*mask_buffers),
            _key(*block_lists[:2]), tuple(block_size), tuple(mask_lengths), scale, enable_gqa, options,
            want_max, _allow_tf32(query), positions)
    return _memo(_ATTENTION, memo, lambda: _plan_attention(
        query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, block_lists,
        block_size, mask_lengths, scale, enable_gqa, options, want_max, positions))


def _plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, block_lists,
                    block_size, mask_lengths, scale, enable_gqa, options, want_max,
                    positions) -> AttentionPlan:
    info = _mask_info(block_lists, block_size, mask_lengths)
    check_qkv(query, key, value, enable_gqa, None if info is None else info.batch)
    B, Hq, Lq, D = query.shape
    Hkv, Lkv, Dv = key.shape[1], key.shape[2], value.shape[3]
    device, dtype = query.device, query.dtype
    opts = KernelOptions.from_text(options)
    score_traced = TracedMod.from_graph(score_mod, score_buffers) if score_mod else None
    mask_traced = TracedMod.from_graph(mask_mod, mask_buffers) if mask_mod else None
    score = None if score_traced is None else lower(score_traced)
    mask = None if mask_traced is None else lower(mask_traced)
    for traced in (score_traced, mask_traced):
        if traced is not None:
            check_captured(traced, device)
    check_mask(info, mask, B, Hq, Lq, Lkv)
    proven = ((), ())
    if any(t is not None and t.buffers for t in (score_traced, mask_traced)):
        # Captured tensors indexed outside their bounds raise, as torch's indexing would
        # (imported here: sympy, which a warm restart of mods without tensors never loads);
        # loads the same bounds prove inside their tensors are read without checks.
        from ..frontend.bounds_check import check_call_indices, proven_loads
        ranges = positions or (B, Hq, Lq, Lkv)
        check_call_indices(score_traced, mask_traced, *ranges[:2], Lq, Lkv)
        proven = (proven_loads(score_traced, *ranges),
                  proven_loads(None if mask is None or mask.is_true else mask_traced, *ranges))
    if info is not None and mask_traced is None:
        raise expected("block_mask", "a mask with its mask_mod", "lists without a mask_mod",
                       "build it with create_block_mask (or give BlockMask.mask_mod)")
    plan = AttentionPlan("forward", B, Hq, Hkv, Lq, Lkv, D, Dv, dtype, device, scale, score,
                         None if mask is None or mask.is_true else mask, score_traced, info, opts,
                         out_strides=out_strides(query, Dv), proven=proven)
    # (An empty batch or query takes the forward kernel, which launches nothing for it.)
    few = 0 < Lq <= MAX_DECODE_QUERIES and B > 0 and not want_max
    plan.use_tma = _use_tma(opts, B, Hq, Lq, Lkv, dtype, device) and _tma_shapes_ok(query, key, value)
    if opts.BACKEND == "gluon":
        gluon, why = _gluon_spec(query, key, value, score, mask, info, opts, proven)
        if why is not None:
            raise expected("kernel_options['BACKEND']", "'gluon' only where the Gluon kernel runs",
                           why, "use BACKEND 'AUTO' or 'tl' (the Triton-language kernel)")
    if opts.BACKEND == "TRITON_DECODE" or (opts.BACKEND in ("AUTO", "tl") and few):
        if want_max:
            raise expected("kernel_options['BACKEND']", "'AUTO' or 'TRITON' with return_aux max_scores",
                           "'TRITON_DECODE'", "the decode kernel does not write max scores")
        plan.kernel = "decode"
        plan.decode = plan_decode(query, key, value, score_traced, mask_traced, info, enable_gqa,
                                  opts, paged=False)
        return plan
    sparse_q, sparse_kv = info.block_size if info is not None else (128, 128)
    names = tuning.forward_kernel(score, mask, info is not None)
    t = tiles(names, opts, "", max(D, Dv), DTYPES[dtype], device, sparse_q, sparse_kv)
    use_tma = plan.use_tma

    def spec(tma):
        return kernel_spec(
            "forward", **mod_fields(score, mask, proven), qk_head=D, v_head=Dv, dtype=DTYPES[dtype],
            has_block_mask=info is not None, block_m=t["BLOCK_M"], block_n=t["BLOCK_N"],
            num_warps=t["num_warps"], num_stages=t["num_stages"],
            dot_precision=dot_precision(query), use_tma=tma)

    plan.spec = spec(use_tma)
    plan.pointer_spec = spec(False) if use_tma else plan.spec
    plan.tune_blocks = None if opts.sets_tiles else (sparse_q, sparse_kv)
    if (opts.BACKEND == "AUTO" and GLUON_AUTO and not opts.sets_tiles
            and B * Hq * Lq * Lkv >= gluon_min_scores(D)
            and not _narrow_band(mask, D)):
        gluon, _ = _gluon_spec(query, key, value, score, mask, info, opts, proven)
    elif opts.BACKEND != "gluon":
        gluon = None
    if gluon is not None:
        # The tl kernel stays at hand: its pointer variant for inputs TMA cannot address at
        # launch, itself for a Triton the Gluon kernel does not compile on (run_forward).
        plan.tl_spec, plan.spec = plan.spec, gluon
        plan.pointer_spec = spec(False)
        plan.tune_blocks = None      # the tl autotuner's tiles are not the Gluon kernel's
    return plan


def gluon_min_scores(D: int) -> int:
    """The fewest scores for which AUTO takes the Gluon forward kernel at head dim ``D`` (as the
    kernel pads it): GLUON_MIN_SCORES_D128 at 128 and 256, else GLUON_MIN_SCORES."""
    return GLUON_MIN_SCORES_D128 if pad_head_dim(D) in (128, 256) else GLUON_MIN_SCORES


def _narrow_band(mask, D: int) -> bool:
    """Whether AUTO keeps the tl kernel for this mask at head dim ``D``, as the kernel pads it
    (GLUON_MIN_BAND_D64)."""
    band = None if mask is None or pad_head_dim(D) != 64 else mask.kv_range
    return band is not None and None not in band[:2] and band[1] - band[0] + 1 <= GLUON_MIN_BAND_D64


# Head dims the Gluon kernels take (equal for keys and values). The forward takes 256 too, with
# 64-key slots: its 128 query rows (64 KB) and a ring of two 64-key K and V slots (128 KB) fill
# shared memory; and any head dim these pad (80 or 96 as 128: TMA zero-fills the padding). The
# backward kernels keep tiles of dK, dV (or dQ) beside Sᵀ and dPᵀ in a warpgroup's registers,
# which at 256 they do not fit: the tl kernels run those backwards, and padded ones.
GLUON_HEAD_DIMS = (64, 128, 256)
GLUON_BACKWARD_HEAD_DIMS = (64, 128)


def gluon_unavailable(query, D: int, Dv: int) -> str | None:
    """Why the Gluon forward kernel cannot run this call (None where it can): a pure function
    of the device, dtype, head dims and the installed Triton."""
    cuda = query.device.type == "cuda"
    capability = torch.cuda.get_device_capability(query.device) if cuda else None
    return gluon_refusal(query.device.type, capability, query.dtype, D, Dv)


def gluon_refusal(device_type: str, capability, dtype, D: int, Dv: int) -> str | None:
    """``gluon_unavailable`` on plain values (what the tests drive without a GPU)."""
    from ..codegen.gluon import gluon_api_missing
    if device_type != "cuda":
        return (f"tensors on {device_type} (the Gluon kernel runs on CUDA GPUs only; "
                "Triton's interpreter does not run Gluon)")
    if tuple(capability) != (9, 0):
        return f"a GPU of compute capability {tuple(capability)} (the Gluon kernel is for sm_90, Hopper)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (the Gluon kernel takes float16 / bfloat16)"
    if D != Dv or pad_head_dim(D) not in GLUON_HEAD_DIMS:
        return (f"head dims qk={D}, v={Dv} (the Gluon kernel takes equal head dims from 33 to 256: "
                "64, 128 or 256, or less padded to one of them)")
    missing = gluon_api_missing()
    if missing:
        return f"Triton {triton_version()} whose Gluon API lacks {missing}"
    return None


def triton_version() -> str:
    import triton
    return triton.__version__


def _tma_refusal(query, key, value) -> str | None:
    """Why TMA cannot step through these layouts (None where it can), for the Gluon kernels."""
    if _tma_shapes_ok(query, key, value):
        return None
    row_bytes = query.shape[3] * query.element_size()
    if row_bytes % 16:
        return (f"head dim {query.shape[3]} ({row_bytes}-byte rows; TMA steps rows of a multiple of "
                "16 bytes: a head dim that is a multiple of 8)")
    return "query / key / value layouts TMA cannot step through (make them contiguous)"


def _gluon_spec(query, key, value, score, mask, info, opts, proven=((), ())):
    """(the Gluon forward spec, None) or (None, why it cannot run this call)."""
    B, Hq, Lq, D = query.shape
    Dv, dtype = value.shape[3], query.dtype
    why = gluon_unavailable(query, D, Dv) or _tma_refusal(query, key, value)
    sparse_q, sparse_kv = info.block_size if info is not None else (128, 128)
    cols = pad_head_dim(D)          # the tiles' columns
    block_n = opts.BLOCK_N or (128 if sparse_kv % 128 == 0 and cols <= 128 else 64)
    if why is None and (opts.BLOCK_M not in (None, 128) or sparse_q % 128):
        why = (f"BLOCK_M {opts.BLOCK_M} / a block mask's Q_BLOCK {sparse_q} (the Gluon kernel takes "
               "128 query rows, two warpgroups of 64, inside one sparse block)")
    if why is None and (block_n not in (64, 128) or sparse_kv % block_n):
        why = f"BLOCK_N {block_n} with KV_BLOCK {sparse_kv} (the Gluon kernel takes 64 or 128 dividing it)"
    # K / V ring depth: three slots where they fit beside Q with room to spare (D=64; D=128 with
    # 64-key slots), else two (D=128: 2 x 64 KB, D=256: 2 x 64 KB of 64-key slots).
    stages = opts.num_stages or (3 if _forward_shared_bytes(block_n, 3, cols) < GLUON_SHARED_BYTES else 2)
    if why is None and _forward_shared_bytes(block_n, stages, cols) > GLUON_SHARED_BYTES:
        why = (f"BLOCK_N {block_n} and {stages} stages at head dim {D} (more shared memory than the "
               "Gluon kernel has; BLOCK_N 64 and 2 stages fit every head dim it takes)")
    if why is not None:
        return None, why
    return kernel_spec("forward_gluon", **mod_fields(score, mask, proven), qk_head=D, v_head=Dv,
                       dtype=DTYPES[dtype], has_block_mask=info is not None, block_m=128,
                       block_n=block_n, num_warps=4, num_stages=stages, use_tma=True), None


# ---------------------------------------------------------------------------------- decode

@dataclass
class DecodePlan:
    """The static half of a decode call: its kernels and geometry (``plan_decode``)."""
    spec: object                 # the split kernel
    deep_spec: object            # the same with deeper pipelining, for programs alone on an SM
    merge_spec: object           # the kernel combining the splits
    q_tile: int
    page_size: int               # 1 for contiguous keys
    capacity: int                # keys per sequence the key tensor / page table can hold
    programs: int                # (batch, kv head, query tile) work items
    block_n: int
    num_splits: int | None       # the caller's NUM_SPLITS, else None (chosen per call)
    group: int                   # query heads per kv head
    has_block_mask: bool
    sparse_q: int
    sparse_kv: int
    replays: dict = field(default_factory=dict, repr=False)


_DECODE: dict = {}


def plan_decode(query, key, value, score_traced, mask_traced, info, enable_gqa, options, *,
                paged: bool, page_table_shape=None) -> DecodePlan:
    """Check the static inputs of a decode call and decide its kernels.

    ``info`` is the block mask (``flexgen.runtime.plan.Mask``) or None; ``mask_traced`` is
    its mask_mod, or a mask_mod applied element-wise to every key when ``info`` is None.
    Paged calls give K/V caches ``[pages, page_size, Hkv, D]`` and the page table's shape.
    """
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
        capacity = page_table_shape[1] * page_size
    else:
        if key.shape[0] not in (1, B) or value.shape[0] != key.shape[0]:
            raise expected("key/value batch", f"batch {B} like query (or 1)",
                           f"{key.shape[0]} and {value.shape[0]}", "give query, key and value one batch size")
        if key.shape[1:3] != value.shape[1:3]:
            raise expected("value", f"the key's heads and length {tuple(key.shape[1:3])}",
                           tuple(value.shape[1:3]), "key and value must come from the same positions")
        _, Hkv, capacity, Dk = key.shape
        page_size = 1
    if Dk != D:
        raise expected("key.shape[-1]", f"the query's head dim {D}", Dk,
                       "query and key need the same head dim (value's may differ)")
    if B == 0:
        raise expected("query/key", "at least one batch row", f"query {list(query.shape)}, "
                       f"key {list(key.shape)}", "skip the call for an empty batch")
    check_heads(Hq, Hkv, enable_gqa)
    memo = (tuple(query.shape), query.dtype, device, tuple(key.shape), tuple(value.shape), paged,
            None if page_table_shape is None else tuple(page_table_shape),
            None if score_traced is None else score_traced.graph,
            None if mask_traced is None else mask_traced.graph, info, options,
            dot_precision(query))
    hit = _DECODE.get(memo)
    if hit is not None:
        return hit
    G = Hq // Hkv
    score = None if score_traced is None else lower(score_traced)
    mask = None if mask_traced is None else lower(mask_traced)
    sparse_q, sparse_kv = info.block_size if info is not None else (None, None)
    for name, sparse in (("BLOCK_M", sparse_q), ("BLOCK_N", sparse_kv)):
        if getattr(options, name) is not None:      # (the forward kernel's rule: check_tile)
            check_tile(name, getattr(options, name), sparse or 128)
    q_tile, block_m, block_n, warps, stages = decode_geometry(device, G, Lq, max(D, Dv), sparse_q)
    if options.BLOCK_M is not None:
        # The query rows of a program: G heads' q_tile queries each.
        q_tile = max(1, min(q_tile, options.BLOCK_M // next_pow2(G)))
        block_m = max(16, next_pow2(G) * q_tile)
    block_n = options.BLOCK_N or block_n
    if sparse_kv is not None:
        block_n = min(block_n, sparse_kv)
    warps = options.num_warps or warps
    stages = options.num_stages or stages

    def decode_spec(num_stages):
        return kernel_spec(
            "decode", **mod_fields(score, mask, terms=False), qk_head=D, v_head=Dv, dtype=DTYPES[query.dtype],
            has_block_mask=info is not None, block_m=block_m, block_n=block_n,
            num_warps=warps, num_stages=num_stages, dot_precision=dot_precision(query))

    spec = decode_spec(stages)
    deep = deep_stages(device, max(D, Dv), stages, options)
    plan = DecodePlan(
        spec=spec, deep_spec=spec if deep == stages else decode_spec(deep),
        merge_spec=kernel_spec("decode_merge", v_head=Dv, dtype=DTYPES[query.dtype],
                               block_m=64 if device.type != "cuda" else 16, num_warps=4),
        q_tile=q_tile, page_size=page_size, capacity=capacity,
        programs=B * Hkv * -(-Lq // q_tile), block_n=block_n, num_splits=options.NUM_SPLITS,
        group=G, has_block_mask=info is not None, sparse_q=sparse_q or 16,
        sparse_kv=sparse_kv or block_n)
    if len(_DECODE) >= _MEMO_MAX:
        _DECODE.clear()
    _DECODE[memo] = plan
    return plan


def plan_decode_call(query, key, value, score_mod: str, score_buffers, mask_mod: str, mask_buffers,
                     block_lists, block_size, mask_lengths, page_table, enable_gqa, options: str):
    """``plan_decode`` from what the decode op carries (program texts, lists, option text)."""
    score = TracedMod.from_graph(score_mod, score_buffers) if score_mod else None
    mask = TracedMod.from_graph(mask_mod, mask_buffers) if mask_mod else None
    return plan_decode(query, key, value, score, mask, _mask_info(block_lists, block_size, mask_lengths),
                       enable_gqa, KernelOptions.from_text(options), paged=page_table is not None,
                       page_table_shape=None if page_table is None else tuple(page_table.shape))


# ---------------------------------------------------------------------------------- backward

def plan_backward(plan: AttentionPlan, query, key, value, grad_slots: tuple):
    """The dQ and dK/dV kernels of a planned call (``flexgen.kernels.backward``), memoized
    on the plan; raises GradientError naming the mod before anything runs."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    hit = plan.backward.get((grad_slots, deterministic))
    if hit is None:
        from ..kernels.backward import backward_specs, delta_spec
        info, opts = plan.mask_info, plan.options
        sparse_q, sparse_kv = info.block_size if info is not None else (128, 128)
        head_dim = max(plan.D, plan.Dv)
        dq, dkdv = (tiles(kernel, opts, part, head_dim, DTYPES[plan.dtype], plan.device,
                          sparse_q, sparse_kv)
                    for kernel, part in (("backward.dq:scatter" if grad_slots else "backward.dq", "dq"),
                                         ("backward.dkdv", "dkdv")))
        use_tma = plan.use_tma
        bw = backward_specs(
            plan.score_traced, plan.mask, grad_slots, qk_head=plan.D, v_head=plan.Dv,
            dtype=DTYPES[plan.dtype], has_block_mask=info is not None,
            dot_precision=dot_precision(query), use_tma=use_tma, dq_tiles=dq, dkdv_tiles=dkdv,
            tune_blocks=None if opts.sets_tiles else (sparse_q, sparse_kv), deterministic=deterministic,
            proven=plan.proven)
        gluon = gluon_dq = None
        auto = opts.BACKEND == "AUTO" and not opts.sets_tiles
        scores = plan.B * plan.Hq * plan.Lq * plan.Lkv
        big = opts.BACKEND == "gluon" or (auto and scores >= (
            GLUON_BACKWARD_MIN_SCORES_D128 if plan.D == 128 else GLUON_BACKWARD_MIN_SCORES))
        if big:
            gluon, _ = gluon_backward_spec(plan, query, key, value, bw.dkdv)
            # At 64 query rows it ties the tl kernel on plain rows (H100): AUTO keeps the tl
            # kernel there (the fused kernel may take them), and for a score_mod computing a
            # tile of both positions, but not where the mods read captured tensors per element.
            if auto and gluon is not None and gluon.block_m < 128 and (
                    not _loads_per_element(bw.dkdv) or _tile_of_both_positions(bw.dkdv)):
                gluon = None
        if big:
            gluon_dq, _ = gluon_backward_spec(plan, query, key, value, bw.dq)
            # AUTO at head dim 64: ahead under a block mask wider than a narrow band, at 128 keys.
            if opts.BACKEND == "AUTO" and (
                    not GLUON_DQ_AUTO or (bw.dq.scatters and not GLUON_DQ_SCATTERS) or (plan.D == 64 and (
                        plan.mask_info is None or gluon_dq is None or gluon_dq.block_n < 128
                        or _narrow_band(plan.mask, 64)))):
                gluon_dq = None
        fused = None
        # (a size rule, AUTO's alone, as GLUON_BACKWARD_MIN_SCORES is)
        fused_waves = (launch.waves(plan.B * plan.Hkv * -(-plan.Lkv // 128), plan.device)
                       if opts.BACKEND == "AUTO" else float("inf"))
        if big and (opts.BACKEND == "gluon" or gluon is not None or gluon_dq is not None) and _fuses(
                bw, deterministic, fused_waves):
            fused, _ = gluon_backward_spec(plan, query, key, value, dataclasses.replace(bw.dkdv, part="fused"))
        hit = plan.backward[(grad_slots, deterministic)] = dataclasses.replace(
            bw, gluon_dkdv=gluon, gluon_dq=gluon_dq, gluon_fused=fused,
            fused_delta=None if fused is None else delta_spec(plan.D, plan.Dv, query.dtype))
    return hit


def _fuses(bw, deterministic: bool, waves: float) -> bool:
    """Whether the fused Gluon backward may take this backward (GLUON_FUSED); ``waves``: its
    grid's waves of programs over the SMs."""
    if GLUON_FUSED is False or deterministic or bw.dq.scatters:
        return False
    spec = bw.dkdv
    if GLUON_FUSED:
        return True
    # (A score_mod taken as key and row terms adds no per-element work: as plain rows.)
    if (spec.score is None or spec.score_terms is not None) and spec.qk_head == 128 and not spec.mask_buffers:
        return waves >= GLUON_FUSED_MIN_WAVES
    if spec.score is None or _tile_of_both_positions(spec):
        return False
    if not spec.score_grad_const:
        return True
    # A score_mod reading a captured tensor per element at one position (a per-key bias): the
    # fused kernel loads it once per tile pair, the two kernels twice (H200, score + bias[b,
    # kv_idx] under a causal mask, 16 x 16k and 4 x 4k: -9.1% / -9.5% at head dim 128, -7.0% /
    # -4.7% at 64; a document mask's loads, on partial tiles only, did not pay for it).
    if _loads_per_element(spec) and _score_positions(spec) == 1 and not spec.mask_buffers:
        return waves >= GLUON_FUSED_MIN_WAVES
    return False


def _loads_per_element(spec) -> bool:
    """Whether a backward spec's mods read captured tensors per element: a mask_mod's (on the
    partial tiles), a score_mod's not taken as key and row terms."""
    return bool(spec.mask_buffers) or (spec.score_terms is None and bool(spec.score_buffers))


def _score_positions(spec) -> int:
    """How many of q_idx and kv_idx a spec's score_mod reads, inside load indices too
    (``Snippet.positions``); 0 without a score_mod."""
    return 0 if spec.score is None else len(spec.score.positions)


def _tile_of_both_positions(spec) -> bool:
    """Whether a spec's score_mod computes a tile of both positions (or may: its free names
    unknown), which spills in the fused kernel (ALiBi-like arithmetic; a table read at both,
    ``Snippet.positions``, is a load, not such a tile)."""
    return spec.score is not None and (spec.score.free is None or {"q_idx", "kv_idx"} <= set(spec.score.free))


# An sm_90 program's shared memory, less what the compiler reserves (barriers, scratch).
GLUON_SHARED_BYTES = 224 * 1024


def _fused_shared_bytes(tiles: dict, stages: int, D: int) -> int:
    """The fused kernel's shared memory (16-bit tiles): K and V, the Q / dO ring, dSᵀ, and
    two float32 dQ stages per consumer warpgroup of at most min(D, 4096 / BLOCK_M) columns
    (fewer where the warpgroups split dQ's columns)."""
    m, n = tiles["BLOCK_M"], tiles["BLOCK_N"]
    return 2 * (2 * n * D + 2 * stages * m * D + n * m) + 4 * 2 * (n // 64) * m * min(D, 4096 // m)


def _dq_shared_bytes(tiles: dict, stages: int, D: int, rotates: bool) -> int:
    """The Gluon dQ kernel's shared memory (16-bit tiles): Q and dO, a ring of K and V slots,
    and where a captured tensor's gradient is summed per tile diagonal, each consumer
    warpgroup's [64, BLOCK_N] float32 tile its rotation reads back (common.scatter_gradients)."""
    m, n = tiles["BLOCK_M"], tiles["BLOCK_N"]
    return 2 * (2 * m * D + 2 * stages * n * D) + (4 * m * n if rotates else 0)


def _forward_shared_bytes(block_n: int, stages: int, D: int) -> int:
    """Shared memory of the Gluon forward's tiles: two 64-row Q halves and a ring of K and V slots."""
    return 2 * (128 * D + 2 * stages * block_n * D)


def gluon_backward_spec(plan: AttentionPlan, query, key, value, spec):
    """(the Gluon kernel of a backward part, None) or (None, why it cannot run this call), from
    the tl spec of that part (``dq`` or ``dkdv``: the same mods, derivatives and head dims).

    A program owns 64 rows per consumer warpgroup (dQ: queries, BLOCK_M2 / BLOCK_M; dK/dV:
    keys, BLOCK_N1 / BLOCK_N; else 128 where the sparse block allows, else 64) and steps
    through the other side (dQ: keys, BLOCK_N2 / BLOCK_N; dK/dV: queries, BLOCK_M1 / BLOCK_M;
    else GLUON_DQ_BLOCK_N's / GLUON_DKDV_BLOCK_M's where the sparse block and the score_mod
    allow, else 64). The dQ kernel scatters a captured tensor's gradient as the tl one does (the
    fused kernel does not: the two kernels take such a backward). A reason it cannot run is an
    InputError under BACKEND "gluon" (the fused kernel is optional: the two kernels run instead)."""
    opts, info = plan.options, plan.mask_info
    dq = spec.part == "dq"
    kernel = "dQ" if dq else "dK/dV"
    why = gluon_unavailable(query, plan.D, plan.Dv)
    if why is None and plan.D not in GLUON_BACKWARD_HEAD_DIMS:
        why = f"head dim {plan.D} (the Gluon backward kernels take 64 or 128)"
    why = why or _tma_refusal(query, key, value)
    sparse = dict(zip(("BLOCK_M", "BLOCK_N"), info.block_size if info is not None else (128, 128)))
    chosen = opts.tiles(spec.part)
    own, step = ("BLOCK_M", "BLOCK_N") if dq else ("BLOCK_N", "BLOCK_M")
    tiles = {own: chosen.get(own, 128 if sparse[own] % 128 == 0 else 64)}
    steps = {"dq": GLUON_DQ_BLOCK_N, "dkdv": GLUON_DKDV_BLOCK_M,
             "fused": GLUON_FUSED_BLOCK_M}[spec.part].get(plan.D, 64)
    # A score_mod of both positions costs registers a tile (its position tiles), unless the
    # kernel takes it as key and row terms (KernelSpec.score_terms: no position tile).
    if spec.score is not None and spec.score_terms is None and (
            spec.score.free is None or {"q_idx", "kv_idx"} <= set(spec.score.free)):
        steps = 64
    # (dQ: a diagonal sum's rotation takes 64 KB more shared memory at 128 keys, which at head
    # dim 128 do not fit beside a ring of two; 64 keys do, three deep.)
    rotates = dq and any(g.reduce_diag for g in spec.scatters)
    if rotates and "BLOCK_N" not in chosen and _dq_shared_bytes(
            {"BLOCK_M": tiles["BLOCK_M"], "BLOCK_N": steps}, 2, plan.D, True) > GLUON_SHARED_BYTES:
        steps = 64
    tiles[step] = chosen.get(step, steps if sparse[step] % steps == 0 else 64)
    for name in ("BLOCK_M", "BLOCK_N"):
        if why is None and (tiles[name] not in (64, 128) or sparse[name] % tiles[name]):
            what, block = ("query rows", "Q_BLOCK") if name == "BLOCK_M" else ("keys", "KV_BLOCK")
            why = (f"{name}{'2' if dq else '1'} {tiles[name]} with {block} {sparse[name]} (the Gluon {kernel} "
                   f"kernel takes 64 or 128 {what} dividing it)")
    # The ring's depth: what fits in shared memory beside the tiles a program keeps (D=128:
    # 64 KB; a slot of 64 streamed rows 32 KB, of 128 rows 64 KB; the fused kernel's dSᵀ and
    # dQ stages take 48 KB more).
    stages = opts.num_stages or (2 if plan.D == 128 and (tiles[step] == 128 or spec.part == "fused") else 3)
    if why is None and spec.part == "fused" and _fused_shared_bytes(tiles, stages, plan.D) > GLUON_SHARED_BYTES:
        why = (f"BLOCK_M1 {tiles['BLOCK_M']} and {stages} stages at head dim {plan.D} (more shared memory than "
               "the fused kernel has)")
    if why is None and dq and _dq_shared_bytes(tiles, stages, plan.D, rotates) > GLUON_SHARED_BYTES:
        why = (f"BLOCK_N2 {tiles['BLOCK_N']} and {stages} stages at head dim {plan.D}"
               f"{' with a gradient summed per diagonal' if rotates else ''} (more shared memory than the "
               "dQ kernel has)")
    # (The fused kernel is optional: where it cannot run, the two kernels do.)
    if why is not None and opts.BACKEND == "gluon" and spec.part != "fused":
        raise expected("kernel_options['BACKEND']", "'gluon' only where the Gluon kernels run",
                       f"a backward the Gluon {kernel} kernel cannot run: {why}",
                       "use BACKEND 'AUTO' or 'tl' (the Triton-language kernels)")
    if why is not None:
        return None, why
    return dataclasses.replace(spec, template="backward_gluon", block_m=tiles["BLOCK_M"],
                               block_n=tiles["BLOCK_N"], num_warps=4, num_stages=stages, use_tma=True), None


# ---------------------------------------------------------------------------------- varlen attention
#
# varlen_attention packs sequences along one axis ([total, H, D] with int32 offsets). Its plan
# is flex_attention's for the packed tensors viewed as one batch row [1, H, total, D] (views,
# no copy): the same checks, lowering, tiles and backward derivation, with every spec switched
# to its varlen form (the mask's band in place of block lists, the sequences found on the
# device from the offsets).

_VARLEN: dict = {}


@dataclass
class VarlenPlan:
    """A checked ``varlen_attention`` call: flex_attention's plan of the packed views, and its
    varlen forward spec (the Gluon kernel's where AUTO or "gluon" takes it, with the tl
    kernel's in ``tl_spec`` for inputs TMA cannot address or a Triton it does not compile on)."""
    base: AttentionPlan
    spec: KernelSpec
    num_seqs: int
    backward: dict = field(default_factory=dict, repr=False)
    tl_spec: KernelSpec | None = None


def packed_view(t):
    """[total, H, D] as the [1, H, total, D] view flex_attention's planner reads (no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def plan_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, score_mod: str, score_buffers,
                mask_mod: str, mask_buffers, scale, enable_gqa: bool, options: str) -> VarlenPlan:
    """Check a ``varlen_attention`` call and decide its kernel (memoized on what it reads)."""
    memo = (_key(query, key, value, cu_seqlens_q, cu_seqlens_k), score_mod, _key(*score_buffers),
            mask_mod, _key(*mask_buffers), scale, enable_gqa, options, _allow_tf32(query))
    return _memo(_VARLEN, memo, lambda: _plan_varlen(
        query, key, value, cu_seqlens_q, cu_seqlens_k, score_mod, score_buffers, mask_mod,
        mask_buffers, scale, enable_gqa, options))


def _plan_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, score_mod, score_buffers, mask_mod,
                 mask_buffers, scale, enable_gqa, options) -> VarlenPlan:
    check_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k)
    opts = KernelOptions.from_text(options)
    if opts.BACKEND == "TRITON_DECODE":
        raise expected("kernel_options['BACKEND']", "'AUTO' or 'TRITON' for varlen_attention",
                       "'TRITON_DECODE'", "leave BACKEND out: varlen runs the forward kernel")
    if opts.USE_TMA:
        raise expected("kernel_options['USE_TMA']", "False or unset for varlen_attention", True,
                       "leave USE_TMA out: packed sequences are read through pointers")
    # The forward kernel always (a decode-length packed batch is still many sequences), by pointers.
    forward = dataclasses.replace(opts, BACKEND="TRITON", USE_TMA=False).text
    views = packed_view(query), packed_view(key), packed_view(value)
    num_seqs = cu_seqlens_q.shape[0] - 1
    # The mods see b = the sequence and positions inside it: q_idx up to the longer of its
    # query and key counts (queries align to the last keys), kv_idx below its key count.
    # (None: symbolic sizes, which nothing is proven over; max() of two would add a guard.)
    total_q, total_kv = query.shape[0], key.shape[0]
    longest = max(total_q, total_kv) if type(total_q) is int and type(total_kv) is int else None
    base = plan_attention(*views, score_mod, score_buffers, mask_mod, mask_buffers, (), (), (), scale,
                          enable_gqa, forward, positions=(num_seqs, query.shape[1], longest, total_kv))
    tl = varlen_spec(base.spec, base.mask)
    # The Gluon kernel as flex_attention takes it (AUTO: from gluon_min_scores() scores of the
    # packed views, no tiles of the caller's; "gluon": always, or an InputError saying why not).
    _, Hq, total_q, D = views[0].shape
    auto = (opts.BACKEND == "AUTO" and GLUON_AUTO and not opts.sets_tiles
            and Hq * total_q * views[1].shape[2] >= gluon_min_scores(D)
            and not _narrow_band(base.mask, D))
    if auto or opts.BACKEND == "gluon":
        gluon, why = _gluon_spec(*views, base.score, base.mask, None, opts, base.proven)
        if why is not None and opts.BACKEND == "gluon":
            raise expected("kernel_options['BACKEND']", "'gluon' only where the Gluon kernel runs",
                           why, "use BACKEND 'AUTO' or 'tl' (the Triton-language kernel)")
        if gluon is not None:
            return VarlenPlan(base, varlen_spec(gluon, base.mask), num_seqs, tl_spec=tl)
    return VarlenPlan(base, tl, num_seqs)


def varlen_spec(spec, mask):
    """``spec`` (a forward or backward spec) in its varlen form, with ``mask``'s band."""
    from ..codegen.spec import VarlenSpec
    from ..kernels.backward import BackwardSpec, VarlenBackwardSpec
    band = None if mask is None else mask.kv_range
    lo, hi, exact = band if band is not None else (None, None, False)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    cls = VarlenBackwardSpec if isinstance(spec, BackwardSpec) else VarlenSpec
    hit = _VARLEN.get(("spec", spec.key, lo, hi, exact))
    if hit is None:
        hit = _VARLEN[("spec", spec.key, lo, hi, exact)] = cls(
            **fields, kv_lo=lo, kv_hi=hi, band_exact=bool(exact))
    return hit


def plan_varlen_backward(plan: VarlenPlan, query, key, value, grad_slots: tuple):
    """The dQ and dK/dV kernels of a planned ``varlen_attention`` call: ``plan_backward``'s of
    its packed views, in varlen form (memoized; GradientError as there)."""
    memo = (grad_slots, torch.are_deterministic_algorithms_enabled())
    hit = plan.backward.get(memo)
    if hit is None:
        bw = plan_backward(plan.base, packed_view(query), packed_view(key), packed_view(value),
                           grad_slots)
        mask = plan.base.mask
        hit = plan.backward[memo] = dataclasses.replace(
            bw, dq=varlen_spec(bw.dq, mask), dkdv=varlen_spec(bw.dkdv, mask), pointer=None,
            tune_blocks=None, gluon_dkdv=None)
    return hit


# ---------------------------------------------------------------------------------- sigmoid attention
#
# sigmoid_attention runs flex_attention's kernels with the "sigmoid" activation (each weight
# sigmoid(z + bias) on its own, no running max or row sum): the same checks, the same kernel
# choice (the decode kernel for a few queries), the same tiles and block-sparse loops. Its plans
# are flex_attention's with every spec switched.

_SIGMOID: dict = {}
_SIGMOID_SPECS: dict = {}


def sigmoid_spec(spec):
    """``spec`` (a forward, backward, decode or merge spec, or None) with the sigmoid activation."""
    if spec is None:
        return None
    hit = _SIGMOID_SPECS.get(spec.key)
    if hit is None:
        if len(_SIGMOID_SPECS) >= _MEMO_MAX:
            _SIGMOID_SPECS.clear()
        hit = _SIGMOID_SPECS[spec.key] = dataclasses.replace(spec, activation="sigmoid")
    return hit


def _sigmoid_plans(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, block_lists,
                   block_size, mask_lengths, scale, enable_gqa, options) -> tuple:
    """(flex_attention's plan that plans the backward, sigmoid_attention's plan) of one call,
    memoized."""
    memo = (_key(query, key, value), score_mod, _key(*score_buffers), mask_mod, _key(*mask_buffers),
            _key(*block_lists[:2]), tuple(block_size), tuple(mask_lengths), scale, enable_gqa, options,
            _allow_tf32(query))

    def make():
        # The Gluon forward kernel where softmax takes it (AUTO's rule, or BACKEND "gluon" and
        # its refusals): the sigmoid plan keeps the tl kernel in tl_spec for the same fallback.
        base = plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                              block_lists, block_size, mask_lengths, scale, enable_gqa, options)
        decode = base.decode
        if decode is not None:
            decode = dataclasses.replace(decode, spec=sigmoid_spec(decode.spec),
                                         deep_spec=sigmoid_spec(decode.deep_spec),
                                         merge_spec=sigmoid_spec(decode.merge_spec), replays={})
        plan = dataclasses.replace(base, spec=sigmoid_spec(base.spec),
                                   pointer_spec=sigmoid_spec(base.pointer_spec),
                                   tl_spec=sigmoid_spec(base.tl_spec), decode=decode,
                                   replays={}, backward={})
        if base.options.BACKEND == "gluon":
            # The Gluon dK/dV kernel is softmax only: the sigmoid backward runs the tl kernels,
            # so BACKEND "gluon" names the forward kernel here (and refuses only for it).
            base = dataclasses.replace(base, options=dataclasses.replace(base.options, BACKEND="tl"),
                                       replays={}, backward={})
        return base, plan

    return _memo(_SIGMOID, memo, make)


def plan_sigmoid(query, key, value, score_mod: str, score_buffers, mask_mod: str, mask_buffers,
                 block_lists, block_size, mask_lengths, scale, enable_gqa: bool,
                 options: str) -> AttentionPlan:
    """Check a ``sigmoid_attention`` call and decide its kernels: ``plan_attention``'s, with the
    sigmoid activation."""
    return _sigmoid_plans(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                          block_lists, block_size, mask_lengths, scale, enable_gqa, options)[1]


def plan_sigmoid_backward(query, key, value, score_mod: str, score_buffers, mask_mod: str, mask_buffers,
                          block_lists, block_size, mask_lengths, scale, enable_gqa: bool, options: str,
                          grad_slots: tuple):
    """The dQ and dK/dV kernels of a ``sigmoid_attention`` call: ``plan_backward``'s, with the
    sigmoid activation (memoized on the sigmoid plan; GradientError as there)."""
    base, plan = _sigmoid_plans(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                                block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    memo = (grad_slots, torch.are_deterministic_algorithms_enabled())
    hit = plan.backward.get(memo)
    if hit is None:
        bw = plan_backward(base, query, key, value, grad_slots)
        hit = plan.backward[memo] = dataclasses.replace(
            bw, dq=sigmoid_spec(bw.dq), dkdv=sigmoid_spec(bw.dkdv),
            pointer=None if bw.pointer is None else tuple(map(sigmoid_spec, bw.pointer)),
            gluon_dkdv=None)        # the Gluon dK/dV kernel is softmax only
    return hit


def clear_memos() -> None:
    """Forget every plan (``flexgen.clear_caches``)."""
    _ATTENTION.clear()
    _DECODE.clear()
    _SIGMOID.clear()
    _SIGMOID_SPECS.clear()
    _LINEAR.clear()
    _VARLEN.clear()
    from ..kernels.linear import clear_memos as clear_linear
    clear_linear()
    from ..kernels.decode import clear_memos as clear_decode
    clear_decode()


__all__ = ["AttentionPlan", "DecodePlan", "Mask", "plan_attention", "plan_backward", "plan_decode",
           "plan_decode_call", "check_qkv", "plan_sigmoid", "plan_sigmoid_backward", "sigmoid_spec",
           "plan_linear", "plan_linear_decode", "plan_varlen", "plan_varlen_backward", "VarlenPlan",
           "check_varlen", "packed_view", "plan_linear_backward", "check_linear", "LINEAR_CHUNK",
           "check_mask", "tiles", "out_strides", "TMA_MIN_SCORES", "MAX_DECODE_QUERIES",
           "LARGE_SPARSE_BLOCK", "clear_memos"]


# Linear attention's planning (re-exported). Imported last: it uses this module's memo helpers,
# so whichever of the two is imported first, the other finds them defined.
from .plan_linear import (  # noqa: E402, F401
    LINEAR_CHUNK, LINEAR_GPU_TILES, _LINEAR, check_linear, plan_linear, plan_linear_backward, plan_linear_decode)
