"""``sigmoid_attention`` and its backward as custom ops (see ``flexgen.runtime.ops``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...kernels import backward as _backward
from ..plan import out_strides
from . import _backward_fake, _checks_backward, _eager, _grad_outputs, _on_device
from .define import once_differentiable, op

# ---------------------------------------------------------------------------------- sigmoid attention
#
#     sigmoid_attention(q, k, v, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
#                       block_size, mask_lengths, scale, bias, enable_gqa, options) -> out
#     sigmoid_attention_backward(q, k, v, grad_out, ..., grad_slots, needs_kv) -> (dq, dk, dv, grads)
#
# The attention op's arguments plus the bias, minus want_max; nothing but the inputs is saved
# for the backward (the weights are recomputed from q and k).

@op("sigmoid_attention", autograd="formula")
def sigmoid_attention(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
                      mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str,
                      mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
                      bias: float, enable_gqa: bool, options: str) -> Tensor:
    """sigmoid_attention's forward: out [B, Hq, Lq, Dv] (``flexgen.kernels.sigmoid``)."""
    return _sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                              mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options)


def _sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                       block_size, mask_lengths, scale, bias, enable_gqa, options):
    from ...kernels.sigmoid import run_sigmoid
    from ..plan import plan_sigmoid
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    plan = plan_sigmoid(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                        block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    return run_sigmoid(plan, query, key, value, score_buffers, mask_buffers, block_lists, bias)


@sigmoid_attention.register_fake
def _sigmoid_attention_fake(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                            mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    from ..plan import plan_sigmoid
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        plan_sigmoid(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                     block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    B, Hq, Lq = query.shape[:3]
    return query.new_empty_strided((B, Hq, Lq, value.shape[3]), out_strides(query, value.shape[3]))


def check_sigmoid_backward(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                           mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    """Plan the backward of a sigmoid_attention call whose inputs require grad (GradientError now)."""
    from ..plan import plan_sigmoid_backward
    plan_sigmoid_backward(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                          block_lists, block_size, mask_lengths, scale, enable_gqa, options,
                          _backward.grad_slots(score_buffers))


def _setup_sigmoid(ctx, inputs, output):
    (query, key, value, score_buffers, mask_buffers, block_lists, *rest) = inputs
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        check_sigmoid_backward(*inputs)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, key, value, *score_buffers, *mask_buffers, *block_lists)
    ctx.counts = (len(score_buffers), len(mask_buffers), len(block_lists))
    ctx.rest = tuple(rest)                    # score_mod ... options
    ctx.grad_slots = _backward.grad_slots(score_buffers)


@once_differentiable
def _sigmoid_grad(ctx, grad_out):
    query, key, value, *saved = ctx.saved_tensors
    ns, nm, nl = ctx.counts
    score_buffers, mask_buffers, block_lists = saved[:ns], saved[ns:ns + nm], saved[ns + nm:]
    needs = ctx.needs_input_grad
    score_mod, mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options = ctx.rest
    slots = [i for i in ctx.grad_slots if needs[3][i]]
    grads = [None] * ns
    dq = dk = dv = None
    if grad_out is not None:
        dq, dk, dv, buffer_grads = sigmoid_attention_backward(
            query, key, value, grad_out, list(score_buffers), list(mask_buffers), list(block_lists),
            score_mod, mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options, slots,
            needs[1] or needs[2])
        for slot, g in zip(slots, buffer_grads):
            grads[slot] = g
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            grads, [None] * nm, [None] * nl, None, None, None if block_size else [],
            None if mask_lengths else [], None, None, None, None)


sigmoid_attention.register_autograd(_sigmoid_grad, setup_context=_setup_sigmoid)


@op("sigmoid_attention_backward", autograd="none")
def sigmoid_attention_backward(query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor,
                               score_buffers: list[Tensor], mask_buffers: list[Tensor],
                               block_lists: list[Tensor], score_mod: str, mask_mod: str,
                               block_size: list[int], mask_lengths: list[int], scale: float, bias: float,
                               enable_gqa: bool, options: str, grad_slots: list[int],
                               needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """sigmoid_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    from ...kernels.sigmoid import run_sigmoid_backward
    from ..plan import plan_sigmoid, plan_sigmoid_backward
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    args = (query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, block_lists, block_size,
            mask_lengths, scale, enable_gqa, options)
    plan = plan_sigmoid(*args)
    bw = plan_sigmoid_backward(*args, tuple(grad_slots))
    dq, dk, dv, grads = run_sigmoid_backward(bw, plan, query, key, value, grad_out, score_buffers,
                                             mask_buffers, block_lists, bias, needs_kv)
    return _grad_outputs(query, dq, dk, dv, grads, grad_slots, needs_kv)


@sigmoid_attention_backward.register_fake
def _sigmoid_attention_backward_fake(query, key, value, grad_out, score_buffers, mask_buffers,
                                     block_lists, score_mod, mask_mod, block_size, mask_lengths, scale,
                                     bias, enable_gqa, options, grad_slots, needs_kv):
    return _backward_fake(query, key, value, score_buffers, grad_slots, needs_kv)


def call_sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                           mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    """``sigmoid_attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, list(score_buffers), list(mask_buffers), list(block_lists), score_mod,
            mask_mod, list(block_size), list(mask_lengths), scale, bias, enable_gqa, options)
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _sigmoid_attention(*args)
    if _checks_backward(query, key, value, *score_buffers):
        check_sigmoid_backward(*args)
    return torch.ops.flexgen.sigmoid_attention(*args)
