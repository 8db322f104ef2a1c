"""Generated kernel modules: in memory first, with a verified copy on disk.

A module's source is rendered from its spec, and that text is what runs: it is
compiled from the string and executed into a fresh module object. Nothing is
ever imported from the cache directory, so a file swapped on disk after it was
checked cannot run, and Python neither reads nor writes bytecode
(``__pycache__``) there.

The copy on disk is for people (``kernel_source``, tracebacks) and lives in
``$FLEXGEN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flexgen`` or
``~/.cache/flexgen``), a directory private to the user (0700). A file is kept
only if it is a regular file of the user's that no one else can write and it
holds exactly the rendered source; anything else is replaced atomically (temp
file + rename), so concurrent writers never see half a file. Triton's own cache
then finds the compiled binary for the same source on the next process.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import stat
import sys
import tempfile
import threading
import types
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


def _read_private(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of the user's that no one else
    can write; None for anything else (missing, a symlink, a FIFO, someone else's).

    The checks run on the opened file, so what is checked is what is read.
    O_NOFOLLOW refuses a symlink without opening what it points at; O_NONBLOCK
    keeps a planted FIFO from hanging the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        try:
            info = os.fstat(fd)
            if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                    or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
                return None
            return f.read()
        except OSError:
            return None


def _write_atomically(path: Path, text: str) -> None:
    # mkstemp creates the file 0600 with O_EXCL (never through a planted symlink), and
    # rename replaces whatever sits at ``path`` (a symlink included) in one step:
    # a concurrent reader sees the old file or the whole new one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".py")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _disk_copy(name: str, text: str) -> Path:
    """The file holding exactly ``text`` as ``<name>.py`` in the cache directory, kept if
    it is already there and verified, else written."""
    path = _private_dir() / f"{name}.py"
    if _read_private(path) != text.encode("utf-8"):
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


def _execute(name: str, text: str, path: Path, interpret: bool) -> types.ModuleType:
    """A fresh module ``name`` running ``text``, compiled from the string itself."""
    filename = str(path)
    # Triton reads each kernel's source with inspect.getsourcelines, that is from
    # linecache under the code's file name. An entry without an mtime is never
    # checked against the disk: Triton gets the verified text whatever the file
    # holds by then.
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    # dont_inherit: this module's `from __future__ import annotations` would turn the
    # kernels' tl.constexpr annotations into strings.
    code = compile(text, filename, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module      # triton resolves helper functions through it
    with _interpreter(interpret):
        exec(code, module.__dict__)
    if interpret:
        # The interpreter reads a function's source again at its first launch, to
        # rewrite it. Doing that now, while linecache holds the verified text, leaves
        # no later read that a cleared linecache (torch.compile clears it) would send
        # to the file on disk.
        from triton.runtime.interpreter import InterpretedFunction
        for value in list(vars(module).values()):
            if isinstance(value, InterpretedFunction):
                value.rewrite()
    return module


def load(spec: KernelSpec, interpret: bool):
    """The kernel module for ``spec``; ``interpret`` loads it for the Triton interpreter (CPU)."""
    cache_key = (spec.key, interpret)
    module = _MODULES.get(cache_key)
    if module is not None:
        return module
    with _LOCK:
        module = _MODULES.get(cache_key)
        if module is None:
            text = source(spec)
            name = f"flexgen_kernels.{spec.kernel_name}{'_interp' if interpret else ''}"
            module = _execute(name, text, _disk_copy(spec.kernel_name, text), interpret)
            _MODULES[cache_key] = module
    return module
