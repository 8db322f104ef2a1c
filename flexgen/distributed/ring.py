"""Context-parallel attention: the sequence sharded over a process group, K/V shards exchanged.

Every rank holds the shard ``[B, H, L/W, D]`` of Q, K and V that ``layout`` gives it
(``flexgen.distributed.layout``). The forward pass, on rank ``r``, for steps
``t = 0 .. W-1``:

- step ``t`` works on the K/V shard of rank ``src = r - t`` (mod W): its own at t = 0;
  for t > 0 that shard arrives by a point-to-point receive, while rank ``r`` sends its
  own shard to ``dst = r + t``. Every step is a permutation of the ranks (for W = 2
  the ring), and each transfer goes straight from the owner to the rank that needs it,
  so a transfer the mask makes useless is simply not posted: no rank forwards data it
  does not use. Step ``t + 1``'s sends and receives are posted (``batch_isend_irecv``)
  before step ``t``'s kernel runs, so communication overlaps compute; NCCL runs them
  on its own stream.
- the local kernel is ``flexgen.flex_attention`` on (my queries, that shard) with the
  mods shifted to global positions and the pair's block mask
  (``flexgen.distributed.schedule``); a pair with no block is skipped.
- partial results merge with their log-sum-exp: ``lse = logaddexp(lse, lse_t)``,
  ``out = out * exp(lse_old - lse) + out_t * exp(lse_t - lse)`` in float32; a row no
  key reaches keeps lse = -inf and a zero output (the exponents are taken against 0
  there, never -inf - -inf).

``comm="all_gather"`` instead gathers every shard in one collective (the local pair is
computed while it runs): fewer, larger messages, for shards small enough that the
per-step latency of the ring would dominate; ``"auto"`` takes it for unmasked
attention on small shards, where nothing could be skipped anyway.

The backward pass is exact with the global softmax: the gradient of pair (r, s) is
flexgen's backward (``torch.ops.flexgen.attention_backward``) with the MERGED output
and LSE (P is recomputed as exp(score - global lse); delta = rowsum(dO * out) uses the
merged output), so the partials need no rescaling. dQ and the captured tensors'
gradients stay on rank r; dK/dV of shard s travel back to rank s (the reverse ring:
sent after the pair's kernel, received from rank r + t) and are summed there in
float32. K/V shards are sent again rather than kept from the forward pass (memory of
one shard per step in flight, not W). With ``"all_gather"`` the backward gathers the
shards again and sums dK/dV with one reduce-scatter.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..api import check_scale, flex_attention
from ..errors import expected
from ..frontend.trace import trace_cached
from ..kernels.backward import grad_slots
from ..masks.block_mask import mask_inputs
from ..runtime import ops
from ..runtime.options import parse_options
from .layout import check_layout, check_shard_length, group_info
from .schedule import plan_for

COMMS = ("auto", "p2p", "all_gather")
# "auto" gathers all shards at once when nothing can be skipped and a packed K/V shard
# is at most this big: below it, a ring step's latency costs more than its bytes.
ALL_GATHER_MAX_BYTES = 2 << 20
_KV_TAG, _DKV_TAG = 17, 18      # gloo matches messages by tag; NCCL ignores tags

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Statistics of the last calls in this process, for benchmarks and tests: bytes this
# rank posted for sending, and pairs computed / skipped.
STATS = {"bytes_sent": 0, "pairs_computed": 0, "pairs_skipped": 0}


def reset_stats() -> None:
    for k in STATS:
        STATS[k] = 0


# ---------------------------------------------------------------------------------- the call

class _Call:
    """Everything one call's forward and backward share (autograd keeps it on the ctx)."""

    def __init__(self, group, rank, world, plan, score_mod, scale, enable_gqa, kernel_options,
                 comm, k_shape, v_shape):
        self.group, self.rank, self.world, self.plan = group, rank, world, plan
        self.score_mods = plan.score_mods(score_mod)
        self.scale, self.enable_gqa, self.kernel_options = scale, enable_gqa, kernel_options
        self.comm = comm
        self.k_shape, self.v_shape = k_shape, v_shape
        self.peers = [dist.get_global_rank(group, r) for r in range(world)] \
            if group is not dist.group.WORLD else list(range(world))
        self.grad_buffers = ()        # the score_mod's tensors that get a gradient

    # --- packing: K and V travel as one message -----------------------------------
    def pack(self, k, v):
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, kv):
        nk = math.prod(self.k_shape)
        return kv[:nk].view(self.k_shape), kv[nk:].view(self.v_shape)

    # --- point-to-point ------------------------------------------------------------
    def post(self, sends, recvs, tag):
        """Post ``(tensor, rank)`` sends and receives; returns their works (none posted: [])."""
        ops_ = [dist.P2POp(dist.isend, t, self.peers[r], self.group, tag) for t, r in sends]
        ops_ += [dist.P2POp(dist.irecv, t, self.peers[r], self.group, tag) for t, r in recvs]
        for t, _ in sends:
            STATS["bytes_sent"] += t.numel() * t.element_size()
        return dist.batch_isend_irecv(ops_) if ops_ else []

    def post_kv(self, t, kv):
        """Step ``t``'s exchange: my shard to rank + t, the shard of rank - t to me."""
        plan = self.plan
        sends = [(kv, plan.dest(t))] if plan.send[t] else []
        buf = torch.empty_like(kv) if plan.recv[t] else None
        recvs = [(buf, plan.source(t))] if buf is not None else []
        return buf, self.post(sends, recvs, _KV_TAG)

    def gather_kv(self, kv):
        """(all shards [W, n], its pending work): the all-gather that replaces the ring."""
        out = torch.empty(self.world * kv.numel(), dtype=kv.dtype, device=kv.device)
        STATS["bytes_sent"] += kv.numel() * kv.element_size() * (self.world - 1)
        return out.view(self.world, -1), _all_gather(out, kv, group=self.group, async_op=True)

    # --- one pair --------------------------------------------------------------------
    def forward_pair(self, q, kv, src):
        k, v = self.unpack(kv)
        STATS["pairs_computed"] += 1
        return flex_attention(q, k, v, score_mod=self.score_mods[src], block_mask=self.plan.masks[src],
                              scale=self.scale, enable_gqa=self.enable_gqa, return_lse=True,
                              kernel_options=self.kernel_options)

    def backward_pair(self, q, kv, src, out, lse, grad_out, grad_lse):
        k, v = self.unpack(kv)
        score_text, score_buffers = "", ()
        if self.score_mods[src] is not None:
            traced = trace_cached(self.score_mods[src], "score_mod")
            score_text, score_buffers = traced.graph, traced.buffers
        mask_text, mask_buffers, lists, block_size, lengths = mask_inputs(self.plan.masks[src])
        slots = [i for i, t in enumerate(score_buffers) if any(t is g for g in self.grad_buffers)]
        dq, dk, dv, grads = ops.attention_backward(
            q, k, v, out, lse, grad_out, grad_lse, list(score_buffers), list(mask_buffers),
            list(lists), score_text, mask_text, list(block_size), list(lengths), self.scale,
            self.enable_gqa, parse_options(self.kernel_options).text, slots, True)
        by_buffer = {}
        for slot, g in zip(slots, grads):
            by_buffer[id(score_buffers[slot])] = g
        return dq, self.pack(dk, dv), [by_buffer.get(id(b)) for b in self.grad_buffers]

    def check_backward(self, q, k, v):
        """Raise flexgen.GradientError now (not in backward) for a score_mod with no derivative."""
        src = self.rank
        score_text, score_buffers = "", ()
        if self.score_mods[src] is not None:
            traced = trace_cached(self.score_mods[src], "score_mod")
            score_text, score_buffers = traced.graph, traced.buffers
        mask_text, mask_buffers, lists, block_size, lengths = mask_inputs(self.plan.masks[src])
        ops.check_backward(q, k, v, list(score_buffers), list(mask_buffers), list(lists), score_text,
                           mask_text, list(block_size), list(lengths), self.scale, self.enable_gqa,
                           parse_options(self.kernel_options).text, False)


class _Merge:
    """Running LSE merge of partial attention outputs, in float32."""

    def __init__(self):
        self.out = self.lse = None

    def add(self, out, lse):
        if self.out is None:
            self.out, self.lse = out.to(torch.float32, copy=True), lse.clone()
            return
        new = torch.logaddexp(self.lse, lse)
        # A row with no key yet stays -inf: take its exponents against 0, not -inf.
        safe = new.masked_fill(torch.isneginf(new), 0.0)
        self.out.mul_(torch.exp(self.lse - safe).unsqueeze(-1))
        self.out.add_(out.to(torch.float32) * torch.exp(lse - safe).unsqueeze(-1))
        self.lse = new

    def result(self, q, v_dim):
        if self.out is None:           # the mask leaves this rank's queries nothing
            B, H, L = q.shape[:3]
            return (q.new_zeros(B, H, L, v_dim),
                    torch.full((B, H, L), -math.inf, dtype=torch.float32, device=q.device))
        return self.out.to(q.dtype), self.lse


def _wait(works):
    for w in works:
        w.wait()


# ---------------------------------------------------------------------------------- forward

def _forward(call, q, k, v):
    plan, world = call.plan, call.world
    kv = call.pack(k, v)
    merge = _Merge()
    if call.comm == "all_gather" and world > 1:
        gathered, work = call.gather_kv(kv)
        if plan.recv[0]:
            merge.add(*call.forward_pair(q, kv, call.rank))
        work.wait()
        for t in range(1, world):
            if plan.recv[t]:
                merge.add(*call.forward_pair(q, gathered[plan.source(t)], plan.source(t)))
    else:
        posted = {}
        for t in range(world):
            if t + 1 < world:
                posted[t + 1] = call.post_kv(t + 1, kv)      # in flight while step t computes
            if t == 0:
                shard = kv
            else:
                shard, works = posted.pop(t)
                _wait(works)
            if plan.recv[t]:
                merge.add(*call.forward_pair(q, shard, plan.source(t)))
    STATS["pairs_skipped"] += plan.skipped_pairs()
    return merge.result(q, v.shape[-1])


# ---------------------------------------------------------------------------------- backward

def _backward(call, q, k, v, out, lse, grad_out, grad_lse):
    plan, world = call.plan, call.world
    kv = call.pack(k, v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    buffer_grads = [None] * len(call.grad_buffers)

    def pair(shard, src):
        dq_t, dkv_t, grads = call.backward_pair(q, shard, src, out, lse, grad_out, grad_lse)
        dq.add_(dq_t)
        for i, g in enumerate(grads):
            if g is not None:
                buffer_grads[i] = g.float() if buffer_grads[i] is None else buffer_grads[i].add_(g)
        return dkv_t

    if call.comm == "all_gather" and world > 1:
        gathered, work = call.gather_kv(kv)
        partial = torch.zeros(world, kv.numel(), dtype=kv.dtype, device=kv.device)
        if plan.recv[0]:
            partial[call.rank] = pair(kv, call.rank)
        work.wait()
        for t in range(1, world):
            src = plan.source(t)
            if plan.recv[t]:
                partial[src] = pair(gathered[src], src)
        mine = torch.empty_like(kv)
        _reduce_scatter(mine, partial.view(-1), group=call.group)
        dkv.add_(mine)
    else:
        posted, returning = {}, None
        for t in range(world):
            if t + 1 < world:
                posted[t + 1] = call.post_kv(t + 1, kv)
            if t == 0:
                shard = kv
            else:
                shard, works = posted.pop(t)
                _wait(works)
            dkv_t = pair(shard, plan.source(t)) if plan.recv[t] else None
            if returning is not None:        # the previous step's gradients came back meanwhile
                buf, works, _ = returning
                _wait(works)
                if buf is not None:
                    dkv.add_(buf)
                returning = None
            if t == 0:
                if dkv_t is not None:
                    dkv.add_(dkv_t)
                continue
            # The reverse direction: dK/dV of shard src go home; rank + t returns mine.
            sends = [(dkv_t, plan.source(t))] if dkv_t is not None else []
            buf = torch.empty_like(kv) if plan.send[t] else None
            recvs = [(buf, plan.dest(t))] if buf is not None else []
            returning = (buf, call.post(sends, recvs, _DKV_TAG), dkv_t)   # dkv_t: alive until sent
        if returning is not None:
            buf, works, _ = returning
            _wait(works)
            if buf is not None:
                dkv.add_(buf)
    dk, dv = call.unpack(dkv)
    grads = [None if g is None else g.to(b.dtype) for g, b in zip(buffer_grads, call.grad_buffers)]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads


class _RingAttention(torch.autograd.Function):
    """The whole ring, forward and backward, as one autograd node."""

    @staticmethod
    def forward(ctx, call, q, k, v, *buffers):
        out, lse = _forward(call, q, k, v)
        ctx.call = call
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        if grad_out is None and grad_lse is None:
            return (None,) * (4 + len(call.grad_buffers))
        dq, dk, dv, grads = _backward(call, q, k, v, out, lse, grad_out, grad_lse)
        return (None, dq, dk, dv, *grads)


# ---------------------------------------------------------------------------------- checks

_CHECKED: set = set()
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_inputs(query, key, value, mask_mod, comm, block_size):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise expected(name, "this rank's shard, a 4-D tensor [B, H, L / world, D]", got,
                           "shard the sequence with flexgen.distributed.shard(x, group, layout)")
    if key.shape[2] != query.shape[2] or value.shape[2] != query.shape[2]:
        raise expected("key", f"shards as long as the query's ({query.shape[2]}): context "
                       "parallelism shards one sequence (self-attention)",
                       f"key {key.shape[2]}, value {value.shape[2]}",
                       "shard query, key and value of the same sequence the same way")
    if key.dtype != value.dtype or key.device != value.device:
        raise expected("value", f"the key's dtype and device ({key.dtype}, {key.device})",
                       f"{value.dtype}, {value.device}", "cast value like key")
    if mask_mod is not None and (hasattr(mask_mod, "kv_indices") or not callable(mask_mod)):
        raise expected("mask_mod", "a mask_mod function (b, h, q_idx, kv_idx) -> bool over global "
                       "positions", type(mask_mod).__name__,
                       "pass the mask_mod itself: the block masks are built per shard pair")
    if comm not in COMMS:
        raise expected("comm", '"auto", "p2p" or "all_gather"', repr(comm), "pick one of the three")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 16 \
            or block_size & (block_size - 1):
        raise expected("block_size", "a power of two >= 16", repr(block_size), "use 128 (the default)")


def _check_across_ranks(group, world, comm, query, key, value, layout, block_size):
    """Every rank passes shards of one shape: checked with one small all-gather the first time
    this process sees a shape (shapes that differ across ranks would deadlock or corrupt the
    exchange). A rank that repeats a shape while another brings a new one is not caught."""
    sig = (tuple(query.shape), tuple(key.shape), tuple(value.shape),
           _DTYPES.index(query.dtype) if query.dtype in _DTYPES else -1,
           _DTYPES.index(key.dtype) if key.dtype in _DTYPES else -1,
           ("load_balanced", "contiguous").index(layout), block_size, COMMS.index(comm))
    key_ = (id(group), world, sig)
    if world == 1 or key_ in _CHECKED:
        return
    flat = [n for part in sig for n in (part if isinstance(part, tuple) else (part,))]
    mine = torch.tensor(flat, dtype=torch.int64, device=query.device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=query.device)
    _all_gather(every, mine, group=group)
    rows = every.view(world, -1).tolist()
    if any(row != rows[0] for row in rows):
        names = ["query shape", "key shape", "value shape", "query dtype", "key dtype", "layout",
                 "block_size", "comm"]
        sizes = [4, 4, 4, 1, 1, 1, 1, 1]
        parts, start = [], 0
        for name, n in zip(names, sizes):
            values = [tuple(r[start:start + n]) if n > 1 else r[start] for r in rows]
            if len(set(values)) > 1:
                parts.append(f"{name}: " + ", ".join(f"rank {i} {v}" for i, v in enumerate(values)))
            start += n
        raise expected("query", "shards of one shape, dtype and layout on every rank of the group",
                       "; ".join(parts),
                       "split the sequence evenly (flexgen.distributed.shard) and call with the same "
                       "arguments on every rank")
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED.add(key_)


# ---------------------------------------------------------------------------------- the API

def context_parallel_attention(query, key, value, score_mod=None, mask_mod=None, group=None,
                               layout="load_balanced", scale=None, enable_gqa=False, return_lse=False,
                               *, block_size=128, comm="auto", kernel_options=None):
    """Attention over a sequence sharded along its length across the ranks of ``group``.

    Each rank passes its shard: query ``[B, Hq, L/W, D]``, key ``[B, Hkv, L/W, D]``,
    value ``[B, Hkv, L/W, Dv]`` of one sequence of ``L`` tokens split over the ``W``
    ranks as ``layout`` says (``flexgen.distributed.shard`` cuts a whole tensor that
    way): ``"load_balanced"`` (rank r holds chunks r and 2W-1-r of 2W; even causal work)
    or ``"contiguous"``. ``score_mod(score, b, h, q_idx, kv_idx)`` and
    ``mask_mod(b, h, q_idx, kv_idx)`` see GLOBAL positions, as in ``flex_attention`` on
    the whole sequence; tensors they capture (document ids of the whole sequence, a
    bias) must be the same on every rank. Returns this rank's shard of the output
    ``[B, Hq, L/W, Dv]`` (and with ``return_lse`` the natural-log LSE ``[B, Hq, L/W]``).

    K/V shards move between ranks while the local kernels run; a shard whose pairing
    with a query shard the mask rules out entirely (causal, sliding window, documents)
    is neither sent nor computed. The block masks and that plan are built once per
    (mask, lengths, world, layout) and reused; a mask over data (document ids) gets a
    new plan for each new tensor it captures. ``block_size`` is the sparse block size
    of those masks; ``comm`` is "p2p" (the ring), "all_gather" (one collective) or
    "auto"; ``kernel_options`` go to every kernel.

    Differentiable: gradients flow to query, key and value (dK/dV return to the rank
    that owns the shard) and to floating tensors the score_mod captures that require
    grad; those get this rank's share (its queries' scores): sum them over the group,
    as DistributedDataParallel / FSDP do for parameters. Every rank of the group must
    make the same calls in the same order (the backward communicates too).
    """
    group, rank, world = group_info(group)
    check_layout(layout)
    _check_inputs(query, key, value, mask_mod, comm, block_size)
    B, Hq, local_len, D = query.shape
    check_shard_length("query", local_len, world, layout)
    scale = check_scale(scale, D)
    parse_options(kernel_options)
    if comm == "auto":
        kv_bytes = (key.numel() + value.numel()) * key.element_size()
        comm = "all_gather" if mask_mod is None and kv_bytes <= ALL_GATHER_MAX_BYTES else "p2p"
    _check_across_ranks(group, world, comm, query, key, value, layout, block_size)
    plan = plan_for(mask_mod, B, Hq, local_len, world, rank, layout, block_size, query.device)
    call = _Call(group, rank, world, plan, score_mod, scale, bool(enable_gqa), kernel_options, comm,
                 tuple(key.shape), tuple(value.shape))
    buffers = () if score_mod is None else trace_cached(score_mod, "score_mod").buffers
    call.grad_buffers = tuple(buffers[i] for i in grad_slots(buffers))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *call.grad_buffers)):
        call.check_backward(query, key, value)
        out, lse = _RingAttention.apply(call, query, key, value, *call.grad_buffers)
    else:
        call.grad_buffers = ()
        out, lse = _forward(call, query, key, value)
    return (out, lse) if return_lse else out


__all__ = ["context_parallel_attention", "STATS", "reset_stats", "COMMS"]
