"""``varlen_attention`` and its backward as custom ops (see ``flexgen.runtime.ops``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...kernels import backward as _backward
from . import _backward_fake, _checks_backward, _eager, _grad_outputs, _on_device
from .define import once_differentiable, op

# ---------------------------------------------------------------------------------- varlen attention
#
#     varlen_attention(q, k, v, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
#                      scale, enable_gqa, options) -> (out [total_q, Hq, Dv], lse [Hq, total_q])
#     varlen_attention_backward(q, k, v, out, lse, grad_out?, grad_lse?, cu_q, cu_k, ...,
#                               grad_slots, needs_kv) -> (dq, dk, dv, buffer grads)
#
# Packed sequences: the mods see b = the sequence, positions inside it (``plan_varlen``).

def _varlen_plan(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                 scale, enable_gqa, options):
    from ..plan import plan_varlen
    return plan_varlen(query, key, value, cu_q, cu_k, score_mod, score_buffers, mask_mod, mask_buffers,
                       scale, enable_gqa, options)


@op("varlen_attention", autograd="formula")
def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, score_buffers: list[Tensor], mask_buffers: list[Tensor],
                     score_mod: str, mask_mod: str, scale: float, enable_gqa: bool,
                     options: str) -> tuple[Tensor, Tensor]:
    """varlen_attention's forward: (out [total_q, Hq, Dv], lse [Hq, total_q] float32)."""
    return _varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, score_buffers, mask_buffers,
                             score_mod, mask_mod, scale, enable_gqa, options)


def _varlen_attention(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                      scale, enable_gqa, options):
    from ...kernels.varlen import run_varlen
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    plan = _varlen_plan(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                        scale, enable_gqa, options)
    return run_varlen(plan, query, key, value, cu_q, cu_k, score_buffers, mask_buffers)


@varlen_attention.register_fake
def _varlen_attention_fake(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod,
                           mask_mod, scale, enable_gqa, options):
    if all(isinstance(n, int) for t in (query, key, value, cu_q) for n in t.shape):
        _varlen_plan(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                     scale, enable_gqa, options)
    total_q, Hq = query.shape[:2]
    return (query.new_empty((total_q, Hq, value.shape[2])),
            query.new_empty((Hq, total_q), dtype=torch.float32))


def check_varlen_backward(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod,
                          mask_mod, scale, enable_gqa, options):
    """Plan the backward of a call whose inputs require grad: GradientError now, not in backward()."""
    from ..plan import plan_varlen_backward
    plan = _varlen_plan(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                        scale, enable_gqa, options)
    plan_varlen_backward(plan, query, key, value, _backward.grad_slots(score_buffers))


def _setup_varlen(ctx, inputs, output):
    (query, key, value, cu_q, cu_k, score_buffers, mask_buffers, *rest) = inputs
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        check_varlen_backward(*inputs)
    out, lse = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, key, value, out, lse, cu_q, cu_k, *score_buffers, *mask_buffers)
    ctx.counts = (len(score_buffers), len(mask_buffers))
    ctx.rest = tuple(rest)                    # score_mod ... options
    ctx.grad_slots = _backward.grad_slots(score_buffers)


@once_differentiable
def _varlen_grad(ctx, grad_out, grad_lse):
    query, key, value, out, lse, cu_q, cu_k, *saved = ctx.saved_tensors
    ns, nm = ctx.counts
    score_buffers, mask_buffers = saved[:ns], saved[ns:]
    needs = ctx.needs_input_grad
    slots = [i for i in ctx.grad_slots if needs[5][i]]
    grads = [None] * ns
    dq = dk = dv = None
    if grad_out is not None or grad_lse is not None:
        dq, dk, dv, buffer_grads = varlen_attention_backward(
            query, key, value, out, lse, grad_out, grad_lse, cu_q, cu_k, list(score_buffers),
            list(mask_buffers), *ctx.rest, slots, needs[1] or needs[2])
        for slot, g in zip(slots, buffer_grads):
            grads[slot] = g
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None, None,
            grads, [None] * nm, None, None, None, None, None)


varlen_attention.register_autograd(_varlen_grad, setup_context=_setup_varlen)


@op("varlen_attention_backward", autograd="none")
def varlen_attention_backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                              grad_out: Tensor | None, grad_lse: Tensor | None, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, score_buffers: list[Tensor],
                              mask_buffers: list[Tensor], score_mod: str, mask_mod: str, scale: float,
                              enable_gqa: bool, options: str, grad_slots: list[int],
                              needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """varlen_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    from ...kernels.varlen import run_varlen_backward
    from ..plan import plan_varlen_backward
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    plan = _varlen_plan(query, key, value, cu_seqlens_q, cu_seqlens_k, score_buffers, mask_buffers,
                        score_mod, mask_mod, scale, enable_gqa, options)
    bw = plan_varlen_backward(plan, query, key, value, tuple(grad_slots))
    dq, dk, dv, grads = run_varlen_backward(bw, plan, query, key, value, out, lse, grad_out, grad_lse,
                                            cu_seqlens_q, cu_seqlens_k, score_buffers, mask_buffers,
                                            needs_kv)
    return _grad_outputs(query, dq, dk, dv, grads, grad_slots, needs_kv)


@varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(query, key, value, out, lse, grad_out, grad_lse, cu_q, cu_k,
                                    score_buffers, mask_buffers, score_mod, mask_mod, scale, enable_gqa,
                                    options, grad_slots, needs_kv):
    return _backward_fake(query, key, value, score_buffers, grad_slots, needs_kv)


def call_varlen_attention(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod,
                          mask_mod, scale, enable_gqa, options):
    """``varlen_attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, cu_q, cu_k, list(score_buffers), list(mask_buffers), score_mod, mask_mod,
            scale, enable_gqa, options)
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _varlen_attention(*args)
    if _checks_backward(query, key, value, *score_buffers):
        check_varlen_backward(*args)
    return torch.ops.flexgen.varlen_attention(*args)
