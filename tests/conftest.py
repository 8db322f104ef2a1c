"""Shared test setup: poisoned outputs, a private kernel cache, an ahead-of-time
compile check of every launched kernel, and the comparison with the oracle.

Environment (set here, before flexgen is imported):

- ``FLEXGEN_POISON=1``: outputs are filled with NaN before each launch, so an
  element a kernel forgets to write shows up as NaN (``check`` rejects NaN).
- ``FLEXGEN_CACHE_DIR``: a fresh directory per test session, removed at exit,
  so the suite never reads or pollutes the user's kernel cache.
- ``FLEXGEN_TEST_SEED`` (optional, default 0): mixed with each test's id to
  seed torch; every test draws its own random inputs, reproducibly.
- ``FLEXGEN_TEST_AOT=0`` skips the sm_90 compile check (for quick local runs;
  CI keeps it on).

AOT check: every kernel launched while a test runs (``flexgen.runtime.launch.RECORDED``)
is compiled for Hopper with ``flexgen.runtime.aot.compile_launch`` right after the test
body, once per distinct (spec key, argument types) in the session. A compile
error fails the test that launched the kernel (and every later test that
launches the same kernel), whatever the order tests run in and whichever
subset is selected. Triton's own disk cache makes a re-run cheap.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import zlib

_SESSION_DIR = tempfile.mkdtemp(prefix="flexgen-tests-")
os.environ["FLEXGEN_POISON"] = "1"
os.environ["FLEXGEN_CACHE_DIR"] = os.path.join(_SESSION_DIR, "kernels")
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import flexgen  # noqa: E402
from flexgen.runtime import aot
from flexgen.runtime import launch  # noqa: E402
from flexgen.reference import flex_attention_reference  # noqa: E402

from flexgen.runtime import poison  # noqa: E402

# flexgen may have been imported before this conftest (a plugin?): poison anyway.
poison.ENABLED = True

SEED = int(os.environ.get("FLEXGEN_TEST_SEED", "0"))
AOT_ENABLED = os.environ.get("FLEXGEN_TEST_AOT", "1") != "0"

# Absolute tolerances against the float64 oracle, by input dtype. Outputs are
# convex combinations of V rows (|v| ~ 1), so absolute error is the right measure.
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def pytest_report_header(config):
    return [f"flexgen: cache {os.environ['FLEXGEN_CACHE_DIR']}, seed {SEED}, "
            f"sm_90 AOT check {'on' if AOT_ENABLED else 'OFF'}"]


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random inputs per test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ SEED)


# --- ahead-of-time compile check ----------------------------------------------------

# (spec key, argument types) -> None when it compiled, else the error text.
_AOT_RESULTS: dict = {}
AOT_STATS = {"compiled": 0, "seconds": 0.0}


def _arg_types(args) -> tuple:
    return tuple(str(a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)


def compile_error(spec, args, constexprs) -> str | None:
    """Compile one recorded launch for sm_90 (memoized): None, or the compiler's error text."""
    import time
    # constexprs too: EVEN_KV and friends select different code in one spec.
    key = (spec.key, _arg_types(args), tuple(sorted((k, repr(v)) for k, v in constexprs.items())))
    if key not in _AOT_RESULTS:
        start = time.perf_counter()
        try:
            aot.compile_launch(spec, args, constexprs)
            _AOT_RESULTS[key] = None
        except Exception as exc:  # any compiler error is a test failure
            _AOT_RESULTS[key] = f"{type(exc).__name__}: {exc}"
        AOT_STATS["compiled"] += 1
        AOT_STATS["seconds"] += time.perf_counter() - start
    return _AOT_RESULTS[key]


def compile_recorded(recorded) -> int:
    """Compile each recorded launch for sm_90 (memoized); fail the test on an error.

    Returns the number of kernels newly compiled.
    """
    new, failures = 0, []
    for spec, args, constexprs in recorded:
        before = AOT_STATS["compiled"]
        error = compile_error(spec, args, constexprs)
        new += AOT_STATS["compiled"] - before
        if error is not None and spec.key not in (f[0] for f in failures):
            failures.append((spec.key, spec.kernel_name, spec.template, error))
    if failures:
        lines = [f"ahead-of-time compile for sm_90 failed for {len(failures)} kernel(s):"]
        for _, name, template, error in failures:
            lines.append(f"- {name} (template {template!r}): {error[-3000:]}")
        pytest.fail("\n".join(lines), pytrace=False)
    return new


# Every launch of the session, by test module: (spec, args, constexprs).
_LAUNCHES_BY_MODULE: dict = {}


def assert_module_launches_compile(module_name: str, templates: set) -> None:
    """Each distinct launch the module's tests made compiles to a cubin for sm_90, and the
    launches cover ``templates``. Skips when the module's other tests did not run."""
    launches = launches_of(module_name)
    if not launches:
        pytest.skip("no launches recorded (run the whole module)")
    seen = set()
    for spec, args, constexprs in launches:
        signature = tuple(aot._arg_type(a) for a in args)
        key = (spec.key, tuple(sorted(constexprs.items())), signature)
        if key in seen:
            continue
        seen.add(key)
        compiled = aot.compile_launch(spec, args, constexprs)
        assert compiled.asm.get("cubin"), f"no cubin for {spec.kernel_name}"
    assert {s.template for s, _, _ in launches} >= templates


def launches_of(module_name: str) -> list:
    """The launches recorded so far by the tests of one module (``__name__`` there)."""
    return _LAUNCHES_BY_MODULE.get(module_name, [])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    previous = launch.RECORDED
    launch.RECORDED = recorded = []
    try:
        result = yield
    finally:
        launch.RECORDED = previous
    _LAUNCHES_BY_MODULE.setdefault(item.module.__name__, []).extend(recorded)
    if AOT_ENABLED and recorded and not item.get_closest_marker("no_aot"):
        compile_recorded(recorded)
    return result


def pytest_configure(config):
    config.addinivalue_line("markers", "no_aot: launches of this test are not AOT-compiled "
                                       "(it launches deliberately broken kernels)")


def pytest_terminal_summary(terminalreporter):
    if AOT_STATS["compiled"]:
        terminalreporter.write_line(
            f"flexgen: compiled {AOT_STATS['compiled']} distinct kernel launches for sm_90 "
            f"in {AOT_STATS['seconds']:.1f}s with triton {triton.__version__}")


# --- inputs and comparison with the oracle -------------------------------------------

def make_qkv(B=1, H=2, L=67, D=32, *, Hkv=None, Lkv=None, Dv=None, dtype=torch.float32,
             device="cpu"):
    """Random query ``[B, H, L, D]``, key ``[B, Hkv, Lkv, D]``, value ``[B, Hkv, Lkv, Dv]``.

    The default head dim is 32: under the interpreter and in the sm_90 compile
    check (fp32 dots are unrolled FMAs there) cost grows with it; the head-dim
    tests cover 64, 80 and 128.
    """
    Hkv = H if Hkv is None else Hkv
    Lkv = L if Lkv is None else Lkv
    Dv = D if Dv is None else Dv
    q = torch.randn(B, H, L, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, Lkv, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, Lkv, Dv, device=device).to(dtype)
    return q, k, v


def check(out, ref, dtype=None, lse=None, ref_lse=None, atol=None, rtol=None):
    """``out`` (and ``lse``) match the float64 oracle; no NaN anywhere.

    Poisoned outputs start as NaN, so a NaN here is either an unwritten element
    or a NaN the kernel computed: both are bugs. An LSE of -inf (a fully masked
    row) must be -inf in both, and the output row must then be exactly zero.
    """
    dtype = dtype or out.dtype
    atol = ATOL[dtype] if atol is None else atol
    rtol = RTOL[dtype] if rtol is None else rtol
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    nan = torch.isnan(out)
    assert not nan.any(), f"{int(nan.sum())} NaN output elements (unwritten or computed), first at " \
                          f"{tuple(nan.nonzero()[0].tolist())}"
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=rtol)
    if lse is not None:
        assert ref_lse is not None
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}, expected float32"
        assert lse.shape == ref_lse.shape
        assert not torch.isnan(lse).any(), "NaN in lse"
        dead = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), dead), "lse is -inf on other rows than the oracle's"
        assert not torch.isposinf(lse).any()
        if dead.any():
            assert (out[dead] == 0).all(), "fully masked rows must give exact zeros"
        live = ~dead
        torch.testing.assert_close(lse[live].double(), ref_lse[live].double(),
                                   atol=max(atol, 1e-4), rtol=max(rtol, 1e-5))


def run_and_check(q, k, v, score_mod=None, block_mask=None, mask_mod=None, *, scale=None,
                  enable_gqa=False, return_lse=True, kernel_options=None, atol=None, rtol=None):
    """Run ``flexgen.flex_attention`` and compare it with the float64 oracle.

    ``mask_mod`` defaults to the block mask's own mask_mod. Returns (out, lse).
    """
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    res = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                 enable_gqa=enable_gqa, return_lse=return_lse,
                                 kernel_options=kernel_options)
    out, lse = res if return_lse else (res, None)
    ref, ref_lse = flex_attention_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                            scale=scale, enable_gqa=enable_gqa, return_lse=True,
                                            dtype=torch.float64)
    check(out, ref, q.dtype, lse, ref_lse if return_lse else None, atol=atol, rtol=rtol)
    return out, lse


def kernel_count() -> int:
    """Kernel modules loaded in this process (one per spec key and mode)."""
    return len(flexgen.codegen.cache._MODULES)


@pytest.fixture
def helpers():
    """The helpers above, for test files that prefer a fixture to ``from conftest import``."""
    return sys.modules[__name__]


__all__ = ["make_qkv", "check", "run_and_check", "kernel_count", "compile_recorded", "compile_error",
           "ATOL"]
