"""Sigmoid attention: flex_attention's kernels with another activation.

``sigmoid_attention`` computes, for every query row i::

    out_i = Σ_j keep_ij · sigmoid(z_ij + bias) · v_j,    z = score_mod(q·kᵀ · scale)

Each weight stands alone: there is no running max, no row sum and no rescaling of
the accumulator, and a fully masked row is exactly 0. The forward, backward,
decode and merge templates each have an ``activation`` switch (part of the spec,
so of its key); everything else — the traced score_mod and mask_mod, the block-sparse
loops over the block mask's lists, the GQA tiles, TMA, the tuning table — is
flex_attention's (``flexgen.runtime.plan.plan_sigmoid``).

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

import torch

from ..codegen.spec import tma_addressable
from ..runtime import launch
from ..runtime.poison import poison
from .backward import run_backward
from .decode import constant, run_decode
from .forward import replay_key, broadcast_lists, remember, replay


def run_sigmoid(plan, query, key, value, score_buffers, mask_buffers, block_lists, bias: float):
    """out ``[B, Hq, Lq, Dv]`` (in the query's dtype and stride order) of a planned call."""
    device = query.device
    if plan.kernel == "decode":
        out, _ = run_decode(plan.decode, query, key, value, score_buffers, mask_buffers,
                            block_lists[:4] if block_lists else None, constant(plan.Lkv, device),
                            constant(0, device), constant(plan.Lq, device), None, plan.scale,
                            plan.Lkv, out_strides=plan.out_strides, bias=bias)
        return out
    B, Hq, Lq = plan.B, plan.Hq, plan.Lq
    if key.shape[0] != B:                     # key / value shared by every query row
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    out = torch.empty_strided((B, Hq, Lq, plan.Dv), plan.out_strides, dtype=plan.dtype, device=device)
    poison(out)
    sparse = None
    if plan.mask_info is not None:
        sparse = (*broadcast_lists(block_lists[:4], B, Hq), *plan.mask_info.block_size)
    spec = plan.spec
    if spec.use_tma and not all(map(tma_addressable, (query, key, value, out))):
        spec = plan.pointer_spec
    # A repeated call relaunches with its new Q, K, V and OUT (the bias too is the launch's).
    others = replay_key(score_buffers, mask_buffers, block_lists, bias)
    if replay(plan, spec, others, (query, key, value, out)):
        return out
    launched = launch.run(spec, device, dict(
        q=query, k=key, v=value, out=out, lse=None, sparse=sparse, score_buffers=score_buffers,
        mask_buffers=mask_buffers, scale=plan.scale, bias=bias), tune_blocks=plan.tune_blocks, replay=4)
    remember(plan, spec, others, launched)
    return out


def run_sigmoid_backward(bw, plan, query, key, value, grad_out, score_buffers, mask_buffers,
                         block_lists, bias: float, needs_kv: bool = True):
    """(dq, dk, dv, buffer gradients) of one call: ``flexgen.kernels.backward.run_backward``
    with the sigmoid kernels (no output, LSE or delta to read)."""
    return run_backward(bw, plan, query, key, value, None, None, grad_out, None, score_buffers,
                        mask_buffers, block_lists, needs_kv, bias=bias)


__all__ = ["run_sigmoid", "run_sigmoid_backward"]
