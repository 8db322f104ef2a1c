"""Launch the kernels of a planned ``varlen_attention`` call (packed variable-length sequences).

The forward and backward templates render a varlen form (``VarlenSpec``,
``VarlenBackwardSpec``): each program finds its sequence and tile from the
offsets on the device (``_varlen_tile`` in ``templates/common.py.jinja``), so
the host reads no offset, builds no block list and pads nothing; the grids are
bounded by the shapes alone (a tile past the last sequence does nothing), so a
launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from ..runtime import launch
from ..runtime.poison import poison
from .backward import buffer_grads, gradient_buffers


def run_varlen(plan, query, key, value, cu_q, cu_k, score_buffers, mask_buffers):
    """(out [total_q, Hq, Dv], lse [Hq, total_q] float32) of one planned call. Rows past
    ``cu_q[-1]`` belong to no sequence and are left unwritten."""
    total_q, Hq, _ = query.shape
    device = query.device
    out = torch.empty(total_q, Hq, plan.base.Dv, dtype=query.dtype, device=device)
    lse = torch.empty(Hq, total_q, dtype=torch.float32, device=device)
    poison(out, lse)
    launch.run(plan.spec, device, dict(q=query, k=key, v=value, out=out, lse=lse, cu_q=cu_q, cu_k=cu_k,
                                       score_buffers=score_buffers, mask_buffers=mask_buffers,
                                       scale=plan.base.scale))
    return out, lse


def run_varlen_backward(bw, plan, query, key, value, out, lse, grad_out, grad_lse, cu_q, cu_k,
                        score_buffers, mask_buffers, needs_kv: bool = True):
    """(dq, dk, dv, buffer gradients) of one call, as ``backward.run_backward`` gives them; dk,
    dv are None unless ``needs_kv``. Rows and keys outside every sequence get zero gradients."""
    device = query.device
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dlse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    delta = torch.empty(lse.shape, dtype=torch.float32, device=device)
    poison(delta)
    dq = torch.zeros(query.shape, dtype=query.dtype, device=device)
    dk = dv = None
    if needs_kv:
        dk = torch.zeros(key.shape, dtype=key.dtype, device=device)
        dv = torch.zeros(value.shape, dtype=value.dtype, device=device)
    grads = gradient_buffers(bw, score_buffers, device)
    common = dict(q=query, k=key, v=value, out=out, dout=grad_out, lse=lse.contiguous(), dlse=dlse,
                  delta=delta, dq=dq, dk=dk, dv=dv, cu_q=cu_q, cu_k=cu_k, score_buffers=score_buffers,
                  mask_buffers=mask_buffers, scale=plan.base.scale)
    launch.run(bw.dq, device, dict(common, grad_buffers=grads))
    if needs_kv:
        launch.run(bw.dkdv, device, dict(common, grad_buffers=()))
    return dq, dk, dv, buffer_grads(bw, grads, score_buffers)


__all__ = ["run_varlen", "run_varlen_backward"]
