"""Compile a serving model's kernels ahead of time: ``flexgen.precompile`` and
``python -m flexgen warmup module:function``.

A warm-up runs the calls a deployment will make, once, on example inputs of the
right dtypes and head dims (lengths and batch sizes are runtime arguments: one
call per mod and dtype is enough). Each call fills the disk caches a later
process finds: flexgen's module cache and restart index (``$FLEXGEN_CACHE_DIR``)
and Triton's compiled binaries (``$TRITON_CACHE_DIR``), so that process's
first calls neither import sympy or Jinja nor compile.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import time

from ..errors import expected


def precompile(calls, progress: bool = True) -> dict:
    """Run each zero-argument callable of ``calls`` once (a progress bar on stderr when tqdm is
    installed and ``progress``); returns ``{"calls", "kernels", "seconds"}``, kernels being the
    distinct kernels launched."""
    calls = list(calls)
    for i, call in enumerate(calls):
        if not callable(call):
            raise expected(f"calls[{i}]", "a callable taking no arguments (one attention call)",
                           type(call).__name__, "wrap the call: lambda: flexgen.flex_attention(q, k, v, ...)")
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(calls), desc="flexgen warm-up", unit="call", file=sys.stderr)
        except ImportError:
            pass
    start = time.perf_counter()
    with _warming_up() as recorded:
        try:
            for call in calls:
                call()
                if bar is not None:
                    bar.update(1)
            _synchronize()
        finally:
            if bar is not None:
                bar.close()
    return dict(calls=len(calls), kernels=len({spec.key for spec, _, _ in recorded}),
                seconds=time.perf_counter() - start)


@contextlib.contextmanager
def _warming_up():
    """The launches made inside, as a list (``launch.RECORDED``; an outer recorder, the test
    suite's sm_90 check, still sees them). Inside, a mask's first build on a GPU launches the
    block-mask kernel (``builder.compile_on_first_build``): the warm-up builds each mask once,
    and serving's second build of it must find that kernel compiled."""
    from ..masks import builder
    from . import launch
    previous, launch.RECORDED = launch.RECORDED, []
    recorded = launch.RECORDED
    try:
        with builder.compile_on_first_build():
            yield recorded
    finally:
        launch.RECORDED = previous
        if previous is not None:
            previous.extend(recorded)


def _synchronize() -> None:
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def load_target(target: str):
    """The function ``module:function`` names (dots after the colon walk attributes)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise expected("target", "'module:function' (e.g. my_server.kernels:warmup_calls)", repr(target),
                       "name the module and, after a colon, the function that makes the calls")
    sys.path.insert(0, "")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def warmup(target: str, progress: bool = True) -> dict:
    """Call ``target``'s function; when it returns an iterable of zero-argument callables
    (one attention call each), run them through ``precompile`` (with a progress bar), else
    the function made its calls itself."""
    fn = load_target(target)
    if not callable(fn):
        raise expected("target", "a function", type(fn).__name__, "name a function after the colon")
    start = time.perf_counter()
    with _warming_up() as recorded:
        made = fn()
        summary = dict(calls=None, kernels=0)
        if made is not None and not isinstance(made, (str, bytes)) and hasattr(made, "__iter__"):
            summary = precompile(made, progress)
        _synchronize()
    summary.update(kernels=len({spec.key for spec, _, _ in recorded}), seconds=time.perf_counter() - start)
    return summary


__all__ = ["precompile", "warmup", "load_target"]
