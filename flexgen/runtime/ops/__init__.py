"""flexgen's kernels as ``torch.library`` custom ops (``torch.ops.flexgen.*``).

torch.compile (dynamo, AOTAutograd, inductor) and torch.export see each call as
one opaque op with a fake implementation (shapes only, through the planner) and,
for attention, a registered backward that is itself one op. A mod travels into an
op as data: its traced program text (a str, ``flexgen.frontend.trace``) and its
captured tensors as a list input, so a new mod or a new captured tensor is not a
new graph for the user's code, and captured tensors get their gradients through
autograd like any other input.

    attention(q, k, v, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
              block_size, mask_lengths, scale, enable_gqa, options, want_max) -> (out, lse, max)
    attention_backward(...) -> (dq, dk, dv, buffer_grads)
    block_mask(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device) -> lists

``block_lists`` is a block mask's eight lists (kv_num, kv_idx, full_kv_num, full_kv_idx,
q_num, q_idx, full_q_num, full_q_idx) or empty; ``score_mod`` / ``mask_mod`` are ""
for none; ``options`` is ``KernelOptions.text``.

Outside any tracing, a call that needs no gradient runs the implementation directly
(the dispatcher's round trip costs ~15 us a call, as much as the rest of a warm call);
everything else — gradients, fake tensors, torch.compile, torch.export, dispatch
modes — goes through the op.
Every op is defined with ``define.op`` (why not ``torch.library.custom_op`` for all: there).
The other families live in submodules, each registered when first imported (by its
API function): ``ops.serving`` (decode, paged_write, paged_write_rope), ``ops.sigmoid``,
``ops.varlen``, ``ops.linear``. Defining a custom op costs ~4 ms (~10 ms on the H100's
host), and a process that never calls a family should not pay for it at its first call.
"""
from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from .. import collector

with collector.paused():        # a process's first import of the kernels, the planner and Triton
    from ...kernels import backward as _backward
    from ...kernels.decode import constant, run_decode
    from ...kernels.forward import run_forward
    from ...masks import builder
    from ..plan import out_strides, plan_attention, plan_backward
from .define import PLAIN, once_differentiable, op


def _plain(*tensors) -> bool:
    """Whether a call runs outside any tracing and dispatch mode, on real tensors only (no
    FakeTensor, FunctionalTensor or other subclass)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    return all(type(t) in PLAIN for t in tensors)


def _wants_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _eager(*tensors) -> bool:
    """Whether a call may skip the dispatcher: ``_plain``, and no gradient wanted."""
    return _plain(*tensors) and not _wants_grad(*tensors)


def _on_device(buffers, device) -> list:
    """Captured 0-d CPU tensors (``torch.tensor(2.0)`` in a mod) moved to the kernel's device,
    as torch lets a 0-d CPU tensor join a CUDA computation."""
    return [t.to(device) if t.dim() == 0 and t.device != device else t for t in buffers]

# ---------------------------------------------------------------------------------- attention

def _grad_outputs(query, dq, dk, dv, grads, grad_slots, needs_kv) -> tuple:
    """A backward op's outputs: (dq, dk, dv (empty unless ``needs_kv``: ops return fixed
    outputs), the gradients of the captured tensors in ``grad_slots``)."""
    if not needs_kv:
        # (Two empty tensors, not one: an op's outputs must not alias one another.)
        dk, dv = (torch.empty(0, dtype=query.dtype, device=query.device) for _ in range(2))
    return dq, dk, dv, [grads[i] for i in grad_slots]


def _backward_fake(query, key, value, score_buffers, grad_slots, needs_kv) -> tuple:
    """The shapes an attention-style backward op returns: (dq, dk, dv (empty unless
    ``needs_kv``), gradients of the captured tensors in ``grad_slots``)."""
    # (Two empty tensors, not one: an op's outputs must not alias one another.)
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            key.new_empty(key.shape) if needs_kv else query.new_empty((0,)),
            value.new_empty(value.shape) if needs_kv else query.new_empty((0,)),
            [torch.empty_like(score_buffers[i]) for i in grad_slots])


def _checks_backward(*tensors) -> bool:
    """Whether an op's backward must be checked before its forward runs: eagerly, with a
    gradient wanted for one of ``tensors`` (under torch.compile: setup_context does it)."""
    return not torch.compiler.is_compiling() and _wants_grad(*tensors)


@op("attention", autograd="formula")
def attention(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
              mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str, mask_mod: str,
              block_size: list[int], mask_lengths: list[int], scale: float, enable_gqa: bool,
              options: str, want_max: bool) -> tuple[Tensor, Tensor, Tensor]:
    """flex_attention's forward: (out [B, Hq, Lq, Dv], lse [B, Hq, Lq], max scores or empty)."""
    return _attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                      mask_mod, block_size, mask_lengths, scale, enable_gqa, options, want_max)


def _attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
               block_size, mask_lengths, scale, enable_gqa, options, want_max, plan=None):
    """``attention``'s implementation; ``plan``: the call's plan where the caller made it
    (``_eager_plan``), else it is made here."""
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    if plan is None:
        plan = plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                              block_lists, block_size, mask_lengths, scale, enable_gqa, options, want_max)
    if plan.kernel == "decode":
        out, lse = run_decode(plan.decode, query, key, value, score_buffers, mask_buffers,
                              block_lists[:4] if block_lists else None, constant(plan.Lkv, device),
                              constant(0, device), constant(plan.Lq, device), None, plan.scale,
                              plan.Lkv, out_strides=plan.out_strides)
        return out, lse, torch.empty(0, dtype=torch.float32, device=device)
    return run_forward(plan, query, key, value, score_buffers, mask_buffers, block_lists, want_max)


@attention.register_fake
def _attention_fake(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                    block_size, mask_lengths, scale, enable_gqa, options, want_max):
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        # Concrete sizes: the whole planner runs, so a bad call fails while compiling.
        plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                       block_lists, block_size, mask_lengths, scale, enable_gqa, options, want_max)
    B, Hq, Lq = query.shape[:3]
    out = query.new_empty_strided((B, Hq, Lq, value.shape[3]), out_strides(query, value.shape[3]))
    lse = query.new_empty((B, Hq, Lq), dtype=torch.float32)
    return out, lse, query.new_empty((B, Hq, Lq) if want_max else (0,), dtype=torch.float32)


def check_backward(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                   block_size, mask_lengths, scale, enable_gqa, options, want_max):
    """Plan a call whose inputs require grad and its backward (returns the call's plan): a
    score_mod that cannot be differentiated raises GradientError now, not when backward() runs."""
    plan = plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                          block_lists, block_size, mask_lengths, scale, enable_gqa, options, want_max)
    plan_backward(plan, query, key, value, _backward.grad_slots(score_buffers))
    return plan


def _setup_attention(ctx, inputs, output):
    (query, key, value, score_buffers, mask_buffers, block_lists, *rest) = inputs
    # torch.compile traces this (call_attention's check is skipped while compiling); an eager
    # call has been checked by call_attention already.
    if torch.compiler.is_compiling() and all(isinstance(n, int) for t in (query, key, value)
                                             for n in t.shape):
        check_backward(*inputs)
    _save(ctx, query, key, value, output, score_buffers, mask_buffers, block_lists, rest)


def _save(ctx, query, key, value, output, score_buffers, mask_buffers, block_lists, rest,
          plan=None) -> None:
    """What the backward of ``attention`` (the op's, or ``_EagerAttention``'s with the forward's
    ``plan``) keeps in ``ctx``."""
    out, lse, max_scores = output
    ctx.plan = plan
    ctx.set_materialize_grads(False)          # an unused output's gradient stays None
    ctx.mark_non_differentiable(max_scores)
    ctx.save_for_backward(query, key, value, out, lse, *score_buffers, *mask_buffers, *block_lists)
    ctx.counts = (len(score_buffers), len(mask_buffers), len(block_lists))
    ctx.rest = tuple(rest)                    # score_mod ... want_max
    ctx.grad_slots = _backward.grad_slots(score_buffers)


def _gradients(ctx, grad_out, grad_lse, needs_qkv, needs_score, through_op: bool) -> tuple:
    """(dq, dk, dv, [gradient or None per captured tensor]) from what ``_save`` kept:
    ``needs_qkv`` / ``needs_score`` say which inputs want one. ``through_op``: the backward
    runs as the op ``attention_backward`` (the op's own autograd), else as its implementation
    (``_EagerAttention``) unless the saved tensors are torch.func's wrappers (grad, vjp: no
    storage a kernel can read), which only the op's dispatch unwraps."""
    query, key, value, out, lse, *saved = ctx.saved_tensors
    through_op = through_op or torch._C._functorch.is_functorch_wrapped_tensor(query)
    backward = attention_backward if through_op else functools.partial(_attention_backward, plan=ctx.plan)
    ns, nm, _ = ctx.counts
    slots = [i for i in ctx.grad_slots if needs_score[i]]
    grads = [None] * ns
    dq = dk = dv = None
    if grad_out is not None or grad_lse is not None:
        # ctx.rest ends with want_max, which the backward does not take
        dq, dk, dv, buffer_grads = backward(
            query, key, value, out, lse, grad_out, grad_lse, list(saved[:ns]), list(saved[ns:ns + nm]),
            list(saved[ns + nm:]), *ctx.rest[:-1], slots, needs_qkv[1] or needs_qkv[2])
        for slot, g in zip(slots, buffer_grads):
            grads[slot] = g
    return (dq if needs_qkv[0] else None, dk if needs_qkv[1] else None, dv if needs_qkv[2] else None,
            grads)


@once_differentiable
def _attention_grad(ctx, grad_out, grad_lse, grad_max):
    needs = ctx.needs_input_grad
    _, nm, nl = ctx.counts
    dq, dk, dv, grads = _gradients(ctx, grad_out, grad_lse, needs[:3], needs[3], through_op=True)
    block_size, mask_lengths = ctx.rest[2], ctx.rest[3]
    # One entry per input in the structure autograd checks: a tensor list as a list of as
    # many, an int list as one entry (an empty one as an empty list).
    return (dq, dk, dv, grads, [None] * nm, [None] * nl, None, None, None if block_size else [],
            None if mask_lengths else [], None, None, None, None)


attention.register_autograd(_attention_grad, setup_context=_setup_attention)


@op("attention_backward", autograd="none")
def attention_backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                       grad_out: Tensor | None, grad_lse: Tensor | None, score_buffers: list[Tensor],
                       mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str,
                       mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
                       enable_gqa: bool, options: str, grad_slots: list[int],
                       needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """flex_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    return _attention_backward(query, key, value, out, lse, grad_out, grad_lse, score_buffers,
                               mask_buffers, block_lists, score_mod, mask_mod, block_size,
                               mask_lengths, scale, enable_gqa, options, grad_slots, needs_kv)


def _attention_backward(query, key, value, out, lse, grad_out, grad_lse, score_buffers, mask_buffers,
                        block_lists, score_mod, mask_mod, block_size, mask_lengths, scale, enable_gqa,
                        options, grad_slots, needs_kv, plan=None):
    """``attention_backward``'s implementation; ``plan``: the forward's (an eager call's,
    kept by ``_EagerAttention``), else it is made here."""
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    if plan is None:
        plan = plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                              block_lists, block_size, mask_lengths, scale, enable_gqa, options, False)
    bw = plan_backward(plan, query, key, value, tuple(grad_slots))
    dq, dk, dv, grads = _backward.run_backward(
        bw, plan, query, key, value, out, lse, grad_out, grad_lse, score_buffers, mask_buffers,
        block_lists, needs_kv)
    return _grad_outputs(query, dq, dk, dv, grads, grad_slots, needs_kv)


@attention_backward.register_fake
def _attention_backward_fake(query, key, value, out, lse, grad_out, grad_lse, score_buffers,
                             mask_buffers, block_lists, score_mod, mask_mod, block_size, mask_lengths,
                             scale, enable_gqa, options, grad_slots, needs_kv):
    return _backward_fake(query, key, value, score_buffers, grad_slots, needs_kv)


class _EagerAttention(torch.autograd.Function):
    """``attention`` and its gradient for an eager call that wants one (``call_attention``):
    the op's forward and backward implementations, without the op. torch's autograd wrapper
    of a custom op flattens every argument at each call, ~0.3 ms on the dev CPU (four times
    the rest of a warm call); torch.compile and torch.export still see the op.

    ``apply(query, key, value, rest, plan, *tensors)``: ``tensors`` the captured tensors, the
    mask's and the block lists, in that order (inputs, so autograd sees each); ``rest`` their
    counts and ``attention``'s other arguments from ``score_mod`` on; ``plan`` the call's plan
    (``_eager_plan``), which the backward reuses. The context is set up apart from the
    forward, as torch.func's transforms (``torch.func.grad``) require; ``_EagerAttentionCtx``
    is the same Function for calls under no transform."""

    @staticmethod
    def forward(query, key, value, rest, plan, *tensors):
        return _attention(query, key, value, *_EagerAttention._lists(rest, tensors), *rest[1:], plan=plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        query, key, value, rest, plan, *tensors = inputs
        _save(ctx, query, key, value, output, *_EagerAttention._lists(rest, tensors), rest[1:], plan)

    @staticmethod
    def _lists(rest, tensors) -> tuple:
        """(score_buffers, mask_buffers, block_lists) from ``apply``'s flat ``tensors``."""
        ns, nm, _ = rest[0]
        return list(tensors[:ns]), list(tensors[ns:ns + nm]), list(tensors[ns + nm:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse, grad_max):
        return _eager_gradients(ctx, grad_out, grad_lse, 5)    # (query, key, value, rest, plan, *tensors)


def _eager_gradients(ctx, grad_out, grad_lse, first) -> tuple:
    """The eager Functions' backward: a gradient for each of ``apply``'s arguments, q, k, v's
    and the score_mod's captured tensors' (which start at argument ``first``), None elsewhere."""
    needs, ns = ctx.needs_input_grad, ctx.counts[0]
    dq, dk, dv, grads = _gradients(ctx, grad_out, grad_lse, needs[:3], needs[first:first + ns], through_op=False)
    return (dq, dk, dv, *[None] * (first - 3), *grads, *[None] * (len(needs) - first - ns))


# torch's Function.apply binds its arguments to forward's signature on every call of a
# Function with a setup_context: inspect.signature, a quarter of a warm eager call's host time
# on the dev CPU (~25 us of 107). inspect returns a signature stored on the function as is.
_EagerAttention.forward.__signature__ = inspect.signature(_EagerAttention.forward)


class _EagerAttentionCtx(_EagerAttention):
    """``_EagerAttention`` with its context set up inside the forward: what ``apply`` takes under
    no torch.func transform. A Function with a ``setup_context`` costs ~30 us more a call on
    the dev CPU (its arguments bound to forward's signature, its inputs and outputs packed for
    ``setup_context``): 53 against 20 us for an empty forward with these arguments.

    ``apply(query, key, value, rest, plan, block_lists, *tensors)``: ``tensors`` the captured
    tensors, the mask's after the score_mod's; the block lists one argument (a tuple), not
    inputs. They are int32 (``torch_compat.kernel_lists``), never differentiated, and
    ``apply`` handles each input it takes (~2 us a call for the eight on the dev CPU); they
    are saved as before, so one changed in place before the backward still raises."""

    setup_context = torch.autograd.Function.setup_context     # not defined: the forward's ctx

    @staticmethod
    def forward(ctx, query, key, value, rest, plan, block_lists, *tensors):
        ns = rest[0][0]
        lists = list(tensors[:ns]), list(tensors[ns:]), list(block_lists)
        output = _attention(query, key, value, *lists, *rest[1:], plan=plan)
        _save(ctx, query, key, value, output, *lists, rest[1:], plan)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse, grad_max):
        # (query, key, value, rest, plan, block_lists, *tensors)
        return _eager_gradients(ctx, grad_out, grad_lse, 6)


def _eager_plan(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                block_size, mask_lengths, scale, enable_gqa, options, want_max, differentiated):
    """The plan of an eager call through ``_EagerAttention`` (``_attention`` would make the same
    one); where query, key, value or a captured tensor wants a gradient (``differentiated``) its
    backward is planned too, so a score_mod that cannot be differentiated raises GradientError
    before the forward kernel runs."""
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    if differentiated:
        return check_backward(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                              mask_mod, block_size, mask_lengths, scale, enable_gqa, options, want_max)
    return plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers, block_lists,
                          block_size, mask_lengths, scale, enable_gqa, options, want_max)


def call_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                   block_size, mask_lengths, scale, enable_gqa, options, want_max):
    """``attention``, straight to its implementation where nothing needs the op (``_eager``), or
    through ``_EagerAttention`` where only autograd does."""
    args = (query, key, value, list(score_buffers), list(mask_buffers), list(block_lists), score_mod,
            mask_mod, list(block_size), list(mask_lengths), scale, enable_gqa, options, want_max)
    if _plain(query, key, value, *score_buffers, *mask_buffers, *block_lists):
        differentiated = _wants_grad(query, key, value, *score_buffers)
        # (The block lists are int32, kernel_lists: none of them requires grad.)
        if not differentiated and not _wants_grad(*mask_buffers):
            return _attention(*args)
        rest = ((len(score_buffers), len(mask_buffers), len(block_lists)), *args[6:])
        plan = _eager_plan(*args, differentiated)
        if torch._C._are_functorch_transforms_active():
            return _EagerAttention.apply(query, key, value, rest, plan, *score_buffers, *mask_buffers,
                                         *block_lists)
        return _EagerAttentionCtx.apply(query, key, value, rest, plan, tuple(block_lists), *score_buffers,
                                        *mask_buffers)
    if _checks_backward(query, key, value, *score_buffers):
        check_backward(*args)      # before the forward kernel runs (torch.compile: setup_context)
    return torch.ops.flexgen.attention(*args)

# ---------------------------------------------------------------------------------- block masks

# cudagraph_unsafe: a build is not the same work from call to call (a mask's first build in
# the process runs torch ops, its second compiles and launches the kernel: masks/builder.py;
# off the GPU it reads values back to the host), which a CUDA graph capture cannot hold;
# under mode="reduce-overhead" torch.compile runs this op outside its graphs.
@op("block_mask", tags=(torch.Tag.cudagraph_unsafe,), autograd="integer")
def block_mask(mask_buffers: list[Tensor], mask_mod: str, B: int, H: int, Q_LEN: int, KV_LEN: int,
               Q_BLOCK: int, KV_BLOCK: int, device: torch.device) -> Tensor:
    """create_block_mask's lists, as one int32 tensor (``flexgen.masks.builder.layout``)."""
    return builder.build(_on_device(mask_buffers, device), mask_mod, B, H, Q_LEN, KV_LEN,
                         Q_BLOCK, KV_BLOCK, device)


@block_mask.register_fake
def _block_mask_fake(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device):
    return torch.empty(builder.layout(B, H, -(-Q_LEN // Q_BLOCK), -(-KV_LEN // KV_BLOCK)).size,
                       dtype=torch.int32, device=device)


def call_block_mask(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device):
    args = (list(mask_buffers), mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device)
    if _eager(*mask_buffers):
        return builder.build(_on_device(args[0], device), *args[1:])
    return torch.ops.flexgen.block_mask(*args)
