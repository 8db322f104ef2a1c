"""flexgen.linear_attention / linear_attention_decode against the float64 step-by-step oracle.

``S_t = exp(g_t) S_{t-1} + φ(k_t)ᵀ v_t``, ``o_t = scale · φ(q_t) S_t`` with ``g = decay_mod(b, h, t)``
and ``φ = feature_map``: the chunked kernels (state, output), the recurrent decode kernel,
and the backward (grad, gates) on CPU tensors through the Triton interpreter, outputs poisoned
with NaN. ``linear_attention_reference`` runs the recurrence one position at a time, so the
chunking (lengths that are not multiples of the chunk, one chunk, many), the decay folded in
through running sums, GQA and the feature maps are all checked against the definition;
gradients (the gates' and the initial state's included) against torch autograd through it.
Chunks are 16 positions (``kernel_options={"BLOCK_M": 16}``) so short sequences span several;
one case runs the default (128, two chunks). Every kernel launched is also compiled for sm_90
(conftest).
"""
from __future__ import annotations

import os

os.environ.setdefault("FLEXGEN_POISON", "1")  # before flexgen is imported, if it is not yet

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flexgen  # noqa: E402
from flexgen import (FlexgenError, GradientError, TraceError, linear_attention,  # noqa: E402
                     linear_attention_decode)
from flexgen.reference import linear_attention_reference  # noqa: E402

CHUNK16 = {"BLOCK_M": 16}
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(flexgen.runtime.poison, "ENABLED", True)


def _launched() -> list:
    return [(spec.template, getattr(spec, "part", None))
            for spec, _, _ in (flexgen.runtime.launch.RECORDED or [])]


def elu1(x):
    return F.elu(x) + 1


def lightning(slopes):
    def lightning_decay(b, h, t):
        return -slopes[h]
    return lightning_decay


def gated(gates):
    def gate_decay(b, h, t):
        return gates[b, h, t]
    return gate_decay


def _close(got, want, atol, what=""):
    assert not got.isnan().any(), f"{what}: NaN (an unwritten or a computed one)"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol * max(1.0, want.abs().max().item()), f"{what}: max error {err:.3g}"


def _inputs(B, Hq, Hkv, T, D, Dv=None, dtype=torch.float32, grad=False):
    # Scaled so that the states stay O(1)-O(10) and the comparison is about the algorithm.
    q = torch.randn(B, Hq, T, D) * 0.5
    k = torch.randn(B, Hkv, T, D) * 0.5
    v = torch.randn(B, Hkv, T, Dv or D)
    return tuple(t.to(dtype).requires_grad_(grad) for t in (q, k, v))


# id -> (B, Hq, Hkv, T, D, Dv, dtype, decay kind, feature_map, initial state, options)
FORWARD = {
    "plain_odd": (2, 2, 2, 37, 32, None, torch.float32, None, None, False, CHUNK16),
    "lightning_gqa_dv16": (1, 4, 2, 50, 32, 16, torch.float32, "heads", None, False, CHUNK16),
    "gates_elu_state": (2, 2, 2, 33, 32, None, torch.float32, "tokens", elu1, True, CHUNK16),
    "one_chunk_exact": (1, 2, 2, 16, 32, None, torch.float32, "tokens", None, False, CHUNK16),
    "single_position": (1, 2, 2, 1, 32, None, torch.float32, "heads", elu1, False, {"BACKEND": "TRITON"}),
    "bf16_d64_default_chunk": (1, 2, 1, 150, 64, None, torch.bfloat16, "tokens", None, True, None),
    "fp16_d16": (1, 2, 2, 40, 16, None, torch.float16, "heads", elu1, False, CHUNK16),
    "bf16_d256": (1, 1, 1, 20, 256, 32, torch.bfloat16, "heads", None, False, CHUNK16),
}


def _decay(kind, B, Hq, T, grad=False):
    if kind == "heads":
        slopes = (torch.rand(Hq) * 0.5 + 0.05).requires_grad_(grad)
        return lightning(slopes), slopes
    if kind == "tokens":
        gates = F.logsigmoid(torch.randn(B, Hq, T) + 2.0).requires_grad_(grad)
        return gated(gates), gates
    return None, None


@pytest.mark.parametrize("case", FORWARD)
def test_forward_matches_reference(case):
    B, Hq, Hkv, T, D, Dv, dtype, kind, feature_map, with_state, options = FORWARD[case]
    q, k, v = _inputs(B, Hq, Hkv, T, D, Dv, dtype)
    decay_mod, _ = _decay(kind, B, Hq, T)
    state = torch.randn(B, Hq, D, Dv or D) if with_state else None
    out, final = linear_attention(q, k, v, decay_mod=decay_mod, feature_map=feature_map,
                                  initial_state=state, output_final_state=True, enable_gqa=Hq != Hkv,
                                  kernel_options=options)
    ref, ref_final = linear_attention_reference(q, k, v, decay_mod, feature_map, initial_state=state,
                                                output_final_state=True, enable_gqa=Hq != Hkv)
    assert out.dtype == dtype and out.shape == ref.shape
    assert final.dtype == torch.float32 and final.shape == (B, Hq, D, Dv or D)
    _close(out, ref, ATOL[dtype], f"{case} out")
    _close(final, ref_final, ATOL[dtype], f"{case} final state")
    assert ("linear", "state") in _launched() and ("linear", "output") in _launched()


def test_decode_kernel_for_short_calls_with_a_state():
    """T <= 16 with an initial_state runs the recurrent kernel: the same numbers as the chunks."""
    q, k, v = _inputs(2, 4, 2, 5, 32, 16)
    decay_mod, _ = _decay("tokens", 2, 4, 5)
    state = torch.randn(2, 4, 32, 16)
    out, final = linear_attention(q, k, v, decay_mod, elu1, initial_state=state, output_final_state=True,
                                  enable_gqa=True)
    assert _launched() == [("linear_decode", "decode")]
    ref, ref_final = linear_attention_reference(q, k, v, decay_mod, elu1, initial_state=state,
                                                output_final_state=True, enable_gqa=True)
    _close(out, ref, ATOL[torch.float32], "out")
    _close(final, ref_final, ATOL[torch.float32], "state")
    assert final.data_ptr() != state.data_ptr()          # a new tensor; the input is not touched


def test_chunked_prefill_then_decode_equals_one_prefill():
    """Prefill 35 positions (chunks), then 1 and 4 more from a cache of states in place (the
    serving layout, slots out of order): the outputs and states of one 40-position call."""
    B, Hq, Hkv, T, D = 2, 4, 2, 40, 32
    q, k, v = _inputs(B, Hq, Hkv, T, D)
    gates = F.logsigmoid(torch.randn(B, Hq, T) + 2.0)
    ref, ref_final = linear_attention_reference(q, k, v, gated(gates), elu1, output_final_state=True,
                                                enable_gqa=True)
    first, state = linear_attention(q[:, :, :35], k[:, :, :35], v[:, :, :35], gated(gates[..., :35]),
                                    elu1, output_final_state=True, enable_gqa=True, kernel_options=CHUNK16)
    cache = torch.full((5, Hq, D, D), float("nan"))
    slots = [3, 1]
    cache[slots] = state
    outs = [first]
    for lo, hi in ((35, 36), (36, 40)):
        outs.append(linear_attention_decode(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], cache,
                                            torch.tensor(slots, dtype=torch.int32),
                                            gated(gates[..., lo:hi]), elu1, enable_gqa=True))
    _close(torch.cat(outs, 2), ref, ATOL[torch.float32], "outputs")
    _close(cache[slots], ref_final, ATOL[torch.float32], "states")
    assert cache[[0, 2, 4]].isnan().all()               # other slots untouched


# id -> (B, Hq, Hkv, T, D, Dv, dtype, decay kind, feature_map, initial state, final state, options)
BACKWARD = {
    "gates_elu_state_gqa": (2, 4, 2, 37, 32, 16, torch.float32, "tokens", elu1, True, True, CHUNK16),
    "learned_slopes": (1, 2, 2, 45, 32, None, torch.float32, "heads", None, False, False,
                       {"BLOCK_M": 16, "BLOCK_N": 16}),
    "bf16_gates": (1, 2, 2, 33, 64, None, torch.bfloat16, "tokens", None, True, False, CHUNK16),
    "decode_path": (1, 2, 2, 6, 32, None, torch.float32, "tokens", elu1, True, True, None),
}


@pytest.mark.parametrize("case", BACKWARD)
def test_gradients_match_reference(case):
    _check_gradients(*BACKWARD[case], case=case)


def _check_gradients(B, Hq, Hkv, T, D, Dv, dtype, kind, feature_map, with_state, with_final, options, case):
    q, k, v = _inputs(B, Hq, Hkv, T, D, Dv, dtype, grad=True)
    decay_mod, learned = _decay(kind, B, Hq, T, grad=True)
    state = torch.randn(B, Hq, D, Dv or D, requires_grad=True) if with_state else None
    out, final = linear_attention(q, k, v, decay_mod, feature_map, initial_state=state,
                                  output_final_state=True, enable_gqa=Hq != Hkv, kernel_options=options)
    d_out, d_final = torch.randn(out.shape), torch.randn(final.shape)
    leaves = [q, k, v, learned] + ([state] if with_state else [])
    loss = (out.float() * d_out).sum() + ((final * d_final).sum() if with_final else 0.0)
    got = torch.autograd.grad(loss, leaves)
    parts = [p for t, p in _launched() if t == "linear"]
    assert "grad" in parts and ("gates" in parts) == (kind is not None)

    ref, ref_final = linear_attention_reference(q, k, v, decay_mod, feature_map, initial_state=state,
                                                output_final_state=True, enable_gqa=Hq != Hkv)
    tol = 2e-5 if dtype == torch.float32 else 4e-2
    _close(out, ref, tol, f"{case} out")
    _close(final, ref_final, tol, f"{case} final state")
    ref_loss = (ref * d_out.double()).sum() + ((ref_final * d_final.double()).sum() if with_final else 0.0)
    want = torch.autograd.grad(ref_loss, leaves)
    for name, a, b, leaf in zip(["dq", "dk", "dv", "d" + kind, "d_state"], got, want, leaves):
        assert a.dtype == leaf.dtype and a.shape == leaf.shape, name
        _close(a, b, tol, f"{case} {name}")
    return parts


# The GPU's kind of tiles, small: key- and value-dim slices in the state and output kernels
# (the output kernel's key-dim loop), and a backward chunk (32) other than the forward's (16).
SLICED = dict(state_dk=16, state_dv=16, state_warps=4, state_stages=1, output_dk=16, output_dv=16,
              output_warps=4, output_stages=1, grad_chunk=32, grad_dv=16, grad_warps=4, grad_stages=1,
              grad_dg_dv=16, grad_dg_warps=4, grad_dg_stages=1)


@pytest.mark.parametrize("case,prefix", [("gates_elu_state_gqa", True), ("learned_slopes", True),
                                         ("gates_elu_state_gqa", False)])
def test_sliced_tiles_and_decay_forms(case, prefix, monkeypatch):
    """The tiles a GPU runs (through LINEAR_CPU_TILES) and the three ways the kernels get the
    decay's running sums: a per-token decay from the prefix kernel (or, LINEAR_PREFIX off,
    scanned in every kernel), a per-head decay in closed form."""
    from flexgen.runtime import plan_linear
    monkeypatch.setattr(plan_linear, "LINEAR_CPU_TILES", SLICED)
    monkeypatch.setattr(plan_linear, "LINEAR_CHUNK", 16)
    monkeypatch.setattr(plan_linear, "LINEAR_PREFIX", prefix)
    plan_linear._LINEAR.clear()
    try:
        parts = _check_gradients(*BACKWARD[case][:-1], None, case=case)
    finally:
        plan_linear._LINEAR.clear()
    assert ("prefix" in parts) == (prefix and BACKWARD[case][7] == "tokens")
    specs = [spec for spec, _, _ in flexgen.runtime.launch.RECORDED if getattr(spec, "part", None)]
    forms = {spec.decay_form for spec in specs if spec.part in ("state", "output", "grad")}
    assert forms == {"prefix" if prefix else "traced"} if BACKWARD[case][7] == "tokens" else {"head"}
    chunks = {(spec.part, spec.block_m) for spec in specs if spec.part in ("output", "grad")}
    assert chunks == {("output", 16), ("grad", 32)}
    assert {spec.block_k for spec in specs if spec.part in ("state", "output")} == {16}


def test_only_value_requires_grad_and_no_state_gradient():
    q, k = _inputs(1, 2, 2, 20, 32)[:2]
    v = torch.randn(1, 2, 20, 32, requires_grad=True)
    out = linear_attention(q, k, v, lightning(torch.tensor([0.1, 0.2])), kernel_options=CHUNK16)
    (dv,) = torch.autograd.grad(out.sum(), [v])
    ref = linear_attention_reference(q, k, v, lightning(torch.tensor([0.1, 0.2])))
    (want,) = torch.autograd.grad(ref.sum(), [v])
    _close(dv, want, 2e-5)


def test_torch_compile_fullgraph():
    """linear_attention in a compiled function: one op, the same values and gradients as eager."""
    torch._dynamo.reset()
    q, k, v = _inputs(1, 2, 2, 24, 16, grad=True)
    gates = F.logsigmoid(torch.randn(1, 2, 24)).requires_grad_()

    def fn(q, k, v, gates):
        def decay(b, h, t):
            return gates[b, h, t]
        return linear_attention(q, k, v, decay, elu1, kernel_options=CHUNK16)

    from torch._dynamo.testing import CompileCounterWithBackend
    counter = CompileCounterWithBackend("aot_eager")
    out = torch.compile(fn, fullgraph=True, backend=counter)(q, k, v, gates)
    got = torch.autograd.grad(out.sum(), [q, k, v, gates])
    eager = fn(q, k, v, gates)
    want = torch.autograd.grad(eager.sum(), [q, k, v, gates])
    _close(out, eager, 1e-6)
    for a, b in zip(got, want):
        _close(a, b, 1e-6)
    assert counter.frame_count == 1
    targets = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "flexgen.linear_attention" in targets
    torch._dynamo.reset()


def test_ops_are_registered_with_fake_implementations():
    q, k, v = _inputs(1, 2, 2, 20, 16)
    gates = -torch.rand(1, 2, 20)
    decay = flexgen.frontend.trace.trace(gated(gates), "decay_mod").graph
    feature = flexgen.frontend.trace.trace(elu1, "feature_map").graph
    torch.library.opcheck(torch.ops.flexgen.linear_attention.default,
                          (q, k, v, None, [gates], [], decay, feature, 0.25, False, True, "BLOCK_M=16"),
                          test_utils=("test_schema", "test_faketensor"))
    state = torch.zeros(3, 2, 16, 16)
    torch.library.opcheck(torch.ops.flexgen.linear_attention_decode.default,
                          (q[:, :, :1], k[:, :, :1], v[:, :, :1], state, torch.tensor([2], dtype=torch.int32),
                           [gates], [], decay, feature, 0.25, False, ""),
                          test_utils=("test_schema", "test_faketensor"))


def test_errors():
    q, k, v = _inputs(1, 2, 2, 20, 16)
    with pytest.raises(TraceError, match="decay_mod 'positive'.*bool"):
        def positive(b, h, t):
            return t > 3
        linear_attention(q, k, v, decay_mod=positive)
    with pytest.raises(TraceError, match="feature_map 'indexed'.*1 arguments"):
        def indexed(x, h):
            return x * h
        linear_attention(q, k, v, feature_map=indexed)
    with pytest.raises(TraceError, match="decay_mod '.*'.*3 arguments"):
        linear_attention(q, k, v, decay_mod=lambda b, h, q_idx, kv_idx: 0.0)
    with pytest.raises(FlexgenError, match="key/value length"):
        linear_attention(q, k[:, :, :10], v[:, :, :10])
    with pytest.raises(FlexgenError, match="initial_state: expected a tensor \\[1, 2, 16, 16\\]"):
        linear_attention(q, k, v, initial_state=torch.zeros(1, 2, 16, 8))
    with pytest.raises(FlexgenError, match="enable_gqa"):
        linear_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(FlexgenError, match="BLOCK_M"):
        linear_attention(q, k, v, kernel_options={"BLOCK_M": 24})
    cache = torch.zeros(4, 2, 16, 16)
    with pytest.raises(FlexgenError, match="state: expected a float32"):
        linear_attention_decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache.double(), [0])
    with pytest.raises(FlexgenError, match="slots: expected rows of the state cache"):
        linear_attention_decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache, [4])
    with pytest.raises(FlexgenError, match="state: expected a tensor \\[num_slots, 2, 16, 16\\]"):
        linear_attention_decode(q[:, :, :1], k[:, :, :1], v[:, :, :1], cache[:, :1], [0])
    temperature = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(GradientError, match="feature_map 'scaled'.*captured"):
        def scaled(x):
            return x * temperature
        linear_attention(q.requires_grad_(), k, v, feature_map=scaled)
    with pytest.raises(GradientError, match="feature_map 'stepped'"):
        def stepped(x):
            return torch.floor(x) + 1.0
        linear_attention(q.requires_grad_(), k, v, feature_map=stepped)


# --------------------------------------------------------------------------- snapshots

@pytest.fixture
def snapshot(snapshot):
    from test_snapshots import KernelSourceExtension
    return snapshot.use_extension(KernelSourceExtension)


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
GATES = torch.zeros(1, 4, 128, requires_grad=True)
SNAPSHOTS = {
    "state_lightning": ("state", lightning(SLOPES), None),
    "state_plain_elu": ("state", None, elu1),
    "output_lightning_elu": ("output", lightning(SLOPES), elu1),
    "output_plain": ("output", None, None),
    "grad_gates_elu": ("grad", gated(GATES), elu1),
    "gates_per_token": ("gates", gated(GATES), None),
    "prefix_gates": ("prefix", gated(GATES), None),
    "decode_gates_elu": ("decode", gated(GATES), elu1),
}


@pytest.mark.parametrize("case", SNAPSHOTS)
def test_kernel_source_snapshot(case, snapshot):
    """Golden linear-attention kernels (tests/snapshots/test_linear/); rewrite with --snapshot-update."""
    from test_snapshots import normalize
    part, decay_mod, feature_map = SNAPSHOTS[case]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 128, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, generator=gen).to(torch.bfloat16)
    text = flexgen.linear_kernel_source(q, k, k.clone(), decay_mod, feature_map, enable_gqa=True, part=part)
    assert normalize(text) == snapshot


def test_snapshot_files_are_there():
    folder = Path(__file__).parent / "snapshots" / "test_linear"
    assert {p.name for p in folder.glob("*.py.txt")} == {
        f"test_kernel_source_snapshot[{case}].py.txt" for case in SNAPSHOTS}
