"""bench/ckpt_gpu.py works before GPU time is spent on it: the same code runs on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(120)
def test_the_gpu_checkpoint_bench_runs_every_method_on_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ckpt_gpu.py"), "--device", "cpu", "--params",
         "3e5", "--steps", "4", "--every", "2", "--batch", "32"],
        capture_output=True, text=True, timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ckpt_gpu: CPU (a check of the script)"), lines
    methods = [line.split()[0] for line in lines[2:]]
    assert methods == ["torch.save", "dcp.async_save", "elasticft"], lines


def test_without_cuda_it_measures_nothing_and_says_so() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ckpt_gpu.py")],
                          capture_output=True, text=True, timeout=100,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ckpt_gpu: no CUDA device"), done.stdout
