"""bench/persist.py, bench/disk_restore.py and bench/fresh_memory.py work before a long run is
spent on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_persist_bench_measures_both_paths_beside_training(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "persist.py"), "--gb", "0.02", "--repeat", "2",
         "--train", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=220, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("round ") for line in lines) == 2, lines
    assert "persist/disk speed" in lines[-3] and "through the page cache" in lines[-3], lines
    # A step time each, or "too few steps" where none fitted in a persist this small.
    assert "during a persist with O_DIRECT" in lines[-2], lines
    assert "during a persist through the page cache" in lines[-1], lines
    assert list(tmp_path.iterdir()) == []  # its checkpoints and test file removed


@pytest.mark.timeout(120)
def test_the_disk_restore_bench_reads_a_shard_three_ways(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "disk_restore.py"), "--gb", "0.01", "--repeat",
         "1", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    assert "read" in last and "elasticft" in last and "torch.load" in last, last
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_the_fresh_memory_bench_prints_a_round_per_wait(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fresh_memory.py"), "--gb", "0.01", "--waits",
         "0,0.1"], capture_output=True, text=True, timeout=50, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("fresh_memory: ") and "free page reporting" in lines[0], lines
    assert [line.split(" s after")[0] for line in lines[1:]] == [
        "0.01 GB filled 0", "0.01 GB filled 0.1"], lines
