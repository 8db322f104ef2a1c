"""The warm host path: the call memo (flexgen.api._prepare) and the direct launch
(flexgen.runtime.launch._launch_compiled, with a stand-in for Triton's kernel).

The direct launch needs a GPU; these tests pin down its bookkeeping: the first
launch of a specialization goes through Triton (``KERNEL[grid](...)``), later
ones call the compiled kernel's launcher with every parameter in signature
order, and anything Triton would specialize differently goes through Triton again.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch
import triton

import flexgen
from flexgen import api
from flexgen.runtime import launch
from flexgen.errors import InputError
from flexgen.codegen.spec import KernelSpec


class FakeCompiled:
    function, packed_metadata = "function-handle", (4, 1, 0)

    def __init__(self):
        self.calls = []

    def run(self, *call):
        self.calls.append(call)


class FakeKernel:
    """Stands in for a JITFunction: records Triton-path launches, returns one compiled kernel."""
    arg_names = ["X", "N", "stride", "SCALE", "BLOCK", "EVEN"]

    def __init__(self):
        self.compiled = FakeCompiled()
        self.triton_launches = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.triton_launches.append((grid, args, kwargs))
            return self.compiled
        return launch_


@pytest.fixture
def fake_gpu(monkeypatch):
    launch._COMPILED.clear()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)      # a replay's check
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    kernel = FakeKernel()
    module = types.SimpleNamespace(KERNEL=kernel, NUM_WARPS=4, NUM_STAGES=2)
    yield module, kernel
    launch._COMPILED.clear()


SPEC = KernelSpec("forward", qk_head=64, v_head=64, dtype="float32")


def _launch(module, x, n=100, stride=64, grid=(3, 2)):
    launch._launch_compiled(SPEC, module, grid, [x, n, stride, 0.125], dict(BLOCK=64, EVEN=True))


def test_second_launch_calls_the_compiled_launcher_directly(fake_gpu):
    module, kernel = fake_gpu
    x = torch.zeros(64)
    _launch(module, x)
    assert len(kernel.triton_launches) == 1
    grid, args, kwargs = kernel.triton_launches[0]
    assert kwargs == dict(BLOCK=64, EVEN=True, num_warps=4, num_stages=2)
    assert kernel.compiled.calls == []

    y = torch.ones(64)
    _launch(module, y, n=200, grid=(5,))
    assert len(kernel.triton_launches) == 1
    (call,) = kernel.compiled.calls
    assert call[:3] == (5, 1, 1)
    assert call[3] == 1234 and call[4] == "function-handle" and call[5] == (4, 1, 0)
    assert call[6:9] == (None, None, None)
    # Every parameter in signature order, constexprs included (the launcher skips them).
    assert call[9] is y and call[10:] == (200, 64, 0.125, 64, True)


@pytest.mark.parametrize("change", ["alignment", "int_is_one", "multiple_of_16", "dtype", "constexpr", "wide_int"])
def test_a_different_specialization_goes_through_triton(fake_gpu, change):
    module, kernel = fake_gpu
    base = torch.zeros(64)
    _launch(module, base, n=100, stride=64)
    x, n, stride, constexprs = base, 100, 64, dict(BLOCK=64, EVEN=True)
    if change == "alignment":
        x = base[1:]                        # 4 bytes past a 16-byte boundary
    elif change == "int_is_one":
        stride = 1
    elif change == "multiple_of_16":
        n = 96
    elif change == "dtype":
        x = torch.zeros(64, dtype=torch.float16)
    elif change == "constexpr":
        constexprs = dict(BLOCK=64, EVEN=False)
    elif change == "wide_int":
        n = 2**31 + 1
    launch._launch_compiled(SPEC, module, (1,), [x, n, stride, 0.125], constexprs)
    assert len(kernel.triton_launches) == 2
    assert kernel.compiled.calls == []


def test_launch_hooks_keep_tritons_path(fake_gpu, monkeypatch):
    module, kernel = fake_gpu
    hooks = triton.knobs.runtime
    x = torch.zeros(64)
    _launch(module, x)
    monkeypatch.setattr(hooks, "launch_enter_hook", lambda metadata: None)
    _launch(module, x)
    assert len(kernel.triton_launches) == 2 and kernel.compiled.calls == []


def test_unhandled_argument_types_keep_tritons_path(fake_gpu):
    module, kernel = fake_gpu
    for _ in range(2):
        launch._launch_compiled(SPEC, module, (1,), [torch.zeros(4), True, 3, 0.5], dict(BLOCK=64, EVEN=True))
    assert len(kernel.triton_launches) == 2


def test_arg_classes_match_tritons_specialization():
    """Wherever Triton specializes two arguments differently, so does the key (finer is fine)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(64, dtype=torch.bfloat16)

    def desc(t, block):
        t = t.view(1, 1, -1, 16)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block, 16])

    values = [0, 1, 2, 15, 16, 17, -16, 2**31 - 1, 2**31, 2**32, -2**31 - 1, 2**63, 0.5,
              base, base[1:], base[8:], base.float(),
              desc(base, 4), desc(base, 2), desc(base[16:], 4), desc(base.half(), 4)]
    for a in values:
        for b in values:
            if type(a) is not type(b):
                continue
            if native_specialize_impl(BaseBackend, a, False, True, True) != \
                    native_specialize_impl(BaseBackend, b, False, True, True):
                assert launch._arg_classes([a]) != launch._arg_classes([b]), (a, b)


def test_replay_launches_with_new_leading_tensors_only_when_they_specialize_alike(fake_gpu, monkeypatch):
    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)     # the suite records launches for its AOT check
    x = torch.zeros(64)
    launched = launch._launch_compiled(SPEC, module, (3, 2), [x, 100, 64, 0.125], dict(BLOCK=64, EVEN=True))
    replay = launch.Replay(*launched, 1)
    y = torch.ones(64)
    assert replay(y)
    call = kernel.compiled.calls[-1]
    assert call[:3] == (3, 2, 1) and call[9] is y and call[10:] == (100, 64, 0.125, 64, True)
    calls = len(kernel.compiled.calls)
    assert not replay(torch.ones(65)[1:])                       # not 16-byte aligned
    assert not replay(torch.ones(64, dtype=torch.float16))      # another dtype
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert not replay(y)                                        # another current device
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(launch, "RECORDED", [])
    assert not replay(y)                                        # recording for the AOT checks
    assert len(kernel.compiled.calls) == calls


def test_replay_launch_skips_only_the_class_check(fake_gpu, monkeypatch):
    """``Replay.launch`` is for a caller that has checked the tensors' classes itself
    (api._forward): it launches whatever it gets, and still declines where Triton's own
    path must run (another current device, launch hooks, recording)."""
    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)
    launched = launch._launch_compiled(SPEC, module, (3, 2), [torch.zeros(64), 100, 64, 0.125],
                                       dict(BLOCK=64, EVEN=True))
    replay = launch.Replay(*launched, 1)
    y = torch.ones(64)
    assert replay.launch(y) and kernel.compiled.calls[-1][9] is y
    calls = len(kernel.compiled.calls)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert not replay.launch(y)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    with monkeypatch.context() as m:
        m.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert not replay.launch(y)
    monkeypatch.setattr(launch, "RECORDED", [])
    assert not replay.launch(y)
    assert len(kernel.compiled.calls) == calls


def test_no_replay_of_tma_descriptors(fake_gpu, monkeypatch):
    """A replay swaps tensors in; a launch whose leading arguments are descriptors is not replayed."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)
    monkeypatch.setattr(launch, "_launch", lambda spec, device, inputs: (kernel.compiled, (1,), list(inputs), (), 0))
    t = torch.zeros(1, 1, 16, 16)
    d = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, 16])
    cuda = torch.device("cuda", 0)
    assert launch.run(SPEC, cuda, d, 3, replay=1) is None
    assert isinstance(launch.run(SPEC, cuda, t, 3, replay=1), launch.Replay)


def test_the_interpreter_path_never_replays():
    q = torch.randn(1, 2, 40, 32)
    flexgen.flex_attention(q, q, q)
    assert _prepare(q, q, q).replay == [None]


# ---------------------------------------------------------------------------- call memo

def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _prepare(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
    return api._prepare(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options)


def test_a_repeated_call_reuses_its_plan():
    q = torch.randn(1, 2, 40, 32)
    mask = flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu")
    first = _prepare(q, q, q, block_mask=mask, kernel_options={"BLOCK_M": 16})
    again = _prepare(torch.randn(1, 2, 40, 32), q, q, block_mask=mask, kernel_options={"BLOCK_M": 16})
    assert again is first


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "scale", "gqa_heads", "options",
                                    "mask_object", "mask_lists", "score_mod", "captured_tensor",
                                    "alignment"])
def test_anything_the_plan_reads_makes_a_new_plan(change):
    q = torch.randn(1, 2, 40, 32)
    bias = torch.randn(4)       # one per head of the GQA case's query heads (h indexes it)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    mask = flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu")
    args = dict(q=q, k=q, v=q, score_mod=biased, block_mask=mask)
    first = _prepare(**args)
    if change == "shape":
        x = torch.randn(1, 2, 40, 48)
        args.update(q=x, k=x, v=x)
    elif change == "stride":
        x = torch.randn(1, 40, 2, 32).transpose(1, 2)
        args.update(q=x)
    elif change == "dtype":
        x = q.to(torch.float16)
        args.update(q=x, k=x, v=x)
    elif change == "scale":
        args.update(scale=0.5)
    elif change == "gqa_heads":
        args.update(q=torch.randn(1, 4, 40, 32), enable_gqa=True)
    elif change == "options":
        args.update(kernel_options={"BLOCK_N": 16})
    elif change == "mask_object":
        args.update(block_mask=flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu"))
    elif change == "mask_lists":
        mask.kv_num_blocks = mask.kv_num_blocks.clone()
    elif change == "score_mod":
        args.update(score_mod=lambda score, b, h, q_idx, kv_idx: score * 2)
    elif change == "captured_tensor":
        bias = torch.randn(4, dtype=torch.float64)     # the closure now reads a new tensor
    elif change == "alignment":
        args.update(q=_misaligned(q))                  # same shape and strides
    second = _prepare(**args)
    assert second is not first
    assert second.aligned == (change != "alignment")
    if change == "mask_lists":
        assert second.sparse[0].data_ptr() == mask.kv_num_blocks.data_ptr()
    if change == "captured_tensor":
        assert second.score_buffers[0] is bias


def test_a_bad_call_still_raises_after_a_good_one():
    q = torch.randn(1, 2, 40, 32)
    _prepare(q, q, q)
    with pytest.raises(InputError, match="key.shape"):
        _prepare(q, q[..., :16], q)
    with pytest.raises(InputError, match="enable_gqa"):
        _prepare(q, q[:, :1], q[:, :1])
    with pytest.raises(InputError, match="kernel_options"):
        _prepare(q, q, q, kernel_options={"BLOCK_Q": 64})
    _prepare(q, q, q, scale=1)
    with pytest.raises(InputError, match="scale"):
        _prepare(q, q, q, scale=True)       # equal to 1, and still not a scale
    _prepare(q, q, q, kernel_options={"BLOCK_M": 16})
    with pytest.raises(InputError, match="BLOCK_M"):
        _prepare(q, q, q, kernel_options={"BLOCK_M": 16.0})     # equal to 16, and still not a tile


def _misaligned(t):
    """A copy of ``t`` with the same shape and strides whose base is 4 bytes off 16-byte alignment."""
    flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
    shift = (16 - flat.data_ptr() % 16) % 16 // t.element_size() + 4 // t.element_size()
    out = flat[shift:shift + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.stride() == t.stride() and out.data_ptr() % 16 != 0
    return out


_SCALE = 0.5


def _scaled(score, b, h, q_idx, kv_idx):
    return score * _SCALE


def _helper(score):
    return score * _SCALE + 1.0


def _via_helper(score, b, h, q_idx, kv_idx):
    return _helper(score)


def test_what_the_memos_key_on_still_gives_the_right_result(helpers, monkeypatch):
    """Calls that differ from an earlier one only in what the memos (the call's plan, the
    score_mod's trace) key on: each matches the float64 oracle."""
    q, k, v = helpers.make_qkv(B=1, H=2, L=40, D=32)
    bias = torch.randn(2)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    helpers.run_and_check(q, k, v, biased)
    helpers.run_and_check(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, biased)   # strides
    helpers.run_and_check(_misaligned(q), k, _misaligned(v), biased)                     # alignment
    bias = torch.randn(2) * 4                    # the closure's cell now holds a new tensor
    helpers.run_and_check(q, k, v, biased)
    bias.mul_(-1)                                # the same tensor, new values: read at run time
    helpers.run_and_check(q, k, v, biased)
    for mod in (_scaled, _via_helper):           # a global read directly, and through a helper
        helpers.run_and_check(q, k, v, mod)
        monkeypatch.setattr(sys.modules[__name__], "_SCALE", 2.5)
        helpers.run_and_check(q, k, v, mod)
        monkeypatch.setattr(sys.modules[__name__], "_SCALE", 0.5)


def _fake_forward_launches(kernel, monkeypatch):
    """Let launch.run hand api._forward a Replay of the fake compiled kernel (as on a GPU);
    returns the list of the launches that went through launch.run (their inputs)."""
    monkeypatch.setattr(launch, "RECORDED", None)
    monkeypatch.setattr(api, "_CALLS", {})
    launched = []

    def fake_launch(spec, device, inputs):
        launched.append(inputs)
        return kernel.compiled, (4, 2), list(inputs), ("tail",), 0
    monkeypatch.setattr(launch, "_launch", fake_launch)
    return launched


def test_a_repeated_forward_call_replays_with_its_new_tensors(fake_gpu, monkeypatch):
    module, kernel = fake_gpu
    launched = _fake_forward_launches(kernel, monkeypatch)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    flexgen.flex_attention(q, k, v)
    assert len(launched) == 1 and kernel.compiled.calls == []
    q2 = torch.randn(1, 2, 40, 32)
    out, lse = flexgen.flex_attention(q2, k, v, return_lse=True)
    assert len(launched) == 1
    call = kernel.compiled.calls[-1]
    assert call[:4] == (4, 2, 1, 1234)
    assert all(a is b for a, b in zip(call[9:14], (q2, k, v, out, lse)))
    assert call[14:] == (*launched[0][5:], "tail")      # everything else as at the first launch

    # A misaligned query: another plan, launched anew; a later call like it replays after
    # the full check of its tensors' classes (its plan only knows that one is misaligned).
    qm = _misaligned(q)
    flexgen.flex_attention(qm, k, v)
    assert len(launched) == 2
    calls = len(kernel.compiled.calls)
    flexgen.flex_attention(_misaligned(q2), k, v)
    assert len(launched) == 2 and len(kernel.compiled.calls) == calls + 1


def test_a_forward_replay_checks_the_new_outputs_alignment(fake_gpu, monkeypatch):
    """The kernel is specialized on the outputs' alignment too: a misaligned allocation
    (no torch allocator makes one, a custom one might) launches anew."""
    module, kernel = fake_gpu
    launched = _fake_forward_launches(kernel, monkeypatch)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    flexgen.flex_attention(q, k, v)
    empty = torch.empty

    def misaligned_empty(*size, dtype=None, device=None):
        return _misaligned(empty(*size, dtype=dtype, device=device))
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", misaligned_empty)
        flexgen.flex_attention(q, k, v)
    assert len(launched) == 2 and kernel.compiled.calls == []
