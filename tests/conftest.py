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
- ``FLEXGEN_TEST_AOT_SAMPLE`` (default 1): the sm_90 compiles (this check, and the tests that
  compile Gluon kernels) cover one kernel spec in N, a fixed sample by a hash of the spec's
  key. CI's pass with the newest Triton takes 4: there a kernel must compile or decline, and
  what moves between releases (Triton's and Gluon's API, its lowering) moves for every kernel
  of a template alike; its pass with Triton 3.6, the GPU machines' compiler, compiles every
  kernel. The compiles are most of a CI run's CPU: fp32 launches, the CPU tests' dtype, compile
  ~2-5 s each (their dots as the GPU plans them, "tf32x3": ``aot.compile_signature``).
- ``FLEXGEN_TEST_RECORD_ONCE=path`` / ``FLEXGEN_TEST_COMPILE_RECORDED=path``: CI's two passes.
  Tests marked ``once`` (torch.compile, torch.distributed, Hugging Face, notebook and example
  plumbing, checks of rendering alone, and the front end's modules: tracing, masks, mods and
  their kernels' numerics) run in the first pass only: the sources they generate are the same
  under either Triton (no template reads its version), so under 3.6 what can differ is the
  compile, which the record covers;
  it writes their launches to ``path``, and the second pass (Triton 3.6, ``-m "not once"``)
  compiles those for sm_90 from the record, so its compile check still covers every kernel
  (a failure there fails the session, naming the test that launched the kernel).
- ``FLEXGEN_TEST_AOT_WORKERS`` (default 2): worker processes for the sm_90 compile
  check (below); 0 compiles in the test process, right after each test body. Two on a
  2-core machine keep both cores busy through the compiles' tail: the whole suite with
  Triton 3.9 took 896 s with two, 1495 s with one (another load on the machine then).

AOT check: every kernel launched while a test runs (``flexgen.runtime.launch.RECORDED``)
is compiled for Hopper (``flexgen.runtime.aot.check_compiles``) as the GPU would compile
it for that launch (Triton's specialization of its arguments: aligned pointers, ints of 1
and multiples of 16), once per distinct (spec key, argument types and specialization,
constexprs) in the session. A compile error fails the
test that launched the kernel (and every later test that launches the same
kernel), whatever the order tests run in and whichever subset is selected.
Triton's own disk cache makes a re-run cheap.

Where it compiles. A cold compile takes about a second, ~800 of them most of a
CI run, and the tests themselves run serially: so by default two worker processes
compile the kernels of test N while test N+1 runs. Workers are
started with 'spawn' (a child forked from a process with torch's threads would
inherit their locks in whatever state they were) when the session starts, so they
see the session's environment (this module's FLEXGEN_CACHE_DIR, Triton's cache
dir, the PYTHONPATH that picks the Triton under test), not a test's monkeypatched
one. What crosses is small and picklable: the spec, the argument types and their
specialization (``aot.arg_types``) and the constexprs; the worker renders the module from the
spec as this process does.

How a failure is reported. A kernel whose failure is known when its test ends
fails that test's call, as without workers. A test that ends while its kernels
are still compiling cannot fail its own call any more: when all its results are
in (checked after every test; every outstanding one is awaited before the
session ends), a failure is logged as that test's failed teardown ("ERROR at
teardown of <test>", naming the kernel and the compiler's error), which counts
like any failure: the exit status, ``-x``. This keeps each failure on the test
that launched the kernel, never on whichever test happened to run when the
result came in, and none can be lost by the session ending first.
"""
from __future__ import annotations

import atexit
import math
import concurrent.futures
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import warnings
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
AOT_WORKERS = int(os.environ.get("FLEXGEN_TEST_AOT_WORKERS", "2"))
AOT_SAMPLE = int(os.environ.get("FLEXGEN_TEST_AOT_SAMPLE", "1"))
RECORD_ONCE = os.environ.get("FLEXGEN_TEST_RECORD_ONCE")
COMPILE_RECORDED = os.environ.get("FLEXGEN_TEST_COMPILE_RECORDED")

# Absolute tolerances against the float64 oracle, by input dtype. Outputs are
# convex combinations of V rows (|v| ~ 1), so absolute error is the right measure.
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
RTOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def pytest_report_header(config):
    sample = f", 1 spec in {AOT_SAMPLE}" if AOT_SAMPLE > 1 else ""
    return [f"flexgen: cache {os.environ['FLEXGEN_CACHE_DIR']}, seed {SEED}, "
            f"sm_90 AOT check {f'on, {AOT_WORKERS} worker(s){sample}' if AOT_ENABLED else 'OFF'}"]


def aot_sampled(spec) -> bool:
    """Whether this run compiles ``spec``'s kernels for sm_90 (``FLEXGEN_TEST_AOT_SAMPLE``)."""
    return AOT_SAMPLE <= 1 or zlib.crc32(spec.key.encode()) % AOT_SAMPLE == 0


def skip_outside_aot_sample(spec) -> None:
    """Skip a test that compiles ``spec``'s kernel for sm_90 where this run's sample leaves it out."""
    if not aot_sampled(spec):
        pytest.skip(f"outside this run's sample of sm_90 compiles (FLEXGEN_TEST_AOT_SAMPLE={AOT_SAMPLE})")


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random inputs per test."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) ^ SEED)


# --- ahead-of-time compile check ----------------------------------------------------

# (spec key, argument types, constexprs) -> a future of (None or the error text, CPU
# seconds): the session's one compile of each, in a worker or in this process.
_AOT_RESULTS: dict = {}
# the same key -> (the test module that launched it first, the kernel's template): where the
# compile time goes, for the summary (CI's time is mostly these compiles)
_AOT_OWNERS: dict = {}
_CURRENT_MODULE = [""]
AOT_STATS = {"waited": 0.0}     # wall seconds this process spent waiting for compiles
_AOT_POOL: list = []            # the worker pool while the session runs (none with 0 workers)
_OUTSIDE_SAMPLE = concurrent.futures.Future()
_OUTSIDE_SAMPLE.set_result((None, 0.0))
# Tests that ended before all their kernels had compiled: [(item, [(spec, future)])].
_AOT_LATE: list = []
# FLEXGEN_TEST_RECORD_ONCE: the distinct launches of the tests marked ``once``, by compile key:
# (the test's id, spec, argument types, constexprs).
_ONCE_LAUNCHES: dict = {}
# FLEXGEN_TEST_COMPILE_RECORDED: the compiles of that record, [(test id, spec, future)].
_RECORDED_COMPILES: list = []


def _compile(spec, args, constexprs, pool=None):
    """The session's compile of one recorded launch: (future, whether it is new). A new one
    runs in ``pool``, or here and now; one outside the run's sample (``aot_sampled``) is not
    compiled (a done future of no error)."""
    return _compile_types(spec, aot.arg_types(spec, args, constexprs), constexprs, pool)


def _compile_key(spec, types, constexprs) -> tuple:
    """What tells two launches' compiles apart: constexprs too (EVEN_KV and friends select
    different code in one spec)."""
    return spec.key, types, tuple(sorted((k, repr(v)) for k, v in constexprs.items()))


def _compile_types(spec, types, constexprs, pool=None):
    """``_compile`` with the arguments' Triton types and specialization (``aot.arg_types``)."""
    if not aot_sampled(spec):
        return _OUTSIDE_SAMPLE, False
    key = _compile_key(spec, types, constexprs)
    future = _AOT_RESULTS.get(key)
    if future is not None:          # done, or still compiling in a worker: never twice
        return future, False
    if pool is not None:
        future = pool.submit(aot.check_compiles, spec, types, constexprs)
    else:
        start = time.perf_counter()
        future = concurrent.futures.Future()
        future.set_result(aot.check_compiles(spec, types, constexprs))
        AOT_STATS["waited"] += time.perf_counter() - start
    _AOT_RESULTS[key] = future
    _AOT_OWNERS[key] = (_CURRENT_MODULE[0], spec.template)
    return future, True


def _error(future) -> str | None:
    """A compile's outcome, waited for: None, or the error text."""
    if not future.done():
        start = time.perf_counter()
        concurrent.futures.wait([future])
        AOT_STATS["waited"] += time.perf_counter() - start
    try:
        return future.result()[0]
    except Exception as exc:  # the worker died, or the launch did not pickle: a failure too
        return f"in the compile worker: {type(exc).__name__}: {exc}"


def _fail_on_errors(compiles, when="") -> None:
    """``pytest.fail`` naming each kernel of ``compiles`` [(spec, future)] that did not compile."""
    failures = {}
    for spec, future in compiles:
        error = _error(future)
        if error is not None:
            failures.setdefault(spec.key, (spec, error))
    if failures:
        lines = [f"ahead-of-time compile for sm_90 failed for {len(failures)} kernel(s){when}:"]
        for spec, error in failures.values():
            lines.append(f"- {spec.kernel_name} (template {spec.template!r}): {error[-3000:]}")
        pytest.fail("\n".join(lines), pytrace=False)


def compile_error(spec, args, constexprs) -> str | None:
    """Compile one recorded launch for sm_90 now (memoized): None, or the compiler's error text."""
    return _error(_compile(spec, args, constexprs)[0])


def compile_recorded(recorded) -> int:
    """Compile each recorded launch for sm_90 now (memoized); fail the test on an error.

    Returns the number of kernels newly compiled.
    """
    new, compiles = 0, []
    for spec, args, constexprs in recorded:
        future, is_new = _compile(spec, args, constexprs)
        new += is_new
        compiles.append((spec, future))
    _fail_on_errors(compiles)
    return new


def _submit_recorded(item, recorded) -> None:
    """Hand the test's new launches to the workers; fail it now on what is already known."""
    done, pending = [], []
    for spec, args, constexprs in recorded:
        future = _compile(spec, args, constexprs, _AOT_POOL[0])[0]
        (done if future.done() else pending).append((spec, future))
    if pending:
        _AOT_LATE.append((item, pending))
    _fail_on_errors(done)


def _report_late(wait: bool) -> None:
    """Log a failed teardown for each test in ``_AOT_LATE`` whose kernels did not all compile,
    once all its results are in (``wait``: waiting for them)."""
    for entry in list(_AOT_LATE):
        item, compiles = entry
        if not wait and not all(future.done() for _, future in compiles):
            continue
        _AOT_LATE.remove(entry)
        call = pytest.CallInfo.from_call(
            lambda: _fail_on_errors(compiles, " (compiled in a worker after the test ended)"),
            when="teardown")
        if call.excinfo is not None:    # what pytest's own runner does with a phase's outcome
            report = item.ihook.pytest_runtest_makereport(item=item, call=call)
            item.ihook.pytest_runtest_logreport(report=report)


def pytest_sessionstart(session):
    if AOT_ENABLED and AOT_WORKERS > 0:
        # Warnings off in the workers: they would print raw into the progress line. The
        # same compile warnings show in pytest's summary from this process's own compiles.
        pool = concurrent.futures.ProcessPoolExecutor(
            AOT_WORKERS, mp_context=multiprocessing.get_context("spawn"),
            initializer=warnings.simplefilter, initargs=("ignore",))
        # Start every worker now, under the session's environment (the pool starts them on
        # demand). Cheap: a worker imports torch, Triton and flexgen at its first compile.
        for _ in range(AOT_WORKERS):
            pool.submit(int)
        _AOT_POOL.append(pool)
    if AOT_ENABLED and COMPILE_RECORDED:
        _compile_the_record(COMPILE_RECORDED)


def _compile_the_record(path) -> None:
    """Start the sm_90 compiles of the launches another pass recorded (FLEXGEN_TEST_RECORD_ONCE),
    as this Triton renders their specs."""
    import dataclasses
    import pickle
    with open(path, "rb") as f:
        launches = pickle.load(f)
    _CURRENT_MODULE[0] = "the first pass's record"      # (the summary's owner of these compiles)
    for nodeid, spec, types, constexprs in launches:
        spec = dataclasses.replace(spec, triton_version=triton.__version__)
        future = _compile_types(spec, types, constexprs, _AOT_POOL[0] if _AOT_POOL else None)[0]
        _RECORDED_COMPILES.append((nodeid, spec, future))
    _CURRENT_MODULE[0] = ""


def _report_the_record(session) -> None:
    """Fail the session on each recorded launch that did not compile (its test did not run here)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for nodeid, spec, future in _RECORDED_COMPILES:
        error = _error(future)
        if error is not None:
            session.testsfailed += 1
            reporter.write_line(f"FAILED sm_90 compile of {spec.kernel_name} (template {spec.template!r}), "
                                f"launched by {nodeid} in the first pass: {error[-3000:]}", red=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    result = yield
    if _AOT_POOL:
        _report_late(wait=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    try:
        return (yield)
    except KeyboardInterrupt:
        if _AOT_POOL:               # no waiting for a backlog of compiles nobody wants now
            _AOT_POOL.pop().shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        if _AOT_POOL:               # every outstanding result, before the session's verdict
            _report_late(wait=True)
        _report_the_record(session)
        if _AOT_POOL:
            _AOT_POOL.pop().shutdown()
        if RECORD_ONCE:
            import pickle
            with open(RECORD_ONCE, "wb") as f:
                pickle.dump(list(_ONCE_LAUNCHES.values()), f)


# Every launch of the session, by test module: (spec, args, constexprs).
_LAUNCHES_BY_MODULE: dict = {}


def assert_module_launches_compile(module_name: str, templates: set) -> None:
    """Each distinct launch the module's tests made compiles to a cubin for sm_90, and the
    launches cover ``templates``. Skips when the module's other tests did not run."""
    launches = launches_of(module_name)
    if not launches:
        pytest.skip("no launches recorded (run the whole module)")
    for spec, args, constexprs in launches:
        # the session's memo: a kernel a worker compiled (or is compiling) is not compiled again
        error = compile_error(spec, args, constexprs)
        assert error is None, f"sm_90 compile of {spec.kernel_name} failed: {error[-3000:]}"
    assert {s.template for s, _, _ in launches} >= templates


def launches_of(module_name: str) -> list:
    """The launches recorded so far by the tests of one module (``__name__`` there)."""
    return _LAUNCHES_BY_MODULE.get(module_name, [])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    previous = launch.RECORDED
    launch.RECORDED = recorded = []
    _CURRENT_MODULE[0] = item.module.__name__
    try:
        result = yield
    finally:
        launch.RECORDED = previous
    _LAUNCHES_BY_MODULE.setdefault(item.module.__name__, []).extend(recorded)
    if RECORD_ONCE and item.get_closest_marker("once") and not item.get_closest_marker("no_aot"):
        for spec, args, constexprs in recorded:
            types = aot.arg_types(spec, args, constexprs)
            _ONCE_LAUNCHES.setdefault(_compile_key(spec, types, constexprs), (item.nodeid, spec, types, constexprs))
    if AOT_ENABLED and recorded and not item.get_closest_marker("no_aot"):
        if _AOT_POOL:
            _submit_recorded(item, recorded)
        else:
            compile_recorded(recorded)
    return result


def pytest_configure(config):
    config.addinivalue_line("markers", "no_aot: launches of this test are not AOT-compiled "
                                       "(it launches deliberately broken kernels)")
    config.addinivalue_line("markers", "once: plumbing and front-end tests; CI runs them "
                                       "with the newest Triton only (FLEXGEN_TEST_RECORD_ONCE)")


def pytest_terminal_summary(terminalreporter):
    if _AOT_RESULTS:
        by_module, by_template = {}, {}
        for key, future in _AOT_RESULTS.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                module, template = _AOT_OWNERS[key]
                for table, name in ((by_module, module), (by_template, template)):
                    count, seconds = table.get(name, (0, 0.0))
                    table[name] = (count + 1, seconds + future.result()[1])
        seconds = sum(s for _, s in by_module.values())
        where = f"{AOT_WORKERS} worker process(es)" if AOT_WORKERS else "the test process"
        sample = f" (1 spec in {AOT_SAMPLE})" if AOT_SAMPLE > 1 else ""
        terminalreporter.write_line(
            f"flexgen: compiled {len(_AOT_RESULTS)} distinct kernel launches for sm_90{sample} "
            f"in {seconds:.1f}s of CPU with triton {triton.__version__} in {where}; "
            f"the tests waited {AOT_STATS['waited']:.1f}s for them")
        for what, table in (("test module", by_module), ("template", by_template)):
            heaviest = sorted(table.items(), key=lambda kv: -kv[1][1])[:8]
            terminalreporter.write_line(f"  by {what}: " + ", ".join(
                f"{name.removeprefix('tests.')} {count} in {secs:.0f}s" for name, (count, secs) in heaviest))


# --- inputs and comparison with the oracle -------------------------------------------

def hf_t5_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket, verbatim (the reference of flexgen.mods's
    T5 buckets, and a mod of real client code: log(0) at distance 0 lies in the branch torch.where
    drops)."""
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1))
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


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
