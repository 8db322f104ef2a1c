"""The planner's input checks: the query, key and value of an attention call, its block mask
(``Mask``, as the planner sees it), the mods' captured tensors and varlen's packed tensors
and offsets. Each raises ``InputError`` naming the argument, what was expected, what was
given and the fix (``flexgen.runtime.plan`` runs them before it plans)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import expected
from ..frontend.trace import TracedMod
from .checks import check_buffers, check_heads, check_tensor


@dataclass(frozen=True)
class Mask:
    """A call's block mask as the planner sees it: the block size, the lengths it was
    built for, and its lists' leading dims (B', H': 1 where it broadcasts)."""
    block_size: tuple            # (Q_BLOCK, KV_BLOCK)
    lengths: tuple               # (Q_LEN, KV_LEN) it was built for
    batch: int
    heads: int
    q_blocks: int                # NQ of the kv lists
    kv_blocks: int               # NKV of the kv lists


def check_same_kind(query, key, value, *layout) -> None:
    """Three attention inputs, each a tensor (of ``layout``, check_tensor's), of one dtype on one device."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t, *layout)
    if not (query.dtype == key.dtype == value.dtype):
        raise expected("key/value", f"the query's dtype {query.dtype}",
                       f"key {key.dtype}, value {value.dtype}", "convert all three to one dtype")
    if not (query.device == key.device == value.device):
        raise expected("key/value", f"the query's device {query.device}",
                       f"key on {key.device}, value on {value.device}", "move all three to one device")


def check_qkv(query, key, value, enable_gqa, block_batch: int | None) -> None:
    """query [B, Hq, Lq, D], key [B or 1, Hkv, Lkv, D], value [B or 1, Hkv, Lkv, Dv]."""
    check_same_kind(query, key, value)
    B, Hq, _, D = query.shape
    if key.shape[0] != value.shape[0] or key.shape[0] not in (1, B):
        raise expected("key/value batch", f"batch {B} like query (or 1, shared by every query row)",
                       f"{key.shape[0]} and {value.shape[0]}",
                       "give query, key and value the same batch size")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise expected("value", f"the key's heads and length {tuple(key.shape[1:3])}",
                       tuple(value.shape[1:3]), "key and value must come from the same positions")
    if key.shape[3] != D:
        raise expected("key.shape[-1]", f"the query's head dim {D}", key.shape[3],
                       "query and key need the same head dim (value's may differ)")
    check_heads(Hq, key.shape[1], enable_gqa)


def check_mask(info: Mask | None, mask: object, B: int, Hq: int, Lq: int, Lkv: int) -> None:
    """The block mask fits the call: its lengths, batch and heads (torch's rules)."""
    if info is None:
        return
    mQ, mKV = info.lengths
    if (mQ, mKV) != (Lq, Lkv):
        bigger = mQ >= Lq and mKV >= Lkv
        raise expected("block_mask", f"a mask for Q_LEN={Lq}, KV_LEN={Lkv}",
                       f"one for Q_LEN={mQ}, KV_LEN={mKV}",
                       "crop it with block_mask._adjust(q_len, kv_len) (its upper left corner: right "
                       "for causal-like masks, not for every mask_mod) or build a new one with "
                       f"create_block_mask(mask_mod, B, H, {Lq}, {Lkv})" if bigger else
                       f"create_block_mask(mask_mod, B, H, {Lq}, {Lkv})")
    q_block, kv_block = info.block_size
    if info.q_blocks < -(-Lq // q_block) or info.kv_blocks < -(-Lkv // kv_block):
        raise expected("block_mask", f"lists covering {-(-Lq // q_block)} query blocks and "
                       f"{-(-Lkv // kv_block)} kv blocks of {info.block_size}",
                       f"[{info.q_blocks}, {info.kv_blocks}]", "build the mask for these lengths")
    if info.batch not in (1, B) or info.heads not in (1, Hq):
        raise expected("block_mask", f"batch 1 or {B} and heads 1 or {Hq}",
                       f"batch {info.batch}, heads {info.heads}",
                       "create the mask with B and H of the query (or None to broadcast)")
    if mask is not None:
        # A mask built once for every head (H=None) whose mod reads h was classified with
        # h = 0: other heads would get head 0's blocks. Refuse it rather than guess.
        free = mask.free
        for index, size, mine, arg in (("b", info.batch, B, "B"), ("h", info.heads, Hq, "H")):
            if index in free and size == 1 and mine > 1:
                raise expected("block_mask", f"a mask built per {'batch row' if index == 'b' else 'head'} "
                               f"(its mask_mod reads {index})", f"one built with {arg}=None (broadcast)",
                               f"create_block_mask(mask_mod, B, H, ...) with {arg}={mine}")


def check_captured(traced: TracedMod, device) -> None:
    """Captured tensors are on the query's device (0-d CPU tensors too are moved by the op)."""
    check_buffers(traced, device)


def check_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k) -> None:
    """query [total_q, Hq, D], key / value [total_k, Hkv, D(v)], offsets int32 [num_seqs + 1]
    on the query's device (their values are not read: no host synchronization)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise expected(name, "a 3-D tensor [total_tokens, H, D] (sequences packed along dim 0)",
                           got, "pack the sequences with torch.cat along the token dim")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            got = (f"{t.dtype} shape {list(t.shape)}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise expected(name, "a 1-D int32 tensor [num_seqs + 1] of start offsets", got,
                           f"pass torch.tensor([0, len0, len0 + len1, ...], dtype=torch.int32)")
        if t.shape[0] < 2:
            raise expected(name, "at least two offsets (one sequence)", list(t.shape),
                           "start with 0 and end with the total token count")
        if t.device != query.device:
            raise expected(name, f"a tensor on the query's device {query.device}", t.device,
                           f"{name}.to('{query.device}')")
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise expected("cu_seqlens_k", f"{cu_seqlens_q.shape[0]} offsets like cu_seqlens_q",
                       cu_seqlens_k.shape[0], "give one query and one key range per sequence")
