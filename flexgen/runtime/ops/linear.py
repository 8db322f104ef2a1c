"""``linear_attention``, its backward and its decode step as custom ops (see
``flexgen.runtime.ops``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...kernels import backward as _backward
from . import _checks_backward, _eager, _on_device
from .define import once_differentiable, op

# ---------------------------------------------------------------------------------- linear attention
#
#     linear_attention(q, k, v, initial_state?, decay_buffers, feature_buffers, decay_mod,
#                      feature_map, scale, enable_gqa, want_state, options) -> (out, final state)
#     linear_attention_backward(q, k, v, initial_state?, grad_out?, grad_state?, ...,
#                               grad_slots, needs_state) -> (dq, dk, dv, d initial state, grads)
#     linear_attention_decode(q, k, v, state!, slots, ...) -> out     (the state cache in place)
#
# The decay_mod and feature_map travel as program texts, their captured tensors as lists;
# the final state is an empty tensor unless ``want_state``. The backward recomputes the
# states from the inputs (``flexgen.kernels.linear``): nothing else is saved.

def _linear_plan(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                 feature_map, scale, enable_gqa, options):
    from ..plan import plan_linear
    return plan_linear(query, key, value, initial_state, decay_mod, decay_buffers, feature_map,
                       feature_buffers, scale, enable_gqa, options)


@op("linear_attention", autograd="formula")
def linear_attention(query: Tensor, key: Tensor, value: Tensor, initial_state: Tensor | None,
                     decay_buffers: list[Tensor], feature_buffers: list[Tensor], decay_mod: str,
                     feature_map: str, scale: float, enable_gqa: bool, want_state: bool,
                     options: str) -> tuple[Tensor, Tensor]:
    """linear_attention's forward: (out [B, Hq, T, Dv], final state [B, Hq, Dk, Dv] float32 or
    an empty tensor unless ``want_state``)."""
    return _linear_attention(query, key, value, initial_state, decay_buffers, feature_buffers,
                             decay_mod, feature_map, scale, enable_gqa, want_state, options)


def _linear_attention(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                      feature_map, scale, enable_gqa, want_state, options):
    from ...kernels.linear import run_linear
    device = query.device
    decay_buffers, feature_buffers = _on_device(decay_buffers, device), _on_device(feature_buffers, device)
    plan = _linear_plan(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                        feature_map, scale, enable_gqa, options)
    out, final = run_linear(plan, query, key, value, initial_state, decay_buffers, feature_buffers,
                            want_state)
    return out, final if want_state else torch.empty(0, dtype=torch.float32, device=device)


@linear_attention.register_fake
def _linear_attention_fake(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                           feature_map, scale, enable_gqa, want_state, options):
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        _linear_plan(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                     feature_map, scale, enable_gqa, options)
    B, Hq, T, Dk = query.shape
    Dv = value.shape[3]
    return (query.new_empty((B, Hq, T, Dv)),
            query.new_empty((B, Hq, Dk, Dv) if want_state else (0,), dtype=torch.float32))


def check_linear_backward(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                          feature_map, scale, enable_gqa, want_state, options):
    """Plan the backward of a call whose inputs require grad: GradientError now, not in backward()."""
    from ..plan import plan_linear_backward
    plan = _linear_plan(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                        feature_map, scale, enable_gqa, options)
    plan_linear_backward(plan, _backward.grad_slots(decay_buffers))


def _setup_linear(ctx, inputs, output):
    (query, key, value, initial_state, decay_buffers, feature_buffers, *rest) = inputs
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        check_linear_backward(*inputs)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, key, value, initial_state, *decay_buffers, *feature_buffers)
    ctx.counts = (len(decay_buffers), len(feature_buffers))
    ctx.rest = tuple(rest)                    # decay_mod ... options
    ctx.grad_slots = _backward.grad_slots(decay_buffers)


@once_differentiable
def _linear_grad(ctx, grad_out, grad_state):
    query, key, value, initial_state, *saved = ctx.saved_tensors
    nd, nf = ctx.counts
    decay_buffers, feature_buffers = saved[:nd], saved[nd:]
    needs = ctx.needs_input_grad
    decay_mod, feature_map, scale, enable_gqa, want_state, options = ctx.rest
    slots = [i for i in ctx.grad_slots if needs[4][i]]
    grads = [None] * nd
    dq = dk = dv = d_init = None
    if not want_state:
        grad_state = None
    if grad_out is not None or grad_state is not None:
        dq, dk, dv, d_init, buffer_grads = linear_attention_backward(
            query, key, value, initial_state, grad_out, grad_state, list(decay_buffers),
            list(feature_buffers), decay_mod, feature_map, scale, enable_gqa, options, slots,
            initial_state is not None and needs[3])
        for slot, g in zip(slots, buffer_grads):
            grads[slot] = g
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            d_init if initial_state is not None and needs[3] else None, grads, [None] * nf,
            None, None, None, None, None, None)


linear_attention.register_autograd(_linear_grad, setup_context=_setup_linear)


@op("linear_attention_backward", autograd="none")
def linear_attention_backward(query: Tensor, key: Tensor, value: Tensor, initial_state: Tensor | None,
                              grad_out: Tensor | None, grad_state: Tensor | None,
                              decay_buffers: list[Tensor], feature_buffers: list[Tensor], decay_mod: str,
                              feature_map: str, scale: float, enable_gqa: bool, options: str,
                              grad_slots: list[int], needs_state: bool
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """linear_attention's backward: (dq, dk, dv, d initial state (empty unless ``needs_state``),
    gradients of the decay_mod's captured tensors in ``grad_slots``, in that order)."""
    from ...kernels.linear import run_linear_backward
    from ..plan import plan_linear_backward
    device = query.device
    decay_buffers, feature_buffers = _on_device(decay_buffers, device), _on_device(feature_buffers, device)
    plan = _linear_plan(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                        feature_map, scale, enable_gqa, options)
    bw = plan_linear_backward(plan, tuple(grad_slots))
    dq, dk, dv, d_init, grads = run_linear_backward(plan, bw, query, key, value, initial_state, grad_out,
                                                    grad_state, decay_buffers, feature_buffers,
                                                    needs_state)
    if d_init is None:
        d_init = torch.empty(0, dtype=torch.float32, device=device)
    return dq, dk, dv, d_init, grads


@linear_attention_backward.register_fake
def _linear_attention_backward_fake(query, key, value, initial_state, grad_out, grad_state, decay_buffers,
                                    feature_buffers, decay_mod, feature_map, scale, enable_gqa, options,
                                    grad_slots, needs_state):
    B, Hq, _, Dk = query.shape
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format),
            query.new_empty((B, Hq, Dk, value.shape[3]) if needs_state else (0,), dtype=torch.float32),
            [torch.empty_like(decay_buffers[i]) for i in grad_slots])


def call_linear_attention(query, key, value, initial_state, decay_buffers, feature_buffers, decay_mod,
                          feature_map, scale, enable_gqa, want_state, options):
    """``linear_attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, initial_state, list(decay_buffers), list(feature_buffers), decay_mod,
            feature_map, scale, enable_gqa, want_state, options)
    tensors = (query, key, value, *decay_buffers, *feature_buffers,
               *(() if initial_state is None else (initial_state,)))
    if _eager(*tensors):
        return _linear_attention(*args)
    if _checks_backward(*tensors):
        check_linear_backward(*args)
    return torch.ops.flexgen.linear_attention(*args)


@op("linear_attention_decode", mutates_args=("state",))
def linear_attention_decode(query: Tensor, key: Tensor, value: Tensor, state: Tensor, slots: Tensor,
                            decay_buffers: list[Tensor], feature_buffers: list[Tensor], decay_mod: str,
                            feature_map: str, scale: float, enable_gqa: bool, options: str) -> Tensor:
    """linear_attention_decode: out [B, Hq, T, Dv]; the rows ``slots`` of the state cache
    [num_slots, Hq, Dk, Dv] float32 are advanced by the T positions in place."""
    return _linear_attention_decode(query, key, value, state, slots, decay_buffers, feature_buffers,
                                    decay_mod, feature_map, scale, enable_gqa, options)


def _linear_attention_decode(query, key, value, state, slots, decay_buffers, feature_buffers, decay_mod,
                             feature_map, scale, enable_gqa, options):
    from ...kernels.linear import run_linear_decode
    from ..plan import plan_linear_decode
    device = query.device
    decay_buffers, feature_buffers = _on_device(decay_buffers, device), _on_device(feature_buffers, device)
    plan = plan_linear_decode(query, key, value, state, decay_mod, decay_buffers, feature_map,
                              feature_buffers, scale, enable_gqa, options)
    return run_linear_decode(plan, query, key, value, state, slots, decay_buffers, feature_buffers)


@linear_attention_decode.register_fake
def _linear_attention_decode_fake(query, key, value, state, slots, decay_buffers, feature_buffers,
                                  decay_mod, feature_map, scale, enable_gqa, options):
    B, Hq, T, _ = query.shape
    return query.new_empty((B, Hq, T, value.shape[3]))


def call_linear_attention_decode(*args):
    """``linear_attention_decode``, straight to its implementation where nothing needs the op."""
    query, key, value, state, slots, decay_buffers, feature_buffers = args[:7]
    if _eager(query, key, value, state, slots, *decay_buffers, *feature_buffers):
        return _linear_attention_decode(*args)
    return torch.ops.flexgen.linear_attention_decode(*args)


__all__ = ["attention", "attention_backward", "decode", "paged_write", "block_mask",
           "call_attention", "call_decode", "call_paged_write", "call_block_mask", "paged_write_rope",
           "call_paged_write_rope",
           "sigmoid_attention", "sigmoid_attention_backward", "call_sigmoid_attention",
           "linear_attention", "linear_attention_backward", "linear_attention_decode",
           "call_linear_attention", "call_linear_attention_decode", "varlen_attention",
           "varlen_attention_backward", "call_varlen_attention"]
