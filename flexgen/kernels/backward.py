"""The backward pass of ``flex_attention``: derivatives of the mods, and the two kernels.

With ``z = score_mod(s)``, ``s = q·k * scale``, ``P = softmax(mask(z))`` and
``out = P V``, the gradients are (per row, delta = rowsum(dO * out))::

    dV = Pᵀ dO        dZ = P * (dO Vᵀ - delta)        dS = dZ * dz/ds
    dQ = dS K * scale      dK = dSᵀ Q * scale      d buffer[i] = Σ dZ * dz/d buffer[i]

``dz/ds`` and ``dz/d buffer[i]`` come from sympy (``flexgen.frontend.grad``) on
the canonical expression, printed like the mod itself: softcap, ALiBi, clamps and
learned biases differentiate without a user-written backward. P is recomputed
from the LSE the forward kernel saved, never stored.

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

On sm_90 both parts also have a Gluon kernel (``templates/backward_gluon.py.jinja``,
``plan.gluon_backward_spec``): warp-specialized, a TMA producer warp
streaming tiles through an mbarrier ring to consumer warpgroups that own 64 keys (dK/dV)
or 64 queries (dQ) each (async wgmma). BACKEND "gluon" takes them (an InputError where
they cannot run); a call whose tensors TMA cannot address runs the tl kernels. The Gluon dQ
kernel scatters the captured tensors' gradients as the tl one does (``common.scatter_gradients``,
one macro for both); AUTO gives it such a score_mod only under ``plan.GLUON_DQ_SCATTERS``.

The Gluon dK/dV kernel also has a fused form (part "fused", ``plan.GLUON_FUSED``): it adds
each tile's dS K into a float32 dQ through TMA reduce-adds, so S, dP and the mods are
computed once per tile pair. A small tl kernel (``templates/backward_delta.py.jinja``) comes
first: delta, and the float32 sum zeroed; the sum is rounded into dQ after. Its adds come in
any order, so a deterministic backward never takes it, nor does one that scatters gradients.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from triton.compiler.errors import CompilationError

from ..codegen.spec import KernelSpec, kernel_spec, pad_head_dim, tma_addressable, tma_layout_ok
from ..errors import expected
from ..frontend.lowering import lower
from ..runtime import launch, tuning
from ..runtime.checks import DTYPES
from ..runtime.poison import poison
from .forward import remember, replay_key


@dataclass(frozen=True)
class BackwardSpec(KernelSpec):
    """A ``KernelSpec`` for one part ("dq" or "dkdv") of the backward template."""
    part: str = "dq"
    score_grad: str | None = None       # code of d mod / d score (None: the mod is score + ...)
    score_grad_const: bool = True       # that derivative is a finite constant
    scatters: tuple = ()                # Scatter per buffer load that gets a gradient (dq only)
    grad_buffers: tuple = ()            # BufferSig per gradient buffer (dq only)
    deterministic: bool = False         # gradient buffers in int64 fixed point (see FIXED_POINT)


@dataclass(frozen=True)
class VarlenBackwardSpec(BackwardSpec):
    """A ``BackwardSpec`` over packed variable-length sequences: the fields of
    ``flexgen.codegen.spec.VarlenSpec``."""
    varlen: bool = True
    kv_lo: int | None = None
    kv_hi: int | None = None
    band_exact: bool = False


# Under torch.use_deterministic_algorithms(True) the gradients of captured tensors, which
# many programs add into with atomics, are summed in int64 fixed point with 32 fractional
# bits: every contribution is rounded to 2**-32 (2.3e-10) and the sum is exact and
# independent of the order of the atomics, so the backward is bitwise reproducible. A
# gradient must stay below 2**31 in magnitude. dQ, dK and dV never use atomics (each
# program owns its tile and loops in a fixed order): they are deterministic either way.
FIXED_POINT = 2.0 ** 32


@dataclass(frozen=True)
class BackwardPlan:
    """The two kernels of a call's backward (``flexgen.runtime.plan.plan_backward``)."""
    dq: BackwardSpec
    dkdv: BackwardSpec
    pointer: tuple | None         # TMA dq, dkdv: their pointer variants (for tensors TMA cannot address)
    grad_slots: tuple             # score buffers that receive a gradient
    tune_blocks: tuple | None     # sparse block sizes the autotuner's tiles divide; None: fixed tiles
    # The Gluon dK/dV and dQ kernels (sm_90) where the plan takes them
    # (``plan.gluon_backward_spec``), else None. dq and dkdv stay the tl kernels: what runs where a
    # tensor TMA cannot address (or a Gluon kernel does not compile) comes to them.
    gluon_dkdv: BackwardSpec | None = None
    gluon_dq: BackwardSpec | None = None
    # The fused Gluon kernel (dK, dV and dQ's atomic float32 sum), where the plan takes it,
    # and the kernel before it (delta, the zeroed sum: ``delta_spec``).
    gluon_fused: BackwardSpec | None = None
    fused_delta: KernelSpec | None = None


def _tiles(t: dict) -> dict:
    return dict(block_m=t["BLOCK_M"], block_n=t["BLOCK_N"], num_warps=t["num_warps"],
                num_stages=t["num_stages"])


def backward_specs(score_traced, mask, grad_slots: tuple, *, qk_head, v_head, dtype, has_block_mask,
                   dot_precision, use_tma, dq_tiles, dkdv_tiles, tune_blocks,
                   deterministic=False, proven=((), ())) -> BackwardPlan:
    """The dQ and dK/dV specs of a call (raises GradientError naming the mod). ``proven``:
    (score_mod's, mask_mod's) loads read without checks (``bounds_check.proven_loads``)."""
    from ..frontend.grad import lower_grad      # sympy: loaded by the first backward only
    from ..frontend.lowering import proven_snippet
    grads = lower_grad(score_traced, grad_slots, proven[0])
    deterministic = deterministic and bool(grads.scatters)
    grad_buffers = tuple(dataclasses.replace(g, dtype="int64") for g in grads.grad_buffers) \
        if deterministic else grads.grad_buffers
    mask_buffers = () if mask is None else mask.buffers
    score_lowered = None if score_traced is None else lower(score_traced)
    score_buffers = () if score_lowered is None else score_lowered.buffers

    def both(tma):
        common = dict(mask=None if mask is None else proven_snippet(mask, proven[1]), score_buffers=score_buffers,
                      mask_buffers=mask_buffers, qk_head=qk_head, v_head=v_head, dtype=dtype,
                      has_block_mask=has_block_mask, dot_precision=dot_precision,
                      score_grad_const=grads.score_grad_const, use_tma=tma,
                      score_terms=None if score_lowered is None else score_lowered.terms)
        dq = BackwardSpec("backward", part="dq", score=grads.dq.snippet,
                          score_grad=grads.dq.score_grad, scatters=grads.scatters,
                          grad_buffers=grad_buffers, deterministic=deterministic,
                          **_tiles(dq_tiles), **common)
        dkdv = BackwardSpec("backward", part="dkdv", score=grads.dkdv.snippet,
                            score_grad=grads.dkdv.score_grad, **_tiles(dkdv_tiles), **common)
        return dq, dkdv

    dq, dkdv = both(use_tma)
    return BackwardPlan(dq, dkdv, both(False) if use_tma else None, grad_slots, tune_blocks)


def _lists(lists, B: int, H: int, block_size) -> tuple:
    """(num, indices, full_num, full_indices) broadcast to [B, H, ...], then the block sizes.

    The kernels take one set of strides for a partial list and its full list,
    and any strides at all (the transposed lists are often not contiguous).
    """
    num, idx, full_num, full_idx = lists
    if num.stride() != full_num.stride():
        num, full_num = num.contiguous(), full_num.contiguous()
    if idx.stride() != full_idx.stride():
        idx, full_idx = idx.contiguous(), full_idx.contiguous()
    return (*(t.expand(B, H, *t.shape[2:]) for t in (num, idx, full_num, full_idx)), *block_size)


def _addressable(tensors, dtype) -> bool:
    """Whether TMA descriptors can address every one of ``tensors`` (None: an output not
    computed), all in ``dtype``: an expanded or sliced upstream gradient, a key shared by the
    batch, cannot."""
    return all(t is None or (t.dtype == dtype and tma_addressable(t)) for t in tensors)


def _fixed_addressable(plan, tensors) -> bool:
    """``_addressable`` of (query, key, value, dq, dk, dv) in the query's dtype: the plan fixes
    their layouts and dtypes (its key holds the first three's, the others are made from them;
    dk and dv are None where not computed), so the verdict on those is taken once per plan
    (kept with its backward plans: ~2.5 us a call on the dev CPU), the 16-byte alignment of
    their addresses at every call."""
    memo = ("addressable", tensors[4] is None)
    fixed = plan.backward.get(memo)
    if fixed is None:
        dtype = tensors[0].dtype
        fixed = plan.backward[memo] = all(t is None or (t.dtype == dtype and tma_layout_ok(
            t.shape, t.stride(), t.element_size())) for t in tensors)
    return fixed and all(t is None or not t.data_ptr() & 15 for t in tensors)


def run_backward(bw: BackwardPlan, plan, query, key, value, out, lse, grad_out, grad_lse,
                 score_buffers, mask_buffers, block_lists, needs_kv: bool = True, bias=None):
    """(dq, dk, dv, buffer gradients) for one call; dk, dv are None unless ``needs_kv``.

    ``bias``: the sigmoid's bias, for sigmoid_attention's kernels (``flexgen.kernels.sigmoid``:
    no ``out``, ``lse`` or ``grad_lse`` then, and no delta).

    Buffer gradients come back as a list in slot order (None where a slot gets none), in
    each buffer's dtype. A key / value of batch 1 shared by every query row gets its
    gradient summed over the rows. With TMA specs, a call whose tensors TMA cannot
    address (a grad_out that is expanded, sliced or misaligned, say) runs the pointer kernels.
    """
    device = query.device
    B, H, Q_LEN, _ = query.shape
    shared_kv = key.shape[0] != B
    if shared_kv:
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    sigmoid = bias is not None
    lse = None if sigmoid else lse.contiguous()
    dlse = None if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    delta = None if sigmoid else torch.empty(B, H, Q_LEN, dtype=torch.float32, device=device)
    dq = torch.empty_like(query, memory_format=torch.contiguous_format)
    dk = dv = None
    if needs_kv:
        dk = torch.empty(key.shape, dtype=key.dtype, device=device)
        dv = torch.empty(value.shape, dtype=value.dtype, device=device)
    poison(delta, dq, dk, dv)
    grads = gradient_buffers(bw, score_buffers, device)

    def inputs(dq_kernel: bool) -> dict:
        """A launch's inputs (a replay needs none: it has the lists' addresses)."""
        lists = block_lists[:4] if dq_kernel else block_lists[4:]
        sparse = None if plan.mask_info is None else _lists(lists, B, H, plan.mask_info.block_size)
        return dict(q=query, k=key, v=value, out=out, dout=grad_out, lse=lse, dlse=dlse, delta=delta,
                    dq=dq, dk=dk, dv=dv, score_buffers=score_buffers, mask_buffers=mask_buffers,
                    scale=plan.scale, sparse=sparse, grad_buffers=grads if dq_kernel else (),
                    **({"bias": bias} if sigmoid else {}))

    # Checked once for the TMA and the Gluon kernels alike (the Gluon ones read out by pointer).
    addressable = (bw.pointer, bw.gluon_dq, bw.gluon_dkdv, bw.gluon_fused) != (None,) * 4 and _addressable(
        (grad_out,), query.dtype) and _fixed_addressable(plan, (query, key, value, dq, dk, dv))
    with_out = addressable and _addressable((out,), query.dtype)
    # (Of the tensors a launch reads, the plan fixes the layouts of query, key, value and of
    # what is made here from them: delta, dq, dk, dv, dq_sum, the accumulators. out, grad_out,
    # lse and dlse come from the caller: their layouts key the replays.)
    layouts = (out, grad_out, lse, dlse)
    dq_spec, dkdv_spec = bw.dq, bw.dkdv
    if bw.pointer is not None and not with_out:
        dq_spec, dkdv_spec = bw.pointer
    fused = _gluon(bw.gluon_fused, with_out and needs_kv)
    if fused is not None:
        # delta and the zeroed float32 dQ sum first (one kernel), then dK, dV and dQ in one
        # kernel; dQ summed in float32 by TMA reduce-adds across the kv tiles, rounded after.
        dq_sum = torch.empty(query.shape, dtype=torch.float32, device=device)
        poison(dq_sum)
        run = _Launcher(plan, (query, key, value, out, grad_out, lse, dlse, delta, dq_sum, dk, dv), layouts,
                        score_buffers, mask_buffers, block_lists, bias)
        run(bw.fused_delta, lambda: dict(out=out, dout=grad_out, dlse=dlse, delta=delta, dq=dq_sum))
        try:
            run(fused, lambda: dict(inputs(False), dq=dq_sum))
        except CompilationError:
            _GLUON_FAILED.add(fused.key)    # (optional: the two kernels take this call and the next)
        else:
            dq.copy_(dq_sum)
            if shared_kv:
                dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
            return dq, dk, dv, buffer_grads(bw, grads, score_buffers)
    run = _Launcher(plan, (query, key, value, out, grad_out, lse, dlse, delta, dq, dk, dv, *grads), layouts,
                    score_buffers, mask_buffers, block_lists, bias)
    # The dQ kernel runs first in any case: it writes delta, which the dK/dV kernel reads.
    run.either(_gluon(bw.gluon_dq, addressable), dq_spec, functools.partial(inputs, True), bw.tune_blocks)
    if needs_kv:
        run.either(_gluon(bw.gluon_dkdv, addressable), dkdv_spec, functools.partial(inputs, False),
                   bw.tune_blocks)
        if shared_kv:
            dk, dv = dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)
    return dq, dk, dv, buffer_grads(bw, grads, score_buffers)


def delta_spec(D: int, Dv: int, dtype: torch.dtype) -> KernelSpec:
    """The fused backward's first kernel (``templates/backward_delta.py.jinja``): delta and the
    zeroed float32 dQ sum, [64 or 128 rows, D] tiles per program."""
    return kernel_spec("backward_delta", qk_head=D, v_head=Dv, dtype=DTYPES[dtype],
                       block_m=max(16, min(128, 8192 // pad_head_dim(max(D, Dv)))), num_warps=4)


class _Launcher:
    """Launches a backward kernel, or replays its launch of an earlier call like this one
    (``launch.Replay``): the same plan, kernel and bias, tensors laid out alike, and the
    captured tensors and block lists at the same addresses (``forward.replay_key``). The
    call's own tensors (``fresh``: inputs, outputs, gradient accumulators) are swapped in;
    ``layouts``: those of them whose shapes and strides the plan does not fix (the others'
    are part of the plan's key or made from them), which the key holds (~0.2 us a tensor).
    The replays are kept in the plan beside the forward's, one entry per such call holding its
    kernels' replays by name: a call launches two or three kernels, and its key (some twenty
    tensors' addresses, shapes and strides) and its tensors' signature are taken once for all
    of them, not once per kernel."""

    def __init__(self, plan, fresh, layouts, score_buffers, mask_buffers, block_lists, bias):
        self.plan, self.fresh = plan, fresh
        self.origins = (*score_buffers, *mask_buffers, *block_lists)
        # (A backward's key starts with a name: a forward's (replay_key) never does.)
        self.key = ("backward", replay_key(score_buffers, mask_buffers, block_lists, bias),
                    tuple([None if t is None else (t.shape, t.stride()) for t in layouts]))
        self.replays = plan.replays.get(self.key)        # kernel name -> Replay, or None
        self.signature = None                            # the fresh tensors', once needed

    def __call__(self, spec, make_inputs, tune_blocks=None) -> None:
        """Replay ``spec``'s launch, or launch it with ``make_inputs()``."""
        found = None if self.replays is None else self.replays.get(spec.kernel_name)
        if found is not None and not tuning.needs_lookup():
            if self.signature is None:
                self.signature = launch.fresh_signature(self.fresh)
            if found.signature == self.signature and found.launch(*self.fresh):
                return
        inputs = make_inputs()
        launched = launch.run(spec, self.fresh[0].device, inputs, tune_blocks=tune_blocks,
                              replay=self.fresh, origins=self.origins)
        if launched is not None:
            if self.replays is None:
                self.replays = {}
                remember(self.plan, self.key, self.replays)
            self.replays[spec.kernel_name] = launched

    def either(self, gluon, tl, make_inputs, tune_blocks) -> None:
        """The Gluon kernel ``gluon`` (or None), else (or where it does not compile) the tl one."""
        if gluon is not None:
            try:
                return self(gluon, make_inputs)
            except CompilationError as err:
                _gluon_failed(self.plan, gluon, err)
        self(tl, make_inputs, tune_blocks)


# Keys of Gluon backward specs that failed to compile with this Triton (AUTO then runs the tl
# kernel for them from there on).
_GLUON_FAILED: set = set()


def _gluon(gluon: BackwardSpec | None, addressable: bool):
    """``gluon`` (a plan's Gluon dQ or dK/dV spec, or None) where it compiled and the call's
    tensors are TMA-addressable (else the tl kernel takes the call), else None."""
    if gluon is None or gluon.key in _GLUON_FAILED or not addressable:
        return None
    return gluon


def _gluon_failed(plan, spec, err) -> None:
    """A Gluon backward kernel did not compile with this Triton (its API moves between
    releases): under BACKEND "gluon" an InputError saying so; under AUTO the tl kernel runs
    this call and every later one of the spec."""
    if plan.options.BACKEND == "gluon":
        import triton
        raise expected("kernel_options['BACKEND']", f"'gluon' where the Gluon {spec.part} kernel compiles",
                       f"a compile error with Triton {triton.__version__}: {str(err)[-400:]}",
                       "use BACKEND 'AUTO' or 'tl' (the Triton-language kernels)") from err
    _GLUON_FAILED.add(spec.key)


def gradient_buffers(bw: BackwardPlan, score_buffers, device) -> list:
    """Zeroed accumulators for the captured tensors in ``bw.grad_slots`` (int64 fixed point in
    deterministic mode, else float32)."""
    grad_dtype = torch.int64 if bw.dq.deterministic else torch.float32
    return [torch.zeros(score_buffers[i].shape, dtype=grad_dtype, device=device) for i in bw.grad_slots]


def buffer_grads(bw: BackwardPlan, grads, score_buffers) -> list:
    """The accumulators of ``gradient_buffers`` as gradients: one per captured tensor, in slot
    order (None where a slot gets none), in each tensor's dtype."""
    out = [None] * len(score_buffers)
    for slot, g in zip(bw.grad_slots, grads):
        if bw.dq.deterministic:
            g = g.to(torch.float64) / FIXED_POINT
        out[slot] = g.to(score_buffers[slot].dtype)
    return out


def grad_slots(buffers) -> tuple:
    """Slots of a score_mod's captured tensors that require a gradient."""
    return tuple(i for i, t in enumerate(buffers) if t.requires_grad and t.dtype.is_floating_point)


__all__ = ["BackwardSpec", "VarlenBackwardSpec", "BackwardPlan", "backward_specs", "run_backward",
           "gradient_buffers", "buffer_grads", "grad_slots"]
