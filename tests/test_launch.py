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
from flexgen import mods as M
from flexgen.runtime import driver, launch
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
    # The fake kernel has no cubin: Triton's JIT path (flexgen.runtime.driver is tested
    # in tests/test_driver.py and on the GPU).
    monkeypatch.setattr(driver, "ENABLED", False)
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
    assert kwargs == dict(BLOCK=64, EVEN=True, num_warps=4, num_stages=2, enable_fp_fusion=True)
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
    replay = launch.Replay(*launched, (x,))
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
    replay = launch.Replay(*launched, launched[2][:1])
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


def test_replay_launches_views_of_its_origins_at_their_addresses(fake_gpu, monkeypatch):
    """A block list broadcast over heads is an expand() made per call, at its origin's
    address: the replay launches at that address (the caller's key holds it), so it still
    launches once the view is gone; an argument at no origin's address is held weakly."""
    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)
    origin = torch.arange(8, dtype=torch.int32).view(2, 1, 4)
    view = origin.expand(2, 4, 4)
    other = torch.zeros(3)
    launched = launch._launch_compiled(SPEC, module, (3, 2), [torch.zeros(64), view, other, 0.125],
                                       dict(BLOCK=64, EVEN=True))
    replay = launch.Replay(*launched, launched[2][:1], (origin,))
    kernel.triton_launches.clear()              # (the fake's record of the first launch)
    address = origin.data_ptr()
    del view, launched, origin
    y = torch.ones(64)
    assert replay(y)
    assert kernel.compiled.calls[-1][10].data_ptr() == address
    del other
    assert not replay(y)                        # held weakly: gone


def test_replay_of_tma_descriptors_copies_them_with_the_new_tensor(fake_gpu, monkeypatch):
    """A descriptor over a tensor that changes per call is copied with the new tensor as its
    base; one over any other tensor would have to be rebuilt: no replay then."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)
    t, other = torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 16)
    cuda = torch.device("cuda", 0)

    def descriptor(x):
        return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, 16, 16])

    monkeypatch.setattr(launch, "_launch", lambda spec, device, inputs: (
        launch._TritonLauncher(kernel.compiled, ()), (1,),
        [descriptor(inputs["x"]), inputs["x"], descriptor(other), 3], 0))
    assert launch.run(SPEC, cuda, dict(x=t), replay=(t,)) is None
    monkeypatch.setattr(launch, "_launch", lambda spec, device, inputs: (
        launch._TritonLauncher(kernel.compiled, ()), (1,), [descriptor(inputs["x"]), inputs["x"], 3], 0))
    replay = launch.run(SPEC, cuda, dict(x=t), replay=(t,))
    y = torch.ones(1, 1, 16, 16)
    assert replay(y)
    args = kernel.compiled.calls[-1][9:]
    assert isinstance(args[0], TensorDescriptor) and args[0].base is y and args[0].block_shape == [1, 1, 16, 16]
    assert args[1] is y and args[2] == 3


def test_replay_declines_tensors_aliased_otherwise(fake_gpu, monkeypatch):
    """Recorded with q, k, v one tensor, a call with three must not launch all three as one."""
    module, kernel = fake_gpu
    monkeypatch.setattr(launch, "RECORDED", None)
    x = torch.zeros(64)
    launched = launch._launch_compiled(SPEC, module, (3, 2), [x, 100, 64, 0.125], dict(BLOCK=64, EVEN=True))
    replay = launch.Replay(*launched, (x, x))
    assert not replay(torch.ones(64), torch.ones(64))
    y = torch.ones(64)
    assert replay(y, y)


def test_the_interpreter_path_never_replays():
    q = torch.randn(1, 2, 40, 32)
    flexgen.flex_attention(q, q, q)
    assert _plan(q, q, q).replays == {}


# ---------------------------------------------------------------------------- call memo

def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _plan(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
    """The plan flex_attention's op would make for these arguments."""
    from flexgen.runtime.options import parse_options
    from flexgen.runtime.plan import plan_attention
    score, sbufs, mask, mbufs, lists, block_size, lengths = api._mods(score_mod, block_mask)
    return plan_attention(q, k, v, score, sbufs, mask, mbufs, lists, block_size, lengths,
                          api.check_scale(scale, q.shape[-1]), enable_gqa,
                          parse_options(kernel_options).text)


def test_a_repeated_call_reuses_its_plan():
    q = torch.randn(1, 2, 40, 32)
    mask = flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu")
    first = _plan(q, q, q, block_mask=mask, kernel_options={"BLOCK_M": 16})
    again = _plan(torch.randn(1, 2, 40, 32), q, q, block_mask=mask, kernel_options={"BLOCK_M": 16})
    assert again is first


def _plan_change(change):
    """(first plan, plan after ``change``) of one call."""
    q = torch.randn(1, 2, 40, 32)
    bias = torch.randn(4)       # one per head of the GQA case's query heads (h indexes it)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[h]

    mask = flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu")
    args = dict(q=q, k=q, v=q, score_mod=biased, block_mask=mask)
    first = _plan(**args)
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
    elif change == "score_mod":
        args.update(score_mod=lambda score, b, h, q_idx, kv_idx: score * 2)
    elif change == "captured_dtype":
        bias = torch.randn(4, dtype=torch.float64)     # the closure now reads a float64 tensor
    elif change == "mask_object":
        args.update(block_mask=flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu"))
    elif change == "mask_lists":
        mask.kv_num_blocks = mask.kv_num_blocks.clone()
    elif change == "captured_tensor":
        bias = torch.randn(4)                          # a new tensor, same dtype and shape
    elif change == "alignment":
        args.update(q=_misaligned(q))                  # same shape and strides
    return first, _plan(**args)


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "scale", "gqa_heads", "options",
                                    "score_mod", "captured_dtype"])
def test_anything_the_plan_reads_makes_a_new_plan(change):
    first, second = _plan_change(change)
    assert second is not first


@pytest.mark.parametrize("change", ["mask_object", "mask_lists", "captured_tensor", "alignment"])
def test_identities_and_addresses_are_not_part_of_a_plan(change):
    """A plan is a function of shapes, dtypes, strides, devices and mods only (so it is the
    same on FakeTensors): new tensor objects, new masks of the same layout and other base
    addresses keep it (the launch checks alignment itself)."""
    first, second = _plan_change(change)
    assert second is first


def test_plans_are_made_on_fake_and_meta_tensors():
    """The planner reads no data: it plans (and checks) FakeTensor and meta inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = _plan(*(torch.randn(1, 2, 40, 32) for _ in range(3)), score_mod=M.tanh_softcap(3.0))
    with FakeTensorMode():
        fake = torch.empty(1, 2, 40, 32)
        assert _plan(fake, fake, fake, score_mod=M.tanh_softcap(3.0)).spec is real.spec
    meta = torch.empty(1, 2, 40, 32, device="meta")
    with pytest.raises(InputError, match="CUDA or CPU"):
        _plan(meta, meta, meta)


def test_a_bad_call_still_raises_after_a_good_one():
    q = torch.randn(1, 2, 40, 32)
    _plan(q, q, q)
    with pytest.raises(InputError, match="key.shape"):
        _plan(q, q[..., :16], q)
    with pytest.raises(InputError, match="enable_gqa"):
        _plan(q, q[:, :1], q[:, :1])
    with pytest.raises(InputError, match="kernel_options"):
        _plan(q, q, q, kernel_options={"BLOCK_Q": 64})
    _plan(q, q, q, scale=1)
    with pytest.raises(InputError, match="scale"):
        _plan(q, q, q, scale=True)       # equal to 1, and still not a scale
    _plan(q, q, q, kernel_options={"BLOCK_M": 16})
    with pytest.raises(InputError, match="BLOCK_M"):
        _plan(q, q, q, kernel_options={"BLOCK_M": 16.0})     # equal to 16, and still not a tile


def _misaligned(t):
    """A copy of ``t`` with the same shape and strides whose base is 4 bytes off 16-byte alignment."""
    flat = torch.zeros(t.numel() + 8, dtype=t.dtype)
    shift = (16 - flat.data_ptr() % 16) % 16 // t.element_size() + 4 // t.element_size()
    out = flat[shift:shift + t.numel()].as_strided(t.shape, t.stride())
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
    """Let launch.run hand the forward a Replay of the fake compiled kernel (as on a GPU);
    returns the list of the launches that went through launch.run (their kernel arguments)."""
    from flexgen.runtime import plan
    monkeypatch.setattr(launch, "RECORDED", None)
    monkeypatch.setattr(plan, "_ATTENTION", {})
    launched = []

    def fake_launch(spec, device, inputs):
        args = [inputs["q"], inputs["k"], inputs["v"], inputs["out"], inputs["lse"],
                inputs["max_scores"] if inputs["max_scores"] is not None else inputs["lse"],
                "strides", "lengths"]
        launched.append(args)
        return launch._TritonLauncher(kernel.compiled, ("tail",)), (4, 2), args, 0
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
    assert all(a is b for a, b in zip(call[9:15], (q2, k, v, out, lse, lse)))
    assert call[15:] == (*launched[0][6:], "tail")      # everything else as at the first launch

    # A misaligned query: the same plan, but its replay refuses tensors Triton would
    # specialize otherwise, so it launches anew; a later call like it replays.
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
    empty_strided = torch.empty_strided

    def misaligned_empty(size, stride, dtype=None, device=None):
        return _misaligned(empty_strided(size, stride, dtype=dtype, device=device))
    with monkeypatch.context() as m:
        m.setattr(torch, "empty_strided", misaligned_empty)
        flexgen.flex_attention(q, k, v)
    assert len(launched) == 2 and kernel.compiled.calls == []


def test_a_replay_is_only_for_the_same_captured_tensors_and_mask_lists(fake_gpu, monkeypatch):
    """Calls of one plan that read other captured tensors or other block lists (a new
    document mask of the same shapes) launch with theirs: a replay swaps in only Q, K, V
    and the outputs, so it must never stand in for them."""
    module, kernel = fake_gpu
    launched = _fake_forward_launches(kernel, monkeypatch)
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))

    def with_bias(bias):
        return lambda score, b, h, q_idx, kv_idx: score + bias[h]

    first, second = torch.randn(2), torch.randn(2)
    masks = []
    for _ in range(2):       # two builds with lists of their own (a mask capturing no tensor shares them)
        flexgen.masks.builder._LISTS.clear()
        masks.append(flexgen.create_block_mask(_causal, None, None, 40, 40, device="cpu"))
    flexgen.flex_attention(q, k, v, score_mod=with_bias(first), block_mask=masks[0])
    flexgen.flex_attention(q, k, v, score_mod=with_bias(second), block_mask=masks[0])
    flexgen.flex_attention(q, k, v, score_mod=with_bias(first), block_mask=masks[1])
    assert len(launched) == 3 and kernel.compiled.calls == []
    flexgen.flex_attention(torch.randn_like(q), k, v, score_mod=with_bias(second), block_mask=masks[0])
    assert len(launched) == 3 and len(kernel.compiled.calls) == 1      # the second launch, replayed
