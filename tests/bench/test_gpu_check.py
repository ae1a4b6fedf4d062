"""bench/gpu_check.sh where no GPU is: the shell parses, and the dry run says so in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.timeout(120)
def test_without_a_gpu_it_installs_nothing_and_says_so_in_one_line():
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: dry run, no CUDA device"), lines
    assert "shim built" in lines[0] and "nothing measured" in lines[0]


@pytest.mark.timeout(60)
def test_an_unknown_part_is_a_usage_error_that_names_the_choices():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--parts",
                           "ops,bogus"], capture_output=True, text=True, timeout=50)
    assert done.returncode == 2
    assert ("unknown --parts ['bogus']; choose from ops, overhead, gloo, hang, restart, ckpt, "
            "recovery, inprocess, conformance, torchtitan, persist, tests") in done.stderr


@pytest.fixture(scope="module")
def parts_line() -> str:
    """The one line of a dry run of the inprocess and torchtitan parts together, with no CUDA
    device and no torchtitan checkout (one run read by a test per part)."""
    done = subprocess.run(["bash", str(SCRIPT), "--parts", "inprocess,torchtitan"],
                          capture_output=True, text=True, timeout=200,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
                               "TORCHTITAN_DIR": ""})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: dry run, no CUDA device"), lines
    assert lines[0].endswith("; nothing measured"), lines
    return lines[0]


@pytest.mark.timeout(240)
def test_the_inprocess_part_dry_runs_its_parts_without_cuda_and_checks_the_torch_parts(
        parts_line: str) -> None:
    assert "_abort_process_group" in parts_line and ") present; " in parts_line
    assert "_get_default_group" in parts_line  # ProcessGroup.abort and the group's settings
    # The abort bench's parts without CUDA: the known answer, no device as recovery arms, a
    # gloo group aborted by torch's real call (which clears its table) and a new group.
    said = parts_line.split("bench/inprocess_abort_gpu.py: ", 1)[1]
    said = said.split("; bench/torchtitan_gpu.py: ", 1)[0]  # the next part's words
    assert said.startswith("known answer right, rank device None, gloo group aborted by "
                           "_abort_process_group in "), said
    assert "(table cleared), a new group's all_reduce right in " in said


@pytest.mark.timeout(240)
def test_the_torchtitan_part_dry_runs_without_cuda_or_torchtitan_and_says_what_is_missing(
        parts_line: str) -> None:
    said = parts_line.split("bench/torchtitan_gpu.py: dry run, ", 1)[1]
    assert said.startswith("lacks 2 CUDA devices (torch "), said
    assert "--titan-dir: a torchtitan checkout" in said and said.endswith("; nothing measured")
