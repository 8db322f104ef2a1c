"""The wheel: it ships the templates and the mods, and works outside the source tree.

The package is built from a copy of the source (so the build never writes
``build/`` or ``*.egg-info`` into the working tree), installed with
``pip install --target`` into a temporary directory, and imported by a fresh
interpreter whose working directory is outside the repository; that
interpreter renders a kernel and runs it through the Triton interpreter.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

# Front-end checks (tracing, masks, mods and their kernels' numerics): CI runs them with the
# newest Triton; its second pass compiles their launches from the first pass's record.
pytestmark = pytest.mark.once

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("flexgen", "mods", "templates")   # pyproject's package-dir mapping


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for item in ROOT.iterdir():
        if item.is_file() and (item.name in ("pyproject.toml", "setup.cfg", "setup.py", "MANIFEST.in")
                               or item.name.upper().startswith(("README", "LICENSE"))):
            shutil.copy2(item, src / item.name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PACKAGE_DIRS:
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    # --skip-dependency-check: the venv has setuptools (which builds wheels by
    # itself since 70.1) but need not have the separate `wheel` package.
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                           "--skip-dependency-check", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list(out.glob("flexgen-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in (ROOT / "templates").glob("*.jinja"):
        assert f"flexgen/templates/{template.name}" in names, f"{template.name} missing from the wheel"
    for mod in (ROOT / "mods").glob("*.py"):
        assert f"flexgen/mods/{mod.name}" in names, f"mods/{mod.name} missing from the wheel"
    for module in (ROOT / "flexgen").rglob("*.py"):      # every subpackage listed in pyproject
        path = module.relative_to(ROOT).as_posix()
        assert path in names, f"{path} missing from the wheel"
    assert "flexgen/templates/forward.py.jinja" in names
    assert "flexgen/templates/common.py.jinja" in names
    assert "flexgen/mods/lowered.json" in names       # the shipped lowered forms (frontend.seeds)
    assert not any(n.startswith(("tests/", "mods/", "templates/")) for n in names), \
        "only the flexgen package belongs at the top of the wheel"
    assert not any("__pycache__" in n for n in names)


SMOKE = textwrap.dedent("""
    import os, sys
    import torch
    import flexgen
    from flexgen import create_block_mask, flex_attention, kernel_source
    from flexgen.mods import causal_mask, tanh_softcap
    from flexgen.reference import flex_attention_reference

    target = os.path.realpath(sys.argv[1])
    assert os.path.realpath(flexgen.__file__).startswith(target + os.sep), flexgen.__file__
    import flexgen.mods, flexgen.templates
    assert os.path.realpath(flexgen.mods.__file__).startswith(target + os.sep)

    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    mask = create_block_mask(causal_mask, None, None, 40, 40, device="cpu", BLOCK_SIZE=32)
    src = kernel_source(q, k, v, score_mod=tanh_softcap(20.3), block_mask=mask)
    assert "@triton.jit" in src and "_tanh(" in src, src[:500]
    out = flex_attention(q, k, v, score_mod=tanh_softcap(20.3), block_mask=mask)
    # The mask's and the soft-cap's forms came from the wheel's mods/lowered.json, not sympy.
    from flexgen.frontend import seeds
    assert seeds.table() and "sympy" not in sys.modules, sorted(seeds.table())[:1]
    ref = flex_attention_reference(q, k, v, score_mod=tanh_softcap(20.3), mask_mod=causal_mask)
    assert (out.double() - ref).abs().max() < 1e-4
    print("SMOKE OK", flexgen.__file__)
""")


def test_installed_wheel_works_outside_the_source_tree(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (target / "flexgen" / "templates" / "forward.py.jinja").is_file()
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(PYTHONPATH=str(target), FLEXGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONNOUSERSITE="1")
    proc = subprocess.run([sys.executable, "-c", SMOKE, str(target)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "SMOKE OK" in proc.stdout
