"""Launch the forward kernel of a planned ``flex_attention`` call.

``run_forward`` allocates the outputs (in the query's stride order), picks the
pointer variant where a TMA plan meets a base TMA cannot address, and launches
through ``flexgen.runtime.launch``; a repeated call with the same plan replays
the previous launch with its new tensors (``launch.Replay``).
"""
from __future__ import annotations

import torch

from ..codegen.spec import tma_addressable
from ..runtime import launch, tuning
from ..runtime.poison import poison


def broadcast_lists(lists, B: int, H: int) -> tuple:
    """Four block-mask lists as ``[B, H, ...]`` views (a batch or head of 1 broadcasts)."""
    return tuple(t if t.shape[0] == B and t.shape[1] == H else t.expand(B, H, *t.shape[2:])
                 for t in lists)


def run_forward(plan, query, key, value, score_buffers, mask_buffers, block_lists, want_max: bool):
    """(out [B, Hq, Lq, Dv], lse [B, Hq, Lq] float32, max scores like lse or an empty tensor)."""
    B, Hq, Lq = plan.B, plan.Hq, plan.Lq
    device = query.device
    if key.shape[0] != B:                     # key / value shared by every query row
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    out = torch.empty_strided((B, Hq, Lq, plan.Dv), plan.out_strides, dtype=plan.dtype, device=device)
    lse = torch.empty(B, Hq, Lq, dtype=torch.float32, device=device)
    max_scores = torch.empty(B, Hq, Lq, dtype=torch.float32, device=device) if want_max else None
    poison(out, lse, max_scores)
    sparse = None
    if plan.mask_info is not None:
        sparse = (*broadcast_lists(block_lists[:4], B, Hq), *plan.mask_info.block_size)
    spec = plan.spec
    if spec.use_tma and not all(map(tma_addressable, (query, key, value, out))):
        spec = plan.pointer_spec
    # The first six kernel arguments: Q, K, V, OUT, LSE and MAX (LSE again when not asked for).
    leading = (query, key, value, out, lse, lse if max_scores is None else max_scores)
    replay = plan.replay[0]
    if (replay is not None and spec is plan.spec and not tuning.needs_lookup()
            and replay(*leading)):
        return out, lse, _placeholder(max_scores, device)
    launched = launch.run(spec, device, dict(
        q=query, k=key, v=value, out=out, lse=lse, sparse=sparse, score_buffers=score_buffers,
        mask_buffers=mask_buffers, scale=plan.scale, max_scores=max_scores),
        tune_blocks=plan.tune_blocks, replay=6)
    if spec is plan.spec:
        plan.replay[0] = launched
    return out, lse, _placeholder(max_scores, device)


def _placeholder(t, device) -> torch.Tensor:
    """``t``, or an empty tensor for an output the call did not ask for (ops return fixed outputs)."""
    return t if t is not None else torch.empty(0, dtype=torch.float32, device=device)
