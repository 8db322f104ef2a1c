"""The kernel cache: a private directory, atomic writes, and a module that runs the
source rendered for its key, never a file (a tampered file is never executed).

Each test points ``FLEXGEN_CACHE_DIR`` at a fresh directory and starts from an
empty in-memory cache (``flexgen.codegen.cache._MODULES``, restored afterwards), so
every kernel goes through the disk path. The attacks each test plays are named in
its docstring; a payload that runs sets ``builtins.<MARKER>``.

The CI runs as root, where file permissions do not stop a write
and ``os.chown`` works: foreign owners are made with chown where possible and
else reported through ``os.stat`` / ``os.fstat``; conditions permissions cannot
force for root (a read-only directory) are forced by the failing call itself.
"""
from __future__ import annotations

import builtins
import errno
import inspect
import json
import linecache
import multiprocessing
import os
import py_compile
import stat
import subprocess
import sys
import warnings
from importlib.util import cache_from_source
from pathlib import Path

import pytest
import torch

from flexgen import FlexgenError, clear_caches, create_block_mask, flex_attention, kernel_source

from flexgen.runtime import aot

from flexgen.codegen import cache
from flexgen.runtime import tuning
from flexgen import mods as M
from conftest import AOT_ENABLED, make_qkv, run_and_check

MARKER = "_flexgen_test_tampered_module_ran"
PAYLOAD = f"import builtins\nbuiltins.{MARKER} = True\n"
FOREIGN_UID = 4242


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A new, not yet existing cache directory and an empty in-memory cache (with no memo of
    the masks built so far: a mask another test built would otherwise skip its kernel here)."""
    from flexgen.masks import builder
    builder.clear_memos()
    path = tmp_path / "nested" / "flexgen-cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    monkeypatch.setattr(cache, "_warned_memory_only", False)
    monkeypatch.delattr(builtins, MARKER, raising=False)
    return path


def make_foreign(path, how, monkeypatch):
    """Make ``path`` someone else's: ``"chown"`` gives it to FOREIGN_UID (root only);
    ``"reported"`` leaves it ours but has ``os.stat`` / ``os.fstat`` report FOREIGN_UID
    as its owner, which is all the cache can see of an owner."""
    if how == "chown":
        if os.getuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(path, FOREIGN_UID, -1, follow_symlinks=False)
        return
    info = os.stat(path, follow_symlinks=False)
    inode = (info.st_dev, info.st_ino)

    class Foreign:
        st_uid = FOREIGN_UID

        def __init__(self, real):
            self.real = real

        def __getattr__(self, name):
            return getattr(self.real, name)

    def reporting(real_call):
        def call(*args, **kwargs):
            result = real_call(*args, **kwargs)
            return Foreign(result) if (result.st_dev, result.st_ino) == inode else result
        return call

    monkeypatch.setattr(os, "stat", reporting(os.stat))
    monkeypatch.setattr(os, "fstat", reporting(os.fstat))


def small_inputs():
    q, k, v = make_qkv(B=1, H=1, L=40, D=32)
    return q, k, v


def softcap(score, b, h, q_idx, kv_idx):
    return 12.0 * torch.tanh(score / 12.0)


def launch_spec(q, k, v, **kwargs):
    """Run flex_attention and return the KernelSpec of the forward launch."""
    with aot.recording() as launches:
        flex_attention(q, k, v, **kwargs)
    specs = [spec for spec, _, _ in launches if spec.template == "forward"]
    assert len(specs) == 1
    return specs[0]


def test_directory_created_private(fresh_cache):
    assert not fresh_cache.exists()
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    assert fresh_cache.is_dir()
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    assert cache.module_path(spec) == fresh_cache / f"{spec.kernel_name}.py"
    assert cache.module_path(spec).is_file()
    assert cache.cache_dir() == fresh_cache


@pytest.mark.parametrize("mode", [0o770, 0o777], ids=oct)
def test_group_writable_directory_is_made_private(fresh_cache, mode, monkeypatch):
    """Attack: others could write to the cache directory and planted a kernel file
    there (their own file, with a payload). The directory is taken back (0700) and
    the planted file is replaced, never executed."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v)
    path = cache.module_path(spec)
    path.unlink()
    path.write_text(PAYLOAD + cache.source(spec))
    make_foreign(path, "chown" if os.getuid() == 0 else "reported", monkeypatch)
    os.chmod(fresh_cache, mode)
    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v)
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    assert not hasattr(builtins, MARKER), "a planted file was executed"
    assert path.read_text() == cache.source(spec)


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FLEXGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "flexgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "flexgen"


TAMPERED = {
    "flag_on_import": PAYLOAD,
    "raise_on_import": f"import builtins\nbuiltins.{MARKER} = True\nraise SystemExit('tampered')\n",
    "not_utf8": None,
    "truncated": None,
    "empty": "",
}


@pytest.mark.parametrize("kind", list(TAMPERED))
def test_tampered_or_truncated_file_is_rewritten_not_executed(fresh_cache, kind, monkeypatch):
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    good = cache.source(spec)
    assert path.read_text() == good

    if kind == "not_utf8":
        path.write_bytes(b"\xff\xfe\x00garbage" + good.encode()[:100])
    elif kind == "truncated":
        path.write_text(good[: len(good) // 2])
    else:
        # keep the real kernel after the payload, so only the check can stop it
        path.write_text(TAMPERED[kind] + good)
    monkeypatch.delattr(builtins, MARKER, raising=False)
    monkeypatch.setattr(cache, "_MODULES", {})          # force a load from disk

    run_and_check(q, k, v, score_mod=softcap)
    assert not hasattr(builtins, MARKER), "a tampered cache file was executed"
    assert path.read_text() == good
    assert not [p for p in fresh_cache.iterdir() if p.name.startswith(".tmp")]


def test_valid_file_is_reused_not_rewritten(fresh_cache, monkeypatch):
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    before = path.stat()
    monkeypatch.setattr(cache, "_MODULES", {})
    assert launch_spec(q, k, v, score_mod=softcap).key == spec.key
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_atomic_writes_leave_no_temp_files(fresh_cache, monkeypatch):
    from flexgen.masks import mask_eval
    # The block-mask kernel classifies the undecided blocks (not the torch path), so it is written too.
    monkeypatch.setattr(mask_eval, "TORCH_MAX_ELEMENTS", 0)
    q, k, v = make_qkv(B=1, H=2, L=70, D=32)
    mask = create_block_mask(M.sliding_window(20), None, None, 70, 70, device="cpu", BLOCK_SIZE=32)
    for mod in (None, softcap, M.alibi(num_heads=2)):
        run_and_check(q, k, v, score_mod=mod, block_mask=mask)
    # The restart index (flexgen.codegen.index) lives beside the modules: its key and its folder.
    names = sorted(p.name for p in fresh_cache.iterdir() if p.name not in ("index", "index.key"))
    assert len(names) >= 4      # three forward kernels and the block-mask kernel
    assert all(n.startswith("flexgen_") and n.endswith(".py") for n in names), names
    entries = sorted(p.name for p in (fresh_cache / "index").iterdir())
    assert entries and all(n.endswith(".json") and not n.startswith(".") for n in entries), entries


def test_failed_write_removes_its_temp_file(fresh_cache, monkeypatch):
    fresh_cache.mkdir(parents=True)
    target = fresh_cache / "flexgen_forward_x.py"

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(cache.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        cache._write_atomically(target, "x = 1\n")
    monkeypatch.undo()
    assert list(fresh_cache.iterdir()) == []


def test_kernel_source_is_the_file_that_runs(fresh_cache):
    q, k, v = make_qkv(B=1, H=2, L=67, D=32)
    mask = create_block_mask(M.causal_mask, None, None, 67, 67, device="cpu", BLOCK_SIZE=64)
    src = kernel_source(q, k, v, score_mod=softcap, block_mask=mask)
    assert not list(fresh_cache.glob("flexgen_forward_*.py")), "kernel_source must not launch"
    spec = launch_spec(q, k, v, score_mod=softcap, block_mask=mask)
    assert src == cache.source(spec) == cache.module_path(spec).read_text()
    assert f"def {spec.kernel_name}(" in src and spec.key in src
    module = cache._MODULES[(spec.key, True)]
    assert Path(module.__file__) == cache.module_path(spec)
    assert module.KERNEL.fn.__name__ == spec.kernel_name
    # the source names its mods in its header, for a reader of the cache
    assert "# score_mod:" in src and "# mask_mod:" in src


def test_source_is_deterministic(fresh_cache):
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    assert cache.source(spec) == cache.source(spec)
    assert kernel_source(q, k, v, score_mod=softcap) == kernel_source(q, k, v, score_mod=softcap)


def test_interpreter_and_compiled_modules_are_separate(fresh_cache):
    """One file, two loaded modules: interpreted for CPU tensors, compiled for the GPU."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v)
    compiled = cache.load(spec, interpret=False)
    interpreted = cache.load(spec, interpret=True)
    assert compiled is not interpreted
    assert compiled.__file__ == interpreted.__file__
    assert cache.load(spec, interpret=True) is interpreted


# ---------------------------------------------------------------- what runs is what was verified

def test_planted_bytecode_is_never_run(fresh_cache, monkeypatch):
    """Attack: bytecode planted in ``__pycache__`` beside a correct kernel file. An
    import would run it (Python prefers a valid .pyc to the .py it checked); the cache
    compiles the verified text itself and never reads or writes ``__pycache__``."""
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    assert not (fresh_cache / "__pycache__").exists(), "loading a kernel wrote bytecode"

    payload = fresh_cache.parent / "payload.py"
    payload.write_text(PAYLOAD)
    pyc = Path(cache_from_source(str(path)))
    # Unchecked-hash bytecode is used without looking at the source at all.
    py_compile.compile(str(payload), cfile=str(pyc), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    import importlib.util
    planted = importlib.util.spec_from_file_location("planted_check", path)
    planted.loader.exec_module(importlib.util.module_from_spec(planted))
    assert getattr(builtins, MARKER, False), "the planted bytecode is not an attack on an import"
    monkeypatch.delattr(builtins, MARKER)

    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert cache.module_path(spec).read_text() == cache.source(spec)
    assert not hasattr(builtins, MARKER), "planted bytecode was executed"


SWAPPER = """
import os, sys
path, bad, running = sys.argv[1:]
swaps = 0
while os.path.exists(running):
    with open(path + ".swap", "w") as f:
        f.write(bad)
    os.replace(path + ".swap", path)      # a whole tampered file, at any moment
    swaps += 1
print(swaps)
"""


def test_a_file_swapped_while_loading_never_runs(fresh_cache, monkeypatch, tmp_path):
    """Attack: another process keeps replacing the kernel file with a tampered one
    (payload + the real kernel) while this one loads the kernel 150 times. Whenever
    the swap lands, between the check and the execution included, the tampered
    text never runs: the module is compiled from the rendered text, not the file."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    running = tmp_path / "running"
    running.touch()
    swapper = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(path), PAYLOAD + cache.source(spec), str(running)],
        stdout=subprocess.PIPE, text=True)
    try:
        while path.read_text().startswith(cache.source(spec)[:40]):
            pass                                    # until the first swap has landed
        for _ in range(150):
            monkeypatch.setattr(cache, "_MODULES", {})
            module = cache.load(spec, interpret=False)
            assert not hasattr(builtins, MARKER), "a swapped-in file was executed"
    finally:
        running.unlink()
        swaps = int(swapper.communicate(timeout=30)[0])
    assert swaps > 0
    assert inspect.getsource(module.KERNEL.fn) in cache.source(spec)
    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert not hasattr(builtins, MARKER)


def test_triton_reads_the_verified_text_not_the_file(fresh_cache, monkeypatch):
    """Attack: the kernel file is changed after its module was loaded and linecache is
    cleared (torch.compile clears it), before the first launch. The interpreter reads
    a kernel's source to rewrite it; it must get the verified text, not the file's."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    good = cache.source(spec)
    monkeypatch.setattr(cache, "_MODULES", {})
    interpreted = cache.load(spec, interpret=True)
    compiled = cache.load(spec, interpret=False)

    # Same lines, so the kernel's line numbers still point into the tampered file.
    line = "    SUBBLOCKS: tl.constexpr = SPARSE_KV_BLOCK // BLOCK_N\n"
    assert line in good
    path.write_text(good.replace(line, line[:-1] + f"; __import__('builtins').{MARKER} = True\n"))
    linecache.clearcache()

    run_and_check(q, k, v, score_mod=softcap)
    assert cache._MODULES[(spec.key, True)] is interpreted
    assert not hasattr(builtins, MARKER), "the interpreter ran the file's text"
    assert compiled.KERNEL.src in good


# ---------------------------------------------------------------- concurrent writers

def _writer(spec, good, rounds):
    """One of several processes that delete and regenerate the same kernel file."""
    path = cache.module_path(spec)
    for _ in range(rounds):
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        cache._MODULES.clear()
        cache.load(spec, interpret=False)
        try:
            seen = path.read_text()
        except FileNotFoundError:
            continue                                # another writer's unlink
        if seen != good:
            os._exit(3)
    os._exit(0)


def test_concurrent_writers_never_expose_a_partial_file(fresh_cache, monkeypatch):
    """Failure: several processes generate the same kernel at once, each deleting and
    rewriting its file. A reader only ever finds no file or the whole verified text
    (writes are temp file + rename), and no temp file is left behind."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    good = cache.source(spec)
    path = cache.module_path(spec)
    # fork: the children start at once with everything imported (a spawned
    # process would import torch first).
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_writer, args=(spec, good, 60)) for _ in range(3)]
    for writer in writers:
        writer.start()
    seen = set()
    while any(writer.is_alive() for writer in writers):
        try:
            seen.add(path.read_text() == good)
        except FileNotFoundError:
            pass
    for writer in writers:
        writer.join()
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    assert seen <= {True}, "a reader saw a partial or foreign kernel file"
    assert path.read_text() == good
    assert [p.name for p in fresh_cache.iterdir()] == [path.name]


# ---------------------------------------------------------------- files the cache does not trust

def _replaced(path, before, good) -> bool:
    """``path`` is now a new regular private file of ours holding ``good``."""
    after = os.stat(path, follow_symlinks=False)
    return ((after.st_dev, after.st_ino) != (before.st_dev, before.st_ino)
            and stat.S_ISREG(after.st_mode) and after.st_uid == os.getuid()
            and stat.S_IMODE(after.st_mode) == 0o600 and path.read_text() == good)


@pytest.mark.parametrize("how", ["chown", "reported"])
def test_a_foreign_owned_file_is_replaced(fresh_cache, monkeypatch, how):
    """Failure: a kernel file that belongs to another user (planted, or left by a
    process running as someone else). Even with the right content it is not trusted:
    it is replaced by a file of ours."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    make_foreign(path, how, monkeypatch)
    before = os.stat(path)
    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert _replaced(path, before, cache.source(spec))


@pytest.mark.parametrize("mode", [0o620, 0o606, 0o666], ids=oct)
def test_a_file_others_can_write_is_replaced(fresh_cache, monkeypatch, mode):
    """Failure: a kernel file of ours that the group or others may write (someone could
    change it at any moment). Right content or not, it is replaced by a 0600 file."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    os.chmod(path, mode)
    before = os.stat(path)
    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert _replaced(path, before, cache.source(spec))


@pytest.mark.parametrize("target", ["tampered", "correct"])
def test_a_symlinked_file_is_not_followed(fresh_cache, monkeypatch, tmp_path, target):
    """Attack: the kernel file is a symlink to a file the attacker controls. It is
    never opened through the link (not even when the target holds the right text)
    and never written through: the link itself is replaced."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    good = cache.source(spec)
    attacker = tmp_path / "attacker.py"
    attacker.write_text(PAYLOAD + good if target == "tampered" else good)
    planted = attacker.read_text()
    path.unlink()
    path.symlink_to(attacker)
    before = os.stat(path, follow_symlinks=False)

    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert not hasattr(builtins, MARKER), "a symlinked file was executed"
    assert attacker.read_text() == planted, "the cache wrote through a symlink"
    assert _replaced(path, before, good)


def test_a_planted_fifo_does_not_hang_the_load(fresh_cache, monkeypatch):
    """Attack: a FIFO where the kernel file should be (opening it for reading would
    block until a writer comes). It is opened without blocking and replaced."""
    q, k, v = small_inputs()
    spec = launch_spec(q, k, v, score_mod=softcap)
    path = cache.module_path(spec)
    path.unlink()
    os.mkfifo(path, 0o600)
    before = os.stat(path)
    monkeypatch.setattr(cache, "_MODULES", {})
    run_and_check(q, k, v, score_mod=softcap)
    assert _replaced(path, before, cache.source(spec))


# ---------------------------------------------------------------- directories

@pytest.mark.parametrize("how", ["chown", "reported"])
def test_a_foreign_owned_directory_is_an_error(fresh_cache, monkeypatch, how):
    """Misconfiguration that cannot be degraded: FLEXGEN_CACHE_DIR is another user's
    directory (on a shared path someone created it first). The error names the
    variable, the owner found and the fix; nothing is written there."""
    fresh_cache.mkdir(parents=True)
    make_foreign(fresh_cache, how, monkeypatch)
    q, k, v = small_inputs()
    with pytest.raises(FlexgenError, match=r"FLEXGEN_CACHE_DIR: expected a directory owned by "
                                           r"the current user .* owned by uid 4242\. Fix: "):
        flex_attention(q, k, v, score_mod=softcap)
    assert list(fresh_cache.iterdir()) == []


def test_a_shared_sticky_directory_is_an_error_and_left_alone(fresh_cache):
    """Misconfiguration: FLEXGEN_CACHE_DIR is a shared scratch directory of ours (mode
    1777, like /tmp for root). Making it private would lock its other users out, so
    its mode is left as it is and the error says to use a directory inside it."""
    fresh_cache.mkdir(parents=True)
    os.chmod(fresh_cache, 0o1777)
    q, k, v = small_inputs()
    with pytest.raises(FlexgenError, match=r"FLEXGEN_CACHE_DIR: expected a private directory, "
                                           r".*1777.*Fix: "):
        flex_attention(q, k, v, score_mod=softcap)
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o1777


def _fail_with(error_number):
    def fail(*args, **kwargs):
        raise OSError(error_number, os.strerror(error_number))
    return fail


# How each case forces its condition, for root too (which ignores permission bits).
UNUSABLE = {
    # A regular file where a parent directory should be: mkdir fails with ENOTDIR.
    "under_a_file": lambda path, mp: path.parent.write_text("not a directory\n"),
    # FLEXGEN_CACHE_DIR names a regular file: mkdir fails with EEXIST.
    "is_a_file": lambda path, mp: (path.parent.mkdir(), path.write_text("a file\n")),
    # A read-only file system: mkdir itself fails with EROFS.
    "read_only_fs": lambda path, mp: mp.setattr(os, "mkdir", _fail_with(errno.EROFS)),
    # An existing directory we may not write: 0500, and the temp file's creation fails
    # with EACCES (root would be allowed, so the failure is forced for it too).
    "read_only_dir": lambda path, mp: (path.mkdir(parents=True), os.chmod(path, 0o500),
                                       mp.setattr(cache.tempfile, "mkstemp",
                                                  _fail_with(errno.EACCES))),
}


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_an_unusable_directory_degrades_to_memory_with_one_warning(fresh_cache, monkeypatch,
                                                                  case):
    """Failure: the cache directory cannot be created or written. Kernels still run,
    from memory, and the process gets one warning naming FLEXGEN_CACHE_DIR and the
    fix, however many kernels it loads; no raw OSError escapes."""
    UNUSABLE[case](fresh_cache, monkeypatch)
    q, k, v = small_inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mod in (softcap, None, softcap):
            run_and_check(q, k, v, score_mod=mod)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"FLEXGEN_CACHE_DIR: expected a directory flexgen can "
                                  f"create and write, got {fresh_cache}")
    assert "Fix: set FLEXGEN_CACHE_DIR to a writable directory" in messages[0]

    spec = launch_spec(q, k, v, score_mod=softcap)
    module = cache._MODULES[(spec.key, True)]
    assert module.__file__.startswith("<flexgen: in memory>/")
    assert inspect.getsource(module.KERNEL.fn) in cache.source(spec)
    if fresh_cache.is_dir():
        assert list(fresh_cache.iterdir()) == []


def test_a_kernel_reloaded_in_memory_keeps_inspect_working(fresh_cache, monkeypatch):
    """Regression: a kernel loaded from disk, then again in memory-only mode under the
    same module name, left a module in sys.modules whose __file__ was None.
    inspect.getmodule (torch.library calls it for a custom operator in a mod) then
    raised 'is a built-in module' on it. Every kernel module has a file name for
    inspect, on disk or not."""
    q, k, v = small_inputs()
    run_and_check(q, k, v, score_mod=softcap)
    clear_caches()                              # plans hold their modules too
    elsewhere = fresh_cache.parent.parent / "not-a-dir" / "cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(elsewhere))
    UNUSABLE["under_a_file"](elsewhere, monkeypatch)
    with pytest.warns(UserWarning, match="FLEXGEN_CACHE_DIR"):
        run_and_check(q, k, v, score_mod=softcap)
    (module,) = cache._MODULES.values()
    assert sys.modules[module.__name__] is module
    assert inspect.getfile(module).startswith("<flexgen: in memory>/")


@pytest.mark.skipif(not AOT_ENABLED, reason="FLEXGEN_TEST_AOT=0")
def test_a_kernel_in_memory_only_compiles_for_sm90(fresh_cache, monkeypatch):
    """Failure: no cache directory at all. Triton's compiler still gets the kernel's
    source (from linecache, under a name that is no file) and builds it for sm_90."""
    UNUSABLE["under_a_file"](fresh_cache, monkeypatch)
    q, k, v = small_inputs()
    with pytest.warns(UserWarning, match="FLEXGEN_CACHE_DIR"), aot.recording() as launches:
        flex_attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: score * 0.5)
    (spec, args, constexprs), = launches
    assert cache.load(spec, interpret=False).__file__.startswith("<flexgen: in memory>/")
    assert aot.compile_launch(spec, args, constexprs).asm.get("cubin")


# ---------------------------------------------------------------- the autotune store

STORED = {"version": tuning.STORE_VERSION,
          "entries": {"some-kernel|H100|1024x1024x8": {"config": dict(
              BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)}}}


def _planted_store(folder, how, monkeypatch, tmp_path):
    store = folder / tuning.STORE_NAME
    if how == "symlink":
        target = tmp_path / "attacker.json"
        target.write_text(json.dumps(STORED))
        store.symlink_to(target)
        return target
    store.write_text(json.dumps(STORED))
    if how == "world_writable":
        os.chmod(store, 0o666)
    elif how in ("chown", "reported"):
        make_foreign(store, how, monkeypatch)
    return store


@pytest.mark.parametrize("how", ["private", "symlink", "world_writable", "chown", "reported"])
def test_an_untrusted_autotune_store_is_ignored_and_replaced(fresh_cache, monkeypatch, tmp_path,
                                                             how):
    """Attack: autotune.json is a symlink to a file the attacker controls, someone
    else's file, or one anyone may write. Its winners (data that picks the tiles a
    kernel launches with) are ignored, and a new winner replaces the file or the link,
    never writing through it. A private file of ours ("private") is read."""
    fresh_cache.mkdir(parents=True, mode=0o700)
    planted = _planted_store(fresh_cache, how, monkeypatch, tmp_path)
    before = planted.read_text()
    monkeypatch.setattr(tuning, "_STORED", None)
    trusted = how == "private"
    assert tuning._load_store() == (STORED["entries"] if trusted else {})

    tuning._save_winner("new", {"config": {}})
    store = fresh_cache / tuning.STORE_NAME
    assert stat.S_ISREG(os.stat(store, follow_symlinks=False).st_mode)
    assert set(json.loads(store.read_text())["entries"]) == (
        {"new"} | (set(STORED["entries"]) if trusted else set()))
    if how == "symlink":
        assert planted.read_text() == before, "the store was written through a symlink"


def test_the_autotune_store_without_a_cache_directory(fresh_cache, monkeypatch):
    """Failure: no usable cache directory. Winners are neither read nor stored, with the
    cache's one warning and no error."""
    UNUSABLE["under_a_file"](fresh_cache, monkeypatch)
    monkeypatch.setattr(tuning, "_STORED", None)
    with pytest.warns(UserWarning, match="FLEXGEN_CACHE_DIR"):
        assert tuning._load_store() == {}
        tuning._save_winner("new", {"config": {}})
    assert fresh_cache.parent.is_file()
