"""What the Gluon forward kernel needs of the installed Triton.

Gluon (``triton.experimental.gluon``) is experimental and its API moves between
Triton releases; the kernel is written against Triton 3.6 (the GPU machines) and
compiles on 3.9 too. ``gluon_api_missing`` names the first piece a Triton lacks,
so that ``BACKEND="gluon"`` declines with that name rather than failing inside the
compiler.
"""
from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=1)
def gluon_api_missing() -> str | None:
    """The first Gluon name the kernel uses that this Triton lacks, or None."""
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia import hopper
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError as err:
        return f"an importable Gluon ({err})"
    needs = [(gluon, "jit"), (gl, "warp_specialize"), (gl, "NVMMADistributedLayout"),
             (gl, "DotOperandLayout"), (gl, "NVMMASharedLayout"), (gl, "allocate_shared_memory"),
             (hopper, "warpgroup_mma"), (hopper, "warpgroup_mma_wait"), (hopper, "mbarrier"),
             (hopper, "fence_async_shared"), (hopper, "tma")]
    for owner, name in needs:
        if not hasattr(owner, name):
            return f"{owner.__name__}.{name}"
    tma = hopper.tma
    if not (hasattr(tma, "async_load") or hasattr(tma, "async_copy_global_to_shared")):
        return "tma.async_load"
    if "worker_num_regs" not in inspect.signature(gl.warp_specialize).parameters:
        return "warp_specialize(worker_num_regs=...)"
    return None
