"""Document masking for packed sequences: a token sees only its own document.

Several documents packed into one sequence must not attend across their
boundaries. Given each token's document id, the mask keeps ``(q, kv)`` when
both tokens belong to the same document: square blocks on the diagonal, one
per document. Combine with ``causal_mask`` via ``and_masks`` for packed
causal LM training (triangles inside the blocks)::

    document_mask(ids), ids = [0, 0, 1, 1, 1, 2]

    █ █ · · · ·
    █ █ · · · ·
    · · █ █ █ ·
    · · █ █ █ ·
    · · █ █ █ ·
    · · · · · █
"""
from __future__ import annotations

import torch

from flexgen.errors import expected

from ._check import int_tensor, nonnegative_int


def document_mask(doc_ids, kv_doc_ids=None):
    """mask_mod keeping ``doc_ids[b, q_idx] == kv_doc_ids[b, kv_idx]``.

    ``doc_ids`` is an integer tensor ``[B, L]`` (one row per sequence) or
    ``[L]`` (shared by the batch); any integer ids work, the mask only
    compares them. ``kv_doc_ids`` (same rank, defaults to ``doc_ids``) gives
    the keys' ids when queries and keys differ (packed cross-attention).
    Sequence lengths must not exceed the tensors' last dimension.
    """
    fix = "pass an integer tensor [B, L] or [L] of document ids (doc_ids_from_lengths builds one)"
    q_ids = int_tensor("doc_ids", doc_ids, (1, 2), fix, min_value=None)
    kv_ids = q_ids if kv_doc_ids is None else int_tensor("kv_doc_ids", kv_doc_ids, (1, 2), fix,
                                                         min_value=None)
    if kv_ids.dim() != q_ids.dim() or (q_ids.dim() == 2 and kv_ids.shape[0] != q_ids.shape[0]):
        raise expected("kv_doc_ids", f"the same rank and batch size as doc_ids {list(q_ids.shape)}",
                       f"shape {list(kv_ids.shape)}", "give both as [B, L] or both as [L]")

    if q_ids.dim() == 1:
        def shared_document_mask(b, h, q_idx, kv_idx):
            return q_ids[q_idx] == kv_ids[kv_idx]
        return shared_document_mask

    def batched_document_mask(b, h, q_idx, kv_idx):
        return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    return batched_document_mask


def doc_ids_from_lengths(lengths, total_length=None, device=None):
    """Document ids ``[L]`` (int32) for documents of the given lengths, packed in order.

    ``lengths`` is a sequence (or 1-D tensor) of document lengths >= 0, e.g.
    ``[2, 3, 1]`` -> ``[0, 0, 1, 1, 1, 2]``. With ``total_length`` larger than
    ``sum(lengths)`` the tail (padding) gets the next id, so padding tokens
    form one more document of their own instead of joining a real one.
    """
    fix = "pass a non-empty list of document lengths, e.g. [512, 300, 212]"
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist() if lengths.dim() == 1 else lengths
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise expected("lengths", "a non-empty sequence of ints", repr(lengths), fix)
    lengths = [nonnegative_int(f"lengths[{i}]", n, fix) for i, n in enumerate(lengths)]
    used = sum(lengths)
    if total_length is not None:
        total_length = nonnegative_int("total_length", total_length, "pass an int >= sum(lengths)")
        if total_length < used:
            raise expected("total_length", f">= sum(lengths) = {used}", total_length,
                           "pass the padded sequence length, or leave it None")
        if total_length > used:
            lengths = lengths + [total_length - used]
    counts = torch.tensor(lengths, dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), counts)
    return ids.to(device=device, dtype=torch.int32)


def doc_ids_from_offsets(offsets, device=None):
    """Document ids ``[offsets[-1]]`` (int32) from cumulative offsets (``cu_seqlens``).

    ``offsets`` starts at 0 and never decreases, one more entry than there
    are documents: ``[0, 2, 5, 6]`` -> ``[0, 0, 1, 1, 1, 2]``.
    """
    fix = "pass cumulative document boundaries starting at 0, e.g. [0, 512, 812, 1024]"
    if isinstance(offsets, torch.Tensor):
        offsets = offsets.tolist() if offsets.dim() == 1 else offsets
    if not isinstance(offsets, (list, tuple)) or len(offsets) < 2:
        raise expected("offsets", "a sequence of at least 2 ints", repr(offsets), fix)
    offsets = [nonnegative_int(f"offsets[{i}]", o, fix) for i, o in enumerate(offsets)]
    if offsets[0] != 0:
        raise expected("offsets[0]", "0", offsets[0], fix)
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if min(lengths) < 0:
        raise expected("offsets", "non-decreasing values", offsets, fix)
    return doc_ids_from_lengths(lengths, device=device)
