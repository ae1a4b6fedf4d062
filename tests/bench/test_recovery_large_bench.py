"""bench/recovery_large.py works before GPU time is spent on it: a small dry run on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_large_recovery_bench_runs_torchrun_on_the_cpu() -> None:
    # elasticft-run's mode is run on two ranks, below, where its figures are checked.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recovery_large.py"), "--device", "cpu", "--gb",
         "0.02", "--limit-s", "120", "--launchers", "torchrun"],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("recovery_large: CPU"), lines
    torchrun = lines[2].split()
    assert torchrun[0] == "torchrun", lines
    # torchrun's restarted script resumed from a save of its own.
    assert torchrun[5] != "-", lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_large_recovery_bench_runs_fsdp2_under_torchrun_from_dcp() -> None:
    # The FSDP2 mode's torchrun row: its restarted ranks load the newest committed
    # torch.distributed.checkpoint directory into their new shards.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recovery_large.py"), "--device", "cpu", "--gb",
         "0.02", "--nproc", "2", "--fsdp", "--limit-s", "200", "--launchers", "torchrun"],
        capture_output=True, text=True, timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "(FSDP2)" in lines[0], lines
    torchrun = lines[2].split()
    assert torchrun[0] == "torchrun", lines
    # It resumed from a committed step, at most the last one saved before the kill.
    assert torchrun[5] != "-" and 1 <= int(torchrun[5]) <= int(torchrun[6]), lines
    survivors = next(line for line in lines if "rank 0 ran in" in line)
    assert "rank 0 ran in 2 process(es)" in survivors, lines


def test_the_gpu_check_has_a_recovery_part() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check

    assert "recovery" in gpu_check.PARTS


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_large_recovery_bench_runs_both_elasticft_modes_on_two_ranks() -> None:
    # torchrun's mode on two ranks is left out: on a loaded machine its restarted group can
    # fail to form within the bench's limit (the bench's own worker, not elasticft).
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recovery_large.py"), "--device", "cpu", "--gb",
         "0.02", "--nproc", "2", "--limit-s", "150", "--launchers",
         "elasticft-run,elasticft-inprocess"],
        capture_output=True, text=True, timeout=580,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert set(rows) == {"elasticft-run", "elasticft-inprocess"}, lines
    # Every figure of the elasticft-run row was measured, and it resumed from a save at least
    # as new as the newest one seen landed before the kill (a copy may land unlogged).
    elasticft = rows["elasticft-run"]
    assert "-" not in elasticft[1:8], lines
    resumed, last_save, landed = map(int, elasticft[5:8])
    assert landed <= resumed <= last_save, lines
    survivors = {line.split(":")[0]: line for line in lines if "rank 0 ran in" in line}
    assert "rank 0 ran in 1 process(es)" in survivors["elasticft-inprocess"], lines
    assert "rank 0 ran in 2 process(es)" in survivors["elasticft-run"], lines
    assert "in-process phases" in survivors["elasticft-inprocess"], lines


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_large_recovery_bench_runs_its_spare_mode_on_the_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "recovery_large.py"), "--device", "cpu", "--gb",
         "0.02", "--nproc", "2", "--limit-s", "150", "--launchers", "elasticft-spare"],
        capture_output=True, text=True, timeout=380,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    survivor = next(line for line in done.stdout.splitlines() if "rank 0 ran in" in line)
    assert "rank 0 ran in 1 process(es)" in survivor, done.stdout
    assert "the spare that took the rank was ready" in survivor, done.stdout
