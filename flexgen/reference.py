"""The oracle: attention with score_mod / mask_mod computed in plain torch.

It materializes the whole ``[B, H, Lq, Lkv]`` score matrix, so it is for tests
and small inputs only. It evaluates the mods exactly as torch's
FlexAttention defines them: once per element, through ``torch.func.vmap`` over
0-d int32 indices and the float score, in any dtype (``dtype=torch.float64`` in
the tests). Calling a mod once on broadcast index grids would be faster, but it
gives another answer for chained or partial indexing of a captured tensor
(``intervals[i][0]`` takes row 0 of a grid rather than column 0 of one row).
"""
from __future__ import annotations

import math

import torch


def index_grids(B: int, H: int, Q_LEN: int, KV_LEN: int, device) -> tuple:
    """int32 index tensors broadcastable to ``[B, H, Q_LEN, KV_LEN]``."""
    def ar(n, dims):
        shape = [1, 1, 1, 1]
        shape[dims] = n
        return torch.arange(n, device=device, dtype=torch.int32).view(shape)

    return ar(B, 0), ar(H, 1), ar(Q_LEN, 2), ar(KV_LEN, 3)


def per_element(mod, B: int, H: int, Q_LEN: int, KV_LEN: int, device, score=None) -> torch.Tensor:
    """``mod`` at every (b, h, q_idx, kv_idx), ``[B, H, Q_LEN, KV_LEN]``: a mask_mod, or with
    ``score`` (``[B, H, Q_LEN, KV_LEN]``) a score_mod. Each call sees 0-d values, as in torch."""
    def one(*args):
        out = mod(*args)
        # A mod may return a Python number (a constant mask); vmap wants tensors.
        return out if isinstance(out, torch.Tensor) else torch.tensor(out, device=device)

    mapped = one
    lead = () if score is None else (0,)
    for axis in (3, 2, 1, 0):              # kv_idx innermost, b outermost
        dims = [None] * 4
        dims[axis] = 0
        mapped = torch.func.vmap(mapped, in_dims=lead + tuple(dims))
    indices = [torch.arange(n, device=device, dtype=torch.int32) for n in (B, H, Q_LEN, KV_LEN)]
    return mapped(*(() if score is None else (score,)), *indices)


def dense_mask(mask_mod, B: int, H: int, Q_LEN: int, KV_LEN: int, device="cpu") -> torch.Tensor:
    """``mask_mod`` evaluated on every position: bool ``[B, H, Q_LEN, KV_LEN]``."""
    if mask_mod is None:
        return torch.ones(B, H, Q_LEN, KV_LEN, dtype=torch.bool, device=device)
    return per_element(mask_mod, B, H, Q_LEN, KV_LEN, device).to(torch.bool)


def flex_attention_reference(query, key, value, score_mod=None, mask_mod=None, scale=None,
                             enable_gqa=False, return_lse=False, dtype=torch.float64):
    """``softmax(mask(score_mod(Q Kᵀ · scale))) V`` computed densely in ``dtype``.

    query ``[B, Hq, Lq, D]``, key ``[B, Hkv, Lkv, D]``, value ``[B, Hkv, Lkv, Dv]``.
    ``mask_mod`` may also be a ``BlockMask`` (its mask_mod is used; its block
    lists are not: the oracle does not trust them). Rows where every position
    is masked give zeros and an LSE of ``-inf``. Returns ``out`` in ``dtype``
    (and the natural-log LSE ``[B, Hq, Lq]`` when ``return_lse``).
    """
    if mask_mod is not None and hasattr(mask_mod, "mask_mod") and hasattr(mask_mod, "kv_indices"):
        mask_mod = mask_mod.mask_mod
    B, Hq, Lq, D = query.shape
    Hkv, Lkv = key.shape[1], key.shape[2]
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError("query and key head counts differ; pass enable_gqa=True")
        group = Hq // Hkv
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        scores = per_element(score_mod, B, Hq, Lq, Lkv, query.device, scores).to(dtype)
    if mask_mod is not None:
        keep = dense_mask(mask_mod, B, Hq, Lq, Lkv, query.device)
        scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(score - lse) is 0 for masked positions; a fully masked row has lse=-inf,
    # which would give NaN, so those rows are zeroed explicitly.
    dead = torch.isneginf(lse)
    probs = torch.exp(scores - lse.masked_fill(dead, 0.0)[..., None])
    probs = probs.masked_fill(dead[..., None], 0.0)
    out = probs @ v
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------- beyond softmax

def sigmoid_attention_reference(query, key, value, score_mod=None, mask_mod=None, scale=None,
                                bias=None, enable_gqa=False, dtype=torch.float64):
    """``Σ_j keep_ij · sigmoid(score_mod(q·k · scale) + bias) · v_j`` computed densely in ``dtype``.

    Shapes as ``flex_attention_reference``; ``bias`` defaults to ``-log(Lkv)``. No row
    normalization: a fully masked row is exactly zero. ``mask_mod`` may be a ``BlockMask``.
    """
    if mask_mod is not None and hasattr(mask_mod, "mask_mod") and hasattr(mask_mod, "kv_indices"):
        mask_mod = mask_mod.mask_mod
    B, Hq, Lq, D = query.shape
    Hkv, Lkv = key.shape[1], key.shape[2]
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError("query and key head counts differ; pass enable_gqa=True")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    bias = -math.log(Lkv) if bias is None else bias
    scores = (q @ k.transpose(-1, -2)) * scale
    b, h, qi, kvi = index_grids(B, Hq, Lq, Lkv, query.device)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, kvi)
        scores = torch.as_tensor(scores, device=query.device).to(dtype).expand(B, Hq, Lq, Lkv)
    weights = torch.sigmoid(scores + bias)
    if mask_mod is not None:
        keep = dense_mask(mask_mod, B, Hq, Lq, Lkv, query.device)
        weights = weights.masked_fill(~keep, 0.0)
    return weights @ v


def decay_values(decay_mod, B: int, H: int, T: int, device, dtype=torch.float64) -> torch.Tensor:
    """``decay_mod(b, h, t)`` on every (batch row, query head, position): ``[B, H, T]`` in ``dtype``
    (zeros for None)."""
    if decay_mod is None:
        return torch.zeros(B, H, T, dtype=dtype, device=device)
    ar = lambda n, dim: torch.arange(n, device=device, dtype=torch.int32).view(  # noqa: E731
        [n if d == dim else 1 for d in range(3)])
    g = decay_mod(ar(B, 0), ar(H, 1), ar(T, 2))
    return torch.as_tensor(g, device=device).to(dtype).expand(B, H, T)


def linear_attention_reference(query, key, value, decay_mod=None, feature_map=None, scale=None,
                               initial_state=None, output_final_state=False, enable_gqa=False,
                               dtype=torch.float64):
    """Decayed causal linear attention, one position at a time, in ``dtype``.

    ``S_t = exp(g_t) S_{t-1} + φ(k_t)ᵀ v_t`` and ``o_t = scale · φ(q_t) S_t`` with
    ``g_t = decay_mod(b, h, t)`` (0 for None), ``φ = feature_map`` (identity for None),
    ``scale`` 1/sqrt(Dk) by default. query ``[B, Hq, T, Dk]``, key ``[B, Hkv, T, Dk]``, value
    ``[B, Hkv, T, Dv]``, ``initial_state`` ``[B, Hq, Dk, Dv]`` (zeros for None). Differentiable
    (the tests take torch autograd through it). Returns ``out`` ``[B, Hq, T, Dv]`` in ``dtype``,
    and the final state ``[B, Hq, Dk, Dv]`` with ``output_final_state``.
    """
    B, Hq, T, Dk = query.shape
    Hkv, Dv = key.shape[1], value.shape[3]
    q, k, v = (t.to(dtype) for t in (query, key, value))
    if Hq != Hkv:
        if not enable_gqa:
            raise ValueError("query and key head counts differ; pass enable_gqa=True")
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    if feature_map is not None:
        q, k = feature_map(q), feature_map(k)
    scale = 1.0 / math.sqrt(Dk) if scale is None else scale
    g = decay_values(decay_mod, B, Hq, T, query.device, dtype)
    state = (torch.zeros(B, Hq, Dk, Dv, dtype=dtype, device=query.device) if initial_state is None
             else initial_state.to(dtype))
    outs = []
    for t in range(T):
        state = torch.exp(g[..., t])[..., None, None] * state + k[..., t, :, None] * v[..., t, None, :]
        outs.append(scale * (q[..., t, None, :] @ state)[..., 0, :])
    out = torch.stack(outs, 2) if outs else q.new_zeros(B, Hq, 0, Dv)
    return (out, state) if output_final_state else out
