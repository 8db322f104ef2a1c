"""The backward pass of ``flex_attention``: derivatives of the mods, and the two kernels.

With ``z = score_mod(s)``, ``s = q·k * scale``, ``P = softmax(mask(z))`` and
``out = P V``, the gradients are (per row, delta = rowsum(dO * out))::

    dV = Pᵀ dO        dZ = P * (dO Vᵀ - delta)        dS = dZ * dz/ds
    dQ = dS K * scale      dK = dSᵀ Q * scale      d buffer[i] = Σ dZ * dz/d buffer[i]

``dz/ds`` and ``dz/d buffer[i]`` come from sympy (``flexgen.expr.derivative``)
on the canonical expression, printed by ``flexgen.codegen.printer`` like the mod
itself: softcap, ALiBi, clamps and learned biases differentiate without a
user-written backward. P is recomputed from the LSE the forward kernel
saved, never stored.

Two kernels, one template (``templates/backward.py.jinja``), two parts:

- ``dq``: one program per (query tile, batch, query head), looping over the
  kv blocks of the block mask's kv lists. It first writes delta for its rows
  (so it runs first), accumulates dQ, and scatters the captured buffers'
  gradients with ``tl.atomic_add`` into float32 buffers, at the element each
  load read (summed over the tile first where the index ignores q or kv).
- ``dkdv``: one program per (kv tile, batch, KV head), looping over the query
  heads of its GQA group and, for each, over the query blocks of the mask's
  transposed lists (``q_num_blocks`` / ``q_indices``, ``full_q_*``).

Both parts have a TMA variant (``use_tma``), as the forward kernel does: q, k,
v, out, dO and the dQ / dK / dV outputs go through host tensor descriptors
(the LSE, delta and the captured buffers stay pointer loads). The backward
takes it when its forward spec did (the same ``USE_TMA`` option and default)
and every tensor it would address that way can be (``spec.tma_addressable``: the
upstream gradient autograd hands over can have any strides); otherwise that
call runs the pointer kernels.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from sympy.printing.str import StrPrinter

from ..runtime import launch
from ..codegen.printer import Address, Snippet, cast, print_address, print_joint
from ..errors import FlexgenError
from ..frontend.expr import INDEX_SYMBOLS, SCORE, NotDifferentiable, derivative, load_applications
from ..frontend.lowering import lower
from ..codegen.spec import BufferSig, KernelSpec, tma_addressable
from ..frontend.trace import Traced


class GradientError(FlexgenError):
    """A score_mod cannot be differentiated (for the gradients that were asked for)."""


@dataclass(frozen=True)
class Scatter:
    """One load of a captured tensor whose gradient the dQ kernel accumulates."""
    buffer: str            # the loaded buffer ("sbuf0")
    grad_name: str         # its float32 gradient buffer ("sbuf0_grad")
    index_text: str        # the index, for the kernel's comment
    partial: str           # code of d mod / d (this load), after the mod's statements
    partial_const: bool    # that derivative is a finite constant: no NaN guard
    reduce_q: bool         # the index ignores q_idx: sum the tile over its rows first
    reduce_kv: bool        # the index ignores kv_idx: sum over its columns first
    address: Address       # where the load read, as an offset into the gradient buffer


@dataclass(frozen=True)
class BackwardSpec(KernelSpec):
    """A ``KernelSpec`` for one part ("dq" or "dkdv") of the backward template."""
    part: str = "dq"
    score_grad: str | None = None       # code of d mod / d score (None: the mod is score + ...)
    score_grad_const: bool = True       # that derivative is a finite constant
    scatters: tuple = ()                # Scatter per buffer load that gets a gradient (dq only)
    grad_buffers: tuple = ()            # BufferSig per float32 gradient buffer (dq only)


@dataclass(frozen=True)
class _Part:
    """One kernel's printed mod: statements computing z and its derivatives, then the codes."""
    snippet: Snippet | None             # the statements; ``result`` is z = score_mod(score)
    score_grad: str | None              # d z / d score after the statements (None: it is 1)


@dataclass(frozen=True)
class LoweredGrad:
    """What the two kernels need of a score_mod's derivatives."""
    dq: _Part                           # z, d z / d score and d z / d each scattered load
    dkdv: _Part                         # z and d z / d score
    score_grad_const: bool
    scatters: tuple
    grad_buffers: tuple


_GRADS: dict = {}


def _const(e) -> bool:
    return bool(e.is_number) and bool(e.is_finite)


class _UserText(StrPrinter):
    """sympy text in the mod's own terms: ``captured0[h, q_idx]``, ``(x).to(torch.int32)``."""

    def _print_Function(self, e):
        name = e.func.__name__
        if name.startswith("sbuf") and name[4:].isdigit():
            return f"captured{name[4:]}[{', '.join(self._print(a) for a in e.args)}]"
        if name == "Trunc":
            return f"({self._print(e.args[0])}).to(torch.int32)"
        if name == "Sigmoid":
            return f"sigmoid({self._print(e.args[0])})"
        return super()._print_Function(e)


def _describe(traced: Traced, what: str, err: NotDifferentiable, fix: str) -> GradientError:
    names = "; ".join(f"captured{i} is the tensor of shape {list(t.shape)}"
                      for i, t in enumerate(traced.buffers)
                      if re.search(rf"\bsbuf{i}\b", str(err.part)))
    where = f"`{_UserText().doprint(err.part)}`" + (f", where {names}" if names else "")
    return GradientError(f"score_mod '{traced.name}': the gradient with respect to {what} cannot "
                         f"be computed: {err.reason} ({where}). Fix: {fix}")


def lower_grad(traced: Traced | None, grad_slots: tuple) -> LoweredGrad:
    """Derivatives of ``traced`` (a score_mod, or None) w.r.t. the score and the buffers in ``grad_slots``.

    Raises ``GradientError`` naming the mod when a derivative does not exist
    or cannot be printed. Memoized per traced graph and set of slots.
    """
    if traced is None:
        return LoweredGrad(_Part(None, None), _Part(None, None), True, (), ())
    key = (traced.signature, grad_slots)
    hit = _GRADS.get(key)
    if hit is not None:
        return hit
    lowered = lower(traced)
    expr = lowered.expr
    name = traced.name
    try:
        d_score = derivative(expr, SCORE)
    except NotDifferentiable as err:
        raise _describe(traced, "the score", err,
                        "keep floor / ceil / sign / integer casts off the score's path, or run "
                        "without gradients (torch.no_grad(), or inputs that do not require grad)") from None
    loads, partials = [], []
    names = {f"sbuf{i}": i for i in grad_slots}
    for app in load_applications(expr, names):
        slot = names[app.func.__name__]
        shape = list(traced.buffers[slot].shape)
        try:
            d = derivative(expr, app)
        except NotDifferentiable as err:
            raise _describe(traced, f"captured{slot} (shape {shape}, requires_grad=True)", err,
                            "index with integer positions only and keep the loaded value off "
                            "floor / ceil / sign / integer casts, or pass the tensor "
                            ".detach()-ed if it should not be trained") from None
        if d != 0:
            loads.append(app)
            partials.append(d)
    score_grad_expr = None if d_score == 1 else d_score

    def joint(exprs):
        try:
            return print_joint(exprs, "s_")
        except RuntimeError as err:   # the printer met a node it has no Triton form for
            raise GradientError(f"score_mod '{name}': its derivative cannot be turned into kernel "
                                f"code ({err}). Fix: rewrite the mod with the functions listed in "
                                "flexgen.trace.UNARY_FUNCS, or run without gradients") from None

    head = [expr] + ([score_grad_expr] if score_grad_expr is not None else [])
    dkdv = joint(head)
    dq = joint(head + partials)
    extra = dq.results[len(head):]
    scatters = []
    for n, (app, d, code) in enumerate(zip(loads, partials, extra)):
        grad_name = f"{app.func.__name__}_grad"
        free = app.free_symbols
        scatters.append(Scatter(
            buffer=app.func.__name__, grad_name=grad_name,
            index_text=", ".join(str(a) for a in app.args), partial=code, partial_const=_const(d),
            reduce_q=INDEX_SYMBOLS["q_idx"] not in free,
            reduce_kv=INDEX_SYMBOLS["kv_idx"] not in free,
            address=print_address(app, grad_name, f"g{n}_")))
    grad_buffers = tuple(BufferSig(f"sbuf{i}_grad", traced.buffers[i].dim(), "float32")
                         for i in grad_slots)
    hit = LoweredGrad(
        dq=_Part(dq.snippet(0), _score_grad(dq, score_grad_expr)),
        dkdv=_Part(dkdv.snippet(0), _score_grad(dkdv, score_grad_expr)),
        score_grad_const=score_grad_expr is None or _const(score_grad_expr),
        scatters=tuple(scatters), grad_buffers=grad_buffers)
    _GRADS[key] = hit
    return hit


def _score_grad(joint, score_grad_expr) -> str | None:
    """The code of d mod / d score in ``joint`` (its second value), as float32."""
    if score_grad_expr is None:
        return None
    return cast(joint.results[1], joint.kinds[1], "float")


@dataclass(frozen=True)
class BackwardPlan:
    """Everything the backward needs besides the saved tensors, decided in the forward."""
    dq: BackwardSpec
    dkdv: BackwardSpec
    kv_sparse: tuple | None       # the kv lists broadcast to [B, H, ...], Q_BLOCK, KV_BLOCK
    q_sparse: tuple | None        # the transposed q lists (broadcast), Q_BLOCK, KV_BLOCK
    grad_slots: tuple             # score buffers that receive a gradient
    mask_buffers: tuple
    scale: float
    tune_blocks: tuple | None     # sparse block sizes the autotuner's tiles divide; None: fixed tiles
    pointer: tuple | None = None  # TMA dq, dkdv: their pointer variants (for calls TMA cannot address)


def plan(forward: KernelSpec, score_traced, block_mask, query, mask_buffers, scale,
         grad_slots: tuple, dq_options: dict, dkdv_options: dict,
         tune_blocks: tuple | None = None) -> BackwardPlan:
    """The two backward specs for a forward call (raises GradientError before anything runs).

    Each part has its own tiles (``flexgen.runtime.tuning`` gives them per kernel).
    """
    memo_key = (forward.key, None if score_traced is None else score_traced.signature, grad_slots,
                tuple(sorted(dq_options.items())), tuple(sorted(dkdv_options.items())))
    specs = _SPECS.get(memo_key)
    if specs is None:
        specs = _SPECS[memo_key] = _specs(forward, lower_grad(score_traced, grad_slots),
                                          dq_options, dkdv_options)
    dq, dkdv, pointer = specs
    kv_sparse = q_sparse = None
    if block_mask is not None:
        B, H = query.shape[:2]
        kv_sparse = _lists(block_mask, "kv", B, H)
        q_sparse = _lists(block_mask, "q", B, H)
    return BackwardPlan(dq, dkdv, kv_sparse, q_sparse, grad_slots, tuple(mask_buffers), scale,
                        tune_blocks, pointer)


# (forward key, score_mod signature, grad slots, options) -> (dq spec, dkdv spec, their pointer
# variants or None): the same spec objects on every call, so their keys (a hash of the whole
# spec) are computed once.
_SPECS: dict = {}


def _tiles(options: dict) -> dict:
    return dict(block_m=options["BLOCK_M"], block_n=options["BLOCK_N"],
                num_warps=options["num_warps"], num_stages=options["num_stages"])


def _specs(forward: KernelSpec, grads: LoweredGrad, dq_options: dict, dkdv_options: dict) -> tuple:
    """(dq spec, dkdv spec, None), or with a TMA forward (TMA dq, TMA dkdv, (pointer dq, pointer dkdv))."""
    def both(use_tma):
        common = dict(mask=forward.mask, score_buffers=forward.score_buffers,
                      mask_buffers=forward.mask_buffers, qk_head=forward.qk_head,
                      v_head=forward.v_head, dtype=forward.dtype,
                      has_block_mask=forward.has_block_mask, dot_precision=forward.dot_precision,
                      score_grad_const=grads.score_grad_const, use_tma=use_tma)
        dq = BackwardSpec("backward", part="dq", score=grads.dq.snippet,
                          score_grad=grads.dq.score_grad, scatters=grads.scatters,
                          grad_buffers=grads.grad_buffers, **_tiles(dq_options), **common)
        dkdv = BackwardSpec("backward", part="dkdv", score=grads.dkdv.snippet,
                            score_grad=grads.dkdv.score_grad, **_tiles(dkdv_options), **common)
        return dq, dkdv

    if not forward.use_tma:
        return (*both(False), None)
    return (*both(True), both(False))


def _lists(block_mask, which: str, B: int, H: int) -> tuple:
    """(num, indices, full_num, full_indices) broadcast to [B, H, ...], then the block sizes.

    The kernels take one set of strides for a partial list and its full list,
    and any strides at all (the transposed lists are often not contiguous).
    """
    num, idx, full_num, full_idx = (getattr(block_mask, f"{prefix}{which}_{name}") for prefix, name in
                                    (("", "num_blocks"), ("", "indices"),
                                     ("full_", "num_blocks"), ("full_", "indices")))
    if num.stride() != full_num.stride():
        num, full_num = num.contiguous(), full_num.contiguous()
    if idx.stride() != full_idx.stride():
        idx, full_idx = idx.contiguous(), full_idx.contiguous()
    lists = [t.expand(B, H, *t.shape[2:]) for t in (num, idx, full_num, full_idx)]
    return (*lists, *block_mask.BLOCK_SIZE)


def _pick(bw: BackwardPlan, tensors, dtype) -> tuple:
    """The (dq, dkdv) specs for one call: the plan's, or its pointer variants where the plan's
    are TMA kernels and one of ``tensors`` (everything they address through descriptors, all
    in ``dtype``; None for an output not computed) is not TMA-addressable."""
    if bw.pointer is not None and not all(t is None or (t.dtype == dtype and tma_addressable(t))
                                          for t in tensors):
        return bw.pointer
    return bw.dq, bw.dkdv


def run(bw: BackwardPlan, query, key, value, out, lse, grad_out, grad_lse, score_buffers,
        needs_kv: bool = True):
    """(dq, dk, dv, buffer gradients) for one call; dk, dv are None unless ``needs_kv``.

    Buffer gradients come back as a dict slot -> tensor in the buffer's dtype. With TMA
    backward specs, a call whose tensors TMA cannot address (a grad_out that is expanded,
    sliced or misaligned, say) runs the pointer kernels instead.
    """
    from ..api import POISON       # the switch lives with the forward's
    device = query.device
    B, H, Q_LEN, _ = query.shape
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    lse = lse.contiguous()
    dlse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    delta = torch.empty(B, H, Q_LEN, dtype=torch.float32, device=device)
    dq = torch.empty_like(query, memory_format=torch.contiguous_format)
    dk = dv = None
    if needs_kv:
        dk = torch.empty_like(key, memory_format=torch.contiguous_format)
        dv = torch.empty_like(value, memory_format=torch.contiguous_format)
    if POISON:
        for t in (delta, dq, dk, dv):
            if t is not None:
                t.fill_(float("nan"))
    grads = [torch.zeros(score_buffers[i].shape, dtype=torch.float32, device=device)
             for i in bw.grad_slots]
    common = (query, key, value, out, grad_out, lse, dlse, delta, dq, dk, dv)
    dq_spec, dkdv_spec = _pick(bw, (query, key, value, out, grad_out, dq, dk, dv), query.dtype)
    launch.run(dq_spec, device, *common, bw.kv_sparse, score_buffers, bw.mask_buffers, grads, bw.scale,
               tune_blocks=bw.tune_blocks)
    if needs_kv:
        launch.run(dkdv_spec, device, *common, bw.q_sparse, score_buffers, bw.mask_buffers, (),
                   bw.scale, tune_blocks=bw.tune_blocks)
    buffer_grads = {slot: g.to(score_buffers[slot].dtype) for slot, g in zip(bw.grad_slots, grads)}
    return dq, dk, dv, buffer_grads


def grad_slots(traced) -> tuple:
    """Slots of a traced score_mod's captured tensors that require a gradient."""
    if traced is None:
        return ()
    return tuple(i for i, t in enumerate(traced.buffers)
                 if t.requires_grad and t.dtype.is_floating_point)


__all__ = ["GradientError", "BackwardSpec", "BackwardPlan", "lower_grad", "plan", "run",
           "grad_slots"]
