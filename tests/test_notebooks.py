"""The example notebooks run top to bottom, and are committed clean.

Each notebook in examples/ is copied to a temporary directory and executed
there with nbclient (a fresh ``python3`` Jupyter kernel, CPU, Triton
interpreter); every notebook checks its own results against
``flexgen.reference``, so a failing assertion in a cell fails the test.
The committed files must have no outputs and be exactly what
``examples/make_notebooks.py`` writes (edit the cells there, then run it).

The kernel is ipykernel's built-in ``python3`` kernel run by the test's own
interpreter (see ``python_kernel``): CI needs the ipykernel package (in the
``test`` extra), and no ``jupyter kernelspec`` / ``ipykernel install`` step.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# torch / Hugging Face / distributed plumbing: CI's second pass compiles its kernels from the
# first pass's record instead of running it (conftest, FLEXGEN_TEST_RECORD_ONCE).
pytestmark = pytest.mark.once

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
EXPECTED = ["01_quickstart.ipynb", "02_write_your_own_mod.ipynb", "03_mask_gallery.ipynb",
            "04_composing_variants.ipynb", "05_attention_without_softmax.ipynb"]


def python_kernel():
    """A manager for ipykernel's own ``python3`` kernel, run by this interpreter (sys.executable).

    No kernel spec directory is searched, so a ``python3`` spec installed for
    another Python (e.g. in ~/.local/share/jupyter) cannot take over, and
    nothing needs installing besides the ipykernel package. The kernel
    inherits this process's environment (FLEXGEN_CACHE_DIR included).
    """
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    specs = KernelSpecManager(kernel_dirs=[])   # ensure_native_kernel: ipykernel's spec only
    return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


def test_the_examples_are_there():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.cells[0].cell_type == "markdown", "start with an introduction of what it teaches"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{path.name}: clear the outputs (python examples/make_notebooks.py)"


def test_notebooks_match_their_generator():
    done = subprocess.run([sys.executable, str(EXAMPLES / "make_notebooks.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    copy = work / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, km=python_kernel(),
                                     resources={"metadata": {"path": str(work)}})
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.outputs if out.output_type == "error"]
    assert not errors
    print(f"{path.name}: {elapsed:.1f} s")
