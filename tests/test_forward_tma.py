"""The forward kernel's TMA variant (``kernel_options={"USE_TMA": True}``) against the oracle.

With USE_TMA the kernel loads Q, K and V and stores the output through
tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``, built
on the host, [B, H, L, D] with [1, 1, rows, padded D] blocks) instead of
pointer arithmetic. Everything else (block-sparse lists, GQA, mods, EVEN_KV,
fully masked rows, the LSE) is the pointer kernel's. Here the Triton
interpreter runs it on CPU tensors; the conftest compiles each launch for
sm_90, where the descriptors become TMA copies. Inputs TMA cannot address
(a base not 16-byte aligned, strides not in multiples of 16 bytes) run the
pointer kernel instead, with the same results.
"""
from __future__ import annotations

import pytest
import torch
from triton.tools.tensor_descriptor import TensorDescriptor

import flexgen
from flexgen import create_block_mask, flex_attention, kernel_source
from flexgen.runtime import aot
from flexgen.runtime import launch
from flexgen import mods as M
from flexgen.errors import FlexgenError
import conftest
from conftest import assert_module_launches_compile, launches_of, make_qkv, run_and_check

TMA = {"USE_TMA": True}


def block_mask(mask_mod, Lq, Lkv=None, B=None, H=None, BLOCK_SIZE=128):
    return create_block_mask(mask_mod, B, H, Lq, Lq if Lkv is None else Lkv, device="cpu",
                             BLOCK_SIZE=BLOCK_SIZE)


def last_launch():
    spec, args, constexprs = launch.RECORDED[-1]
    assert spec.template == "forward"
    return spec, args, constexprs


def run_tma(q, k, v, *, expect_tma=True, kernel_options=None, **kwargs):
    """run_and_check with USE_TMA on; the launch took the TMA path (or, if not expected, did not)."""
    out = run_and_check(q, k, v, kernel_options={**TMA, **(kernel_options or {})}, **kwargs)
    spec, args, _ = last_launch()
    assert spec.use_tma is expect_tma
    descriptors = [a for a in args if isinstance(a, TensorDescriptor)]
    assert len(descriptors) == (4 if expect_tma else 0)
    return out


def poisoned(shape, L_used, D_used, dtype=torch.float32):
    """A [B, H, L_used, D_used] view of a NaN-filled [B, H, L, D] tensor, finite where it is seen.

    Anything a kernel reads past the length or the head dim is NaN, and NaN spreads to
    the output: TMA must zero-fill those rows and lanes, never read them.
    """
    base = torch.full(shape, float("nan"), dtype=dtype)
    base[:, :, :L_used, :D_used] = torch.randn(*shape[:2], L_used, D_used).to(dtype)
    return base[:, :, :L_used, :D_used]


# --- against the oracle -------------------------------------------------------------------

@pytest.mark.parametrize("L", [67, 128, 200])
def test_no_mod(L):
    """67 and 200: ragged last tiles (EVEN_KV off); 128: EVEN_KV on."""
    q, k, v = make_qkv(B=2, H=2, L=L)
    run_tma(q, k, v)


MASKS = {
    "causal": lambda L: M.causal_mask,
    "sliding_window": lambda L: M.sliding_window(37),
    "document": lambda L: M.document_mask(M.doc_ids_from_lengths([50, 13, 60, 1], total_length=L)),
    "causal_document": lambda L: M.and_masks(
        M.causal_mask, M.document_mask(M.doc_ids_from_lengths([29, 80], total_length=L))),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks(name):
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_tma(q, k, v, block_mask=block_mask(MASKS[name](L), L))


@pytest.mark.parametrize("BLOCK_SIZE", [64, (64, 128)])
def test_masks_smaller_sparse_blocks(BLOCK_SIZE):
    L = 200
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_tma(q, k, v, block_mask=block_mask(M.sliding_window(90), L, BLOCK_SIZE=BLOCK_SIZE))


def test_softcap():
    q, k, v = make_qkv(B=2, H=2, L=67)
    run_tma(q * 4, k, v, score_mod=M.tanh_softcap(2.0))


def test_softcap_with_document_mask_bf16():
    B, L = 2, 130
    docs = torch.stack([M.doc_ids_from_lengths([60, 70]), M.doc_ids_from_lengths([10, 100, 20])])
    q, k, v = make_qkv(B=B, H=2, L=L, dtype=torch.bfloat16)
    run_tma(q, k, v, score_mod=M.tanh_softcap(5.0),
            block_mask=block_mask(M.and_masks(M.causal_mask, M.document_mask(docs)), L, B=B))


def test_captured_bias_score_mod():
    B, H, L = 2, 2, 130
    bias = torch.randn(B, H, L)

    def kv_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx]

    q, k, v = make_qkv(B=B, H=H, L=L)
    run_tma(q, k, v, score_mod=kv_bias, block_mask=block_mask(M.causal_mask, L))


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (8, 1)])
def test_gqa(Hq, Hkv):
    L = 67
    slopes = torch.rand(Hq) * 0.1

    def alibi(score, b, h, q_idx, kv_idx):   # h is the query head
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = make_qkv(B=2, H=Hq, Hkv=Hkv, L=L)
    run_tma(q, k, v, score_mod=alibi, block_mask=block_mask(M.causal_mask, L, H=Hq), enable_gqa=True)


@pytest.mark.parametrize("Lq,Lkv", [(67, 200), (200, 67)])
def test_lq_ne_lkv(Lq, Lkv):
    q, k, v = make_qkv(B=1, H=2, L=Lq, Lkv=Lkv)
    run_tma(q, k, v)
    # bottom-right aligned causal; with Lq > Lkv the first rows see nothing
    run_tma(q, k, v, block_mask=block_mask(M.causal_lower_right(Lq, Lkv), Lq, Lkv))


@pytest.mark.parametrize("D,Dv,dtype", [
    (64, 64, torch.float32),
    (80, 80, torch.float32),
    (80, 80, torch.bfloat16),
    (128, 128, torch.bfloat16),
    (64, 32, torch.float16),
])
def test_head_dims(D, Dv, dtype):
    """80 runs in 128 lanes: TMA zero-fills lanes 80..127 of Q, K and V and clips the store."""
    L = 130
    q, k, v = make_qkv(B=1, H=2, Hkv=1, L=L, D=D, Dv=Dv, dtype=dtype)
    out, _ = run_tma(q, k, v, block_mask=block_mask(M.causal_mask, L, H=2), enable_gqa=True)
    assert out.shape == (1, 2, L, Dv)


def test_fully_masked_rows_inside_partial_blocks():
    def some_rows_dead(b, h, q_idx, kv_idx):
        return (q_idx % 3 != 0) & (kv_idx <= q_idx)

    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    out, lse = run_tma(q, k, v, score_mod=M.tanh_softcap(20.0), block_mask=block_mask(some_rows_dead, L))
    assert torch.isneginf(lse[:, :, ::3]).all() and (out[:, :, ::3] == 0).all()


def test_fully_masked_query_blocks():
    def late_rows_only(b, h, q_idx, kv_idx):
        return (q_idx >= 150) & (kv_idx < 40)

    L = 200
    mask = block_mask(late_rows_only, L, BLOCK_SIZE=64)
    q, k, v = make_qkv(B=1, H=2, L=L)
    out, lse = run_tma(q, k, v, block_mask=mask)
    assert torch.isneginf(lse[:, :, :150]).all() and (out[:, :, :150] == 0).all()
    assert torch.isfinite(lse[:, :, 150:]).all()


def test_nan_past_length_and_head_dim_is_never_read():
    """Q, K, V as views of NaN-filled tensors (longer rows, wider heads, aligned strides)."""
    B, H, Lq, Lkv, D = 1, 2, 67, 99, 40          # D=40 runs in 64 lanes; the storage has 48
    q = poisoned((B, H, 80, 48), Lq, D)
    k = poisoned((B, H, 128, 48), Lkv, D)
    v = poisoned((B, H, 128, 48), Lkv, D)
    assert torch.isnan(k.as_strided((B, H, Lkv, 48), k.stride())).any()   # NaN right past each row
    run_tma(q, k, v)
    run_tma(q, k, v, score_mod=M.tanh_softcap(5.0),
            block_mask=block_mask(M.causal_lower_right(Lq, Lkv), Lq, Lkv, BLOCK_SIZE=64))


def test_blhd_layout_uses_tma():
    """[B, L, H, D] storage seen as [B, H, L, D]: not contiguous, but TMA can address it."""
    B, H, L, D = 2, 2, 67, 32
    q, k, v = (torch.randn(B, L, H, D).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    run_tma(q, k, v, block_mask=block_mask(M.causal_mask, L))


def test_size_one_dims_with_any_stride():
    """B = 1 and H = 1 with strides TMA would refuse: never stepped, so TMA still runs."""
    L, D = 67, 32
    q, k, v = (torch.randn(L * D).as_strided((1, 1, L, D), (3, 5, D, 1)) for _ in range(3))
    run_tma(q, k, v, block_mask=block_mask(M.causal_mask, L))


# --- inputs TMA cannot address: the pointer kernel, same results ---------------------------

def misaligned(shape, dtype=torch.float32):
    """A contiguous tensor whose base is 4 bytes past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.randn(n + 8).to(dtype)
    shift = (16 - flat.data_ptr() % 16) % 16 // flat.element_size() + 4 // flat.element_size()
    t = flat[shift:shift + n].view(shape)
    assert t.data_ptr() % 16 != 0
    return t


def test_misaligned_base_falls_back():
    B, H, L, D = 1, 2, 67, 32
    q = misaligned((B, H, L, D))
    _, k, v = make_qkv(B=B, H=H, L=L)
    run_tma(q, k, v, expect_tma=False, block_mask=block_mask(M.causal_mask, L))


def test_expanded_key_and_value_fall_back():
    """K and V expanded over the heads (stride 0 on a stepped dim): the pointer kernel."""
    B, H, L, D = 1, 4, 67, 32
    q = make_qkv(B=B, H=H, L=L)[0]
    k, v = (torch.randn(B, 1, L, D).expand(B, H, L, D) for _ in range(2))
    run_tma(q, k, v, expect_tma=False, block_mask=block_mask(M.causal_mask, L))


def test_misaligned_after_aligned_same_geometry():
    """Same shapes and strides as an earlier TMA call, a misaligned base: pointer kernel."""
    B, H, L, D = 1, 2, 71, 32
    q, k, v = make_qkv(B=B, H=H, L=L)
    run_tma(q, k, v)
    run_tma(q, k, misaligned((B, H, L, D)), expect_tma=False)


def test_row_stride_not_multiple_of_16_bytes_falls_back():
    """A head dim sliced out of a 37-wide tensor: rows 148 bytes apart."""
    B, H, L, D = 1, 2, 67, 32
    q, k = make_qkv(B=B, H=H, L=L)[:2]
    v = torch.randn(B, H, L, 37)[..., :D]
    run_tma(q, k, v, expect_tma=False, score_mod=M.tanh_softcap(3.0))


def test_output_rows_not_16_byte_aligned_fall_back():
    """fp16, value head dim 20 cut from 24-wide rows: the inputs suit TMA, but the output's
    contiguous 40-byte rows do not."""
    B, H, L = 1, 2, 67
    q, k = make_qkv(B=B, H=H, L=L, dtype=torch.float16)[:2]
    v = torch.randn(B, H, L, 24).to(torch.float16)[..., :20]
    run_tma(q, k, v, expect_tma=False)


def test_device_without_tma_falls_back(monkeypatch):
    """No TMA on the device (a GPU before sm_90): the pointer kernel."""
    monkeypatch.setattr(flexgen.codegen.spec, "has_tma", lambda device: False)
    monkeypatch.setattr(flexgen.runtime.plan, "_ATTENTION", {})
    q, k, v = make_qkv(B=1, H=3, L=53)
    run_tma(q, k, v, expect_tma=False)


# --- options, sources, gradients ----------------------------------------------------------

def test_pointer_source_unchanged_when_off():
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L, D=80, dtype=torch.bfloat16)
    mask = block_mask(M.causal_mask, L)
    plain = kernel_source(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask)
    off = kernel_source(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask,
                        kernel_options={"USE_TMA": False})
    on = kernel_source(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask, kernel_options=TMA)
    assert off == plain
    for src in (plain, off):
        assert "TensorDescriptor" not in src and ".load([" not in src and "stride_kn" in src
    assert on != plain
    assert "K.load([off_z, off_hkv, start_n, 0])" in on and "OUT.store(" in on
    assert "stride_kn" not in on and "tl.load(k_base" not in on


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_use_tma_takes_a_bool(value):
    q, k, v = make_qkv(B=1, H=1, L=40)
    with pytest.raises(FlexgenError, match="USE_TMA"):
        flex_attention(q, k, v, kernel_options={"USE_TMA": value})


def test_use_tma_with_tiles():
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L)
    run_tma(q, k, v, block_mask=block_mask(M.causal_mask, L),
            kernel_options={"BLOCK_M": 32, "BLOCK_N": 32, "PRESCALE_QK": False})
    spec, _, _ = last_launch()
    assert (spec.block_m, spec.block_n) == (32, 32)


def test_gradients_match_the_pointer_forward():
    """The backward (pointer kernels) runs from a TMA forward's output and LSE."""
    L = 67
    mask = block_mask(M.causal_mask, L)
    grads = []
    for options in (TMA, None):
        torch.manual_seed(1)
        q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=2, L=L))
        out = flex_attention(q, k, v, score_mod=M.tanh_softcap(4.0), block_mask=mask,
                             kernel_options=options)
        forward = [s for s, _, _ in launch.RECORDED if s.template == "forward"][-1]
        assert forward.use_tma is (options is TMA)
        out.sum().backward()
        grads.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- ahead-of-time compile for sm_90 --------------------------------------------------------

@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_tma_kernel_compiles_to_tma_copies():
    """Host descriptors reach the compiler as tensordesc arguments; loads and the store become TMA."""
    L = 130
    q, k, v = make_qkv(B=1, H=2, L=L, D=80, dtype=torch.bfloat16)
    mask = block_mask(M.causal_mask, L)
    with aot.recording() as launches:
        flex_attention(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask, kernel_options=TMA)
    (spec, args, constexprs), = [launch for launch in launches if launch[0].template == "forward"]
    assert spec.use_tma
    assert [aot._arg_type(a) for a in args[:4]] == ["tensordesc<bf16[1, 1, 64, 128]>"] * 4
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.asm.get("cubin")
    assert "cp.async.bulk.tensor" in compiled.asm["ptx"]          # TMA copies, global <-> shared
    ttgir = compiled.asm["ttgir"]
    assert "async_tma_copy_global_to_local" in ttgir and "async_tma_copy_local_to_global" in ttgir


@pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_every_launched_kernel_compiles_for_sm90():
    """Each distinct kernel launched above, TMA and pointer fall-backs, compiles for sm_90."""
    assert_module_launches_compile(__name__, {"forward"})
    assert any(spec.use_tma for spec, _, _ in launches_of(__name__))


def test_tma_is_the_default_for_long_16_bit_gpu_calls_only():
    from flexgen.runtime.options import parse_options
    from flexgen.runtime.plan import TMA_MIN_SCORES, _use_tma

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def use(options, dtype=torch.bfloat16, device=cuda, L=4096):
        return _use_tma(parse_options(options), 2, 8, L, L, dtype, device)

    assert 2 * 8 * 4096 * 4096 >= TMA_MIN_SCORES
    assert use(None) and use({"BLOCK_M": 64})
    assert not use({"USE_TMA": False})
    assert not use(None, L=128)                       # short: host cost > gain
    assert use({"USE_TMA": True}, L=128)
    assert not use(None, torch.float32)
    assert use({"USE_TMA": True}, torch.float32)
    assert not use(None, device=cpu)                  # CPU: the pointer kernel
