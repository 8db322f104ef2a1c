"""Every mod in flexgen.mods, run through the generated kernel, against the float64 oracle.

Each case builds a ``BlockMask`` with ``create_block_mask`` (sparse blocks of
64 or 128), runs ``flexgen.flex_attention`` on CPU tensors (the Triton
interpreter) with GQA (4 query heads over 2 KV heads unless a case says
otherwise) at odd lengths (77, 150), and compares the output and the LSE
with ``flexgen.reference.flex_attention_reference`` computed in float64 from
the same inputs. float32 for most cases, bfloat16 (and one float16) for a few.
Outputs are poisoned with NaN before each launch, so a position the kernel
fails to write fails the comparison. Each block mask is also checked
against the dense mask: no kept position in a skipped block, no masked one
in a block marked full. A last test makes sure no mod of flexgen.mods is
left without a case.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from flexgen import create_block_mask, flex_attention
from flexgen import mods as M
from flexgen.reference import dense_mask, flex_attention_reference

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

# tests/conftest.py sets FLEXGEN_POISON=1 (NaN-filled outputs) and a private kernel cache.


@dataclass
class Case:
    id: str
    covers: tuple                 # names from flexgen.mods.__all__ this case exercises
    mask: object = None           # mask_mod, or None for no block mask
    score: object = None          # score_mod or None
    L: int = 77                   # Q_LEN (and KV_LEN unless Lkv is given)
    Lkv: int | None = None
    B: int = 1
    Hq: int = 4
    Hkv: int = 2
    D: int = 32
    Dv: int | None = None
    dtype: torch.dtype = torch.float32
    block: int = 64               # create_block_mask's BLOCK_SIZE
    mask_B: int | None = None     # create_block_mask's B (None: broadcast over the batch)
    mask_H: int | None = None     # create_block_mask's H (None: broadcast over the heads)
    q_scale: float = 1.0          # multiplies q, to push scores into a mod's interesting range
    scale: float | None = None


def _gen(seed):
    return torch.Generator().manual_seed(seed)


DOC_77 = M.doc_ids_from_lengths([30, 17, 30])
DOC_150_B2 = torch.stack([M.doc_ids_from_offsets([0, 20, 64, 65, 150]),
                          M.doc_ids_from_lengths([100, 30], total_length=150)])
Q_DOC = M.doc_ids_from_lengths([10, 40, 27])                     # 77 queries
KV_DOC = M.doc_ids_from_lengths([30, 60, 60])                    # 150 keys, same 3 documents
REL_TABLE = torch.randn(4, 2 * 150 - 1, generator=_gen(1))
REL_TABLE_1D = torch.randn(2 * 77 - 1, generator=_gen(2))
T5_TABLE = torch.randn(4, 32, generator=_gen(3))
T5_TABLE_1D = torch.randn(16, generator=_gen(4))
SLOPES = torch.tensor([0.5, -0.25, 0.125, 1.0])


def every_other_head_causal(b, h, q_idx, kv_idx):
    """A head-dependent mask: even heads bidirectional, odd heads causal."""
    return (h % 2 == 0) | (kv_idx <= q_idx)


CASES = [
    # --- mask mods --------------------------------------------------------------------------
    Case("causal_mask_bf16", ("causal_mask",), mask=M.causal_mask, L=150, D=64,
         dtype=torch.bfloat16),
    Case("causal_offset_5", ("causal",), mask=M.causal(5)),
    Case("causal_offset_-3_empty_rows", ("causal",), mask=M.causal(-3)),
    Case("causal_tensor_offset_block128", ("causal",), mask=M.causal(torch.tensor(9)), L=150,
         block=128),
    Case("causal_lower_right_77x150", ("causal_lower_right",), mask=M.causal_lower_right(77, 150),
         L=77, Lkv=150),
    Case("causal_lower_right_150x77", ("causal_lower_right",), mask=M.causal_lower_right(150, 77),
         L=150, Lkv=77),
    Case("sliding_window_40_fp16", ("sliding_window",), mask=M.sliding_window(40), L=150,
         dtype=torch.float16),
    Case("sliding_window_24_two_sided_bf16", ("sliding_window",),
         mask=M.sliding_window(24, causal=False), L=150, dtype=torch.bfloat16),
    Case("prefix_lm_50", ("prefix_lm",), mask=M.prefix_lm(50), L=150),
    Case("prefix_lm_per_batch", ("prefix_lm",), mask=M.prefix_lm(torch.tensor([30, 100])), L=150,
         B=2, mask_B=2),
    Case("document_1d", ("document_mask", "doc_ids_from_lengths"), mask=M.document_mask(DOC_77)),
    Case("document_2d_bf16", ("document_mask", "doc_ids_from_offsets"),
         mask=M.document_mask(DOC_150_B2), L=150, B=2, mask_B=2, dtype=torch.bfloat16),
    Case("document_cross_77x150", ("document_mask",), mask=M.document_mask(Q_DOC, KV_DOC),
         L=77, Lkv=150),
    Case("attention_sinks_4_32", ("attention_sinks",), mask=M.attention_sinks(4, 32), L=150),
    Case("chunked_local_48", ("chunked_local",), mask=M.chunked_local(48), L=150),
    Case("dilated_5_3", ("dilated_sliding_window",), mask=M.dilated_sliding_window(5, 3)),
    Case("neighborhood_10x15_k5x3", ("neighborhood_2d",), mask=M.neighborhood_2d(10, 15, 5, 3),
         L=150),
    Case("neighborhood_7x11_k3x5_unclamped", ("neighborhood_2d",),
         mask=M.neighborhood_2d(7, 11, 3, 5, clamp_at_border=False)),
    Case("block_causal_20_block128", ("block_causal",), mask=M.block_causal(20), L=150, block=128),
    Case("kv_padding_77x150", ("kv_padding",), mask=M.kv_padding(torch.tensor([50, 150])),
         L=77, Lkv=150, B=2, mask_B=2),
    Case("q_padding_zero_rows", ("q_padding",),
         mask=M.q_padding(torch.tensor([77, 40], dtype=torch.int32)), B=2, mask_B=2),
    Case("noop_mask", ("noop_mask",), mask=M.noop_mask),
    Case("and_masks_of_nothing", ("and_masks",), mask=M.and_masks()),
    Case("or_masks_of_nothing_all_masked", ("or_masks",), mask=M.or_masks()),
    # --- score mods -------------------------------------------------------------------------
    Case("alibi_4_heads_no_mask", ("alibi",), score=M.alibi(4)),
    Case("alibi_6_heads_causal", ("alibi", "causal_mask"), score=M.alibi(6), mask=M.causal_mask,
         Hq=6, Hkv=2),
    Case("alibi_custom_slopes", ("alibi",), score=M.alibi(slopes=SLOPES), L=150),
    Case("alibi_paper_slopes_tensor", ("alibi", "alibi_slopes"),
         score=M.alibi(slopes=M.alibi_slopes(4)), mask=M.sliding_window(30), L=150, block=128),
    Case("softcap_2_bf16", ("tanh_softcap",), score=M.tanh_softcap(2.0), dtype=torch.bfloat16,
         q_scale=3.0),
    Case("softcap_2_approx", ("tanh_softcap", "tanh_approx"), score=M.tanh_softcap(2.0, approx=True),
         L=150, q_scale=3.0),
    Case("relative_position_bias", ("relative_position_bias",),
         score=M.relative_position_bias(REL_TABLE, 150), L=150),
    Case("relative_position_bias_1d_causal", ("relative_position_bias", "causal_mask"),
         score=M.relative_position_bias(REL_TABLE_1D, 77), mask=M.causal_mask),
    Case("t5_bidirectional", ("t5_relative_bias",), score=M.t5_relative_bias(T5_TABLE), L=150),
    Case("t5_causal_1d", ("t5_relative_bias", "causal_mask"),
         score=M.t5_relative_bias(T5_TABLE_1D, 16, 40, bidirectional=False), mask=M.causal_mask),
    # --- compositions -----------------------------------------------------------------------
    Case("causal_document_alibi_softcap_bf16",
         ("and_masks", "causal_mask", "document_mask", "compose_score_mods", "alibi", "tanh_softcap"),
         mask=M.and_masks(M.causal_mask, M.document_mask(DOC_150_B2)),
         score=M.compose_score_mods(M.alibi(4), M.tanh_softcap(5.0)),
         L=150, B=2, mask_B=2, dtype=torch.bfloat16, D=64),
    Case("or_window_prefix_blockcausal_block128",
         ("or_masks", "sliding_window", "prefix_lm", "block_causal"),
         mask=M.or_masks(M.sliding_window(16), M.prefix_lm(20), M.block_causal(64)),
         L=150, block=128),
    Case("padding_and_two_sided_window_with_bias",
         ("and_masks", "kv_padding", "q_padding", "sliding_window", "relative_position_bias"),
         mask=M.and_masks(M.kv_padding(torch.tensor([60, 150])), M.q_padding(torch.tensor([150, 99])),
                          M.sliding_window(32, causal=False)),
         score=M.relative_position_bias(REL_TABLE, 150), L=150, B=2, mask_B=2),
    Case("nested_or_in_and_head_dependent",
         ("and_masks", "or_masks", "chunked_local", "attention_sinks", "compose_score_mods",
          "t5_relative_bias", "tanh_softcap"),
         mask=M.and_masks(M.or_masks(M.chunked_local(32), M.attention_sinks(2, 1)),
                          every_other_head_causal),
         score=M.compose_score_mods(M.t5_relative_bias(T5_TABLE), M.tanh_softcap(3.0, approx=True)),
         L=150, mask_H=4, q_scale=2.0),
    Case("compose_nothing_head_dims_48_and_24", ("compose_score_mods", "causal"),
         score=M.compose_score_mods(), mask=M.causal(0), D=48, Dv=24, scale=0.3),
]

# Not mods themselves: helpers that build a mod's parameters, each covered through a mod above.
HELPERS = {"alibi_slopes", "doc_ids_from_lengths", "doc_ids_from_offsets", "tanh_approx"}

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def make_inputs(case: Case):
    Lkv = case.Lkv or case.L
    gen = _gen(case.L * 1000 + Lkv + case.Hq)
    q = torch.randn(case.B, case.Hq, case.L, case.D, generator=gen) * case.q_scale
    k = torch.randn(case.B, case.Hkv, Lkv, case.D, generator=gen)
    v = torch.randn(case.B, case.Hkv, Lkv, case.Dv or case.D, generator=gen)
    return q.to(case.dtype), k.to(case.dtype), v.to(case.dtype)


def check_block_states(block_mask, mask_mod, B, H):
    """No kept position in a skipped block, no masked position in a block marked full."""
    Q_LEN, KV_LEN = block_mask.seq_lengths
    q_block, kv_block = block_mask.BLOCK_SIZE
    states = block_mask.block_states().expand(B, H, -1, -1)
    keep = dense_mask(mask_mod, B, H, Q_LEN, KV_LEN)
    rows = torch.arange(Q_LEN) // q_block
    cols = torch.arange(KV_LEN) // kv_block
    state = states[:, :, rows[:, None], cols[None, :]]
    assert not (keep & (state == 0)).any(), "a kept position lies in a block the kernel skips"
    assert not (~keep & (state == 2)).any(), "a masked position lies in a block marked full"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_generated_kernel_matches_reference(case):
    q, k, v = make_inputs(case)
    Lkv = k.shape[2]
    block_mask = None
    if case.mask is not None:
        block_mask = create_block_mask(case.mask, case.mask_B, case.mask_H, case.L, Lkv,
                                       device="cpu", BLOCK_SIZE=case.block)
        check_block_states(block_mask, case.mask, case.B, case.Hq)
    out, lse = flex_attention(q, k, v, score_mod=case.score, block_mask=block_mask,
                              scale=case.scale, enable_gqa=True, return_lse=True)
    want, want_lse = flex_attention_reference(q, k, v, score_mod=case.score, mask_mod=case.mask,
                                              scale=case.scale, enable_gqa=True, return_lse=True,
                                              dtype=torch.float64)
    assert out.dtype == q.dtype and out.shape == want.shape
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
    tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    # The LSE is accumulated in float32 whatever the input dtype; -inf where a row is masked.
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-4, atol=1e-4)


def test_every_mod_has_a_kernel_case():
    covered = set().union(*(c.covers for c in CASES))
    unknown = covered - set(M.__all__)
    assert not unknown, f"cases name things flexgen.mods does not export: {sorted(unknown)}"
    missing = set(M.__all__) - covered
    assert not missing, f"mods without a kernel case in {__name__}: {sorted(missing)}"
    assert HELPERS <= covered
