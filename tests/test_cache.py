"""The kernel cache: a private directory, atomic writes, and files that are
checked against their key before import (a tampered file is never executed).

Each test points ``FLEXGEN_CACHE_DIR`` at a fresh directory and starts from an
empty in-memory cache (``flexgen.codegen.cache._MODULES``, restored afterwards), so
every kernel goes through the disk path.
"""
from __future__ import annotations

import builtins
import os
import stat
from pathlib import Path

import pytest
import torch

from flexgen import create_block_mask, flex_attention, kernel_source

from flexgen.runtime import aot

from flexgen.codegen import cache
from flexgen import mods as M
from conftest import make_qkv, run_and_check

MARKER = "_flexgen_test_tampered_module_ran"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """A new, not yet existing cache directory and an empty in-memory cache."""
    path = tmp_path / "nested" / "flexgen-cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(path))
    monkeypatch.setattr(cache, "_MODULES", {})
    return path


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


def test_group_writable_directory_is_made_private(fresh_cache):
    fresh_cache.mkdir(parents=True)
    os.chmod(fresh_cache, 0o777)
    q, k, v = small_inputs()
    launch_spec(q, k, v)
    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700


def test_default_location_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FLEXGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "flexgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "flexgen"


TAMPERED = {
    "flag_on_import": f"import builtins\nbuiltins.{MARKER} = True\n",
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
    names = sorted(p.name for p in fresh_cache.iterdir())
    assert len(names) >= 4      # three forward kernels and the block-mask kernel
    assert all(n.startswith("flexgen_") and n.endswith(".py") for n in names), names


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
