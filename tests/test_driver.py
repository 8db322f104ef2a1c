"""flexgen.runtime.driver: kernels compiled with Triton's specialization and launched through
the CUDA driver API. Without a GPU these tests pin down what a launch packs: which
arguments become parameters, at which offsets, checked against the PTX entry. The launches
themselves run in the GPU tests (every GPU test launches through it; test_gpu_driver.py
compares it with Triton's launcher). Every kernel the suite compiles for sm_90 is also asked
``decline_reason`` (flexgen.runtime.aot.check_compiles), so none silently loses this launcher."""
from __future__ import annotations

import struct
import types

import pytest
import torch
import triton
import triton.language as tl

from flexgen.runtime import aot, driver

import conftest

needs_aot = pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")

PTX = """
.visible .entry k_1(
	.param .u64 .ptr .global .align 1 k_1_param_0,
	.param .align 64 .b8 k_1_param_1[128],
	.param .u32 k_1_param_2,
	.param .f32 k_1_param_3,
	.param .u8 k_1_param_4,
	.param .u64 .ptr .global .align 1 k_1_param_5
)
.reqntid 128, 1, 1
{
"""


def test_ptx_parameters_are_read_with_sizes_and_alignments():
    assert driver.ptx_params(PTX, "k_1") == [(8, 8), (128, 64), (4, 4), (4, 4), (1, 1), (8, 8)]
    assert driver.ptx_params(PTX, "other") == []


@triton.jit
def _scale_kernel(X, Y, n, one, scale, stride, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs * stride * one, mask=offs < n)
    tl.store(Y + offs, x * scale, mask=offs < n)


def _packed(compiled, args, metas=()):
    fmt, offsets, kinds = driver._layout(compiled, len(args))
    buffer = bytearray(struct.calcsize(fmt))
    struct.pack_into(fmt, buffer, 0, *driver._packer(kinds, list(metas), lambda i: f"a[{i}]", {})(args))
    return fmt, offsets, buffer


def _unloaded_binary(compiled, n_args):
    """A Binary's packing state without loading it (no GPU here)."""
    binary = driver.Binary.__new__(driver.Binary)
    binary.kinds = driver._layout(compiled, n_args)[2]
    binary.metas = driver._descriptor_metas(compiled.metadata)
    binary.pack = driver._packer(binary.kinds, binary.metas, lambda i: f"a[{i}]", {})
    return binary


@needs_aot
def test_a_pointer_kernels_parameters_are_packed_in_order():
    """Pointers as their addresses, ints and floats as Triton types them; an int equal to 1
    and the constexprs are left out (Triton compiled them in); two null scratch pointers last."""
    module = types.SimpleNamespace(KERNEL=_scale_kernel, NUM_WARPS=4, NUM_STAGES=2)
    x, y = torch.randn(64), torch.empty(64)
    args = [x, y, 50, 1, 0.5, 3]
    compiled = driver.compile_for_device(module, args, dict(BLOCK=64), aot.HOPPER)
    assert compiled.src.signature["one"] == "constexpr"          # Triton's specialization
    assert driver.decline_reason(compiled, len(args)) is None
    fmt, offsets, buffer = _packed(compiled, args)
    assert fmt == "<QQifixxxxQQ" and offsets == [0, 8, 16, 20, 24, 32, 40]     # pointers 8-aligned
    assert struct.unpack(fmt, buffer) == (x.data_ptr(), y.data_ptr(), 50, 0.5, 3, 0, 0)


@needs_aot
def test_a_gluon_kernels_descriptors_are_packed_with_their_shapes_and_strides(monkeypatch):
    """A host TMA descriptor: its 128-byte CUtensorMap (64-byte aligned), then its shape as
    i32 and its strides as i64, as Triton's launcher passes them."""
    import test_forward_gluon as gluon_tests
    from flexgen.runtime import plan as plan_module
    monkeypatch.setattr(plan_module, "gluon_unavailable", lambda query, D, Dv: None)
    plan_module.clear_memos()
    spec, args, constexprs = gluon_tests.gluon_launch("causal_d64_fp16")
    from flexgen.codegen import cache
    module = cache.load(spec, interpret=False)
    compiled = driver.compile_for_device(module, args, constexprs, aot.HOPPER)
    assert driver.decline_reason(compiled, len(args)) is None
    encoded = []

    def encode(ptr, shape, strides, meta, nan, tf32):
        encoded.append((ptr, shape, strides, list(meta[3])))
        return bytes([len(encoded)]) * 128
    monkeypatch.setattr(driver, "_encode", encode)
    driver.clear_memos()
    metas = compiled.metadata.tensordesc_meta
    fmt, offsets, buffer = _packed(compiled, args, driver._descriptor_metas(compiled.metadata))
    q = args[0]
    assert encoded[0] == (q.base.data_ptr(), tuple(q.shape), tuple(q.strides), metas[0]["block_size"])
    assert offsets[0] == 0 and buffer[:128] == bytes([1]) * 128
    rank = len(q.shape)
    shape_and_strides = struct.unpack_from("<" + "i" * rank + "q" * rank, buffer, 128)
    assert shape_and_strides == (*q.shape, *q.strides)
    assert offsets[1 + 2 * rank] % 64 == 0            # the next descriptor, aligned
    plan_module.clear_memos()


@needs_aot
def test_a_replay_packs_its_fresh_tensors_as_a_launch_would(monkeypatch):
    """A replay's packer reads only the fresh tensors (a pointer, a descriptor's new base);
    its values equal a full launch's with those tensors in place."""
    import copy
    import test_forward_gluon as gluon_tests
    from flexgen.codegen import cache
    from flexgen.runtime import launch
    from flexgen.runtime import plan as plan_module
    monkeypatch.setattr(plan_module, "gluon_unavailable", lambda query, D, Dv: None)
    monkeypatch.setattr(driver, "_encode", lambda ptr, shape, strides, meta, nan, tf32:
                        ptr.to_bytes(8, "little") * 16)
    driver.clear_memos()
    plan_module.clear_memos()
    spec, args, constexprs = gluon_tests.gluon_launch("causal_d64_fp16")
    compiled = driver.compile_for_device(cache.load(spec, interpret=False), args, constexprs, aot.HOPPER)
    binary = _unloaded_binary(compiled, len(args))
    q_desc, lse = args[0], args[4]
    lists = args[8]
    kept = [None, *args[1:4], None, *args[5:]]
    kept[8] = launch._Address(lists.data_ptr())
    replay_pack = binary.replayer(kept, [(0, 0, launch._recorded(q_desc)), (4, 1, None)])
    q2, lse2 = torch.randn_like(q_desc.base), torch.randn_like(lse)
    moved = copy.copy(q_desc)
    object.__setattr__(moved, "base", q2)
    assert replay_pack((q2, lse2)) == binary.pack([moved, *args[1:4], lse2, *args[5:]])
    assert replay_pack((q2, lse2))[0] == q2.data_ptr().to_bytes(8, "little") * 16
    plan_module.clear_memos()


@needs_aot
def test_what_it_cannot_launch_is_declined(monkeypatch):
    module = types.SimpleNamespace(KERNEL=_scale_kernel, NUM_WARPS=4, NUM_STAGES=2)
    args = [torch.randn(64), torch.empty(64), 50, 1, 0.5, 3]
    compiled = driver.compile_for_device(module, args, dict(BLOCK=64), aot.HOPPER)
    scratch = compiled.metadata._replace(global_scratch_size=256)
    assert "global_scratch_size" in driver.decline_reason(
        types.SimpleNamespace(metadata=scratch, src=compiled.src, asm=compiled.asm), len(args))
    monkeypatch.setattr(driver, "ptx_params", lambda ptx, name: [(8, 8)] * 3)
    assert "PTX" in driver.decline_reason(compiled, len(args))
    assert driver.Binary.of(compiled, len(args), 0) is None


@needs_aot
def test_a_binary_is_found_again_in_the_restart_index(monkeypatch, tmp_path):
    """The first load compiles and records the cubin and its layout; a later process (here:
    the same one with its memos cleared) loads them without compiling; an entry that does
    not verify is ignored and the kernel compiled again."""
    from flexgen.codegen import index
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path))
    index.clear_memos()
    monkeypatch.setattr(driver, "target", lambda device_index: aot.HOPPER)
    loaded = []
    monkeypatch.setattr(driver.Binary, "__init__",
                        lambda self, kernel, device_index: setattr(self, "kernel", loaded.append(kernel) or kernel))
    compiles = []
    real_compile = driver.compile_for_device
    monkeypatch.setattr(driver, "compile_for_device", lambda *a: compiles.append(a) or real_compile(*a))
    module = types.SimpleNamespace(KERNEL=_scale_kernel, NUM_WARPS=4, NUM_STAGES=2)
    args = [torch.randn(64), torch.empty(64), 50, 1, 0.5, 3]
    classes = (("float32", True), ("float32", True), 0, 1, 2, 0)

    def load():
        index.clear_memos()
        return driver.load(module, "spec-key", classes, args, dict(BLOCK=64), 0)

    index.clear_memos()
    assert driver.load(module, "spec-key", classes, args, dict(BLOCK=64), 0, compile_missing=False) is None
    assert compiles == [] and loaded == []          # not recorded: nothing compiled
    load()
    assert len(compiles) == 1 and len(loaded) == 1
    index.clear_memos()
    assert driver.load(module, "spec-key", classes, args, dict(BLOCK=64), 0, compile_missing=False)
    assert len(compiles) == 1 and len(loaded) == 2
    loaded.pop()
    load()
    assert len(compiles) == 1 and len(loaded) == 2
    assert loaded[1]["cubin"] == loaded[0]["cubin"] and list(loaded[1]["layout"][0]) == list(loaded[0]["layout"][0])
    for path in (tmp_path / "index").glob("binary-*.json"):         # tampered: not trusted
        path.write_text(path.read_text().replace('"shared":', '"shared":1'))
    load()
    assert len(compiles) == 2
    index.clear_memos()


@needs_aot
def test_a_triton_with_other_jit_internals_is_declined(monkeypatch):
    """The binder and argument packing are Triton's internals: where they differ, load
    declines (None: Triton's own launch path runs) instead of failing the call."""
    import triton.runtime.jit as jit
    monkeypatch.delattr(jit, "create_function_from_signature")
    monkeypatch.setattr(driver, "_BINDERS", {})         # (none made before it went)
    monkeypatch.setattr(driver, "target", lambda device_index: aot.HOPPER)
    module = types.SimpleNamespace(KERNEL=_scale_kernel, NUM_WARPS=4, NUM_STAGES=2)
    args = [torch.randn(64), torch.empty(64), 50, 1, 0.5, 3]
    with pytest.raises(driver.Unsupported):
        driver.compile_for_device(module, args, dict(BLOCK=64), aot.HOPPER)
    assert driver.load(module, "spec-key", (), args, dict(BLOCK=64), 0) is None


def test_it_is_off_without_a_driver_or_when_switched_off(monkeypatch):
    monkeypatch.setattr(driver, "ENABLED", False)
    assert not driver.usable()


# ------------------------------------------------------------------------- on the GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _attention_and_grads(backend, dtype, D):
    """Output, LSE and gradients (inputs and a learned bias table) of one causal call with a
    captured tensor; fixed seed, so two runs see the same inputs."""
    import flexgen
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 4, 300, D, device="cuda", generator=gen).to(dtype).requires_grad_()
               for _ in range(3))
    table = torch.randn(4, 599, device="cuda", generator=gen).requires_grad_()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 299]

    bm = flexgen.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 300, 300, device="cuda")
    out, lse = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True,
                                      kernel_options={"BACKEND": backend})
    out.float().square().sum().backward()
    return [out, lse, q.grad, k.grad, v.grad, table.grad]


@needs_cuda
@pytest.mark.parametrize("backend,dtype,D", [("tl", torch.float32, 64), ("tl", torch.bfloat16, 128),
                                             ("AUTO", torch.float16, 64)])
def test_driver_launches_equal_tritons_launcher(monkeypatch, backend, dtype, D):
    """The same kernels launched through the driver and through Triton's C launcher give
    bitwise the same outputs and input gradients, and the driver's path is the one taken
    (pointer kernels, TMA descriptors, Gluon where AUTO picks it)."""
    from flexgen.runtime import launch
    monkeypatch.setattr(launch, "RECORDED", None)       # (the suite's AOT record)
    if not driver.usable():
        pytest.skip("no CUDA driver library")
    import flexgen
    flexgen.clear_caches()          # plans hold replays of their launchers: none from before
    ours = _attention_and_grads(backend, dtype, D)
    taken = [type(x).__name__ for x in launch._COMPILED.values()]
    assert taken and set(taken) == {"Binary"}, taken
    flexgen.clear_caches()
    monkeypatch.setattr(driver, "ENABLED", False)
    theirs = _attention_and_grads(backend, dtype, D)
    assert {type(x).__name__ for x in launch._COMPILED.values()} == {"_TritonLauncher"}
    flexgen.clear_caches()
    for a, b in zip(ours[:5], theirs[:5]):
        assert torch.equal(a, b)
    # The table's gradient is summed by float atomics, in an order that varies run to run.
    torch.testing.assert_close(ours[5], theirs[5], rtol=1e-5, atol=1e-5)
