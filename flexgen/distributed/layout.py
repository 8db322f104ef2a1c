"""Which global positions of a sequence each rank holds, and moving tensors in and out of shards.

A sequence of ``L`` tokens is split over the ``W`` ranks of a process group along its
length. Two layouts:

- ``"contiguous"``: rank ``r`` holds positions ``[r * L/W, (r + 1) * L/W)``.
- ``"load_balanced"``: the sequence is cut into ``2W`` chunks of ``C = L/(2W)`` tokens
  and rank ``r`` holds chunk ``r`` followed by chunk ``2W - 1 - r``. Under a causal
  mask the early chunks see few keys and the late ones many; pairing them gives every
  rank the same number of unmasked scores (within one chunk's triangle), so no rank
  waits for the slowest.

``positions`` is the one definition both ``shard`` and the attention use, so the mods
see the position a token really has in the sequence.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import expected

LAYOUTS = ("load_balanced", "contiguous")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise expected("layout", '"load_balanced" or "contiguous"', repr(layout),
                       'pass layout="load_balanced" (even causal work per rank) or "contiguous"')
    return layout


def group_info(group) -> tuple:
    """(group, this process's rank in it, its size), or InputError when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise expected("group", "an initialized torch.distributed process group",
                       "torch.distributed is not initialized",
                       "call torch.distributed.init_process_group(...) in every process first")
    group = dist.group.WORLD if group is None else group
    try:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    except (RuntimeError, ValueError) as err:
        raise expected("group", "a process group of torch.distributed", repr(group),
                       f"pass a group from torch.distributed.new_group ({err})") from None
    if rank < 0:
        raise expected("group", "a process group this process belongs to", repr(group),
                       "call with a group that has this rank (new_group returns a placeholder "
                       "to processes outside it)")
    return group, rank, world


def check_shard_length(name: str, local_len: int, world: int, layout: str) -> None:
    """A load-balanced shard is two chunks of equal length: its length must be even."""
    if layout == "load_balanced" and local_len % 2:
        raise expected(name, "an even local length with layout='load_balanced' (two equal chunks)",
                       f"local length {local_len}",
                       f"make the sequence length a multiple of 2 * world = {2 * world} "
                       "(pad it), or use layout='contiguous'")


def positions(rank: int, world: int, local_len: int, layout: str, device=None) -> torch.Tensor:
    """int32 ``[local_len]``: the global position of each token of ``rank``'s shard."""
    check_layout(layout)
    ar = torch.arange(local_len, dtype=torch.int32, device=device)
    if layout == "contiguous":
        return ar + rank * local_len
    chunk = local_len // 2
    first, second = rank * chunk, (2 * world - 1 - rank) * chunk
    return torch.where(ar < chunk, ar + first, ar - chunk + second)


def position_ranges(rank: int, world: int, local_len: int, layout: str) -> tuple:
    """The shard's positions as ``(start, stop)`` ranges in shard order (host ints)."""
    if layout == "contiguous":
        return ((rank * local_len, (rank + 1) * local_len),)
    chunk = local_len // 2
    return ((rank * chunk, (rank + 1) * chunk),
            ((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk))


def _dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise expected("dim", f"a dimension of the {x.dim()}-D tensor", dim, "pass the sequence dimension")
    return dim % x.dim()


def shard(x: torch.Tensor, group=None, layout: str = "load_balanced", dim: int = 2) -> torch.Tensor:
    """This rank's shard of ``x``, a whole sequence held by every rank, along ``dim``.

    ``x`` ``[..., L, ...]`` (``L`` at ``dim``, 2 for ``[B, H, L, D]``; pass ``dim=1``
    for token ids ``[B, L]``) -> ``[..., L / world, ...]``, contiguous, with the tokens in
    the order ``context_parallel_attention`` expects for ``layout``. ``L`` must be a
    multiple of ``world`` (``2 * world`` for ``"load_balanced"``).
    """
    group, rank, world = group_info(group)
    check_layout(layout)
    dim = _dim(x, dim)
    L = x.shape[dim]
    parts = world * (2 if layout == "load_balanced" else 1)
    if L % parts:
        raise expected("x", f"a length (dim {dim}) that is a multiple of {parts} "
                       f"({'2 * ' if parts != world else ''}world size {world})", L,
                       f"pad the sequence to {-(-L // parts) * parts} tokens")
    return torch.cat([x.narrow(dim, a, b - a)
                      for a, b in position_ranges(rank, world, L // world, layout)], dim).contiguous()


def unshard(x: torch.Tensor, group=None, layout: str = "load_balanced", dim: int = 2) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (the inverse of ``shard``), on every rank.

    One all-gather over ``group``; not differentiable (for evaluation, checks and logging).
    Every rank must call it with shards of the same shape.
    """
    group, rank, world = group_info(group)
    check_layout(layout)
    dim = _dim(x, dim)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    local_len = x.shape[dim]
    pieces = []
    for r, part in enumerate(parts):
        start = 0
        for a, b in position_ranges(r, world, local_len, layout):
            pieces.append((a, part.narrow(dim, start, b - a)))
            start += b - a
    return torch.cat([p for _, p in sorted(pieces, key=lambda ap: ap[0])], dim)


__all__ = ["LAYOUTS", "check_layout", "check_shard_length", "group_info", "positions",
           "position_ranges", "shard", "unshard"]
