"""The ahead-of-time compile check that conftest runs after every test.

conftest records each launch (``flexgen.runtime.launch.RECORDED``) while a test runs
and compiles every new kernel for sm_90 (``flexgen.runtime.aot.check_compiles``, in a
worker process by default); a compile error fails the test. These tests check the
pieces: recording is on inside a test, a real kernel compiles to sm_90 code, a broken
one fails the check (and keeps failing it), a worker sends its error back, and the
memo avoids compiling a kernel twice.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flexgen import create_block_mask, flex_attention

from flexgen.runtime import aot

from flexgen.codegen import cache

from flexgen.runtime import launch
from flexgen import mods as M
from flexgen.codegen.printer import Snippet
import conftest
from conftest import compile_recorded, make_qkv

pytestmark = pytest.mark.skipif(not conftest.AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")


def one_launch():
    q, k, v = make_qkv(B=1, H=1, L=40, D=32)
    mask = create_block_mask(M.causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    with aot.recording() as launches:
        flex_attention(q, k, v, score_mod=M.tanh_softcap(9.0), block_mask=mask)
    assert len(launches) == 1
    return launches[0], (q, k, v)


def test_launches_are_recorded_during_a_test():
    assert isinstance(launch.RECORDED, list), "conftest must record launches while a test runs"
    before = len(launch.RECORDED)
    q, k, v = make_qkv(B=1, H=1, L=40, D=32)
    flex_attention(q, k, v)
    assert len(launch.RECORDED) == before + 1
    spec, args, constexprs = launch.RECORDED[-1]
    assert spec.template == "forward" and "BLOCK_M" in constexprs


@pytest.fixture
def every_spec(monkeypatch):
    """The tests of the check itself compile their kernels whatever the run samples."""
    monkeypatch.setattr(conftest, "AOT_SAMPLE", 1)


def test_real_kernel_compiles_for_hopper(every_spec):
    (spec, args, constexprs), _ = one_launch()
    compiled = aot.compile_launch(spec, args, constexprs)
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx
    assert spec.kernel_name in ptx
    assert compiled.asm.get("cubin"), "ptxas must have produced a cubin"
    assert compile_recorded([(spec, args, constexprs)]) in (0, 1)   # the memo may know it already
    assert compile_recorded([(spec, args, constexprs)]) == 0, "a compiled kernel is not compiled twice"


def test_the_check_compiles_the_kernel_the_gpu_compiles(every_spec):
    """A recorded launch keeps what Triton's JIT specializes a launch on (each pointer's 16-byte
    alignment, ints of 1 and multiples of 16), so the check compiles the kernel a GPU compiles
    for that launch: the same specialization as Triton's binder gives the real arguments."""
    from flexgen.runtime import driver
    q, k, v = make_qkv(B=1, H=1, L=40, D=32)
    misaligned = torch.randn(q.numel() + 1)[1:].view(q.shape)      # 4 bytes past an aligned address
    misaligned.copy_(q)
    for query in (q, misaligned):
        with aot.recording() as launches:
            flex_attention(query, k, v, score_mod=M.tanh_softcap(9.0))
        (spec, recorded, constexprs), = launches
        module = cache.load(spec, interpret=False)
        real = module.arguments(q=query, k=k, v=v, out=torch.empty_like(query), lse=torch.empty(1, 1, 40),
                                sparse=None, score_buffers=(), mask_buffers=(), scale=0.125,
                                max_scores=None)[1]
        types = aot.arg_types(spec, recorded, constexprs)
        assert types == tuple(driver.specialization(
            module, real, aot._gpu_constexprs(spec, module, constexprs), aot.HOPPER)[:len(real)])
        assert ("constexpr", 1) in types                             # a stride of 1
        assert (types[0][1] == "D") == (query is q)                  # the query's pointer


def test_fp_fusion_stays_on_whatever_tritons_default(every_spec, monkeypatch):
    # Triton 3.10 turns FP fusion off by default; flexgen's kernels were tuned with it on.
    from triton import knobs
    monkeypatch.setattr(knobs.language, "default_fp_fusion", False)
    (spec, args, constexprs), _ = one_launch()
    compiled = aot.compile_launch(spec, args, constexprs)
    assert compiled.metadata.enable_fp_fusion is True


def test_broken_kernel_fails_the_check(every_spec):
    (spec, args, constexprs), _ = one_launch()
    # the same kernel with a score_mod snippet that names nothing: same arguments
    broken = dataclasses.replace(spec, score=Snippet((), "qk + no_such_name_in_the_kernel", "float"))
    assert broken.key != spec.key
    assert "no_such_name_in_the_kernel" in cache.source(broken)
    with pytest.raises(Exception, match="no_such_name_in_the_kernel"):
        aot.compile_launch(broken, args, constexprs)
    for _ in range(2):   # memoized failures keep failing every test that launches the kernel
        with pytest.raises(pytest.fail.Exception, match="(?s)sm_90.*" + broken.kernel_name):
            compile_recorded([(broken, args, constexprs)])


@pytest.mark.skipif(not conftest._AOT_POOL, reason="no compile workers (FLEXGEN_TEST_AOT_WORKERS=0)")
def test_a_worker_sends_back_a_broken_kernels_error(every_spec):
    """What the pool does with every launch: the spec, argument types and constexprs cross to
    a worker process, which renders the module itself and returns the compiler's error text."""
    (spec, args, constexprs), _ = one_launch()
    broken = dataclasses.replace(spec, score=Snippet((), "qk + not_defined_in_a_worker", "float"))
    future, new = conftest._compile(broken, args, constexprs, conftest._AOT_POOL[0])
    assert new
    assert "not_defined_in_a_worker" in conftest._error(future)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_tanh_is_the_one_instruction_form_for_half_inputs(dtype):
    """A mod's tanh compiles to tanh.approx.f32 on the GPU for float16 / bfloat16 inputs (its
    error, 2^-11 relative, is below theirs) and stays the exact form for float32; the
    interpreter always runs the exact one (the CPU tests check its values)."""
    q, k, v = make_qkv(B=1, H=1, L=40, D=32, dtype=dtype)
    with aot.recording() as launches:
        flex_attention(q, k, v, score_mod=M.tanh_softcap(9.0))
    spec, args, constexprs = launches[0]
    ptx = aot.compile_launch(spec, args, constexprs).asm["ptx"]
    assert ("tanh.approx.f32" in ptx) == (dtype != torch.float32)
    assert not cache.load(spec, interpret=True).FAST_TANH


def test_a_sampled_run_compiles_a_fixed_share_of_specs(monkeypatch):
    """FLEXGEN_TEST_AOT_SAMPLE=N (CI's pass with the newest Triton): the check compiles the specs
    whose key hashes into one N-th, the same ones in every run, and reports the others as done
    without an error; the Gluon compile tests skip theirs."""
    (spec, args, constexprs), _ = one_launch()
    specs = [dataclasses.replace(spec, score=Snippet((), f"qk + {i}.0", "float")) for i in range(64)]
    monkeypatch.setattr(conftest, "AOT_SAMPLE", 4)
    sampled = [s for s in specs if conftest.aot_sampled(s)]
    assert 4 <= len(sampled) <= 32 and sampled == [s for s in specs if conftest.aot_sampled(s)]
    outside = next(s for s in specs if not conftest.aot_sampled(s))
    future, new = conftest._compile(outside, args, constexprs)
    assert not new and future.done() and conftest._error(future) is None
    with pytest.raises(pytest.skip.Exception, match="FLEXGEN_TEST_AOT_SAMPLE=4"):
        conftest.skip_outside_aot_sample(outside)
    monkeypatch.setattr(conftest, "AOT_SAMPLE", 1)
    assert all(conftest.aot_sampled(s) for s in specs)


def test_fp32_launches_compile_with_the_gpus_dot_precision(every_spec):
    """A float32 launch recorded on the CPU says "ieee" (the interpreter's exact products); on
    the GPU fp32 dots take ``gpu_fp32_dot_precision()`` ("tf32x3", float32's accuracy from
    tensor cores, unless torch allows tf32), and that is the kernel the check compiles."""
    (spec, args, constexprs), _ = one_launch()
    assert spec.dtype == "float32" and constexprs["DOT_PRECISION"] == "ieee"
    ttir = aot.compile_launch(spec, args, constexprs).asm["ttir"]
    assert "inputPrecision = tf32x3" in ttir     # ("ieee", the default, prints no attribute)


def test_a_recorded_launch_compiles_in_another_pass(every_spec, monkeypatch, tmp_path):
    """CI's second pass compiles the first pass's record of the "once" tests' launches
    (FLEXGEN_TEST_COMPILE_RECORDED): a kernel that does not compile fails the session,
    naming the test that launched it."""
    import pickle
    (spec, args, constexprs), _ = one_launch()
    broken = dataclasses.replace(spec, score=Snippet((), "qk + not_in_the_recorded_kernel", "float"))
    record = tmp_path / "launches.pkl"
    types = aot.arg_types(spec, args, constexprs)
    record.write_bytes(pickle.dumps([("tests/a.py::good", spec, types, constexprs),
                                     ("tests/b.py::broken", broken, types, constexprs)]))
    monkeypatch.setattr(conftest, "_RECORDED_COMPILES", [])
    conftest._compile_the_record(record)
    lines = []
    reporter = SimpleNamespace(write_line=lambda text, **_: lines.append(text))
    session = SimpleNamespace(testsfailed=0, config=SimpleNamespace(
        pluginmanager=SimpleNamespace(get_plugin=lambda name: reporter)))
    conftest._report_the_record(session)
    assert session.testsfailed == 1 and len(lines) == 1
    assert "tests/b.py::broken" in lines[0] and "not_in_the_recorded_kernel" in lines[0]
