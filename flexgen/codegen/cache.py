"""Generated kernel modules: in memory first, then on disk.

The disk cache lives in ``$FLEXGEN_CACHE_DIR`` (default
``$XDG_CACHE_HOME/flexgen`` or ``~/.cache/flexgen``), a directory private to
the user (0700). A module file is named by its spec's key and written
atomically (temp file + rename). Before a file is imported its content must
equal the source rendered for that key, byte for byte: a truncated,
corrupted or tampered file is rewritten, never executed. Triton's own cache
then finds the compiled binary for the same source on the next process.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import FlexgenError
from ..codegen.render import render
from ..codegen.spec import KernelSpec

_MODULES: dict = {}          # (key, interpret) -> loaded module
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where generated modules are kept (created on first use, mode 0700)."""
    env = os.environ.get("FLEXGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flexgen"


def _private_dir() -> Path:
    path = cache_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise FlexgenError(
            f"FLEXGEN_CACHE_DIR: expected a directory owned by the current user, got {path} "
            f"owned by uid {info.st_uid}. Fix: point FLEXGEN_CACHE_DIR at a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # Others could plant code here: take the directory back before using it.
        os.chmod(path, 0o700)
    return path


def module_path(spec: KernelSpec) -> Path:
    return cache_dir() / f"{spec.kernel_name}.py"


def source(spec: KernelSpec) -> str:
    """The kernel module source for ``spec``, as it is (or will be) on disk."""
    return render(spec)


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _file_for(spec: KernelSpec) -> Path:
    """The module file for ``spec``, verified (or rewritten) to hold exactly its source."""
    text = source(spec)
    folder = _private_dir()
    path = folder / f"{spec.kernel_name}.py"
    try:
        with open(path, encoding="utf-8") as f:
            ok = f.read() == text
    except (OSError, UnicodeDecodeError):
        ok = False
    if not ok:
        _write_atomically(path, text)
    return path


@contextlib.contextmanager
def _interpreter(enabled: bool):
    # Triton picks the interpreter when @triton.jit runs, from TRITON_INTERPRET.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def load(spec: KernelSpec, interpret: bool):
    """The kernel module for ``spec``; ``interpret`` loads it for the Triton interpreter (CPU)."""
    cache_key = (spec.key, interpret)
    module = _MODULES.get(cache_key)
    if module is not None:
        return module
    with _LOCK:
        module = _MODULES.get(cache_key)
        if module is None:
            path = _file_for(spec)
            name = f"flexgen_kernels.{spec.kernel_name}{'_interp' if interpret else ''}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module      # triton resolves helper functions through it
            with _interpreter(interpret):
                module_spec.loader.exec_module(module)
            _MODULES[cache_key] = module
    return module


def clear_memos() -> None:
    """Forget the loaded modules (the next call loads them again, from the verified disk cache)."""
    _MODULES.clear()
