"""Captured tensors indexed out of bounds: an error like torch's, on the host where it can be.

``flexgen.frontend.bounds_check`` checks every index that depends on positions
only, before launch, over the call's ranges; indices that depend on loaded data
read 0 past the end.
"""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen import create_block_mask, flex_attention
from flexgen.frontend import bounds_check
from flexgen.frontend.bounds_check import IndexBoundsError, check_indices
from flexgen.frontend.lowering import lower
from flexgen.frontend.trace import trace
from flexgen.kernels.decode import decode_attention
from flexgen.reference import flex_attention_reference
from conftest import run_and_check

OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32}


def _qkv(L, Lkv=None, B=1, H=2):
    return (torch.randn(B, H, n, 16) for n in (L, Lkv or L, Lkv or L))


def test_reads_past_a_short_tensor_raise_like_torch():
    """bias[q_idx] with a bias shorter than the queries read 0 past its end; torch raises."""
    bias = torch.randn(30)

    def query_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    q, k, v = _qkv(40)
    with pytest.raises(IndexError):
        flex_attention_reference(q, k, v, query_bias)
    with pytest.raises(IndexBoundsError) as info:
        flex_attention(q, k, v, score_mod=query_bias)
    message = str(info.value)
    for words in ("score_mod 'query_bias'", "captured tensor 0 (shape [30])", "dim 0", "`q_idx`",
                  "from 0 to 39", "q_idx in [0, 40)", "-30..29", "Fix:"):
        assert words in message, (words, message)
    assert isinstance(info.value, flexgen.FlexgenError)
    q, k, v = _qkv(30)
    run_and_check(q, k, v, query_bias, kernel_options=OPTIONS)      # long enough: runs


def test_negative_indices_wrap_like_torch():
    bias = torch.randn(40)

    def from_the_end(score, b, h, q_idx, kv_idx):
        return score + bias[-1 - kv_idx]

    q, k, v = _qkv(40)
    run_and_check(q, k, v, from_the_end, kernel_options=OPTIONS)    # -40 .. -1: valid
    q, k, v = _qkv(20, 41)
    with pytest.raises(IndexError):
        flex_attention_reference(q, k, v, from_the_end)
    with pytest.raises(IndexBoundsError, match="from -41 to -1"):
        flex_attention(q, k, v, score_mod=from_the_end)


def test_every_dimension_and_position_is_checked():
    table = torch.randn(2, 50)

    def per_head(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 20]

    q, k, v = _qkv(30, H=2)
    run_and_check(q, k, v, per_head, kernel_options=OPTIONS)         # -9 .. 49
    q, k, v = _qkv(30, H=3)
    with pytest.raises(IndexBoundsError, match="along dim 0: the index `h` takes values from 0 to 2"):
        flex_attention(q, k, v, score_mod=per_head)
    q, k, v = _qkv(31, H=2)
    with pytest.raises(IndexBoundsError, match="along dim 1"):
        flex_attention(q, k, v, score_mod=per_head)


def test_loose_interval_bounds_raise_nothing_torch_accepts():
    """q * kv // (kv + 1) <= q - 1: its interval bound reaches (Q-1)(KV-1), a real position never does."""
    bias = torch.randn(39)

    def ratio(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx * kv_idx) // (kv_idx + 1)]

    q, k, v = _qkv(40)
    run_and_check(q, k, v, ratio, kernel_options=OPTIONS)


def test_mask_mods_are_checked_in_create_block_mask_and_the_call():
    doc = torch.zeros(40, dtype=torch.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    mask = create_block_mask(same_doc, 1, 1, 40, 40, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(IndexBoundsError, match="mask_mod 'same_doc'.*shape \\[40\\]"):
        create_block_mask(same_doc, 1, 1, 41, 41, device="cpu", BLOCK_SIZE=32)
    q, k, v = _qkv(40)
    run_and_check(q, k, v, block_mask=mask, kernel_options=OPTIONS)


def test_decode_checks_the_positions_of_its_longest_sequence():
    bias = torch.randn(30)

    def query_bias(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx]

    q, k = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 40, 16)
    decode_attention(q, k, k, score_mod=query_bias, kv_lengths=[30, 20])      # queries at 26..29
    with pytest.raises(IndexBoundsError, match="from 36 to 39"):
        decode_attention(q, k, k, score_mod=query_bias, kv_lengths=[30, 40])  # 36..39
    decode_attention(q, k, k, score_mod=query_bias, q_offsets=0)
    with pytest.raises(IndexBoundsError):
        decode_attention(q, k, k, score_mod=query_bias, q_offsets=[0, 27])
    with pytest.raises(IndexBoundsError):   # flex_attention's decode path: queries 0..3 of 40 keys
        flex_attention(q, k, k, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[kv_idx])


def test_check_indices_is_a_pure_memoized_function_of_shapes_and_ranges():
    bias = torch.randn(30)
    lowered = lower(trace(lambda s, b, h, q_idx, kv_idx: s + bias[q_idx + kv_idx], "score_mod"))
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 15, 16)
    with pytest.raises(IndexBoundsError):
        check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 16, 16)
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, (10, 20), 10)   # 10 .. 28
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, None, 100)      # unknown q: not checked
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 0, 100)         # no positions
    hits = check_indices.cache_info().hits
    check_indices(lowered, "score_mod", "m", ((30,),), 1, 1, 15, 16)
    assert check_indices.cache_info().hits == hits + 1
    assert bounds_check.decode_ranges((2, 4, 3), None, None, [10, 50], 50) == [((1, 2), 4, (47, 50), 50),
                                                                                ((0, 1), 4, (7, 10), 10)]


def test_reads_that_depend_on_data_give_zero_past_the_end_without_debug_mode():
    """Not checkable on the host without reading the tensors: documented (README), pinned here."""
    bias = torch.randn(30)
    doc = torch.arange(40, dtype=torch.int32)        # 30..39 index past bias's end

    def doc_bias(score, b, h, q_idx, kv_idx):
        return score + bias[doc[q_idx]]

    padded = torch.cat([bias, torch.zeros(10)])

    def padded_bias(score, b, h, q_idx, kv_idx):
        return score + padded[doc[q_idx]]

    q, k, v = _qkv(40)
    out = flex_attention(q, k, v, score_mod=doc_bias, kernel_options=OPTIONS)
    torch.testing.assert_close(out.double(), flex_attention_reference(q, k, v, padded_bias),
                               atol=1e-4, rtol=1e-4)
