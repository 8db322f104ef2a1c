"""Triton's compiler key, from a stamp of its files instead of a hash of their contents.

Every compiled kernel's cache key starts with ``triton.runtime.cache.triton_key()``:
a hash of Triton's compiler, backends, language sources and its ``libtriton``
shared library. Triton computes it once per process by reading and hashing
those files, several hundred MB: ~0.35-0.45 s on the H100 host, paid by every
process that compiles or looks a kernel up (a cold start's first call included).

The key only has to change when those files do. flexgen installs, as Triton's
``triton_key``, Triton's version and a stamp of the same files: each one's path,
size and mtime (``os.stat`` of ~300 files, ~3 ms), the way Triton's own pre-load
workers install a key they were given. Any file that changes (an upgrade, an
edit) changes the stamp, so kernels compiled before are not found under the new
key. The stamp covers a superset of the files the key hashes, so it can miss no
change that the key would see, short of a file rewritten with its size and
mtime kept. Cache entries are then keyed differently from a process that lets
Triton hash (torch's inductor alone, say): both compile and keep their own.

``FLEXGEN_RESTART_INDEX=0`` turns this off with flexgen's other restart shortcuts.
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
    """Give Triton a compiler key from the stamp of its files (see the module docstring).

    Called before a process's first compile or compiled-kernel lookup. Leaves a
    Triton whose ``triton_key`` is not the memoized function this was written for
    alone (it then computes the key itself, as before), and one that has already
    computed it.
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
    key = f"{triton.__version__}-files-{_stamp(cache_module, os.path.dirname(os.path.abspath(triton.__file__)))}"
    cache_module.triton_key = functools.lru_cache()(lambda: key)


__all__ = ["install"]
