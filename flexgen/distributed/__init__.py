"""Context parallelism over ``torch.distributed``: one sequence sharded along its length.

    import torch.distributed as dist
    from flexgen.distributed import context_parallel_attention, shard, unshard

    dist.init_process_group("nccl")            # or "gloo" on CPU
    q, k, v = (shard(x, layout="load_balanced") for x in (q_full, k_full, v_full))
    out = context_parallel_attention(q, k, v, mask_mod=causal_mask)   # this rank's shard
    out_full = unshard(out)                                           # (for checks)

The mods see global positions; K/V shards travel between ranks (point-to-point, or
one all-gather), overlapped with the local kernels; shard pairs the mask rules out
are neither sent nor computed; partial results merge with their LSE; the backward
pass returns dK/dV to the rank that owns them. See ``flexgen.distributed.ring``.
"""
from .layout import LAYOUTS, positions, shard, unshard
from .ring import context_parallel_attention
from .schedule import Plan, plan_for


def shard_positions(local_len, group=None, layout="load_balanced", device=None):
    """int32 ``[local_len]``: the global position of each token of this rank's shard
    (for position embeddings or RoPE computed per shard)."""
    from .layout import group_info
    _, rank, world = group_info(group)
    return positions(rank, world, local_len, layout, device)


__all__ = ["context_parallel_attention", "shard", "unshard", "shard_positions", "positions",
           "plan_for", "Plan", "LAYOUTS"]
