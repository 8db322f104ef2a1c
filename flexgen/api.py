"""The public entry points: ``flex_attention`` (torch's call), ``decode_attention``, ``kernel_source``.

Each one traces the mods (``flexgen.frontend.trace``: memoized in eager mode,
inline under torch.compile), gathers what the block mask holds, checks the
arguments a Python function can check, and calls one custom op
(``flexgen.runtime.ops``), which plans (``flexgen.runtime.plan``) and launches.
Everything here is plain Python over tensors and mods, so torch.compile traces
it without a graph break and torch.export records one op per call.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .errors import expected, reported
from .masks.block_mask import mask_inputs
from .runtime.options import parse_options

try:     # torch >= 2.9: return_aux
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # pragma: no cover - older torch
    from typing import NamedTuple

    class AuxRequest(NamedTuple):
        """Which auxiliary outputs ``flex_attention`` returns (torch's AuxRequest)."""
        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):
        """``flex_attention``'s auxiliary outputs (torch's AuxOutput)."""
        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None


# The tracer, the custom ops (and the planner and kernels behind them) and the renderer load
# on first use: ``import flexgen`` stays cheap for a process that only imports it, and the
# first call of a mod the restart index knows never loads sympy or Jinja.

def trace_cached(mod, kind: str):
    """``flexgen.frontend.trace.trace_cached``, imported on first use."""
    from .frontend.trace import trace_cached as trace
    return trace(mod, kind)


def _ops():
    """``flexgen.runtime.ops`` (the custom ops are registered on its import)."""
    from .runtime import ops
    return ops



def source(spec) -> str:
    """The module source of a kernel spec (what ``kernel_source`` shows): the restart
    index's verified copy where a previous process recorded it, so that a warm process
    asks for it without sympy's printing or Jinja, else rendered now."""
    from .codegen.cache import module_text
    return module_text(spec)


def _tensors(**named) -> None:
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise reported(expected(name, "a torch.Tensor [B, H, L, D]", type(t).__name__,
                                    f"pass {name} as a tensor"))
        if t.dim() != 4:
            raise reported(expected(name, "a 4-D tensor [B, H, L, D]", f"shape {list(t.shape)}",
                                    f"reshape {name} to [B, H, L, D] (e.g. x.transpose(1, 2))"))


def check_scale(scale, head_dim: int) -> float:
    """The softmax scale: ``scale`` itself, or 1/sqrt(head_dim) for None."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise reported(expected("scale", "a finite float or None", repr(scale), "pass a Python float"))
    return float(scale)


def _mods(score_mod, block_mask):
    score = None if score_mod is None else trace_cached(score_mod, "score_mod")
    mask_mod, mask_buffers, lists, block_size, lengths = mask_inputs(block_mask)
    return ("" if score is None else score.graph, () if score is None else score.buffers,
            mask_mod, mask_buffers, lists, block_size, lengths)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None):
    """Attention with a user score_mod and a block-sparse mask, in one generated kernel.

    query ``[B, Hq, Lq, D]``, key ``[B or 1, Hkv, Lkv, D]``, value ``[B or 1, Hkv, Lkv, Dv]``
    (fp16, bf16 or fp32; D and Dv from 16 to 256; Hq a multiple of Hkv with
    ``enable_gqa=True``; a last dim that is not contiguous is copied first).
    ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites each
    scaled score ``q·k * scale`` (scale defaults to 1/sqrt(D)); ``block_mask`` (from
    ``create_block_mask``, flexgen's or torch's) removes positions and skips empty blocks.
    Returns ``out [B, Hq, Lq, Dv]`` in the query's dtype and stride order; with
    ``return_lse`` also the natural-log logsumexp ``[B, Hq, Lq]`` float32 (-inf, and a zero
    output, for a fully masked row); with ``return_aux=AuxRequest(lse=..., max_scores=...)``
    ``(out, AuxOutput(lse, max_scores))``, max_scores being each row's largest score after
    score_mod. CPU tensors run through the Triton interpreter.

    Differentiable: gradients flow to query, key, value and to floating tensors the
    score_mod captures that require grad (a learned bias); the score_mod's derivative is
    derived symbolically, and a mod that cannot be differentiated raises
    ``flexgen.GradientError``. One ``torch.ops.flexgen.attention`` op per call (its backward
    one more), so torch.compile(fullgraph=True) and torch.export take it as is.
    """
    _tensors(query=query, key=key, value=value)
    # torch takes a last dim that is not contiguous (a column-major q, k or v); the kernels
    # read each row of D elements at once, so such an input is copied once, here (autograd
    # carries the gradient back to the original layout).
    query, key, value = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
                         for t in (query, key, value))
    if return_lse and return_aux is not None:
        raise reported(expected("return_lse", "False when return_aux is given", True,
                                "ask for the LSE with return_aux=AuxRequest(lse=True)"))
    score_mod, score_buffers, mask_mod, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    options = parse_options(kernel_options)
    want_max = return_aux is not None and bool(return_aux.max_scores)
    out, lse, max_scores = _ops().call_attention(
        query, key, value, score_buffers, mask_buffers, lists, score_mod, mask_mod, block_size,
        lengths, check_scale(scale, query.shape[-1]), bool(enable_gqa), options.text, want_max)
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None,
                              max_scores=max_scores if want_max else None)
    return (out, lse) if return_lse else out


def plan(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
         kernel_options=None):
    """The plan ``flex_attention``'s op makes for these arguments (``flexgen.runtime.plan.
    AttentionPlan``: which kernel, its spec and tiles): for inspection and benchmarks."""
    from .runtime.plan import plan_attention
    _tensors(query=query, key=key, value=value)
    score_mod, score_buffers, mask_mod, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    return plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, lists,
                          block_size, lengths, check_scale(scale, query.shape[-1]), bool(enable_gqa),
                          parse_options(kernel_options).text)


def kernel_source(query, key, value, score_mod=None, block_mask=None, scale=None,
                  enable_gqa=False, kernel_options=None, part="forward") -> str:
    """The generated module source ``flex_attention`` would run for these arguments.

    ``part`` picks the kernel: "forward" (the forward kernel, or the decode kernel for a
    few queries), or one of the backward pass's "dq" and "dkdv" (the latter two scatter
    gradients into the score_mod's captured tensors that require grad), or "fused" (the
    Gluon kernel computing all three gradients, where the plan takes it). Nothing is
    launched; the source is what the disk cache holds for the kernel, with the tile
    table's tiles (a winner that ``flexgen.autotune`` stored for a size bucket may use others).
    """
    from .runtime.plan import plan_backward
    from .kernels.backward import grad_slots
    _check_part(part)
    call = plan(query, key, value, score_mod, block_mask, scale, enable_gqa, kernel_options)
    if part == "forward":
        return source(call.spec if call.kernel == "forward" else call.decode.spec)
    score_buffers = () if score_mod is None else trace_cached(score_mod, "score_mod").buffers
    bw = plan_backward(call, query, key, value, grad_slots(score_buffers))
    return _backward_source(bw, part)


def _check_part(part) -> None:
    """``kernel_source``'s and ``sigmoid_kernel_source``'s ``part``: one of the four kernels."""
    if part not in ("forward", "dq", "dkdv", "fused"):
        raise expected("part", '"forward", "dq", "dkdv" or "fused"', repr(part), "pick one of the four kernels")


def _backward_source(bw, part: str) -> str:
    """The source of backward plan ``bw``'s kernel ``part`` ("dq", "dkdv" or "fused"): the
    Gluon kernel where the plan has one, else the tl one."""
    if part == "fused":
        if bw.gluon_fused is None:
            raise expected("part", '"fused" for a call whose backward the fused Gluon kernel runs',
                           "a call it does not run", 'ask for "dq" and "dkdv"')
        return source(bw.gluon_fused)
    return source(bw.gluon_dq or bw.dq if part == "dq" else bw.gluon_dkdv or bw.dkdv)


# ---------------------------------------------------------------------------------- packed varlen

def varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     score_mod=None, mask_mod=None, scale=None, enable_gqa=False, return_lse=False,
                     kernel_options=None):
    """Attention over sequences of different lengths packed along one axis, no padding.

    query ``[total_q, Hq, D]``, key ``[total_k, Hkv, D]``, value ``[total_k, Hkv, Dv]``;
    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 ``[num_seqs + 1]`` start offsets (sequence s
    is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and key rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``; empty sequences allowed) — the
    ``flash_attn_varlen_func`` convention. ``max_seqlen_q`` / ``max_seqlen_k`` are taken for
    that API's sake and not needed: the offsets are read on the device only (no host
    synchronization, so a step can be captured in a CUDA graph).

    The mods see ``b`` = the sequence's index and ``q_idx`` / ``kv_idx`` = positions inside
    that sequence, the queries aligned to its last keys when it has fewer queries than keys
    (chunked prefill: query i is position ``i + Lk - Lq``); ``mask_mod`` is applied
    element-wise, and for band masks (causal, sliding window) only the key tiles the band
    meets are visited. Returns ``out [total_q, Hq, Dv]`` (rows past ``cu_seqlens_q[-1]``
    unwritten), with ``return_lse`` also the LSE ``[Hq, total_q]`` float32. Differentiable
    like ``flex_attention``; one ``torch.ops.flexgen.varlen_attention`` op per call.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise reported(expected(name, "a torch.Tensor [total_tokens, H, D]", type(t).__name__,
                                    f"pass {name} as a tensor"))
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise reported(expected(name, "a Python int >= 0 (the longest sequence)", repr(n),
                                    f"pass int({name}) computed where the lengths are known"))
    query, key, value = (t if t.dim() != 3 or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
                         for t in (query, key, value))
    score = None if score_mod is None else trace_cached(score_mod, "score_mod")
    mask = None if mask_mod is None else trace_cached(mask_mod, "mask_mod")
    from .runtime.ops import varlen as varlen_ops      # registers its ops
    out, lse = varlen_ops.call_varlen_attention(
        query, key, value, cu_seqlens_q, cu_seqlens_k, () if score is None else score.buffers,
        () if mask is None else mask.buffers, "" if score is None else score.graph,
        "" if mask is None else mask.graph, check_scale(scale, query.shape[-1]), bool(enable_gqa),
        parse_options(kernel_options).text)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------- decoding

def _host_ints(t, B):
    """The B values of a CPU tensor / list / int, or None for a CUDA tensor (never read back:
    no sync) or a value torch.compile traces (no data read while compiling)."""
    if isinstance(t, torch.Tensor):
        if t.device.type == "cuda" or torch.compiler.is_compiling():
            return None
        values = [int(x) for x in t.reshape(-1).tolist()]
    elif isinstance(t, int):
        values = [t]
    else:
        values = [int(x) for x in t]
    return values * B if len(values) == 1 else values


def _lengths_arg(name, value, B, device, fix):
    """``value`` (an int, a list of B ints or an integer tensor [B]) as the kernel reads it:
    a cached one-element constant, or an int32 tensor of B values on ``device``."""
    from .kernels.decode import constant
    if isinstance(value, int) and not isinstance(value, bool):
        return constant(value, device) if not torch.compiler.is_compiling() else torch.full(
            (1,), value, dtype=torch.int32, device=device)
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1 \
                or value.numel() not in (1, B):
            raise reported(expected(name, f"an integer tensor of shape [{B}]",
                                    f"dtype {value.dtype}, shape {list(value.shape)}", fix))
        if value.dtype == torch.int32 and value.dim() == 1 and value.shape[0] == B \
                and value.device == device:
            return value                   # what the kernel reads already: no copy, no launch
        return value.to(device=device, dtype=torch.int32).reshape(-1).expand(B).contiguous()
    if isinstance(value, bool):
        raise reported(expected(name, "an int, a list of ints or an integer tensor [B]", repr(value), fix))
    try:
        values = [int(x) for x in value]
    except (TypeError, ValueError):
        raise reported(expected(name, f"an int, a list of {B} ints or an integer tensor [{B}]",
                                type(value).__name__, fix)) from None
    if len(values) != B:
        raise reported(expected(name, f"{B} values (one per sequence)", len(values), fix))
    return torch.tensor(values, dtype=torch.int32, device=device)


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
                     kernel_options=None, max_kv_len=None, _host_lengths=None, _packed=None):
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
    ``flex_attention``; ``h`` is the query head, ``b`` the batch row (a mask sliced for
    the query, torch's decode pattern ``block_mask[:, :, i]`` with ``seq_lengths=(1, L)``,
    reads q_idx from 0: pass ``q_offsets=0``). Hq must
    be a multiple of Hkv with ``enable_gqa=True``. ``num_splits`` overrides the
    split-K count (as ``kernel_options={"NUM_SPLITS": n}``). ``max_kv_len`` is a host-side
    upper bound on the lengths (only used to choose the split count when the lengths
    live on the GPU).

    Returns ``out [B, Hq, Lq, Dv]`` in the query's dtype, with ``return_lse``
    also the natural-log LSE ``[B, Hq, Lq]`` float32 (-inf and zeros for a
    query that sees no key). Forward only: no autograd. One ``torch.ops.flexgen.decode``
    op per call. ``_host_lengths`` (the lengths as host ints) and ``_packed`` (packed queries:
    (query [total_q, Hq, D], int32 first rows [B + 1], longest), ``query`` being their
    ``kernels.decode.packed_view``; outputs packed too) are PagedKVCache's.
    """
    _tensors(query=query, key=key, value=value)
    if block_mask is not None and mask_mod is not None:
        raise reported(expected("mask_mod", "None when a block_mask is given (its mask_mod is used)",
                                getattr(mask_mod, "__name__", mask_mod), "pass only one of them"))
    score_mod, score_buffers, mask_text, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    if mask_mod is not None:
        traced = trace_cached(mask_mod, "mask_mod")
        mask_text, mask_buffers = traced.graph, traced.buffers
    options = parse_options(kernel_options)
    if num_splits is not None:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
            raise reported(expected("num_splits", "a positive int or None (automatic)", repr(num_splits),
                                    "pass an int"))
        options = dataclasses.replace(options, NUM_SPLITS=num_splits)
    B, _, Lq, D = query.shape
    device = query.device
    paged = page_table is not None
    if paged:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 \
                or page_table.shape[0] != B or page_table.dtype not in (torch.int32, torch.int64):
            got = (f"shape {list(page_table.shape)}, dtype {page_table.dtype}"
                   if isinstance(page_table, torch.Tensor) else type(page_table).__name__)
            raise reported(expected("page_table", f"an int32 tensor [{B}, max_pages_per_seq]", got,
                                    "pass PagedKVCache.page_table rows for the batch"))
        if page_table.device != device:
            raise reported(expected("page_table", f"a tensor on {device}", page_table.device,
                                    f"page_table.to('{device}')"))
        if kv_lengths is None:
            raise reported(expected("kv_lengths", "the length of each cached sequence with a page_table",
                                    None, "pass kv_lengths (PagedKVCache.attention does it for you)"))
        # Converted on every call, never cached: the table changes in place as sequences grow.
        if page_table.dtype != torch.int32:
            page_table = page_table.to(torch.int32)
        if page_table.stride(1) != 1:
            page_table = page_table.contiguous()
        capacity = page_table.shape[1] * key.shape[1]
    else:
        capacity = key.shape[2]
    fix = "pass one length per sequence (ints, a list or an int32 tensor [B])"
    kv = _lengths_arg("kv_lengths", capacity if kv_lengths is None else kv_lengths, B, device, fix)
    ql = _lengths_arg("q_lengths", Lq if q_lengths is None else q_lengths, B, device, fix)
    qs = None if q_offsets is None else _lengths_arg("q_offsets", q_offsets, B, device, fix)
    if _host_lengths is not None:
        host_kv, host_ql = _host_lengths
    else:
        host_kv = None if kv_lengths is None else _host_ints(kv_lengths, B)
        host_ql = None if q_lengths is None else _host_ints(q_lengths, B)
    # (None with the default: every sequence is `capacity` keys long / Lq queries.)
    kv_max = capacity if kv_lengths is None else (None if host_kv is None else max(host_kv))
    if kv_lengths is not None and host_kv is not None and (min(host_kv) < 0 or kv_max > capacity):
        raise reported(expected(
            "kv_lengths", f"lengths from 0 to {capacity} (the "
            + ("page table's capacity" if paged else "key's length") + ")",
            f"{min(host_kv)} .. {kv_max}", "clip the lengths or give a longer cache"))
    if q_lengths is not None and host_ql is not None and (min(host_ql) < 0 or max(host_ql) > Lq):
        raise reported(expected("q_lengths", f"counts from 0 to {Lq} (the query's length)",
                                f"{min(host_ql)} .. {max(host_ql)}", "pad the query to the longest count"))
    if block_mask is not None and lengths:
        mQ, mKV = lengths
        if kv_max is not None and kv_max > mKV:
            raise reported(expected("block_mask", f"a mask whose KV_LEN covers the longest sequence "
                                    f"({kv_max})", f"KV_LEN={mKV}",
                                    "build the mask for the cache's logical length"))
        q_end = _query_end(q_offsets, q_lengths, B, Lq, kv_max, host_ql)
        if q_end is not None and q_end > mQ:
            # A mask as long as the query is most likely torch's decode pattern (a sliced
            # mask, seq_lengths (Lq, L), an offset mask_mod): flex_attention's positions.
            raise reported(expected("block_mask", "a mask whose Q_LEN exceeds every query position "
                                    f"(q_idx runs up to {q_end - 1})", f"Q_LEN={mQ}",
                                    "for a mask of the query's own positions (torch's decode "
                                    "pattern: block_mask[:, :, i] with seq_lengths=(1, L) and an "
                                    "offset mask_mod) pass q_offsets=0, so q_idx starts at 0 as in "
                                    "flex_attention" if mQ == Lq else
                                    "build the mask for the cache's logical length "
                                    "(PagedKVCache.block_mask)"))
    if (score_buffers or mask_buffers) and not torch.compiler.is_compiling():
        # Captured tensors indexed outside their bounds raise, as torch's indexing would. The
        # positions come from the host lengths, which only this eager wrapper has (under
        # torch.compile, FLEXGEN_DEBUG=1's device asserts are the check).
        from .frontend.bounds_check import check_decode_indices
        from .frontend.trace import TracedMod
        check_decode_indices(TracedMod.from_graph(score_mod, score_buffers) if score_mod else None,
                             TracedMod.from_graph(mask_text, mask_buffers) if mask_text else None,
                             (B, query.shape[1], Lq), q_offsets, host_ql, host_kv, kv_max, capacity)
    if max_kv_len is None:
        max_kv_len = capacity if kv_max is None else kv_max
    packed = () if _packed is None else (_packed[1], int(_packed[2]))
    from .runtime.ops import serving as serving_ops      # registers its ops
    out, lse = serving_ops.call_decode(
        query if _packed is None else _packed[0], key, value, list(score_buffers), list(mask_buffers),
        list(lists), kv, qs, ql, page_table, score_mod, mask_text, list(block_size), list(lengths),
        check_scale(scale, D), bool(enable_gqa), options.text, int(max_kv_len), *packed)
    return (out, lse) if return_lse else out


def decode_kernel_source(query, key, value, score_mod=None, block_mask=None, scale=None,
                         enable_gqa=False, kv_lengths=None, page_table=None, *, mask_mod=None,
                         kernel_options=None, **unused) -> str:
    """The generated module source ``decode_attention`` would run for these arguments (nothing
    is launched; the lengths do not change the kernel)."""
    from .runtime.plan import plan_decode_call
    _tensors(query=query, key=key, value=value)
    score_mod, score_buffers, mask_text, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    if mask_mod is not None:
        traced = trace_cached(mask_mod, "mask_mod")
        mask_text, mask_buffers = traced.graph, traced.buffers
    plan = plan_decode_call(query, key, value, score_mod, score_buffers, mask_text, mask_buffers, lists,
                            block_size, lengths, page_table, bool(enable_gqa),
                            parse_options(kernel_options).text)
    return source(plan.spec)


# ---------------------------------------------------------------------------------- sigmoid attention

def check_bias(bias, kv_len) -> float:
    """The sigmoid's bias: ``bias`` itself, or -log(KV_LEN) for None."""
    if bias is None:
        return -math.log(max(1, kv_len))
    if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
        raise reported(expected("bias", "a finite float or None (-log(KV_LEN))", repr(bias),
                                "pass a Python float"))
    return float(bias)


def sigmoid_attention(query, key, value, score_mod=None, block_mask=None, scale=None, bias=None,
                      enable_gqa=False, kernel_options=None):
    """Sigmoid attention: ``out_i = Σ_j keep_ij · sigmoid(score_mod(q_i·k_j · scale) + bias) · v_j``.

    The same call as ``flex_attention`` with the softmax replaced by an elementwise sigmoid
    and no row normalization: query ``[B, Hq, Lq, D]``, key ``[B or 1, Hkv, Lkv, D]``, value
    ``[B or 1, Hkv, Lkv, Dv]`` (fp16, bf16 or fp32; D and Dv from 16 to 256; GQA with
    ``enable_gqa=True``); every score_mod and block mask ``flex_attention`` takes works here
    (the same generated loops skip the same blocks). ``scale`` defaults to 1/sqrt(D),
    ``bias`` (a float, a runtime argument of the kernel) to ``-log(Lkv)``, which keeps the
    sum of the weights near one at initialization. A fully masked row is exactly 0.
    Returns ``out [B, Hq, Lq, Dv]`` in the query's dtype and stride order; a few queries per
    sequence (Lq <= 16) take the split-K decode kernel.

    Differentiable: gradients flow to query, key, value and to floating tensors the
    score_mod captures that require grad. One ``torch.ops.flexgen.sigmoid_attention`` op
    per call (its backward one more), so torch.compile(fullgraph=True) takes it as is.
    """
    _tensors(query=query, key=key, value=value)
    score_mod, score_buffers, mask_mod, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    from .runtime.ops import sigmoid as sigmoid_ops      # registers its ops
    return sigmoid_ops.call_sigmoid_attention(
        query, key, value, score_buffers, mask_buffers, lists, score_mod, mask_mod, block_size, lengths,
        check_scale(scale, query.shape[-1]), check_bias(bias, key.shape[2]), bool(enable_gqa),
        parse_options(kernel_options).text)


def sigmoid_kernel_source(query, key, value, score_mod=None, block_mask=None, scale=None,
                          enable_gqa=False, kernel_options=None, part="forward") -> str:
    """The generated module source ``sigmoid_attention`` would run for these arguments:
    ``part`` "forward" (the forward kernel, or the decode kernel for a few queries), "dq" or
    "dkdv" (the backward's two kernels; "fused" is refused: no sigmoid backward takes the
    fused kernel). Nothing is launched."""
    from .runtime.plan import plan_sigmoid, plan_sigmoid_backward
    from .kernels.backward import grad_slots
    _check_part(part)
    _tensors(query=query, key=key, value=value)
    score_mod, score_buffers, mask_mod, mask_buffers, lists, block_size, lengths = _mods(
        score_mod, block_mask)
    args = (query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, lists, block_size,
            lengths, check_scale(scale, query.shape[-1]), bool(enable_gqa),
            parse_options(kernel_options).text)
    plan = plan_sigmoid(*args)
    if part == "forward":
        return source(plan.spec if plan.kernel == "forward" else plan.decode.spec)
    bw = plan_sigmoid_backward(*args, grad_slots(score_buffers))
    return _backward_source(bw, part)


# ---------------------------------------------------------------------------------- linear attention

def _linear_mods(decay_mod, feature_map):
    decay = None if decay_mod is None else trace_cached(decay_mod, "decay_mod")
    feature = None if feature_map is None else trace_cached(feature_map, "feature_map")
    return ("" if decay is None else decay.graph, () if decay is None else decay.buffers,
            "" if feature is None else feature.graph, () if feature is None else feature.buffers)


def _state_arg(name, state):
    """``initial_state`` as the kernels read it: float32, contiguous (autograd follows the copy)."""
    if state is None:
        return None
    if not isinstance(state, torch.Tensor) or not state.dtype.is_floating_point:
        got = f"dtype {state.dtype}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise reported(expected(name, "a floating tensor [B, H, Dk, Dv] (kept in float32)", got,
                                f"pass {name} as a float32 tensor"))
    return state.to(torch.float32).contiguous()


def linear_attention(query, key, value, decay_mod=None, feature_map=None, scale=None,
                     initial_state=None, output_final_state=False, enable_gqa=False,
                     kernel_options=None):
    """Causal linear attention with a scalar decay per head and position, in chunked kernels.

    ``S_t = exp(g_t) · S_{t-1} + φ(k_t)ᵀ v_t`` and ``o_t = scale · φ(q_t) S_t``, with
    ``g_t = decay_mod(b, h, t)`` (a log-decay <= 0; None: 0, plain causal linear attention)
    and ``φ = feature_map(x)`` (elementwise on the query and key entries; None: identity).
    A constant per head (``-slopes[h]``) is lightning attention / retention; a captured
    per-token tensor (``gates[b, h, t]``) a gated linear attention; ``torch.where(x > 0, x + 1,
    torch.exp(x))`` (or ``F.elu(x) + 1``) the classic feature map. Both mods are traced like a
    score_mod, and their captured tensors are kernel arguments.

    query ``[B, Hq, T, Dk]``, key ``[B, Hkv, T, Dk]``, value ``[B, Hkv, T, Dv]`` (fp16, bf16 or
    fp32; head dims 16 to 256; Hq a multiple of Hkv with ``enable_gqa=True``: ``h`` in the mods
    and the state's head axis are query heads). ``t`` counts positions within the call: a
    caller continuing a sequence passes the matching slice of its gates. ``scale`` defaults to
    1/sqrt(Dk). ``initial_state`` ``[B, Hq, Dk, Dv]`` (float32; zeros for None). Returns ``out``
    ``[B, Hq, T, Dv]`` in the query's dtype, and with ``output_final_state`` also the final state
    ``[B, Hq, Dk, Dv]`` float32. ``kernel_options``: BLOCK_M is the chunk size (default 128 for
    the forward, 64 for the backward on a GPU; BLOCK_M sets both), BLOCK_N the value-dim slice,
    num_warps / num_stages, BACKEND "TRITON" (always chunked) or "TRITON_DECODE" (always the
    recurrent kernel).

    The prefill runs in chunks (O(T·C) per head): the state entering each chunk, one chunk
    after another per head and head-dim slice, then the outputs of all chunks in parallel (a
    decay_mod that reads t first has its running sums per chunk computed by one small kernel);
    a short call (T <= 16) with an ``initial_state``
    runs the recurrent decode kernel. Differentiable with respect to query, key, value,
    ``initial_state`` and floating tensors the decay_mod captures that require grad (the
    gates); the feature map's derivative is derived symbolically. One
    ``torch.ops.flexgen.linear_attention`` op per call.
    """
    _tensors(query=query, key=key, value=value)
    decay_text, decay_buffers, feature_text, feature_buffers = _linear_mods(decay_mod, feature_map)
    from .runtime.ops import linear as linear_ops      # registers its ops
    out, state = linear_ops.call_linear_attention(
        query, key, value, _state_arg("initial_state", initial_state), decay_buffers, feature_buffers,
        decay_text, feature_text, check_scale(scale, query.shape[-1]), bool(enable_gqa),
        bool(output_final_state), parse_options(kernel_options).text)
    return (out, state) if output_final_state else out


def linear_attention_decode(query, key, value, state, slots, decay_mod=None, feature_map=None, scale=None,
                            enable_gqa=False, kernel_options=None):
    """A few decoding steps of ``linear_attention`` for a batch of sequences whose states live in a
    cache: the serving layout.

    ``state`` ``[num_slots, Hq, Dk, Dv]`` float32 holds one state per sequence slot; batch row
    ``b`` continues the sequence in slot ``slots[b]`` (an int, a list of B ints or an integer
    tensor [B]; distinct slots), whose state is updated in place by the call's T positions
    (query ``[B, Hq, T, Dk]``, key ``[B, Hkv, T, Dk]``, value ``[B, Hkv, T, Dv]``, T usually 1).
    The mods see ``b`` (the batch row), ``h`` (the query head) and ``t`` from 0 for the call's
    first position. Returns ``out`` ``[B, Hq, T, Dv]`` in the query's dtype. No autograd.
    """
    _tensors(query=query, key=key, value=value)
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float32:
        got = f"dtype {state.dtype}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise reported(expected("state", "a float32 tensor [num_slots, H, Dk, Dv] (updated in place)",
                                got, "keep the state cache in float32"))
    B = query.shape[0]
    slots = _lengths_arg("slots", slots, B, query.device, "pass one slot per batch row")
    host = _host_ints(slots, B)
    if host is not None and state.dim() == 4 and (min(host) < 0 or max(host) >= state.shape[0]):
        raise reported(expected("slots", f"rows of the state cache, 0 to {state.shape[0] - 1}",
                                f"{min(host)} .. {max(host)}", "allocate a larger cache"))
    if host is not None and len(set(host)) != len(host) and B > 1:
        raise reported(expected("slots", "distinct slots (each row updates its own state)", host,
                                "give each batch row its own slot"))
    decay_text, decay_buffers, feature_text, feature_buffers = _linear_mods(decay_mod, feature_map)
    from .runtime.ops import linear as linear_ops      # registers its ops
    return linear_ops.call_linear_attention_decode(
        query, key, value, state, slots, list(decay_buffers), list(feature_buffers), decay_text,
        feature_text, check_scale(scale, query.shape[-1]), bool(enable_gqa),
        parse_options(kernel_options).text)


LINEAR_PARTS = ("prefix", "state", "output", "decode", "grad", "gates")


def linear_kernel_source(query, key, value, decay_mod=None, feature_map=None, scale=None,
                         initial_state=None, enable_gqa=False, kernel_options=None, part="output") -> str:
    """The generated module source of one of ``linear_attention``'s kernels for these arguments:
    ``part`` "prefix" (a decay_mod reading t: its running sums per chunk), "state", "output"
    (the chunked forward), "decode" (the recurrent kernel),
    "grad" or "gates" (the backward; "gates" for a decay_mod whose captured tensors require
    grad). Nothing is launched."""
    from .runtime.plan import plan_linear, plan_linear_backward
    from .kernels.backward import grad_slots
    if part not in LINEAR_PARTS:
        raise expected("part", " / ".join(map(repr, LINEAR_PARTS)), repr(part), "pick one of the kernels")
    _tensors(query=query, key=key, value=value)
    decay_text, decay_buffers, feature_text, feature_buffers = _linear_mods(decay_mod, feature_map)
    plan = plan_linear(query, key, value, _state_arg("initial_state", initial_state), decay_text,
                       decay_buffers, feature_text, feature_buffers, check_scale(scale, query.shape[-1]),
                       bool(enable_gqa), parse_options(kernel_options).text)
    if part in ("grad", "gates"):
        bw = plan_linear_backward(plan, grad_slots(decay_buffers))
        if part == "gates" and bw.gates is None:
            raise expected("decay_mod", "captured tensors that require grad (for the gates kernel)",
                           "none", "pass gates with requires_grad=True")
        return source(bw.grad if part == "grad" else bw.gates)
    if part == "prefix" and plan.prefix is None:
        raise expected("decay_mod", "a decay that reads t (for the prefix kernel)",
                       "none" if decay_mod is None else "one constant in t (its sums are in closed form)",
                       "pass per-token gates such as gates[b, h, t]")
    return source(getattr(plan, part))


__all__ = ["flex_attention", "plan", "kernel_source", "decode_attention", "decode_kernel_source",
           "AuxRequest", "AuxOutput", "check_scale", "sigmoid_attention", "sigmoid_kernel_source",
           "check_bias", "linear_attention", "linear_attention_decode", "linear_kernel_source"]
