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
from triton.compiler.errors import CompilationError

from ..codegen.spec import tma_addressable
from ..runtime import launch
from ..runtime.plan import packed_view
from ..runtime.poison import poison
from .backward import buffer_grads, gradient_buffers
from .forward import _gluon_failed as _forward_gluon_failed


def run_varlen(plan, query, key, value, cu_q, cu_k, score_buffers, mask_buffers):
    """(out [total_q, Hq, Dv], lse [Hq, total_q] float32) of one planned call. Rows past
    ``cu_q[-1]`` belong to no sequence and are left unwritten."""
    total_q, Hq, _ = query.shape
    device = query.device
    out = torch.empty(total_q, Hq, plan.base.Dv, dtype=query.dtype, device=device)
    lse = torch.empty(Hq, total_q, dtype=torch.float32, device=device)
    poison(out, lse)
    inputs = dict(q=query, k=key, v=value, out=out, lse=lse, cu_q=cu_q, cu_k=cu_k,
                  score_buffers=score_buffers, mask_buffers=mask_buffers, scale=plan.base.scale)
    spec = plan.spec
    if spec.template == "forward_gluon" and not all(
            tma_addressable(packed_view(t)) for t in (query, key, value)):
        spec = plan.tl_spec            # a base TMA cannot address: the pointer kernel
    try:
        launch.run(spec, device, inputs)
    except CompilationError as err:
        if spec.template != "forward_gluon":
            raise
        launch.run(_gluon_failed(plan, err), device, inputs)
    return out, lse


def _gluon_failed(plan, err):
    """As the forward's: under BACKEND "gluon" an InputError naming the compile error; under
    AUTO the plan keeps the tl kernel from now on (returned)."""
    if plan.base.options.BACKEND == "gluon":
        _forward_gluon_failed(plan.base, err)          # raises
    plan.spec, plan.tl_spec = plan.tl_spec, None
    return plan.spec


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
