"""flexgen.sigmoid_attention against the float64 oracle (``sigmoid_attention_reference``).

``out_i = Σ_j keep_ij · sigmoid(score_mod(q_i·k_j · scale) + bias) · v_j``: the forward,
backward and decode templates with their ``activation="sigmoid"`` switch. Each case runs on
CPU tensors through the Triton interpreter with NaN-poisoned outputs; gradients are compared
with torch autograd through the oracle in float64 (captured tensors' included). Every kernel
launched here is also compiled for sm_90 by the suite's conftest. Sizes are small and odd
(partial tails), tiles 32 wide; the bf16 / fp16 cases use other head dims (16, 80, 256).
"""
from __future__ import annotations

import math
import os
import re

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import flexgen  # noqa: E402
from flexgen import FlexgenError, create_block_mask, sigmoid_attention  # noqa: E402
from flexgen import mods as M  # noqa: E402
from flexgen.reference import sigmoid_attention_reference  # noqa: E402

TILES = {"BLOCK_M": 32, "BLOCK_N": 32}
ATOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(flexgen.runtime.poison, "ENABLED", True)


def _launched(template: str) -> list:
    return [spec for spec, _, _ in (flexgen.runtime.launch.RECORDED or []) if spec.template == template]


def _qkv(B, Hq, Hkv, Lq, Lkv, D, Dv=None, dtype=torch.float32, grad=False):
    q = torch.randn(B, Hq, Lq, D).to(dtype)
    k = torch.randn(B, Hkv, Lkv, D).to(dtype)
    v = torch.randn(B, Hkv, Lkv, Dv or D).to(dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _close(got, want, atol, what=""):
    assert not got.isnan().any(), f"{what}: NaN (an unwritten or a computed one)"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol * max(1.0, want.abs().max().item()), f"{what}: max error {err:.3g}"


# id -> (B, Hq, Hkv, Lq, Lkv, D, Dv, dtype, score_mod, mask_mod, bias)
FORWARD = {
    "plain_odd": (2, 2, 2, 45, 45, 32, None, torch.float32, None, None, None),
    "causal_gqa_bias": (1, 4, 2, 77, 77, 32, None, torch.float32, None, M.causal_mask, -2.0),
    "softcap_window_cross": (1, 2, 2, 40, 70, 32, 16, torch.float32, M.tanh_softcap(5.0),
                             M.sliding_window(20), None),
    "alibi_document": (1, 4, 4, 49, 49, 32, None, torch.float32, M.alibi(num_heads=4),
                       M.document_mask(M.doc_ids_from_lengths([20, 5, 24])), 0.5),
    "bf16_causal_d80": (1, 2, 1, 41, 41, 80, None, torch.bfloat16, None, M.causal_mask, None),
    "fp16_d16": (1, 2, 2, 33, 33, 16, None, torch.float16, None, None, None),
    "bf16_d256": (1, 1, 1, 20, 20, 256, None, torch.bfloat16, M.tanh_softcap(20.0), None, None),
}


@pytest.mark.parametrize("case", FORWARD)
def test_forward_matches_reference(case):
    B, Hq, Hkv, Lq, Lkv, D, Dv, dtype, score_mod, mask_mod, bias = FORWARD[case]
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype)
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, B, None, Lq, Lkv, device="cpu", BLOCK_SIZE=32)
    out = sigmoid_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, bias=bias,
                            enable_gqa=Hq != Hkv, kernel_options=TILES)
    ref = sigmoid_attention_reference(q, k, v, score_mod, block_mask, bias=bias, enable_gqa=Hq != Hkv)
    assert out.dtype == dtype and out.shape == ref.shape
    _close(out, ref, ATOL[dtype], case)
    assert [s.activation for s in _launched("forward")] == ["sigmoid"]


def test_default_bias_and_fully_masked_rows():
    """bias defaults to -log(KV_LEN); rows the mask empties are exactly 0 (no normalization)."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 32)
    block_mask = create_block_mask(M.causal(-7), 1, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    out = sigmoid_attention(q, k, v, block_mask=block_mask, kernel_options=TILES)
    ref = sigmoid_attention_reference(q, k, v, mask_mod=block_mask, bias=-math.log(40))
    _close(out, ref, ATOL[torch.float32])
    assert (out[:, :, :7] == 0).all()
    # A constant shift of the bias is the same as a score_mod adding it.
    shifted = sigmoid_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + 1.0, block_mask=block_mask,
                                bias=-math.log(40) - 1.0, kernel_options=TILES)
    _close(shifted, out, 1e-6)


def test_decode_path():
    """A few queries take the split-K decode kernel (sigmoid partial sums add up in the merge)."""
    q, k, v = _qkv(2, 4, 2, 3, 70, 32)
    block_mask = create_block_mask(M.causal(67), 2, None, 3, 70, device="cpu", BLOCK_SIZE=32)
    out = sigmoid_attention(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=block_mask, enable_gqa=True)
    ref = sigmoid_attention_reference(q, k, v, M.tanh_softcap(5.0), block_mask, enable_gqa=True)
    _close(out, ref, ATOL[torch.float32])
    assert [s.activation for s in _launched("decode")] == ["sigmoid"]
    assert [s.activation for s in _launched("decode_merge")] == ["sigmoid"]
    assert not _launched("forward")


def _learned_bias(table):
    def learned_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx]
    return learned_bias


BACKWARD = {
    "causal_gqa_learned": (1, 4, 2, 45, 45, 32, torch.float32, M.causal_mask, True, {}),
    "window_cross_softcap": (2, 2, 2, 37, 64, 32, torch.float32, M.sliding_window(16), False, {}),
    "no_mask_tma": (1, 2, 2, 33, 33, 32, torch.float32, None, True, {"USE_TMA": True}),
    "bf16_document": (1, 2, 2, 49, 49, 64, torch.bfloat16,
                      M.document_mask(M.doc_ids_from_lengths([20, 5, 24])), False, {}),
}


@pytest.mark.parametrize("case", BACKWARD)
def test_gradients_match_reference(case):
    B, Hq, Hkv, Lq, Lkv, D, dtype, mask_mod, learned, options = BACKWARD[case]
    q, k, v = _qkv(B, Hq, Hkv, Lq, Lkv, D, dtype=dtype, grad=True)
    table = torch.randn(Hq, Lkv, requires_grad=True)
    score_mod = _learned_bias(table) if learned else M.tanh_softcap(4.0)
    block_mask = None if mask_mod is None else create_block_mask(
        mask_mod, B, None, Lq, Lkv, device="cpu", BLOCK_SIZE=32)
    out = sigmoid_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, bias=-1.0,
                            enable_gqa=Hq != Hkv, kernel_options=dict(TILES, **options))
    d_out = torch.randn(out.shape)
    leaves = [q, k, v] + ([table] if learned else [])
    got = torch.autograd.grad((out.float() * d_out).sum(), leaves)
    backward = _launched("backward")
    assert sorted(s.part for s in backward) == ["dkdv", "dq"]
    assert {s.activation for s in backward} == {"sigmoid"}
    assert {s.use_tma for s in backward} == {bool(options.get("USE_TMA"))}

    ref = sigmoid_attention_reference(q, k, v, score_mod, block_mask, bias=-1.0, enable_gqa=Hq != Hkv)
    want = torch.autograd.grad((ref * d_out.double()).sum(), leaves)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, a, b in zip(["dq", "dk", "dv", "table"], got, want):
        assert a.dtype == leaves[["dq", "dk", "dv", "table"].index(name)].dtype
        _close(a, b, tol, f"{case} {name}")


@pytest.mark.skipif(os.environ.get("FLEXGEN_TEST_AOT", "1") == "0", reason="FLEXGEN_TEST_AOT=0")
def test_dq_kernel_keeps_its_pipeline_depth_under_a_block_mask():
    """Compiled for sm_90, the sigmoid dQ kernel under a block mask streams K and V through
    NUM_STAGES shared-memory buffers, as softmax's does. With dz = dp * p (1 - p) Triton's
    pipeliner reached the block list's index load through V's address, pipelined it as an
    indirect load and left K and V two buffers: the kernel ran 30% slower on the H100."""
    from flexgen import flex_attention
    from flexgen.runtime import aot
    q, k, v = _qkv(1, 2, 2, 128, 128, 64, dtype=torch.bfloat16, grad=True)
    mask = create_block_mask(M.causal_mask, 1, None, 128, 128, device="cpu")
    options = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "USE_TMA": True}
    rings = {}
    for name, attention in (("sigmoid", sigmoid_attention), ("softmax", flex_attention)):
        with aot.recording() as launches:
            attention(q, k, v, block_mask=mask, kernel_options=options).float().sum().backward()
        spec, args, constexprs = next(launch for launch in launches if getattr(launch[0], "part", "") == "dq")
        ttgir = aot.compile_launch(spec, args, constexprs).asm["ttgir"]
        rings[name] = sorted(set(re.findall(r"memdesc<(\d+)x64x64xbf16", ttgir)))
    assert rings["sigmoid"] == rings["softmax"] == ["3"]


def test_torch_compile_fullgraph_forward_and_backward():
    """One sigmoid_attention op (and its backward op) in a graph dynamo traces without a break."""
    torch._dynamo.reset()
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, grad=True)
    table = torch.randn(2, 40, requires_grad=True)

    def fn(q, k, v, table):
        mask = create_block_mask(M.causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=32)

        def biased(score, b, h, q_idx, kv_idx):
            return score + table[h, kv_idx]
        return sigmoid_attention(q, k, v, score_mod=biased, block_mask=mask, kernel_options=TILES)

    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    out = compiled(q, k, v, table)
    eager = fn(q, k, v, table)
    _close(out, eager, 1e-6)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v, table)]
    for t in (q, k, v, table):
        t.grad = None
    eager.sum().backward()
    for a, t in zip(grads, (q, k, v, table)):
        _close(a, t.grad, 1e-6)
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "flexgen.sigmoid_attention" in targets
    torch._dynamo.reset()


def test_ops_are_registered_with_fake_implementations():
    q, k, v = _qkv(1, 2, 2, 32, 32, 16)
    bias = torch.randn(2, 32)
    traced = flexgen.frontend.trace.trace(lambda s, b, h, qi, kv: s + bias[h, kv], "score_mod")
    torch.library.opcheck(torch.ops.flexgen.sigmoid_attention.default,
                          (q, k, v, [bias], [], [], traced.graph, "", [], [], 0.25, -1.0, False, ""),
                          test_utils=("test_schema", "test_faketensor"))


def test_errors():
    q, k, v = _qkv(1, 2, 2, 20, 20, 16)
    for bad in (float("nan"), True, "1.0"):
        with pytest.raises(FlexgenError, match="bias"):
            sigmoid_attention(q, k, v, bias=bad)
    with pytest.raises(FlexgenError, match="enable_gqa"):
        sigmoid_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(FlexgenError, match="mask for Q_LEN=20"):
        sigmoid_attention(q, k, v, block_mask=create_block_mask(M.causal_mask, 1, None, 40, 40,
                                                                 device="cpu"))


# --------------------------------------------------------------------------- snapshots

def test_sources_differ_from_softmax_only_where_they_should():
    """The sigmoid kernels keep flex_attention's loops and mod code, without the online softmax."""
    q, k, v = _qkv(1, 4, 2, 128, 128, 64, dtype=torch.bfloat16)
    mask = create_block_mask(M.causal_mask, 1, None, 128, 128, device="cpu")
    for part in ("forward", "dq", "dkdv"):
        text = flexgen.sigmoid_kernel_source(q, k, v, M.tanh_softcap(30.0), mask, enable_gqa=True,
                                             part=part)
        softmax = flexgen.kernel_source(q, k, v, M.tanh_softcap(30.0), mask, enable_gqa=True, part=part)
        assert "# activation: sigmoid" in text and "activation" not in softmax
        kernel = text.split("@triton.jit(do_not_specialize")[1].split("def arguments")[0]
        signature = kernel.split('"""')[0]
        assert "SIGMOID_BIAS" in signature and "LSE" not in signature and "DELTA" not in signature
        assert not re.search(r"\b(m_i|l_i|lse2?|delta|alpha)\s*=", kernel), "online-softmax state"
        assert "_tanh(" in kernel and ("FULL_KV_IDX" in kernel or "FULL_Q_IDX" in kernel)


SNAPSHOTS = {
    "forward_causal_softcap": ("forward", 128, M.tanh_softcap(30.0), M.causal_mask),
    "dq_document_alibi": ("dq", 128, M.alibi(4), M.document_mask(M.doc_ids_from_lengths([40, 50, 38]))),
    "dkdv_no_mask": ("dkdv", 128, None, None),
    "decode_sliding_window": ("forward", 1, None, M.sliding_window(32)),
    # The Gluon forward (sm_90), planned as on a Hopper GPU.
    "gluon_forward_causal_softcap": ("forward", 128, M.tanh_softcap(30.0), M.causal_mask),
}


@pytest.fixture
def snapshot(snapshot):
    from test_snapshots import KernelSourceExtension
    return snapshot.use_extension(KernelSourceExtension)


@pytest.mark.parametrize("case", SNAPSHOTS)
def test_kernel_source_snapshot(case, snapshot, monkeypatch):
    """Golden sigmoid kernels (tests/snapshots/test_sigmoid/); rewrite with --snapshot-update."""
    from test_snapshots import normalize
    from flexgen.runtime import plan as plan_module
    part, Lq, score_mod, mask_mod = SNAPSHOTS[case]
    options = None
    if case.startswith("gluon"):
        monkeypatch.setattr(plan_module, "gluon_unavailable", lambda query, D, Dv: None)
        plan_module.clear_memos()
        options = {"BACKEND": "gluon"}
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, Lq, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, generator=gen).to(torch.bfloat16)
    mask = None if mask_mod is None else create_block_mask(mask_mod, 1, None, Lq, 128, device="cpu")
    try:
        text = flexgen.sigmoid_kernel_source(q, k, k.clone(), score_mod, mask, enable_gqa=True, part=part,
                                             kernel_options=options)
    finally:
        plan_module.clear_memos()
    assert normalize(text) == snapshot


def test_snapshot_files_are_there():
    folder = Path(__file__).parent / "snapshots" / "test_sigmoid"
    assert {p.name for p in folder.glob("*.py.txt")} == {
        f"test_kernel_source_snapshot[{case}].py.txt" for case in SNAPSHOTS}


def test_a_repeated_call_replays_only_with_the_same_captured_tensors_and_lists(monkeypatch):
    """On a GPU a repeated call relaunches its kernel with new Q, K, V, OUT only; a call with the
    same shapes but another bias value, captured tensor or block mask launches anew (a fake
    compiled kernel stands in for the GPU here)."""
    from flexgen.runtime import launch
    from flexgen.runtime import plan as P
    from flexgen.kernels import sigmoid as S
    monkeypatch.setattr(launch, "RECORDED", None)
    monkeypatch.setattr(P, "_SIGMOID", {})
    launched, replayed = [], []

    class FakeReplay:
        def __call__(self, *tensors):
            replayed.append(tensors)
            return True

    def fake_run(spec, device, inputs, tune_blocks=None, replay=(), origins=()):
        launched.append(inputs)
        return FakeReplay()
    monkeypatch.setattr(flexgen.runtime.launch, "run", fake_run)

    def factory(table):
        def biased(score, b, h, q_idx, kv_idx):
            return score + table[h]
        return biased

    q, k, v = _qkv(1, 2, 2, 64, 64, 16)
    t1, t2 = torch.randn(2), torch.randn(2)
    docs = [M.document_mask(M.doc_ids_from_lengths(n)) for n in ([30, 34], [50, 14])]
    masks = [create_block_mask(d, 1, None, 64, 64, device="cpu", BLOCK_SIZE=32) for d in docs]
    calls = [(t1, masks[0], -1.0), (t1, masks[0], -1.0), (t2, masks[0], -1.0), (t2, masks[1], -1.0),
             (t2, masks[1], -2.0), (t2, masks[1], -2.0)]
    for table, mask, bias in calls:
        sigmoid_attention(q, k, v, score_mod=factory(table), block_mask=mask, bias=bias,
                          kernel_options=TILES)
    assert len(launched) == 4 and len(replayed) == 2
    assert launched[1]["score_buffers"][0] is t2 and launched[2]["sparse"][1] is not launched[1]["sparse"][1]
