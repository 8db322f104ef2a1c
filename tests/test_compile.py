"""flexgen under torch.compile and torch.export: one opaque op per call, no graph breaks.

Every public entry point is traced with ``fullgraph=True`` (a graph break is an error)
and compared with eager flexgen and the float64 oracle; a counting backend checks that
repeated calls with new tensors of the same shapes do not recompile. Most tests compile
with ``aot_eager`` (AOTAutograd, functionalization and the ops' fake implementations,
without inductor's C++ build); one runs the default inductor backend end to end. On CPU
the Triton interpreter runs inside the op, so dynamo never sees it.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import flexgen
from flexgen import AuxRequest, create_block_mask, decode_attention, flex_attention
from flexgen import mods as M
from flexgen.reference import flex_attention_reference
from conftest import make_qkv

# torch / Hugging Face / distributed plumbing: CI's second pass compiles its kernels from the
# first pass's record instead of running it (conftest, FLEXGEN_TEST_RECORD_ONCE).
pytestmark = pytest.mark.once

B, H, L, D = 1, 2, 48, 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn, backend="aot_eager"):
    """``fn`` compiled with fullgraph=True, and the counter of frames it compiled."""
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, fullgraph=True, backend=counter), counter


def close(got, want, tol=2e-5):
    torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=tol)


def test_block_mask_built_inside_and_captured_bias_no_recompile():
    """create_block_mask and a score_mod closing over a graph input, both inside the
    compiled function: one frame, the same answer as eager, and new bias / query tensors
    of the same shapes run the same graph."""
    def fn(q, k, v, bias):
        mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)

        def biased(score, b, h, q_idx, kv_idx):
            return score + bias[h, q_idx, kv_idx]
        return flex_attention(q, k, v, score_mod=biased, block_mask=mask)

    cfn, counter = compiled(fn)
    for step in range(3):
        q, k, v = make_qkv(B=B, H=H, L=L, D=D)
        bias = torch.randn(H, L, L)
        got = cfn(q, k, v, bias)
        close(got, fn(q, k, v, bias))
        close(got, flex_attention_reference(
            q, k, v, lambda s, b, h, qi, kv: s + bias[h, qi, kv], causal))
    assert counter.frame_count == 1


def test_block_mask_built_outside_gqa_lse_and_aux():
    """A mask made outside (an input of the compiled function), GQA, return_lse and
    return_aux with max_scores."""
    mask = create_block_mask(M.sliding_window(20), None, None, L, L, device="cpu", BLOCK_SIZE=16)

    def fn(q, k, v, mask):
        out, lse = flex_attention(q, k, v, score_mod=M.tanh_softcap(5.0), block_mask=mask,
                                  enable_gqa=True, return_lse=True)
        out2, aux = flex_attention(q, k, v, block_mask=mask, enable_gqa=True,
                                   return_aux=AuxRequest(lse=True, max_scores=True))
        return out, lse, out2, aux.lse, aux.max_scores

    cfn, counter = compiled(fn)
    q = torch.randn(B, 4, L, D)
    k, v = torch.randn(B, 2, L, D), torch.randn(B, 2, L, D)
    for got, want in zip(cfn(q, k, v, mask), fn(q, k, v, mask)):
        close(got, want)
    q2 = torch.randn_like(q)
    cfn(q2, k, v, mask)
    assert counter.frame_count == 1


def test_training_step_with_a_learned_bias_matches_eager():
    """Forward + backward through a compiled module: gradients of q, k, v and of a learned
    bias (an nn.Parameter read by a score_mod defined in forward) equal eager's."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.randn(H, L) * 0.1)

        def forward(self, q, k, v):
            mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)

            def learned(score, b, h, q_idx, kv_idx):
                return score + self.bias[h, kv_idx]
            return flex_attention(q, k, v, score_mod=learned, block_mask=mask)

    module = Block()
    q, k, v = (t.requires_grad_() for t in make_qkv(B=B, H=H, L=L, D=D))
    cmod = torch.compile(module, fullgraph=True, backend="aot_eager")
    grads = []
    for run in (cmod, module):
        for t in (q, k, v, module.bias):
            t.grad = None
        (run(q, k, v) * torch.linspace(-1, 1, D)).sum().backward()
        grads.append([t.grad.clone() for t in (q, k, v, module.bias)])
    for got, want in zip(*grads):
        close(got, want, 1e-4)


def test_inductor_forward_and_backward():
    """The default backend (inductor) around the op: forward and backward match eager."""
    q, k, v = (t.requires_grad_() for t in make_qkv(B=B, H=H, L=L, D=D))
    slopes = torch.linspace(0.1, 0.5, H)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=M.alibi(H), block_mask=None).square().sum()

    cfn = torch.compile(fn, fullgraph=True)
    got = torch.autograd.grad(cfn(q, k, v), (q, k, v))
    want = torch.autograd.grad(fn(q, k, v), (q, k, v))
    for g, w in zip(got, want):
        close(g, w, 1e-4)
    del slopes


def test_decode_attention_with_device_lengths():
    """decode_attention with lengths in a tensor (a decode loop's step): one frame for
    every length the tensor takes."""
    Hkv, Lk = 2, 70
    k, v = torch.randn(2, Hkv, Lk, D), torch.randn(2, Hkv, Lk, D)

    def step(q, lengths):
        return decode_attention(q, k, v, score_mod=M.tanh_softcap(4.0), enable_gqa=True,
                                kv_lengths=lengths, max_kv_len=Lk)

    cstep, counter = compiled(step)
    for n in ((10, 70), (11, 33), (70, 1)):
        q = torch.randn(2, 4, 1, D)
        lengths = torch.tensor(n, dtype=torch.int32)
        close(cstep(q, lengths), step(q, lengths))
    assert counter.frame_count == 1


def test_a_trace_on_fake_tensors_leaves_nothing_fake_behind():
    """decode_attention traced under FakeTensorMode (make_fx's "fake" tracing) keeps none of its
    fake constants: later real calls of both entry points run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = torch.randn(1, 4, 1, D), torch.randn(1, 2, 64, D), torch.randn(1, 2, 64, D)
        decode_attention(q, k, v, enable_gqa=True)
    q, k, v = torch.randn(1, 4, 1, D), torch.randn(1, 2, 64, D), torch.randn(1, 2, 64, D)
    close(decode_attention(q, k, v, enable_gqa=True), flex_attention(q, k, v, enable_gqa=True))
    assert flex_attention(torch.randn(1, 2, 16, D), k, v).shape == (1, 2, 16, D)


def test_reflected_operators_with_captured_scalars_match_eager():
    """A captured 0-d tensor on the right of a non-commutative operator (``score / temperature``,
    ``score - cap``, ``**``, ``//``, ``%``): torch defines these reflected operators in Python,
    and dynamo hands the trace mode another object for them than torch.Tensor's. A learned
    temperature's gradient equals eager's."""
    cap, three = torch.tensor(5.0), torch.tensor(3)
    mods = [lambda s, b, h, q, kv: s - cap,
            lambda s, b, h, q, kv: s.abs() ** (cap / 5),
            lambda s, b, h, q, kv: s + q // cap,
            lambda s, b, h, q, kv: s + q % three]
    q, k, v = make_qkv(B=B, H=H, L=L, D=D)
    for mod in mods:
        torch._dynamo.reset()
        fn, _ = compiled(lambda q, k, v: flex_attention(q, k, v, score_mod=mod))
        close(fn(q, k, v), flex_attention_reference(q, k, v, mod, None), 1e-4)

    class Tempered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.temperature = torch.nn.Parameter(torch.tensor(2.0))

        def forward(self, q, k, v):
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s / self.temperature)

    module = Tempered()
    cmod = torch.compile(module, fullgraph=True, backend="aot_eager")
    grads = []
    for run in (cmod, module):
        module.temperature.grad = None
        (run(q, k, v) * torch.linspace(-1, 1, D)).sum().backward()
        grads.append(module.temperature.grad.clone())
    close(*grads, 1e-4)


def test_paged_cache_append_in_a_compiled_step_runs_outside_the_graph():
    """PagedKVCache's bookkeeping (page allocation, token counts in Python) is not traced: in a
    compiled step that appends and attends, one frame for every step (not a recompile a step as
    its lengths grow) and eager's outputs; fullgraph=True refuses it saying where it belongs."""
    def make():
        cache = flexgen.PagedKVCache(num_pages=16, page_size=8, num_kv_heads=2, head_dim=D, max_batch=2,
                                     max_pages_per_seq=8, dtype=torch.float32, device="cpu")
        return cache, [cache.add_sequence() for _ in range(2)]

    def step(cache, slots, q, k, v):
        cache.append(slots, k, v)
        return cache.attention(q, slots)

    (cache, slots), (twin, twin_slots) = make(), make()
    counter = CompileCounterWithBackend("aot_eager")
    cstep = torch.compile(step, backend=counter)
    for _ in range(10):
        q, k, v = torch.randn(2, 4, 1, D), torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D)
        close(cstep(cache, slots, q, k, v), step(twin, twin_slots, q, k, v))
    assert counter.frame_count == 1 and cache.length(slots[0]) == 10
    with pytest.raises(Exception, match="outside the compiled function"):
        compiled(step)[0](cache, slots, q, k, v)


def test_paged_cache_attention_compiles_once_as_its_sequences_grow():
    """PagedKVCache.attention in a compiled decode step: no graph break, and one frame while the
    cache grows between steps (its host lengths are not read while compiling; the kernel reads
    the device ones)."""
    cache = flexgen.PagedKVCache(num_pages=16, page_size=8, num_kv_heads=2, head_dim=D, max_batch=2,
                                 max_pages_per_seq=8, dtype=torch.float32, device="cpu")
    slots = [cache.add_sequence() for _ in range(2)]
    cache.append(slots, torch.randn(2, 2, 5, D), torch.randn(2, 2, 5, D))

    def step(q):
        return cache.attention(q, slots, score_mod=M.tanh_softcap(4.0))

    cstep, counter = compiled(step)
    for _ in range(3):
        q = torch.randn(2, 4, 1, D)
        close(cstep(q), step(q))
        cache.append(slots, torch.randn(2, 2, 1, D), torch.randn(2, 2, 1, D))
    assert counter.frame_count == 1


@pytest.mark.parametrize("strict", [False, True])
def test_export_runs_and_matches(strict):
    """torch.export (strict and non-strict): a program with flexgen's ops in it that runs
    on new inputs and matches eager."""
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, bias):
            mask = create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)
            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + bias[h, kv],
                                  block_mask=mask)

    q, k, v = make_qkv(B=B, H=H, L=L, D=D)
    bias = torch.randn(H, L)
    program = torch.export.export(Attend(), (q, k, v, bias), strict=strict)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"flexgen.block_mask.default", "flexgen.attention.default"} <= targets
    q2, bias2 = torch.randn_like(q), torch.randn_like(bias)
    close(program.module()(q2, k, v, bias2), Attend()(q2, k, v, bias2))


def test_errors_surface_at_compile_time():
    """A mod flexgen cannot trace fails while compiling, with flexgen's message."""
    def fn(q):
        def branchy(score, b, h, q_idx, kv_idx):
            return score if q_idx > kv_idx else -score
        return flex_attention(q, q, q, score_mod=branchy)

    with pytest.raises(Exception, match="torch.where"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(torch.randn(B, H, L, D))


def test_ops_are_registered_with_fake_implementations():
    """Each op passes torch.library's own checks (schema, fake impl, autograd registration)
    on a representative call."""
    import flexgen.runtime.ops  # noqa: F401  (registers the ops; flexgen imports it lazily)
    from flexgen.frontend.trace import trace
    q, k, v = make_qkv(B=B, H=H, L=32, D=D)
    bias = torch.randn(H, 32)
    traced = trace(lambda s, b, h, qi, kv: s + bias[h, kv], "score_mod")
    torch.library.opcheck(torch.ops.flexgen.attention.default,
                          (q, k, v, [bias], [], [], traced.graph, "", [], [], 0.25, False, "", False),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.flexgen.block_mask.default,
                          ([], trace(causal, "mask_mod").graph, 1, 1, 32, 32,
                           16, 16, torch.device("cpu")),
                          test_utils=("test_schema", "test_faketensor"))


def test_attention_op_differentiates_once():
    """The attention op's registered backward runs flexgen::attention_backward, an op with no
    autograd kernel (the dispatcher's cheapest path): backward(create_graph=True) gives the
    gradients a plain backward gives, differentiating them again raises, and so does a call
    of the backward op itself with inputs that want a gradient (never a silent zero)."""
    import flexgen.runtime.ops  # noqa: F401  (registers the ops; flexgen imports it lazily)
    from flexgen.frontend.trace import trace
    q, k, v = (t.requires_grad_() for t in make_qkv(B=B, H=H, L=32, D=D))
    bias = torch.randn(H, 32, requires_grad=True)
    graph = trace(lambda s, b, h, qi, kv: s + bias[h, kv], "score_mod").graph
    args = (q, k, v, [bias], [], [], graph, "", [], [], 0.25, False, "", False)
    weight = torch.randn(B, H, 32, D, requires_grad=True)   # dO depends on it: it requires grad

    out, lse, _ = torch.ops.flexgen.attention.default(*args)
    want = torch.autograd.grad((out * weight).sum(), (q, bias))
    out, lse, _ = torch.ops.flexgen.attention.default(*args)
    got = torch.autograd.grad((out * weight).sum(), (q, bias), create_graph=True)
    for g, w in zip(got, want):
        close(g, w)
        assert g.requires_grad
    with pytest.raises(RuntimeError, match="differentiable once"):
        got[0].sum().backward()

    with pytest.raises(flexgen.FlexgenError, match="attention_backward.*no derivative"):
        torch.ops.flexgen.attention_backward.default(
            q, k, v, out, lse, torch.ones_like(out), None, [bias], [], [], graph, "", [], [], 0.25,
            False, "", [0], True)


class _OpsSeen(TorchDispatchMode):
    """A dispatch mode listing the ops that reach it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_attention_op_runs_directly_only_with_nothing_below_autograd():
    """A call of the attention op that wants no gradient runs its implementation from the
    autograd kernel (flexgen/runtime/ops/define.py), but a dispatch mode still sees the op
    itself (it runs below autograd: skipping to the implementation would hide the op from
    FakeTensorMode, tracing, torch.export), and the results are the same either way."""
    import flexgen.runtime.ops  # noqa: F401  (registers the ops; flexgen imports it lazily)

    q, k, v = make_qkv(B=B, H=H, L=32, D=D)
    args = (q, k, v, [], [], [], "", "", [], [], 0.25, False, "", False)
    with torch.no_grad():
        direct = torch.ops.flexgen.attention.default(*args)
        with _OpsSeen() as seen:
            through = torch.ops.flexgen.attention.default(*args)
    assert "flexgen.attention.default" in seen.ops, seen.ops
    for a, b in zip(direct[:2], through[:2]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_block_mask_op_takes_inputs_that_want_a_gradient_and_gives_integer_lists():
    """flexgen::block_mask is an op of the torch.library.Library without an autograd kernel (its
    outputs are int32 lists, which carry no gradient): a mask reading a float tensor that
    requires grad builds the same lists as without, none of them requiring grad, and a dispatch
    mode sees the op."""
    import flexgen.runtime.ops  # noqa: F401  (registers the ops; flexgen imports it lazily)
    from flexgen.api import _mods

    level = torch.randn(200)

    def same_level(b, h, q_idx, kv_idx):
        return (level[q_idx] > 0) == (level[kv_idx] > 0)

    mask = flexgen.create_block_mask(same_level, 1, 1, 200, 200, device="cpu")
    _, _, graph, _, _, _, _ = _mods(None, mask)
    args = (graph, 1, 1, 200, 200, 64, 64, torch.device("cpu"))
    want = torch.ops.flexgen.block_mask.default([level], *args)
    with _OpsSeen() as seen:
        got = torch.ops.flexgen.block_mask.default([level.clone().requires_grad_()], *args)
    assert "flexgen.block_mask.default" in seen.ops, seen.ops
    assert got.dtype == torch.int32 and not got.requires_grad
    torch.testing.assert_close(got, want, atol=0, rtol=0)

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_reduce_overhead_replays_on_gpu():
    """mode="reduce-overhead" captures flexgen's ops in CUDA graphs: replays with new
    inputs (and new block-mask lists, mask built inside) give eager's answers."""
    L = 512

    def fn(q, k, v, bias):
        mask = create_block_mask(causal, None, None, L, L, device="cuda")
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + bias[h, kv],
                              block_mask=mask)

    cfn = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bias = torch.randn(4, L, device="cuda")
        close(cfn(q, k, v, bias), fn(q, k, v, bias), 2e-2)

    lengths = torch.tensor([100, 300], dtype=torch.int32, device="cuda")
    k, v = (torch.randn(2, 2, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def step(q, lengths):
        return decode_attention(q, k, v, enable_gqa=True, kv_lengths=lengths, max_kv_len=L)

    cstep = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for n in ((100, 300), (101, 301), (500, 7), (512, 1)):
        lengths.copy_(torch.tensor(n, dtype=torch.int32))
        q = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
        close(cstep(q, lengths), step(q, lengths), 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_cuda_graph_captured_by_hand_on_gpu():
    """A serving loop's step captured with torch.cuda.graph (no torch.compile): flex_attention
    over a block mask built before, flex_attention's decode path and decode_attention with
    lengths in a device tensor. Regression: the decode path's int constants were copied from
    the host, which a capture refuses. Replays after new inputs are copied in give eager's answers."""
    L = 512
    mask = create_block_mask(causal, None, None, L, L, device="cuda")
    q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q1 = torch.randn(2, 4, 1, 64, device="cuda", dtype=torch.bfloat16)
    lengths = torch.tensor([100, 300], dtype=torch.int32, device="cuda")

    def step():
        return (flex_attention(q, k, v, block_mask=mask),
                flex_attention(q1, k, v),
                decode_attention(q1, k, v, kv_lengths=lengths, max_kv_len=L))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()                              # warm: kernels compiled, plans made
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for n in ((100, 300), (512, 1), (7, 500)):
        for t in (q, k, v, q1):
            t.copy_(torch.randn_like(t))
        lengths.copy_(torch.tensor(n, dtype=torch.int32))
        graph.replay()
        for got, want in zip(outs, step()):
            close(got, want, 2e-2)


def test_op_string_arguments_are_single_lines():
    """Regression (H100, torch 2.11): inductor prints an op's str arguments unquoted in the
    FX-graph comments of the code it generates for CUDA; a mod's program text with newlines
    ended the comment and the module failed to import ("unmatched ')'")."""
    from flexgen.frontend.trace import trace
    bias = torch.randn(4)
    for mod, kind in ((lambda score, b, h, q_idx, kv_idx: score + bias[h], "score_mod"),
                      (causal, "mask_mod")):
        graph = trace(mod, kind).graph
        assert "\n" not in graph and "\r" not in graph, graph


def test_block_mask_op_stays_out_of_cuda_graphs():
    """Building a mask reads values back to the host, which a CUDA graph capture cannot hold
    (on the H100, mode="reduce-overhead" with the mask built inside failed in capture):
    the op is tagged so torch.compile runs it outside its graphs."""
    import flexgen.runtime.ops  # noqa: F401  (registers the ops; flexgen imports it lazily)
    assert torch.Tag.cudagraph_unsafe in torch.ops.flexgen.block_mask.default.tags


def _arguments_of(monkeypatch, family, name):
    """The arguments the public call passes to ``flexgen.runtime.ops.<family>.<name>`` (recorded)."""
    import importlib
    ops = importlib.import_module(f"flexgen.runtime.ops.{family}")
    seen, real = [], getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *args: (seen.append(args), real(*args))[1])
    return seen


def test_serving_ops_are_registered_with_fake_implementations(monkeypatch):
    """varlen_attention's and the RoPE append's ops pass torch.library's checks on the
    arguments their public calls give them."""
    varlen = _arguments_of(monkeypatch, "varlen", "call_varlen_attention")
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    flexgen.varlen_attention(q, k, v, cu, cu, 5, 5, mask_mod=causal)
    torch.library.opcheck(torch.ops.flexgen.varlen_attention.default, varlen[0],
                          test_utils=("test_schema", "test_faketensor"))

    rope = _arguments_of(monkeypatch, "serving", "call_paged_write_rope")
    cache = flexgen.PagedKVCache(num_pages=4, page_size=8, num_kv_heads=2, head_dim=16, max_batch=2,
                                 max_pages_per_seq=2, dtype=torch.float32, device="cpu")
    slots = [cache.add_sequence() for _ in range(2)]
    cache.append(slots, torch.randn(2, 2, 3, 16), torch.randn(2, 2, 3, 16), rope=flexgen.RoPE(),
                 query=torch.randn(2, 4, 3, 16))
    torch.library.opcheck(torch.ops.flexgen.paged_write_rope.default, rope[0],
                          test_utils=("test_schema", "test_faketensor"))
