"""``flex_attention``: the same call as ``torch.nn.attention.flex_attention``.

Checks the inputs, traces the score_mod, picks (or generates) the kernel for
this combination of mods, dtypes and head dims, and launches it. Everything
expensive (sympy, rendering, compiling) happens once per new combination; a
repeated call is a trace of the score_mod plus dict lookups.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch.autograd.function import once_differentiable

from .runtime import launch, tuning
from .kernels import backward
from .masks.block_mask import BlockMask
from .codegen.cache import source
from .runtime.checks import DTYPES, check_buffers, check_heads, check_scale, check_tensor
from .kernels.decode import decode_attention, few_queries
from .errors import expected
from .frontend.bounds_check import check_call_indices
from .frontend.lowering import lower
from .codegen.spec import KernelSpec, dot_precision, kernel_spec, mod_fields, tma_supported
from .frontend.trace import trace_cached

OPTION_KEYS = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
# Switches (bools), not tiles: USE_TMA loads Q, K, V and stores the output through Hopper
# TMA descriptors (the forward kernel, and both backward kernels, which follow the forward's
# choice; a call whose tensors TMA cannot address, e.g. an expanded grad_out, runs the
# pointer kernels).
# It is on by default for fp16 / bf16 on GPUs that have TMA (sm_90+), where the H100
# measured it 0-22% faster than pointer loads (benchmarks/NOTES.md), for calls of at
# least TMA_MIN_SCORES score elements (B * Hq * Lq * Lkv, ~150 us of kernel at D=128):
# its four host descriptors cost ~40 us a call there, more than it gains on a short
# kernel. USE_TMA=True / False decides either way.
FLAG_OPTIONS = {"USE_TMA"}
TMA_MIN_SCORES = 2 ** 27
# torch's kernel_options that only tune torch's own kernels: accepted, no effect here.
TORCH_ONLY_OPTIONS = {"PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS",
                      "OUTPUT_LOGSUMEXP", "FORCE_USE_FLEX_ATTENTION", "WRITE_DQ", "BACKEND",
                      "num_consumer_groups", "num_buffers_warp_spec"}

# Set FLEXGEN_POISON=1 (the tests do) to fill outputs with NaN before each
# launch, so an element the kernel fails to write shows up.
POISON = os.environ.get("FLEXGEN_POISON") == "1"


def _check_inputs(query, key, value, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
    if not (query.dtype == key.dtype == value.dtype):
        raise expected("key/value", f"the query's dtype {query.dtype}",
                       f"key {key.dtype}, value {value.dtype}", "convert all three to one dtype")
    if not (query.device == key.device == value.device):
        raise expected("key/value", f"the query's device {query.device}",
                       f"key on {key.device}, value on {value.device}", "move all three to one device")
    B, Hq, _, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise expected("key/value batch", f"batch {B} like query", f"{key.shape[0]} and {value.shape[0]}",
                       "give query, key and value the same batch size")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise expected("value", f"the key's heads and length {tuple(key.shape[1:3])}",
                       tuple(value.shape[1:3]), "key and value must come from the same positions")
    if key.shape[3] != D:
        raise expected("key.shape[-1]", f"the query's head dim {D}", key.shape[3],
                       "query and key need the same head dim (value's may differ)")
    check_heads(Hq, key.shape[1], enable_gqa)


def _check_block_mask(block_mask, query, key):
    if not isinstance(block_mask, BlockMask):
        raise expected("block_mask", "a flexgen BlockMask (from flexgen.create_block_mask) or None",
                       type(block_mask).__name__, "build it with flexgen.create_block_mask")
    B, Hq, Q_LEN = query.shape[:3]
    KV_LEN = key.shape[2]
    if block_mask.seq_lengths != (Q_LEN, KV_LEN):
        raise expected("block_mask", f"a mask for Q_LEN={Q_LEN}, KV_LEN={KV_LEN}",
                       f"one for Q_LEN={block_mask.seq_lengths[0]}, KV_LEN={block_mask.seq_lengths[1]}",
                       f"create_block_mask(mask_mod, B, H, {Q_LEN}, {KV_LEN})")
    mB, mH = block_mask.kv_num_blocks.shape[:2]
    if mB not in (1, B) or mH not in (1, Hq):
        raise expected("block_mask", f"batch 1 or {B} and heads 1 or {Hq}", f"batch {mB}, heads {mH}",
                       "create the mask with B and H of the query (or None to broadcast)")
    if block_mask.device != query.device:
        raise expected("block_mask", f"a mask on {query.device} like the query", block_mask.device,
                       f"block_mask.to('{query.device}')")


def _options(kernel: str, kernel_options, head_dim, dtype, device, sparse_q, sparse_kv) -> dict:
    """The tiles for ``kernel``: the tuning table's (flexgen.runtime.tuning), with the caller's options on top."""
    opts = tuning.options(kernel, head_dim, dtype, device, sparse_q, sparse_kv)
    for k, v in (kernel_options or {}).items():
        if k in TORCH_ONLY_OPTIONS:
            continue
        if k in FLAG_OPTIONS:
            if type(v) not in (bool, int) or v not in (0, 1):
                raise expected(f"kernel_options[{k!r}]", "True or False", repr(v), "pass a bool")
            continue
        if k not in OPTION_KEYS:
            raise expected("kernel_options", f"keys among {sorted(OPTION_KEYS | FLAG_OPTIONS)}",
                           repr(k), "remove the key or fix its spelling")
        if not isinstance(v, int) or v < 1:
            raise expected(f"kernel_options[{k!r}]", "a positive int", repr(v), "pass an int")
        opts[k] = v
    for k, sparse in (("BLOCK_M", sparse_q), ("BLOCK_N", sparse_kv)):
        if opts[k] < 16 or opts[k] & (opts[k] - 1) or sparse % opts[k]:
            raise expected(f"kernel_options[{k!r}]", f"a power of two >= 16 dividing the sparse block {sparse}",
                           opts[k], "use 64 or 128 (or a smaller power of two)")
    return opts


def _use_tma(kernel_options, query, key) -> bool:
    """Whether to ask for the TMA forward kernel: the caller's USE_TMA, else on for
    16-bit GPU inputs of at least TMA_MIN_SCORES score elements."""
    asked = (kernel_options or {}).get("USE_TMA")
    if asked is not None:
        return bool(asked)
    B, Hq, Lq, _ = query.shape
    return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
            and B * Hq * Lq * key.shape[2] >= TMA_MIN_SCORES)


def _tunable_tiles(call) -> tuple | None:
    """The sparse block sizes the autotuner's tiles must divide, or None: the caller chose tiles."""
    if call.kernel_options and OPTION_KEYS & set(call.kernel_options):
        return None
    return call.block_mask.BLOCK_SIZE if call.block_mask is not None else (128, 128)


@dataclass(frozen=True)
class _Call:
    """One checked call: the forward kernel and what the backward would need."""
    spec: KernelSpec
    sparse: tuple | None          # kv lists broadcast to [B, H, ...], Q_BLOCK, KV_BLOCK
    score_traced: object          # the traced score_mod, or None
    block_mask: BlockMask | None
    score_buffers: tuple
    mask_buffers: tuple
    scale: float
    kernel_options: dict | None
    # Whether query, key and value all start 16-byte aligned (part of the memo key).
    aligned: bool
    # The outputs to allocate: out [B, Hq, Lq, Dv] in ``dtype``, lse [B, Hq, Lq] float32.
    out_shape: tuple
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    # The forward launch, replayable with new q, k, v, out, lse (launch.Replay): the
    # next call with this plan skips rebuilding and re-specializing its arguments.
    replay: list = field(default_factory=lambda: [None], compare=False, repr=False)


def _trace_score(score_mod):
    return None if score_mod is None else trace_cached(score_mod, "score_mod")


# A training or serving loop makes the same call every step: what _prepare
# decides is memoized on everything it reads. The key holds ids; the entry
# holds the objects behind them, so no id is reused while its entry exists.
_CALLS: dict = {}
_CALLS_MAX = 256


def _mask_lists(block_mask) -> tuple:
    return (block_mask.kv_num_blocks, block_mask.kv_indices,
            block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


def _aligned(query, key, value) -> bool:
    """Whether all three bases are 16-byte aligned: Triton specializes the kernel on each
    pointer's alignment, and the TMA choice needs all three aligned (spec.tma_supported)."""
    return not (query.data_ptr() | key.data_ptr() | value.data_ptr()) & 15


def _call_key(query, key, value, score_traced, block_mask, scale, enable_gqa, kernel_options):
    """The memo key of a call, or None for one that is not memoized (the checked path then
    raises the InputError). Built inline, one flat tuple: it is most of a warm call's cost."""
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
            and isinstance(value, torch.Tensor)):
        return None
    options = None
    if kernel_options:
        # Each value's type too: 64.0 == 64 (and hashes alike), but only the int is a tile.
        options = (tuple([(k, type(v), v) for k, v in kernel_options.items()])
                   if isinstance(kernel_options, dict) else kernel_options)
    mask = None
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            return None
        bm = block_mask
        mask = (bm.seq_lengths, bm.BLOCK_SIZE, id(bm), id(bm.kv_num_blocks), id(bm.kv_indices),
                id(bm.full_kv_num_blocks), id(bm.full_kv_indices))
    try:
        # fp32 on the GPU uses tf32 only where torch allows it (spec.dot_precision).
        tf32 = query.dtype == torch.float32 and query.is_cuda and torch.backends.cuda.matmul.allow_tf32
        # scale's type too: True == 1 (and hashes alike), but only the int is a valid scale.
        return (id(score_traced), mask, type(scale), scale, enable_gqa, options, tf32,
                _aligned(query, key, value),
                query.shape, query.stride(), query.dtype, query.device,
                key.shape, key.stride(), key.dtype, key.device,
                value.shape, value.stride(), value.dtype, value.device)
    except Exception:  # noqa: BLE001 - an odd tensor (no strides, no storage): the checked path explains
        return None


def _prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
             score_traced=None) -> _Call:
    """Check everything and decide the forward kernel (``score_traced``: the score_mod's trace,
    when the caller has it already)."""
    if score_traced is None and score_mod is not None:
        score_traced = _trace_score(score_mod)
    memo = _call_key(query, key, value, score_traced, block_mask, scale, enable_gqa, kernel_options)
    hit = None
    if memo is not None:
        try:
            hit = _CALLS.get(memo)
        except TypeError:       # an unhashable option value, say: not memoized
            memo = None
    if hit is not None:
        return hit[0]
    call = _plan_call(query, key, value, score_traced, block_mask, scale, enable_gqa, kernel_options)
    if memo is not None:
        if len(_CALLS) >= _CALLS_MAX:
            _CALLS.clear()
        _CALLS[memo] = (call, block_mask and _mask_lists(block_mask))
    return call


def _plan_call(query, key, value, score_traced, block_mask, scale, enable_gqa, kernel_options) -> _Call:
    _check_inputs(query, key, value, enable_gqa)
    device = query.device
    B, Hq, Q_LEN, D = query.shape
    Dv = value.shape[-1]
    scale = check_scale(scale, D)

    score = None if score_traced is None else lower(score_traced)
    if score_traced is not None:
        check_buffers(score_traced, device)

    mask, sparse, mask_buffers = None, None, ()
    sparse_q = sparse_kv = 128
    if block_mask is not None:
        _check_block_mask(block_mask, query, key)
        sparse_q, sparse_kv = block_mask.BLOCK_SIZE
        mask_traced = block_mask.traced()
        check_buffers(mask_traced, device)
        mask = lower(mask_traced)
        mask_buffers = mask_traced.buffers
        sparse = (*block_mask.broadcast_lists("kv", B, Hq), sparse_q, sparse_kv)

    # Captured tensors indexed out of bounds raise here, as torch would (frontend/bounds_check.py).
    check_call_indices(score_traced, block_mask and block_mask.traced(), B, Hq, Q_LEN, key.shape[2])
    opts = _options(tuning.forward_kernel(score, block_mask is not None), kernel_options, max(D, Dv),
                    DTYPES[query.dtype], device, sparse_q, sparse_kv)
    spec = kernel_spec(
        "forward",
        **mod_fields(score, mask),
        qk_head=D, v_head=Dv, dtype=DTYPES[query.dtype],
        has_block_mask=block_mask is not None,
        block_m=opts["BLOCK_M"], block_n=opts["BLOCK_N"],
        num_warps=opts["num_warps"], num_stages=opts["num_stages"],
        dot_precision=dot_precision(query),
        use_tma=_use_tma(kernel_options, query, key) and tma_supported(query, key, value),
    )
    score_buffers = () if score_traced is None else score_traced.buffers
    return _Call(spec, sparse, score_traced, block_mask, score_buffers, mask_buffers, scale,
                 kernel_options, _aligned(query, key, value), (B, Hq, Q_LEN, Dv), (B, Hq, Q_LEN),
                 query.dtype, device)


def _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options):
    """Check everything and decide the kernel: (spec, launch inputs without outputs)."""
    call = _prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options)
    return call.spec, (call.sparse, call.score_buffers, call.mask_buffers, call.scale)


def _backward_plan(call: _Call, query, value, slots) -> backward.BackwardPlan:
    """Derive and print the backward kernels' mods (GradientError here, before any launch)."""
    sparse_q, sparse_kv = (call.block_mask.BLOCK_SIZE if call.block_mask is not None else (128, 128))
    head_dim = max(query.shape[-1], value.shape[-1])
    dq, dkdv = (_options(kernel, call.kernel_options, head_dim, call.spec.dtype, query.device,
                         sparse_q, sparse_kv) for kernel in ("backward.dq", "backward.dkdv"))
    return backward.plan(call.spec, call.score_traced, call.block_mask, query,
                         call.mask_buffers, call.scale, slots, dq, dkdv, _tunable_tiles(call))


def _forward(call: _Call, query, key, value):
    # (Sizes as separate ints: torch parses them faster than one tuple.)
    out = torch.empty(*call.out_shape, dtype=call.dtype, device=call.device)
    lse = torch.empty(*call.lse_shape, dtype=torch.float32, device=call.device)
    if POISON:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    replay = call.replay[0]
    if replay is not None and not tuning.needs_lookup():
        # What the kernel is specialized on is fixed by the plan's memo key (dtypes, and
        # call.aligned: q, k, v aligned) but for the new outputs' alignment: torch's
        # allocators align them, and it is checked all the same, two pointers instead of
        # the five launch.Replay.__call__ would classify.
        if call.aligned and not (out.data_ptr() | lse.data_ptr()) & 15:
            launched = replay.launch(query, key, value, out, lse)
        else:
            launched = replay(query, key, value, out, lse)
        if launched:
            return out, lse
    call.replay[0] = launch.run(call.spec, query.device, query, key, value, out, lse, call.sparse,
                                call.score_buffers, call.mask_buffers, call.scale,
                                tune_blocks=_tunable_tiles(call), replay=5)
    return out, lse


class FlexAttentionFunction(torch.autograd.Function):
    """flex_attention as an autograd Function: gradients for q, k, v and learned captured tensors.

    Saves q, k, v, the output and the LSE; the backward kernels recompute the
    probabilities from the LSE (``flexgen.kernels.backward``).
    """

    @staticmethod
    def forward(ctx, query, key, value, call, bw, *score_buffers):
        out, lse = _forward(call, query, key, value)
        ctx.set_materialize_grads(False)    # an unused output's gradient stays None
        ctx.call, ctx.bw = call, bw
        ctx.save_for_backward(query, key, value, out, lse, *score_buffers)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse, *score_buffers = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dq, dk, dv, buffer_grads = backward.run(
            ctx.bw, query, key, value, out, lse, grad_out, grad_lse, tuple(score_buffers),
            needs_kv=needs[1] or needs[2])
        grads = [buffer_grads.get(i) if needs[5 + i] else None for i in range(len(score_buffers))]
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                None, None, *grads)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None):
    """Attention with a user score_mod and a block-sparse mask, in one generated kernel.

    query ``[B, Hq, Lq, D]``, key ``[B, Hkv, Lkv, D]``, value ``[B, Hkv, Lkv, Dv]``
    (fp16, bf16 or fp32; D and Dv from 16 to 256; Hq a multiple of Hkv with
    ``enable_gqa=True``). ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites each
    scaled score ``q·k * scale`` (scale defaults to 1/sqrt(D)); ``block_mask``
    (from ``create_block_mask``) removes positions and skips empty blocks.
    Returns ``out [B, Hq, Lq, Dv]`` in the query's dtype, and with ``return_lse``
    also the natural-log logsumexp ``[B, Hq, Lq]`` in float32 (-inf, and zero
    output, for a fully masked row). CPU tensors run through the Triton interpreter.

    Differentiable: when grad is enabled and query, key, value or a floating
    tensor the score_mod captures requires grad, the backward kernels give
    their gradients (and the LSE's gradient flows too). The score_mod's
    derivative is derived symbolically; a mod that cannot be differentiated
    raises ``flexgen.backward.GradientError`` here, before anything runs.
    """
    score_traced = _trace_score(score_mod)
    slots, needs_grad = (), False
    if torch.is_grad_enabled():
        if score_traced is not None and score_traced.buffers:
            slots = backward.grad_slots(score_traced)
        needs_grad = bool(slots or getattr(query, "requires_grad", False)
                          or getattr(key, "requires_grad", False) or getattr(value, "requires_grad", False))
    # (decode.use_decode_path, whose gradient test is the one just made.)
    if not needs_grad and few_queries(query):
        # A few queries per sequence: the split-K decode kernel reads K/V once per
        # GQA group and spreads long contexts over the GPU (flexgen.kernels.decode). It
        # checks its inputs itself: planning the forward kernel first would be wasted.
        if block_mask is not None:
            # decode_attention accepts a mask longer than the queries (they sit at
            # q_offsets); flex_attention's mask must match the call exactly.
            _check_inputs(query, key, value, enable_gqa)
            _check_block_mask(block_mask, query, key)
        return decode_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                                scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
                                q_offsets=0, kernel_options=kernel_options, _score_traced=score_traced)
    call = _prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options,
                    score_traced)
    if needs_grad:
        bw = _backward_plan(call, query, value, slots)
        out, lse = FlexAttentionFunction.apply(query, key, value, call, bw, *call.score_buffers)
    else:
        out, lse = _forward(call, query, key, value)
    return (out, lse) if return_lse else out


def kernel_source(query, key, value, score_mod=None, block_mask=None, scale=None,
                  enable_gqa=False, kernel_options=None, part="forward") -> str:
    """The generated module source ``flex_attention`` would run for these arguments.

    ``part`` picks the kernel: "forward", or one of the backward pass's "dq"
    and "dkdv" (the latter two scatter gradients into the score_mod's captured
    tensors that require grad). Nothing is launched; the source is what the
    disk cache holds for the kernel, with the tile table's tiles (a winner that
    ``flexgen.autotune`` stored for a size bucket may use others).
    """
    if part not in ("forward", "dq", "dkdv"):
        raise expected("part", '"forward", "dq" or "dkdv"', repr(part), "pick one of the three kernels")
    call = _prepare(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options)
    if part == "forward":
        return source(call.spec)
    bw = _backward_plan(call, query, value, backward.grad_slots(call.score_traced))
    return source(bw.dq if part == "dq" else bw.dkdv)
