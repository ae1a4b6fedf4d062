"""scripts/install_into.sh puts elasticft into a Python it did not make (a GPU machine's own, with
its CUDA torch), and where pip cannot, says so and leaves the tree runnable as it is."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _tree_copy(where: Path) -> Path:
    """The project's sources without its build outputs, so nothing is built into the checkout."""
    shutil.copytree(ROOT, where, ignore=shutil.ignore_patterns(
        ".git", ".venv", "elasticft-runs", "__pycache__", "*.so", "*.egg-info", "build", ".whl"))
    return where


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the shim")
@pytest.mark.timeout(180)
def test_an_old_setuptools_without_an_index_leaves_the_tree_runnable(tmp_path: Path) -> None:
    # A new interpreter's own setuptools (65 for Python 3.11; none from 3.12) cannot read the
    # project's license expression, and without an index pip cannot fetch a newer one.
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True,
                   timeout=120)
    python = tmp_path / "venv" / "bin" / "python"
    tree = _tree_copy(tmp_path / "tree")
    env = dict(os.environ, PIP_NO_INDEX="1", TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", str(tree / "scripts" / "install_into.sh"), str(python)],
                          capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"elasticft: pip could not install this tree into {python} "), done.stderr
    assert "running it from the tree instead" in done.stderr
    assert (tmp_path / "elasticft_install.log").stat().st_size > 0  # the log it names
    shim = tree / "elasticft" / "diag" / "_nccl_shim.so"
    assert shim.exists()
    # From the tree, elasticft finds that shim (this interpreter has torch, the new one has not).
    found = subprocess.run(
        [sys.executable, "-c",
         "from elasticft.diag.monitor import shim_library; print(shim_library())"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tree)),
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == shim
