"""bench/ckpt_gpu.py works before GPU time is spent on it: the same code runs on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.timeout(180)
def test_the_gpu_checkpoint_bench_runs_every_method_on_the_cpu(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "ckpt_gpu.py"), "--device", "cpu", "--params",
         "3e5", "--steps", "6", "--every", "2", "--batch", "32"],
        capture_output=True, text=True, timeout=160, env=dict(os.environ, OUT=str(tmp_path)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("ckpt_gpu: CPU (a check of the script)"), lines
    methods = [line.split()[0] for line in lines[2:]]
    assert methods == ["torch.save", "dcp.async_save", "elasticft"], lines
    rows = {r["method"]: r for r in json.loads((tmp_path / "ckpt_gpu.json").read_text())["rows"]}
    # The first two saves are printed apart from the later ones, and the restore of torch.save
    # and of elasticft is also measured in a fresh process.
    assert all(len(r["first_saves_ms"]) == 2 for r in rows.values()), rows
    assert rows["torch.save"]["fresh_restore_s"] > 0 and rows["elasticft"]["fresh_restore_s"] > 0
    assert rows["dcp.async_save"]["fresh_restore_s"] is None


def test_without_cuda_it_measures_nothing_and_says_so() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ckpt_gpu.py")],
                          capture_output=True, text=True, timeout=100,
                          env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ckpt_gpu: no CUDA device"), done.stdout
