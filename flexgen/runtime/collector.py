"""Python's cyclic garbage collector paused while flexgen does a first call's work.

A process's first call of a mod imports sympy, Jinja and Triton, builds sympy
expressions, renders and executes a kernel module and compiles it: hundreds of
thousands of new objects, nearly all of them long-lived (modules, classes,
caches). Every 700 net allocations start a collection of the young objects, every
tenth of those one of the middle generation, and every tenth of those a full one
(once the survivors since the last full one are a quarter of the heap), which
walks every object of the process, torch's included, to find almost no garbage:
0.15 s of a cold mask step on the dev CPU, 0.2-0.25 s on the H100's host.

``paused()`` turns automatic collection off for such a step (the misses of the
lowering, module-text, module-load and launcher memos, and the first import of
the kernels) and back on after it; what the step allocated is collected by the
process's next collections as usual. Warm calls never reach these steps, so
their collections are untouched.
"""
from __future__ import annotations

import gc

import torch


class paused:
    """No automatic collection inside ``with paused():``, unless the caller already turned it
    off (then it stays off: a nested step or the application's own choice). Inside
    torch.compile's tracing it does nothing (dynamo traces it as a no-op: no graph break)."""
    __slots__ = ("_resume",)

    def __enter__(self):
        self._resume = not torch.compiler.is_compiling() and gc.isenabled()
        if self._resume:
            gc.disable()

    def __exit__(self, *exc_info):
        if self._resume:
            gc.enable()
