"""Decayed causal linear attention: chunked prefill, its backward, and a recurrent decode.

``linear_attention`` computes, per batch row and query head, with a log-decay
``g_t = decay_mod(b, h, t)`` (<= 0) and a feature map ``φ``::

    S_t = exp(g_t) S_{t-1} + φ(k_t)ᵀ v_t        o_t = scale · φ(q_t) S_t

**Chunked forward** (``templates/linear.py.jinja``), chunks of C positions, G the running
sum of g inside a chunk (inclusive), g_c its total, S_in[c] the state entering chunk c:

0. ``prefix`` (a decay_mod that reads t): G of every chunk, written once [B, H, T] float32, so
   that no kernel scans g on its own (the state kernel would, on its serial path, once per
   chunk). A decay_mod that does not read t needs none: G_i = (i + 1) g in closed form;
1. ``state``: S_in[0] = S_0, S_in[c+1] = exp(g_c) S_in[c] + U[c] with
   U[c] = Σ_j exp(g_c - G_j) φ(k_j)ᵀ v_j: one program per (batch, head, key slice, value
   slice) walks the chunks with its state tile in registers and writes each S_in[c] once, in
   the inputs' dtype (what the output kernel multiplies in). A chunk's U is one small dot whose
   loads run ahead of the serial chain; no [chunks, Dk, Dv] float32 buffer of U is written,
   scanned and reread;
2. ``output``: o_i = scale (exp(G_i) φ(q_i) S_in[c] + Σ_{j<=i} exp(G_i - G_j)(φ(q_i)·φ(k_j)) v_j),
   every chunk in parallel (the lightning attention split: inter-chunk through the state,
   intra-chunk quadratic in C). O(T·C) work per head, not O(T²).

**Backward**, derived from the recurrence and checked against torch autograd of the
step-by-step float64 oracle. With dS_out[c] the gradient of the state leaving chunk c:

- reverse recurrence: dS_out[last] = dS_T (the final state's gradient, or 0) and
  dS_out[c-1] = exp(g_c) dS_out[c] + scale Σ_{i in c} exp(G_i) φ(q_i)ᵀ dO_i, i.e. the same
  ``state`` kernel, walking backwards (REVERSE); what is left after chunk 0
  is the initial state's gradient dS_0;
- per chunk (``grad``), with A_ij = scale exp(G_i - G_j) [i >= j] and dP = (dO Vᵀ) ⊙ A:
  dφ(Q) = dP φ(K) + scale exp(G) ⊙ dO S_inᵀ;  dφ(K) = dPᵀ φ(Q) + exp(g_c - G) ⊙ V dS_outᵀ;
  dV = ((φ(Q)φ(K)ᵀ) ⊙ A)ᵀ dO + exp(g_c - G) ⊙ φ(K) dS_out;  dQ = dφ(Q) ⊙ φ'(Q) (dK alike);
- the decay: dG_t = φ(q_t)·dφ(q_t) - φ(k_t)·dφ(k_t) (every term of the output and of the
  states depends on G through exp(G_i - G_j), exp(G_i) or exp(g_c - G_j)), and since
  G_t = Σ_{u <= t} g_u over the whole sequence, dg_u = Σ_{t >= u} dG_t + <S_T, dS_T> (a
  reverse running sum: ``grad`` writes dG with positions reversed, so one cumsum on the host
  makes it; the last term because every g scales the final state). ``gates`` scatters
  dg · ∂g/∂load into the decay_mod's captured tensors.

The states are recomputed in the backward, never saved, at the backward's own chunk size
(``LinearBackward.chunk``: the grad kernel's tiles want smaller chunks than the forward's).
With GQA the state and the mods' ``h`` belong to the query head; dK / dV are computed per
query head and summed over the group. **Decode** (``templates/linear_decode.py.jinja``): a
few positions from a given state, one step at a time, the state tile in registers — from
``initial_state`` (``linear_attention`` with T <= 16) or from / into a cache of states in
place (``linear_attention_decode``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codegen.spec import KernelSpec
from ..runtime import launch
from ..runtime.poison import poison


@dataclass(frozen=True)
class LinearSpec(KernelSpec):
    """A ``KernelSpec`` for one part of the linear templates. block_m is the chunk size
    (BLOCK_T), block_n the value-dim slice (BLOCK_DV), block_k the key-dim slice (BLOCK_DK) of
    the state and output kernels (0: the whole padded head dim)."""
    part: str = "output"
    block_k: int = 0
    # How the chunked kernels get G, the running sums of g within a chunk: "traced" (the
    # decay_mod at every position, then a scan), "head" (the decay_mod does not read t: closed
    # form) or "prefix" (read from the prefix kernel's buffer). See templates/linear.py.jinja.
    decay_form: str = "traced"
    decay: object = None                # Snippet of g = decay_mod(b, h, t), or None (g = 0)
    feature: object = None              # Snippet of φ(x), or None (identity)
    feature_grad: str | None = None     # code of φ'(x) after the feature's lines (grad part)
    decay_buffers: tuple = ()
    feature_buffers: tuple = ()
    decay_grad_lines: tuple = ()        # gates part: statements computing the partials
    scatters: tuple = ()                # gates part: GateScatter per differentiated load
    grad_buffers: tuple = ()            # gates part: BufferSig per gradient buffer


_LINEAR_SPECS: dict = {}


def linear_spec(template: str, **fields) -> LinearSpec:
    """The ``LinearSpec`` for these fields, one instance per distinct spec (its key is cached)."""
    memo = (template, *sorted(fields.items()))
    spec = _LINEAR_SPECS.get(memo)
    if spec is None:
        if len(_LINEAR_SPECS) > 4096:
            _LINEAR_SPECS.clear()
        spec = _LINEAR_SPECS[memo] = LinearSpec(template, **fields)
    return spec


@dataclass
class LinearPlan:
    """A checked ``linear_attention`` call: its kernels and geometry (``runtime.plan.plan_linear``)."""
    kernel: str                  # "chunked" or "decode"
    B: int
    Hq: int
    Hkv: int
    T: int
    Dk: int
    Dv: int
    dtype: torch.dtype
    device: torch.device
    scale: float
    chunk: int                   # positions per chunk (BLOCK_T) of the forward
    decay_traced: object         # TracedMod or None
    feature_traced: object       # TracedMod or None
    state: LinearSpec | None = None
    output: LinearSpec | None = None
    prefix: LinearSpec | None = None   # decay_form "prefix": the kernel writing G
    decode: LinearSpec | None = None
    common: dict = field(default_factory=dict, repr=False)    # spec fields every part shares
    tiles: dict = field(default_factory=dict, repr=False)     # plan_linear._linear_tiles
    backward: dict = field(default_factory=dict, repr=False)  # grad slots -> LinearBackward



@dataclass(frozen=True)
class LinearBackward:
    """The backward's kernels of a planned call (the states recomputed at its chunk size)."""
    grad: LinearSpec
    gates: LinearSpec | None     # None: no captured tensor of the decay_mod gets a gradient
    grad_slots: tuple
    state: LinearSpec            # the state kernel at ``chunk`` (forward and REVERSE)
    prefix: LinearSpec | None    # the prefix kernel at ``chunk`` (decay_form "prefix")
    chunk: int


# ---------------------------------------------------------------------------------- running

def _prefix(plan: LinearPlan, spec: LinearSpec | None, device, decay_buffers):
    """G [B, Hq, T] float32, the running sums of g within each chunk (the ``prefix`` kernel
    ``spec``), or None where the kernels compute G themselves."""
    if spec is None:
        return None
    gcum = torch.empty(plan.B, plan.Hq, plan.T, dtype=torch.float32, device=device)
    poison(gcum)
    launch.run(spec, device, dict(gcum=gcum, decay_buffers=decay_buffers))
    return gcum


def _states(plan: LinearPlan, spec: LinearSpec, x, y, gcum, decay_buffers, feature_buffers, *,
            reverse: bool, init, final):
    """The ``state`` kernel ``spec``: per-chunk states [B, Hq, chunks, Dk, Dv] in the inputs' dtype
    (S_in, or with ``reverse`` dS_out); ``final`` (float32 or None) gets the state after the last one."""
    chunks = -(-plan.T // spec.block_m)
    states = torch.empty(plan.B, plan.Hq, chunks, plan.Dk, plan.Dv, dtype=plan.dtype, device=x.device)
    poison(states)
    launch.run(spec, x.device, dict(
        x=x, y=y, states=states, init=init, final=final, gcum=gcum, decay_buffers=decay_buffers,
        feature_buffers=feature_buffers, scale=plan.scale, group=plan.Hq // plan.Hkv, reverse=reverse))
    return states


def run_linear(plan: LinearPlan, query, key, value, initial_state, decay_buffers, feature_buffers,
               want_state: bool):
    """(out [B, Hq, T, Dv] in the query's dtype, final state [B, Hq, Dk, Dv] float32 or None)."""
    device = query.device
    out = torch.empty(plan.B, plan.Hq, plan.T, plan.Dv, dtype=plan.dtype, device=device)
    final = None
    if want_state or plan.kernel == "decode":
        final = torch.empty(plan.B, plan.Hq, plan.Dk, plan.Dv, dtype=torch.float32, device=device)
    poison(out, final)
    if plan.kernel == "decode":
        launch.run(plan.decode, device, dict(
            q=query, k=key, v=value, out=out, state_in=initial_state, state_out=final, slots=None,
            decay_buffers=decay_buffers, feature_buffers=feature_buffers, scale=plan.scale))
        return out, final
    gcum = _prefix(plan, plan.prefix, device, decay_buffers)
    states = _states(plan, plan.state, key, value, gcum, decay_buffers, feature_buffers, reverse=False,
                     init=initial_state, final=final)
    launch.run(plan.output, device, dict(
        q=query, k=key, v=value, states=states, out=out, gcum=gcum, decay_buffers=decay_buffers,
        feature_buffers=feature_buffers, scale=plan.scale))
    return out, final


def run_linear_decode(plan: LinearPlan, query, key, value, state, slots, decay_buffers, feature_buffers):
    """out [B, Hq, T, Dv]; ``state`` [num_slots, Hq, Dk, Dv] float32 is updated in place at the
    rows ``slots`` (int32 [B])."""
    out = torch.empty(plan.B, plan.Hq, plan.T, plan.Dv, dtype=plan.dtype, device=query.device)
    poison(out)
    launch.run(plan.decode, query.device, dict(
        q=query, k=key, v=value, out=out, state_in=state, state_out=state, slots=slots,
        decay_buffers=decay_buffers, feature_buffers=feature_buffers, scale=plan.scale))
    return out


def run_linear_backward(plan: LinearPlan, bw: LinearBackward, query, key, value, initial_state, grad_out,
                        grad_state, decay_buffers, feature_buffers, needs_state: bool):
    """(dq, dk, dv, d initial state or None, gradients of the decay_mod's captured tensors in
    ``bw.grad_slots`` order). ``grad_out`` / ``grad_state`` may be None (no gradient there)."""
    device = query.device
    B, Hq, T = plan.B, plan.Hq, plan.T
    group = Hq // plan.Hkv
    if grad_out is None:
        grad_out = torch.zeros(B, Hq, T, plan.Dv, dtype=plan.dtype, device=device)
    gates = bw.gates is not None
    # The forward's states again (and the final state, for the gates' last term).
    final = None
    if gates and grad_state is not None:
        final = torch.empty(B, Hq, plan.Dk, plan.Dv, dtype=torch.float32, device=device)
    gcum = _prefix(plan, bw.prefix, device, decay_buffers)
    states = _states(plan, bw.state, key, value, gcum, decay_buffers, feature_buffers, reverse=False,
                     init=initial_state, final=final)
    d_init = torch.empty(B, Hq, plan.Dk, plan.Dv, dtype=torch.float32, device=device) \
        if needs_state else None
    poison(d_init)
    dstates = _states(plan, bw.state, query, grad_out, gcum, decay_buffers, feature_buffers, reverse=True,
                      init=None if grad_state is None else grad_state.contiguous(), final=d_init)
    dq = torch.empty(B, Hq, T, plan.Dk, dtype=plan.dtype, device=device)
    # dK / dV per query head: a GQA group's heads are summed below (in float32).
    per_head = plan.dtype if group == 1 else torch.float32
    dk = torch.empty(B, Hq, T, plan.Dk, dtype=per_head, device=device)
    dv = torch.empty(B, Hq, T, plan.Dv, dtype=per_head, device=device)
    dg = torch.empty(B, Hq, T, dtype=torch.float32, device=device) if gates else None
    poison(dq, dk, dv, dg)
    launch.run(bw.grad, device, dict(
        q=query, k=key, v=value, do=grad_out, states=states, dstates=dstates, dq=dq, dk=dk, dv=dv,
        dg=dg, gcum=gcum, decay_buffers=decay_buffers, feature_buffers=feature_buffers, scale=plan.scale))
    if group > 1:
        dk = dk.view(B, plan.Hkv, group, T, plan.Dk).sum(2).to(plan.dtype)
        dv = dv.view(B, plan.Hkv, group, T, plan.Dv).sum(2).to(plan.dtype)
    grads = []
    if gates:
        # dg_u = Σ_{t >= u} dG_t (G is the running sum of g), plus <S_T, dS_T> for every u:
        # dG is stored reversed (T - 1 - t), so its running sum is dg, reversed too.
        dg = dg.cumsum(-1)
        if final is not None:
            dg = dg + (final * grad_state.float()).sum((-1, -2))[..., None]
        grads = [torch.zeros(decay_buffers[i].shape, dtype=torch.float32, device=device)
                 for i in bw.grad_slots]
        launch.run(bw.gates, device, dict(dg=dg, decay_buffers=decay_buffers,
                                          grad_buffers=grads))
        grads = [g.to(decay_buffers[i].dtype) for g, i in zip(grads, bw.grad_slots)]
    return dq, dk, dv, d_init, grads


def clear_memos() -> None:
    _LINEAR_SPECS.clear()


__all__ = ["LinearSpec", "LinearPlan", "LinearBackward", "linear_spec", "run_linear",
           "run_linear_decode", "run_linear_backward"]
