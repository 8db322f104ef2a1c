"""Generated kernel modules: in memory first, with a verified copy on disk.

A module's source is rendered from its spec (or, in a later process, taken from
the restart index, whose entries are authenticated: ``flexgen.codegen.index``),
and that text is what runs: it is compiled from the string and executed into a
fresh module object. Nothing is
ever imported from the cache directory, so a file swapped on disk after it was
checked cannot run, and Python neither reads nor writes bytecode
(``__pycache__``) there.

The copy on disk is for people (``kernel_source``, tracebacks) and lives in
``$FLEXGEN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/flexgen`` or
``~/.cache/flexgen``), a directory private to the user (0700). A file is kept
only if it is a regular file of the user's that no one else can write and it
holds exactly the rendered source; anything else is replaced atomically (temp
file + rename), so concurrent writers never see half a file. A directory that
cannot be created or written costs only that copy: kernels run from memory,
with one warning per process. Triton's own cache then finds the compiled
binary for the same source on the next process.
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
import warnings
from pathlib import Path

from ..errors import FlexgenError
from ..codegen.spec import KernelSpec
from ..runtime import collector

MAX_MODULES = 1024
_MODULES: dict = {}          # (key, interpret) -> loaded module
_LOCK = threading.Lock()
_warned_memory_only = False


def cache_dir() -> Path:
    """Where generated modules are kept (created on first use, mode 0700)."""
    env = os.environ.get("FLEXGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flexgen"


def _private_dir() -> Path | None:
    """The cache directory, created or taken back private (0700); None when it cannot be
    used (kernels then run from memory only, after one warning)."""
    path = cache_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.stat(path)            # a symlinked directory is judged by its target
    except OSError as e:
        # Read-only file system, no permission, a file where the directory should
        # be: kernels never run from the disk anyway, so going on without the copy
        # is safe, and a copy for reading should not stop the work.
        return _memory_only(path, e)
    if info.st_uid != os.getuid():
        # Not degraded quietly: the owner of the directory decides what is in it and
        # reads every kernel written there (they hold the user's mods), and a cache
        # directory on a shared path that someone else created first is what a
        # planted one looks like. The user has to choose a directory of their own.
        raise FlexgenError(
            f"FLEXGEN_CACHE_DIR: expected a directory owned by the current user (uid "
            f"{os.getuid()}), got {path} owned by uid {info.st_uid}. Fix: point "
            f"FLEXGEN_CACHE_DIR at a directory of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        if info.st_mode & stat.S_ISVTX:
            # A sticky, writable directory is a shared scratch space (/tmp as root):
            # making it private would lock its other users out.
            raise FlexgenError(
                f"FLEXGEN_CACHE_DIR: expected a private directory, got {path}, a shared one "
                f"(mode {stat.S_IMODE(info.st_mode):o}). Fix: point FLEXGEN_CACHE_DIR at a "
                f"directory of your own inside it")
        # Taking the directory back is safe although others could write here until
        # now: what they planted is theirs (their uid) or a symlink, which
        # _read_private refuses; files of ours they cannot have changed (written
        # 0600, replaced whole, never edited in place); a file of ours renamed or
        # linked to another kernel's name fails the content check. And nothing in
        # the directory is ever executed, only compared with the rendered source.
        try:
            os.chmod(path, 0o700)
        except OSError as e:
            return _memory_only(path, e)
    return path


def _memory_only(path: Path, error: OSError) -> None:
    global _warned_memory_only
    if not _warned_memory_only:
        _warned_memory_only = True
        warnings.warn(
            f"FLEXGEN_CACHE_DIR: expected a directory flexgen can create and write, got {path} "
            f"({error}). Generated kernels run from memory, without a copy to read on disk, "
            f"and autotune winners are not kept. Fix: set FLEXGEN_CACHE_DIR to a writable "
            f"directory of your own")
    return None


def module_path(spec: KernelSpec) -> Path:
    return cache_dir() / f"{spec.kernel_name}.py"


def source(spec: KernelSpec) -> str:
    """The kernel module source for ``spec``, as it is (or will be) on disk."""
    from ..codegen.render import render
    return render(spec)


def module_text(spec: KernelSpec) -> str:
    """The source a load runs: the restart index's verified copy for this spec key when a
    previous process recorded one (no Jinja), else rendered now and recorded."""
    from . import index
    text = index.get("module", spec.key)
    if not isinstance(text, str):
        with collector.paused():        # (Jinja's import and the template's compile)
            text = source(spec)
        index.put("module", spec.key, text)
    return text


def loaded_or_recorded(spec: KernelSpec) -> bool:
    """Whether ``spec``'s module for the GPU is loaded in this process or its text is in the
    restart index: else a load renders it (Jinja), and no compiled binary of it can be
    recorded either."""
    from . import index
    return (spec.key, False) in _MODULES or isinstance(index.get("module", spec.key), str)


def _read_private(path: Path, forbidden: int = stat.S_IWGRP | stat.S_IWOTH) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of the user's with none of the
    ``forbidden`` permission bits (by default: no one else can write it); None for
    anything else (missing, a symlink, a FIFO, someone else's).

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
                    or info.st_mode & forbidden):
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


def _disk_copy(name: str, text: str) -> Path | None:
    """The file holding exactly ``text`` as ``<name>.py`` in the cache directory, kept if
    it is already there and verified, else written; None when there is no usable directory."""
    folder = _private_dir()
    if folder is None:
        return None
    path = folder / f"{name}.py"
    if _read_private(path) != text.encode("utf-8"):
        try:
            _write_atomically(path, text)
        except OSError as e:
            return _memory_only(folder, e)
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


def _execute(name: str, text: str, path: Path | None, interpret: bool) -> types.ModuleType:
    """A fresh module ``name`` running ``text``, compiled from the string itself."""
    filename = str(path) if path is not None else f"<flexgen: in memory>/{name}.py"
    # Triton reads each kernel's source with inspect.getsourcelines, that is from
    # linecache under the code's file name. An entry without an mtime is never
    # checked against the disk: Triton gets the verified text whatever the file
    # holds by then, and a source without any file in memory-only mode.
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    # dont_inherit: this module's `from __future__ import annotations` would turn the
    # kernels' tl.constexpr annotations into strings.
    code = compile(text, filename, "exec", dont_inherit=True)
    module = types.ModuleType(name)
    # Always a string: the interpreter copies its own globals into a kernel's module
    # where they are missing, and inspect.getmodule (torch.library calls it) fails on
    # a module whose __file__ turned from a path into None under the same name.
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


# FLEXGEN_EXACT_TANH=1: compiled kernels use the exact tanh for float16 / bfloat16 too.
EXACT_TANH = os.environ.get("FLEXGEN_EXACT_TANH", "0") not in ("", "0")


def half_inputs(spec: KernelSpec) -> bool:
    """Whether a kernel's inputs are float16 / bfloat16: on the GPU such kernels take the
    one-instruction tanh.approx (mods' tanh, sigmoid weights), whose 2^-11 relative error
    is below those inputs' own precision; float32 kernels keep the exact formulas."""
    return spec.dtype in ("float16", "bfloat16")


def fast_tanh(spec: KernelSpec) -> bool:
    """Whether a module compiled for the GPU takes tanh.approx for the mods' tanh."""
    return not EXACT_TANH and half_inputs(spec)


def load(spec: KernelSpec, interpret: bool):
    """The kernel module for ``spec``; ``interpret`` loads it for the Triton interpreter (CPU)."""
    cache_key = (spec.key, interpret)
    module = _MODULES.get(cache_key)
    if module is not None:
        return module
    with _LOCK:
        module = _MODULES.get(cache_key)
        if module is None:
            text = module_text(spec)
            name = f"flexgen_kernels.{spec.kernel_name}{'_interp' if interpret else ''}"
            with collector.paused():    # (the module's imports: Triton, Gluon)
                module = _execute(name, text, _disk_copy(spec.kernel_name, text), interpret)
            if not interpret and fast_tanh(spec) and "FAST_TANH" in vars(module):
                # Before the first compile: Triton keys a kernel on the constexpr globals it reads.
                module.FAST_TANH = type(module.FAST_TANH)(True)
            if len(_MODULES) >= MAX_MODULES:
                # A process making mods per call: forget the oldest half (a plan that still
                # holds one of them keeps it alive; a later load renders it again).
                for old in list(_MODULES)[:MAX_MODULES // 2]:
                    _MODULES.pop(old)
            _MODULES[cache_key] = module
    return module


def clear_memos() -> None:
    """Forget the loaded modules (the next call renders, checks and loads them again)."""
    _MODULES.clear()
    from . import index
    index.clear_memos()
