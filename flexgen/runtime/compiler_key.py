"""Triton's compiler key, remembered across processes.

Every compiled kernel's cache key starts with ``triton.runtime.cache.triton_key()``:
a hash of Triton's compiler, backends, language sources and its ``libtriton``
shared library. Triton computes it once per process by reading and hashing
those files, several hundred MB: ~0.35-0.45 s on the H100 host, the largest
single part of a warm restart's first call (a process whose kernels are all in
the disk caches).

The key changes only when those files do, so flexgen records it in the restart
index (``flexgen.codegen.index``: authenticated entries, like its other
results) under a stamp of the same files: each one's path, size and mtime
(``os.stat`` of ~300 files, ~3 ms). A later process with the same stamp installs
the recorded value as Triton's ``triton_key``, the way Triton's own pre-load
workers do; any file that changed (an upgrade, an edit) changes the stamp, and
the key is computed again. The stamp covers a superset of the files the key
hashes, so it can miss no change that the key would see, short of a file
rewritten with its size and mtime kept.

``FLEXGEN_RESTART_INDEX=0`` turns this off with the rest of the index.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

_installed: list = []       # [True] once this process has settled the key


def _stamp(cache_module, triton_root: str) -> str:
    """A hash of (path, size, mtime) of every file the key reads, and then some."""
    h = hashlib.sha256()
    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    files = [cache_module.__file__, os.path.join(triton_root, "_C", f"libtriton.{ext}")]
    for sub in ("compiler", "backends", "language"):
        for folder, dirs, names in os.walk(os.path.join(triton_root, sub)):
            dirs.sort()
            files += [os.path.join(folder, n) for n in sorted(names)]
    for path in files:
        try:
            info = os.stat(path)
        except OSError:
            continue
        h.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return h.hexdigest()


def install() -> None:
    """Give Triton its compiler key from the restart index, or compute and record it.

    Called before a process's first compile or compiled-kernel lookup. Leaves a
    Triton whose ``triton_key`` is not the memoized function this was written for
    alone (it then computes the key itself, as before).
    """
    if _installed:
        return
    _installed.append(True)
    from ..codegen import index
    import triton
    import triton.runtime.cache as cache_module
    compute = getattr(cache_module, "triton_key", None)
    if not index.enabled() or not hasattr(compute, "cache_info") or compute.cache_info().currsize:
        return
    stamp = _stamp(cache_module, os.path.dirname(os.path.abspath(triton.__file__)))
    recorded = index.get("triton_key", stamp)
    if isinstance(recorded, str) and recorded.startswith(triton.__version__):
        cache_module.triton_key = functools.lru_cache()(lambda: recorded)
    else:
        index.put("triton_key", stamp, compute())


__all__ = ["install"]
