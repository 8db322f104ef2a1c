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
    decode(q, k, v, ..., kv_lengths, q_offsets, q_lengths, page_table, ...) -> (out, lse)
    paged_write(k_cache!, v_cache!, key, value, page_table, slots, lengths, counts)
    block_mask(mask_buffers, mask_mod, B, H, Q_LEN, KV_LEN, Q_BLOCK, KV_BLOCK, device) -> lists

``block_lists`` is a block mask's eight lists (kv_num, kv_idx, full_kv_num, full_kv_idx,
q_num, q_idx, full_q_num, full_q_idx) or empty; ``score_mod`` / ``mask_mod`` are ""
for none; ``options`` is ``KernelOptions.text``.

Outside any tracing, a call that needs no gradient runs the implementation directly
(the dispatcher's round trip costs ~15 us a call, as much as the rest of a warm call);
everything else — gradients, fake tensors, torch.compile, torch.export, dispatch
modes — goes through the op.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import backward as _backward
from ..kernels.decode import constant, run_decode
from ..kernels.forward import run_forward
from ..masks import builder
from .plan import out_strides, plan_attention, plan_backward, plan_decode_call

_PLAIN = (Tensor, torch.nn.Parameter)


def _eager(*tensors) -> bool:
    """Whether a call may skip the dispatcher: no tracing, no dispatch mode, no gradient,
    and real tensors only (no FakeTensor, FunctionalTensor or other subclass)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if type(t) not in _PLAIN or (grad and t.requires_grad):
            return False
    return True


def _on_device(buffers, device) -> list:
    """Captured 0-d CPU tensors (``torch.tensor(2.0)`` in a mod) moved to the kernel's device,
    as torch lets a 0-d CPU tensor join a CUDA computation."""
    return [t.to(device) if t.dim() == 0 and t.device != device else t for t in buffers]


# ---------------------------------------------------------------------------------- attention

def _grad_outputs(query, dq, dk, dv, grads, grad_slots, needs_kv) -> tuple:
    """A backward op's outputs: (dq, dk, dv (empty unless ``needs_kv``: ops return fixed
    outputs), the gradients of the captured tensors in ``grad_slots``)."""
    empty = torch.empty(0, dtype=query.dtype, device=query.device)
    return dq, dk if needs_kv else empty, dv if needs_kv else empty.clone(), [grads[i] for i in grad_slots]


@torch.library.custom_op("flexgen::attention", mutates_args=())
def attention(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
              mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str, mask_mod: str,
              block_size: list[int], mask_lengths: list[int], scale: float, enable_gqa: bool,
              options: str, want_max: bool) -> tuple[Tensor, Tensor, Tensor]:
    """flex_attention's forward: (out [B, Hq, Lq, Dv], lse [B, Hq, Lq], max scores or empty)."""
    return _attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                      mask_mod, block_size, mask_lengths, scale, enable_gqa, options, want_max)


def _attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
               block_size, mask_lengths, scale, enable_gqa, options, want_max):
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
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
    """Plan the backward of a call whose inputs require grad: a score_mod that cannot be
    differentiated raises GradientError now, not when backward() runs."""
    plan = plan_attention(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                          block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    plan_backward(plan, query, key, value, _backward.grad_slots(score_buffers))


def _setup_attention(ctx, inputs, output):
    (query, key, value, score_buffers, mask_buffers, block_lists, *rest) = inputs
    # torch.compile traces this (call_attention's check is skipped while compiling); an eager
    # call has been checked by call_attention already.
    if torch.compiler.is_compiling() and all(isinstance(n, int) for t in (query, key, value)
                                             for n in t.shape):
        check_backward(*inputs)
    out, lse, max_scores = output
    ctx.set_materialize_grads(False)          # an unused output's gradient stays None
    ctx.mark_non_differentiable(max_scores)
    ctx.save_for_backward(query, key, value, out, lse, *score_buffers, *mask_buffers, *block_lists)
    ctx.counts = (len(score_buffers), len(mask_buffers), len(block_lists))
    ctx.rest = tuple(rest)                    # score_mod ... want_max
    ctx.grad_slots = _backward.grad_slots(score_buffers)


def _attention_grad(ctx, grad_out, grad_lse, grad_max):
    query, key, value, out, lse, *saved = ctx.saved_tensors
    ns, nm, nl = ctx.counts
    score_buffers, mask_buffers, block_lists = saved[:ns], saved[ns:ns + nm], saved[ns + nm:]
    needs = ctx.needs_input_grad
    score_mod, mask_mod, block_size, mask_lengths, scale, enable_gqa, options, want_max = ctx.rest
    slots = [i for i in ctx.grad_slots if needs[3][i]]
    grads = [None] * ns
    dq = dk = dv = None
    if grad_out is not None or grad_lse is not None:
        dq, dk, dv, buffer_grads = attention_backward(
            query, key, value, out, lse, grad_out, grad_lse, list(score_buffers), list(mask_buffers),
            list(block_lists), score_mod, mask_mod, block_size, mask_lengths, scale, enable_gqa,
            options, slots, needs[1] or needs[2])
        for slot, g in zip(slots, buffer_grads):
            grads[slot] = g
    # One entry per input in the structure autograd checks: a tensor list as a list of as
    # many, an int list as one entry (an empty one as an empty list).
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            grads, [None] * nm, [None] * nl, None, None, None if block_size else [],
            None if mask_lengths else [], None, None, None, None)


attention.register_autograd(_attention_grad, setup_context=_setup_attention)


@torch.library.custom_op("flexgen::attention_backward", mutates_args=())
def attention_backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                       grad_out: Tensor | None, grad_lse: Tensor | None, score_buffers: list[Tensor],
                       mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str,
                       mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
                       enable_gqa: bool, options: str, grad_slots: list[int],
                       needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """flex_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
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
    empty = query.new_empty((0,))
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            key.new_empty(key.shape) if needs_kv else empty,
            value.new_empty(value.shape) if needs_kv else query.new_empty((0,)),
            [torch.empty_like(score_buffers[i]) for i in grad_slots])


def call_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                   block_size, mask_lengths, scale, enable_gqa, options, want_max):
    """``attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, list(score_buffers), list(mask_buffers), list(block_lists), score_mod,
            mask_mod, list(block_size), list(mask_lengths), scale, enable_gqa, options, want_max)
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _attention(*args)
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value, *score_buffers)):
        check_backward(*args)      # before the forward kernel runs (torch.compile: setup_context)
    return torch.ops.flexgen.attention(*args)


# ---------------------------------------------------------------------------------- decode

@torch.library.custom_op("flexgen::decode", mutates_args=())
def decode(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
           mask_buffers: list[Tensor], block_lists: list[Tensor], kv_lengths: Tensor,
           q_offsets: Tensor | None, q_lengths: Tensor, page_table: Tensor | None, score_mod: str,
           mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
           enable_gqa: bool, options: str, max_kv_len: int, q_rows: Tensor | None = None,
           max_q_len: int = 0) -> tuple[Tensor, Tensor]:
    """decode_attention: (out [B, Hq, Lq, Dv], lse [B, Hq, Lq]) for a few queries per sequence
    against contiguous or paged K/V (``flexgen.kernels.decode``). With ``q_rows`` (int32
    [B + 1]: each sequence's first row) the queries are packed, ``[total_q, Hq, D]`` with at
    most ``max_q_len`` per sequence, and so are the outputs: (out [total_q, Hq, Dv], lse
    [Hq, total_q])."""
    return _decode(query, key, value, score_buffers, mask_buffers, block_lists, kv_lengths,
                   q_offsets, q_lengths, page_table, score_mod, mask_mod, block_size, mask_lengths,
                   scale, enable_gqa, options, max_kv_len, q_rows, max_q_len)


def _decode_plan(query, key, value, score_buffers, mask_buffers, block_lists, page_table, score_mod,
                 mask_mod, block_size, mask_lengths, enable_gqa, options, q_rows, max_q_len):
    """The decode plan; packed queries are planned as the [B, Hq, max_q_len, D] view the kernel
    addresses (``kernels.decode.packed_view``)."""
    if q_rows is not None:
        from ..kernels.decode import packed_view
        query = packed_view(query, q_rows.shape[0] - 1, max(1, max_q_len))
    return plan_decode_call(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                            block_lists, block_size, mask_lengths, page_table, enable_gqa, options)


def _decode(query, key, value, score_buffers, mask_buffers, block_lists, kv_lengths, q_offsets,
            q_lengths, page_table, score_mod, mask_mod, block_size, mask_lengths, scale, enable_gqa,
            options, max_kv_len, q_rows=None, max_q_len=0):
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    plan = _decode_plan(query, key, value, score_buffers, mask_buffers, block_lists, page_table, score_mod,
                        mask_mod, block_size, mask_lengths, enable_gqa, options, q_rows, max_q_len)
    return run_decode(plan, query, key, value, score_buffers, mask_buffers,
                      block_lists[:4] if block_lists else None, kv_lengths, q_offsets, q_lengths,
                      page_table, scale, max_kv_len, q_rows=q_rows, longest=max(1, max_q_len))


@decode.register_fake
def _decode_fake(query, key, value, score_buffers, mask_buffers, block_lists, kv_lengths, q_offsets,
                 q_lengths, page_table, score_mod, mask_mod, block_size, mask_lengths, scale,
                 enable_gqa, options, max_kv_len, q_rows=None, max_q_len=0):
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        _decode_plan(query, key, value, score_buffers, mask_buffers, block_lists, page_table, score_mod,
                     mask_mod, block_size, mask_lengths, enable_gqa, options, q_rows, max_q_len)
    if q_rows is not None:
        total_q, Hq = query.shape[:2]
        return (query.new_empty((total_q, Hq, value.shape[-1])),
                query.new_empty((Hq, total_q), dtype=torch.float32))
    B, Hq, Lq = query.shape[:3]
    return (query.new_empty((B, Hq, Lq, value.shape[-1])),
            query.new_empty((B, Hq, Lq), dtype=torch.float32))


def call_decode(*args):
    """``decode``, straight to its implementation where nothing needs the op (``_eager``)."""
    query, key, value, score_buffers, mask_buffers = args[:5]
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _decode(*args)
    return torch.ops.flexgen.decode(*args)


# ---------------------------------------------------------------------------------- paged cache

@torch.library.custom_op("flexgen::paged_write", mutates_args=("k_cache", "v_cache"))
def paged_write(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, page_table: Tensor,
                slots: Tensor, lengths: Tensor, counts: Tensor) -> None:
    """Write the first ``counts[b]`` keys / values of row ``b`` at positions ``lengths[slots[b]]``
    onwards of sequence ``slots[b]``, through its page table row (``flexgen.kernels.paged``)."""
    from ..kernels.paged import run_paged_write
    run_paged_write(k_cache, v_cache, key, value, page_table, slots, lengths, counts)


@paged_write.register_fake
def _paged_write_fake(k_cache, v_cache, key, value, page_table, slots, lengths, counts):
    return None


def call_paged_write(*args) -> None:
    """``paged_write``, straight to its implementation where nothing needs the op (``_eager``)."""
    if _eager(*args):
        from ..kernels.paged import run_paged_write
        return run_paged_write(*args)
    return torch.ops.flexgen.paged_write(*args)


@torch.library.custom_op("flexgen::paged_write_rope", mutates_args=("k_cache", "v_cache"))
def paged_write_rope(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, page_table: Tensor,
                     slots: Tensor, lengths: Tensor, counts: Tensor, inv_freq: Tensor, rotary_dim: int,
                     interleaved: bool, query: Tensor | None) -> Tensor:
    """``paged_write`` with RoPE: the keys rotated at their positions on the way in
    (``flexgen.kernels.rope``); returns ``query`` rotated the same way (or an empty tensor)."""
    from ..kernels.paged import run_paged_write
    return run_paged_write(k_cache, v_cache, key, value, page_table, slots, lengths, counts,
                           inv_freq, rotary_dim, interleaved, query)


@paged_write_rope.register_fake
def _paged_write_rope_fake(k_cache, v_cache, key, value, page_table, slots, lengths, counts, inv_freq,
                           rotary_dim, interleaved, query):
    return torch.empty_like(query) if query is not None else key.new_empty((0,))


def call_paged_write_rope(*args) -> Tensor:
    """``paged_write_rope``, straight to its implementation where nothing needs the op (``_eager``)."""
    query = args[-1]
    if _eager(*args[:9], *(() if query is None else (query,))):
        from ..kernels.paged import run_paged_write
        return run_paged_write(*args)
    return torch.ops.flexgen.paged_write_rope(*args)


# ---------------------------------------------------------------------------------- block masks

# cudagraph_unsafe: building the lists reads values back to the host (the element-wise
# pass visits only the blocks it must), which a CUDA graph capture cannot contain; under
# mode="reduce-overhead" torch.compile runs this op outside its graphs.
@torch.library.custom_op("flexgen::block_mask", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
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


# ---------------------------------------------------------------------------------- sigmoid attention
#
#     sigmoid_attention(q, k, v, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
#                       block_size, mask_lengths, scale, bias, enable_gqa, options) -> out
#     sigmoid_attention_backward(q, k, v, grad_out, ..., grad_slots, needs_kv) -> (dq, dk, dv, grads)
#
# The attention op's arguments plus the bias, minus want_max; nothing but the inputs is saved
# for the backward (the weights are recomputed from q and k).

@torch.library.custom_op("flexgen::sigmoid_attention", mutates_args=())
def sigmoid_attention(query: Tensor, key: Tensor, value: Tensor, score_buffers: list[Tensor],
                      mask_buffers: list[Tensor], block_lists: list[Tensor], score_mod: str,
                      mask_mod: str, block_size: list[int], mask_lengths: list[int], scale: float,
                      bias: float, enable_gqa: bool, options: str) -> Tensor:
    """sigmoid_attention's forward: out [B, Hq, Lq, Dv] (``flexgen.kernels.sigmoid``)."""
    return _sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                              mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options)


def _sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod, mask_mod,
                       block_size, mask_lengths, scale, bias, enable_gqa, options):
    from ..kernels.sigmoid import run_sigmoid
    from .plan import plan_sigmoid
    device = query.device
    score_buffers, mask_buffers = _on_device(score_buffers, device), _on_device(mask_buffers, device)
    plan = plan_sigmoid(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                        block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    return run_sigmoid(plan, query, key, value, score_buffers, mask_buffers, block_lists, bias)


@sigmoid_attention.register_fake
def _sigmoid_attention_fake(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                            mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    from .plan import plan_sigmoid
    if all(isinstance(n, int) for t in (query, key, value) for n in t.shape):
        plan_sigmoid(query, key, value, score_mod, score_buffers, mask_mod, mask_buffers,
                     block_lists, block_size, mask_lengths, scale, enable_gqa, options)
    B, Hq, Lq = query.shape[:3]
    return query.new_empty_strided((B, Hq, Lq, value.shape[3]), out_strides(query, value.shape[3]))


def check_sigmoid_backward(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                           mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    """Plan the backward of a sigmoid_attention call whose inputs require grad (GradientError now)."""
    from .plan import plan_sigmoid_backward
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


@torch.library.custom_op("flexgen::sigmoid_attention_backward", mutates_args=())
def sigmoid_attention_backward(query: Tensor, key: Tensor, value: Tensor, grad_out: Tensor,
                               score_buffers: list[Tensor], mask_buffers: list[Tensor],
                               block_lists: list[Tensor], score_mod: str, mask_mod: str,
                               block_size: list[int], mask_lengths: list[int], scale: float, bias: float,
                               enable_gqa: bool, options: str, grad_slots: list[int],
                               needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """sigmoid_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    from ..kernels.sigmoid import run_sigmoid_backward
    from .plan import plan_sigmoid, plan_sigmoid_backward
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
    empty = query.new_empty((0,))
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            key.new_empty(key.shape) if needs_kv else empty,
            value.new_empty(value.shape) if needs_kv else query.new_empty((0,)),
            [torch.empty_like(score_buffers[i]) for i in grad_slots])


def call_sigmoid_attention(query, key, value, score_buffers, mask_buffers, block_lists, score_mod,
                           mask_mod, block_size, mask_lengths, scale, bias, enable_gqa, options):
    """``sigmoid_attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, list(score_buffers), list(mask_buffers), list(block_lists), score_mod,
            mask_mod, list(block_size), list(mask_lengths), scale, bias, enable_gqa, options)
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _sigmoid_attention(*args)
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value, *score_buffers)):
        check_sigmoid_backward(*args)
    return torch.ops.flexgen.sigmoid_attention(*args)


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
    from .plan import plan_varlen
    return plan_varlen(query, key, value, cu_q, cu_k, score_mod, score_buffers, mask_mod, mask_buffers,
                       scale, enable_gqa, options)


@torch.library.custom_op("flexgen::varlen_attention", mutates_args=())
def varlen_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, score_buffers: list[Tensor], mask_buffers: list[Tensor],
                     score_mod: str, mask_mod: str, scale: float, enable_gqa: bool,
                     options: str) -> tuple[Tensor, Tensor]:
    """varlen_attention's forward: (out [total_q, Hq, Dv], lse [Hq, total_q] float32)."""
    return _varlen_attention(query, key, value, cu_seqlens_q, cu_seqlens_k, score_buffers, mask_buffers,
                             score_mod, mask_mod, scale, enable_gqa, options)


def _varlen_attention(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod, mask_mod,
                      scale, enable_gqa, options):
    from ..kernels.varlen import run_varlen
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
    from .plan import plan_varlen_backward
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


@torch.library.custom_op("flexgen::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                              grad_out: Tensor | None, grad_lse: Tensor | None, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, score_buffers: list[Tensor],
                              mask_buffers: list[Tensor], score_mod: str, mask_mod: str, scale: float,
                              enable_gqa: bool, options: str, grad_slots: list[int],
                              needs_kv: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """varlen_attention's backward: (dq, dk, dv (empty unless ``needs_kv``), gradients of the
    captured tensors in ``grad_slots``, in that order)."""
    from ..kernels.varlen import run_varlen_backward
    from .plan import plan_varlen_backward
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
    empty = query.new_empty((0,))
    return (torch.empty_like(query, memory_format=torch.contiguous_format),
            key.new_empty(key.shape) if needs_kv else empty,
            value.new_empty(value.shape) if needs_kv else query.new_empty((0,)),
            [torch.empty_like(score_buffers[i]) for i in grad_slots])


def call_varlen_attention(query, key, value, cu_q, cu_k, score_buffers, mask_buffers, score_mod,
                          mask_mod, scale, enable_gqa, options):
    """``varlen_attention``, straight to its implementation where nothing needs the op (``_eager``)."""
    args = (query, key, value, cu_q, cu_k, list(score_buffers), list(mask_buffers), score_mod, mask_mod,
            scale, enable_gqa, options)
    if _eager(query, key, value, *score_buffers, *mask_buffers):
        return _varlen_attention(*args)
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value, *score_buffers)):
        check_varlen_backward(*args)
    return torch.ops.flexgen.varlen_attention(*args)


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
    from .plan import plan_linear
    return plan_linear(query, key, value, initial_state, decay_mod, decay_buffers, feature_map,
                       feature_buffers, scale, enable_gqa, options)


@torch.library.custom_op("flexgen::linear_attention", mutates_args=())
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
    from ..kernels.linear import run_linear
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
    from .plan import plan_linear_backward
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


@torch.library.custom_op("flexgen::linear_attention_backward", mutates_args=())
def linear_attention_backward(query: Tensor, key: Tensor, value: Tensor, initial_state: Tensor | None,
                              grad_out: Tensor | None, grad_state: Tensor | None,
                              decay_buffers: list[Tensor], feature_buffers: list[Tensor], decay_mod: str,
                              feature_map: str, scale: float, enable_gqa: bool, options: str,
                              grad_slots: list[int], needs_state: bool
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """linear_attention's backward: (dq, dk, dv, d initial state (empty unless ``needs_state``),
    gradients of the decay_mod's captured tensors in ``grad_slots``, in that order)."""
    from ..kernels.linear import run_linear_backward
    from .plan import plan_linear_backward
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
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and any(
            t.requires_grad for t in tensors):
        check_linear_backward(*args)
    return torch.ops.flexgen.linear_attention(*args)


@torch.library.custom_op("flexgen::linear_attention_decode", mutates_args=("state",))
def linear_attention_decode(query: Tensor, key: Tensor, value: Tensor, state: Tensor, slots: Tensor,
                            decay_buffers: list[Tensor], feature_buffers: list[Tensor], decay_mod: str,
                            feature_map: str, scale: float, enable_gqa: bool, options: str) -> Tensor:
    """linear_attention_decode: out [B, Hq, T, Dv]; the rows ``slots`` of the state cache
    [num_slots, Hq, Dk, Dv] float32 are advanced by the T positions in place."""
    return _linear_attention_decode(query, key, value, state, slots, decay_buffers, feature_buffers,
                                    decay_mod, feature_map, scale, enable_gqa, options)


def _linear_attention_decode(query, key, value, state, slots, decay_buffers, feature_buffers, decay_mod,
                             feature_map, scale, enable_gqa, options):
    from ..kernels.linear import run_linear_decode
    from .plan import plan_linear_decode
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
