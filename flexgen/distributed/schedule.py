"""Which shard pairs a mask leaves work in, and their block masks: the communication plan.

Rank ``r`` computes the attention of its query shard against the key/value shard of
every rank ``s`` (a *pair* ``(r, s)``). The mods are the user's, shifted to global
positions through the two shards' position maps (``layout.positions``)::

    mask_mod(b, h, qpos[q_idx], kvpos[kv_idx])

so one kernel serves every pair (the maps are captured tensors: kernel arguments, not
constants). A pair whose block mask has no block at all is neither sent nor computed.
The decision is made on the host once per (mask, lengths, world, layout, block size),
not per step, and every rank makes it alike without communicating:

- rank ``r`` classifies its own row, the pairs ``(r, s)``: it needs their block masks
  to compute, and learns which shards it will receive;
- and its column, the pairs ``(d, r)``: which ranks need its shard, so it knows whom to
  send to. ``2W - 1`` pairs in all, the same arithmetic every other rank runs for its
  own row, so a sender and its receiver always agree.

Blocks are classified from interval bounds first (``flexgen.masks.bounds``), on the
user's mask expression rewritten to global positions: each bare ``q_idx`` becomes a
load of the query position map, and each captured tensor indexed by exactly ``q_idx``
(or ``kv_idx``) is replaced by that tensor gathered through the map. Bounds then see,
per local block, the range of global positions and the range of the captured values
(document ids) over them, so index-only masks (causal, sliding window) and document
masks are decided without looking at elements, except blocks the bounds leave open
(a document boundary, a load-balanced block straddling its two chunks): those are
evaluated element by element with the shifted mod (``flexgen.masks.builder``).
For a mask that reads data (document ids) the plan depends on the values: it is
built once per new tensor (a new batch), which costs a few device-to-host reads of
small summaries (which pairs are empty, which blocks are undecided).
"""
from __future__ import annotations

import sympy
import torch
from sympy.core.function import AppliedUndef

from ..frontend.expr import INDEX_SYMBOLS
from ..frontend.lowering import buffer_map, lower
from ..frontend.trace import trace_cached
from ..masks import bounds
from ..masks.block_mask import BlockMask
from ..masks.builder import _classify_undecided, fill_lists, layout as list_layout
from .layout import positions

_Q, _KV = INDEX_SYMBOLS["q_idx"], INDEX_SYMBOLS["kv_idx"]


def shifted_mask(mask_mod, qpos: torch.Tensor, kvpos: torch.Tensor):
    """``mask_mod`` seen from a shard pair: local indices mapped to global positions."""
    def cp_mask(b, h, q_idx, kv_idx):
        return mask_mod(b, h, qpos[q_idx], kvpos[kv_idx])
    cp_mask.__name__ = f"{getattr(mask_mod, '__name__', 'mask_mod')}_cp"
    return cp_mask


def shifted_score(score_mod, qpos: torch.Tensor, kvpos: torch.Tensor):
    """``score_mod`` seen from a shard pair: local indices mapped to global positions."""
    def cp_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, qpos[q_idx], kvpos[kv_idx])
    cp_score.__name__ = f"{getattr(score_mod, '__name__', 'score_mod')}_cp"
    return cp_score


def _gather(t: torch.Tensor, dim: int, pos: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` read at positions ``pos`` along ``dim``; positions past its end read 0, as the
    kernels' masked loads (and the bounds of the unsharded mask) do."""
    if t.shape[dim] < length:
        pad = list(t.shape)
        pad[dim] = length - t.shape[dim]
        t = torch.cat([t, t.new_zeros(pad)], dim)
    return t.index_select(dim, pos.to(device=t.device, dtype=torch.long))


def global_expr(expr, buffers: dict, qpos: torch.Tensor, kvpos: torch.Tensor, length: int) -> tuple:
    """(expression, buffers) of a mask over a shard pair's local indices, in a form the
    bounds evaluator reads well: bare indices are loads of the position maps, and loads
    of a captured tensor at exactly ``q_idx`` / ``kv_idx`` read a copy of it gathered
    through the maps (so the bounds use its per-block minimum and maximum)."""
    table = dict(buffers)
    table["cpq"], table["cpk"] = qpos, kvpos
    index = {_Q: sympy.Function("cpq", integer=True)(_Q), _KV: sympy.Function("cpk", integer=True)(_KV)}
    memo: dict = {}

    def rewrite(e):
        if e in memo:
            return memo[e]
        if e in index:
            new = index[e]
        elif isinstance(e, AppliedUndef) and e.func.__name__ in buffers and \
                any(a in index for a in e.args):
            t = buffers[e.func.__name__]
            for d, a in enumerate(e.args):
                if a in index:
                    t = _gather(t, d, qpos if a == _Q else kvpos, length)
            name = f"cpg{len(table)}"
            table[name] = t
            kind = {"real": True} if t.is_floating_point() else {"integer": True}
            new = sympy.Function(name, **kind)(*(a if a in index else rewrite(a) for a in e.args))
        elif e.args:
            new = e.func(*(rewrite(a) for a in e.args))
        else:
            new = e
        memo[e] = new
        return new

    return rewrite(expr), table


def pair_hits(traced, wrapped, B: int, H: int, qpos, kvpos, length: int, block: int,
              device) -> torch.Tensor:
    """int32 ``[2, B, H, NQ, NKV]``: which blocks of the pair (query positions ``qpos``, key
    positions ``kvpos``, ``[Ls]`` each) are partial (``[0]``) and which full (``[1]``)."""
    Ls = qpos.shape[0]
    nb = -(-Ls // block)
    shape = (B, H, nb, nb)
    expr, table = global_expr(lower(traced).expr, buffer_map(traced), qpos, kvpos, length)
    hit = torch.empty((2, *shape), dtype=torch.int32, device=device)
    undecided, full = hit.unbind(0)
    _, empty = bounds.block_flags(expr, B, H, Ls, Ls, block, block, table, device, out=full)
    torch.eq(empty.expand(shape), full, out=undecided)
    blocks = undecided.nonzero()
    if blocks.shape[0]:
        wrapped_traced = trace_cached(wrapped, "mask_mod")
        hit[(slice(None), *blocks.unbind(1))] = _classify_undecided(
            lower(wrapped_traced), wrapped_traced, blocks, Ls, Ls, block, block, B, H)
    return hit


class Plan:
    """The communication and compute plan of one rank for one (mask, shapes, world, layout).

    ``recv[t]``: at step ``t`` this rank computes against the shard of rank
    ``(rank - t) % world`` (so receives it, for t > 0); ``send[t]``: rank
    ``(rank + t) % world`` needs this rank's shard. ``masks[s]``: the block mask of the
    pair (this rank, s) with the shifted mask_mod (None: no mask, every block computed).
    """

    def __init__(self, world, rank, layout, local_len, block, device, pos, recv, send, masks, keep):
        self.world, self.rank, self.layout = world, rank, layout
        self.local_len, self.block, self.device = local_len, block, device
        self.pos = pos
        self.recv, self.send = tuple(recv), tuple(send)
        self.masks = masks
        self._keep = keep                 # the mask's captured tensors: their ids stay valid
        self._scores: dict = {}

    def source(self, t: int) -> int:
        return (self.rank - t) % self.world

    def dest(self, t: int) -> int:
        return (self.rank + t) % self.world

    def skipped_pairs(self) -> int:
        """Pairs of this rank's row the mask rules out (not received, not computed)."""
        return sum(not r for r in self.recv)

    def score_mods(self, score_mod) -> list:
        """The shifted score_mod per source rank (memoized: their traces are reused)."""
        if score_mod is None:
            return [None] * self.world
        hit = self._scores.get(id(score_mod))
        if hit is None or hit[0] is not score_mod:
            if len(self._scores) >= 8:
                self._scores.clear()
            mine = self.pos[self.rank]
            hit = self._scores[id(score_mod)] = (
                score_mod, [shifted_score(score_mod, mine, p) for p in self.pos])
        return hit[1]


def _uses(expr, name: str) -> bool:
    return INDEX_SYMBOLS[name] in expr.free_symbols


_PLANS: dict = {}
_PLANS_MAX = 16


def plan_for(mask_mod, B: int, H: int, local_len: int, world: int, rank: int, layout: str,
             block: int, device) -> Plan:
    """The (memoized) plan of this rank. The memo keys on the mask's program and the identity
    and version of each tensor it captured: a new document-id tensor gets a new plan."""
    traced = None if mask_mod is None else trace_cached(mask_mod, "mask_mod")
    if traced is not None and lower(traced).is_true:
        traced = None
    key = (None if traced is None else traced.graph,
           () if traced is None else tuple((id(t), t._version) for t in traced.buffers),
           B, H, local_len, world, rank, layout, block, str(device))
    hit = _PLANS.get(key)
    if hit is not None:
        return hit
    pos = [positions(r, world, local_len, layout, device) for r in range(world)]
    if traced is None:
        plan = Plan(world, rank, layout, local_len, block, device, pos, [True] * world,
                    [True] * world, {s: None for s in range(world)}, ())
    else:
        expr = lower(traced).expr
        Bm, Hm = (B if _uses(expr, "b") else 1), (H if _uses(expr, "h") else 1)
        length = world * local_len
        nb = -(-local_len // block)
        recv, send, masks, found = [], [], {}, []
        for t in range(world):
            src = (rank - t) % world
            wrapped = shifted_mask(mask_mod, pos[rank], pos[src])
            hit = pair_hits(traced, wrapped, Bm, Hm, pos[rank], pos[src], length, block, device)
            found.append(hit.any())
            masks[src] = (wrapped, hit)
        for t in range(1, world):
            dst = (rank + t) % world
            wrapped = shifted_mask(mask_mod, pos[dst], pos[rank])
            found.append(pair_hits(traced, wrapped, Bm, Hm, pos[dst], pos[rank], length, block,
                                   device).any())
        found = torch.stack(found).tolist()          # one device-to-host read for all pairs
        recv, send = found[:world], found[:1] + found[world:]
        for t in range(world):
            src = (rank - t) % world
            wrapped, hit = masks[src]
            if not recv[t]:
                masks[src] = None
                continue
            lists = list_layout(Bm, Hm, nb, nb).views(fill_lists(hit))
            masks[src] = BlockMask(*lists, (block, block), wrapped, (local_len, local_len))
        plan = Plan(world, rank, layout, local_len, block, device, pos, recv, send, masks,
                    traced.buffers)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def clear_memos() -> None:
    _PLANS.clear()


__all__ = ["Plan", "plan_for", "pair_hits", "global_expr", "shifted_mask", "shifted_score", "clear_memos"]
