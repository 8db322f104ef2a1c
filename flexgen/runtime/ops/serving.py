"""The serving ops: ``decode`` (a few queries against a contiguous or paged cache) and the
paged cache's ``paged_write`` / ``paged_write_rope`` (see ``flexgen.runtime.ops``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...kernels.decode import run_decode
from ..plan import plan_decode_call
from . import _eager, _on_device
from .define import op

# ---------------------------------------------------------------------------------- decode

@op("decode")
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
        from ...kernels.decode import packed_view
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

@op("paged_write", mutates_args=("k_cache", "v_cache"))
def paged_write(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, page_table: Tensor,
                slots: Tensor, lengths: Tensor, counts: Tensor) -> None:
    """Write the first ``counts[b]`` keys / values of row ``b`` at positions ``lengths[slots[b]]``
    onwards of sequence ``slots[b]``, through its page table row (``flexgen.kernels.paged``)."""
    from ...kernels.paged import run_paged_write
    run_paged_write(k_cache, v_cache, key, value, page_table, slots, lengths, counts)


@paged_write.register_fake
def _paged_write_fake(k_cache, v_cache, key, value, page_table, slots, lengths, counts):
    return None


def call_paged_write(*args) -> None:
    """``paged_write``, straight to its implementation where nothing needs the op (``_eager``)."""
    if _eager(*args):
        from ...kernels.paged import run_paged_write
        return run_paged_write(*args)
    return torch.ops.flexgen.paged_write(*args)


@op("paged_write_rope", mutates_args=("k_cache", "v_cache"))
def paged_write_rope(k_cache: Tensor, v_cache: Tensor, key: Tensor, value: Tensor, page_table: Tensor,
                     slots: Tensor, lengths: Tensor, counts: Tensor, inv_freq: Tensor, rotary_dim: int,
                     interleaved: bool, query: Tensor | None) -> Tensor:
    """``paged_write`` with RoPE: the keys rotated at their positions on the way in
    (``flexgen.kernels.rope``); returns ``query`` rotated the same way (or an empty tensor)."""
    from ...kernels.paged import run_paged_write
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
        from ...kernels.paged import run_paged_write
        return run_paged_write(*args)
    return torch.ops.flexgen.paged_write_rope(*args)
