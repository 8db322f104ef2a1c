"""Sigmoid attention: flex_attention's kernels with another activation.

``sigmoid_attention`` computes, for every query row i::

    out_i = Σ_j keep_ij · sigmoid(z_ij + bias) · v_j,    z = score_mod(q·kᵀ · scale)

Each weight stands alone: there is no running max, no row sum and no rescaling of
the accumulator, and a fully masked row is exactly 0. The forward (tl and, on sm_90,
Gluon), backward, decode and merge templates each have an ``activation`` switch (part of
the spec, so of its key); everything else — the traced score_mod and mask_mod, the
block-sparse loops over the block mask's lists, the GQA tiles, TMA, the tuning table,
AUTO's choice of the Gluon forward — is flex_attention's
(``flexgen.runtime.plan.plan_sigmoid``).

The backward, with p = sigmoid(z + bias) recomputed per tile (no LSE, nothing saved but
the inputs)::

    dV = Pᵀ dO        dZ = (dO Vᵀ) * p * (1 - p)        dS = dZ * dz/ds
    dQ = dS K * scale      dK = dSᵀ Q * scale      d buffer[i] = Σ dZ * dz/d buffer[i]

Unlike softmax there is no ``delta`` term (no weight depends on another row element), so
the dQ kernel does not have to run before the dK/dV kernel. The bias is a runtime
argument of every kernel: a new bias or a new length (its default -log(KV_LEN)) is not a
new compile.
"""
from __future__ import annotations

from .backward import run_backward
from .decode import constant, run_decode
from .forward import run_forward


def run_sigmoid(plan, query, key, value, score_buffers, mask_buffers, block_lists, bias: float):
    """out ``[B, Hq, Lq, Dv]`` (in the query's dtype and stride order) of a planned call."""
    device = query.device
    if plan.kernel == "decode":
        out, _ = run_decode(plan.decode, query, key, value, score_buffers, mask_buffers,
                            block_lists[:4] if block_lists else None, constant(plan.Lkv, device),
                            constant(0, device), constant(plan.Lq, device), None, plan.scale,
                            plan.Lkv, out_strides=plan.out_strides, bias=bias)
        return out
    return run_forward(plan, query, key, value, score_buffers, mask_buffers, block_lists, bias=bias)[0]


def run_sigmoid_backward(bw, plan, query, key, value, grad_out, score_buffers, mask_buffers,
                         block_lists, bias: float, needs_kv: bool = True):
    """(dq, dk, dv, buffer gradients) of one call: ``flexgen.kernels.backward.run_backward``
    with the sigmoid kernels (no output, LSE or delta to read)."""
    return run_backward(bw, plan, query, key, value, None, None, grad_out, None, score_buffers,
                        mask_buffers, block_lists, needs_kv, bias=bias)


__all__ = ["run_sigmoid", "run_sigmoid_backward"]
