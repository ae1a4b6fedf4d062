"""bench/recovery_large.py works before GPU time is spent on it: a small dry run on the CPU."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from elasticft.inprocess import reconfigure
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


PHASE_HEADERS = ["detect", "decide", "out", "abort", "reap", "fork", "restart", "start-up",
                 "join", "regroup", "rebuild", "restore", "redo", "1st step", "total",
                 "kill->step"]


def measured_phases(cells: list[str]) -> list[str]:
    """The columns of a phase-table row that hold a figure (not "-")."""
    return [column for column, cell in zip(PHASE_HEADERS, cells, strict=True) if cell != "-"]


@pytest.mark.parametrize(("row", "measured"), [
    # torchrun: no event log, so no detection or decision of its own; its restart counts
    # from the kill.
    ({"launcher": "torchrun", "restart_s": 2.0, "startup_s": 1.5, "restore_s": 0.2,
      "first_step_s": 0.3, "kill_to_first_step_s": 4.1},
     ["restart", "start-up", "restore", "1st step", "kill->step"]),
    ({"launcher": "elasticft-run", "kill_to_failure_s": 0.1, "failure_to_decision_s": 0.01,
      "restart_s": 0.4, "startup_s": 1.5, "restore_s": 0.2, "first_step_s": 0.3,
      "kill_to_first_step_s": 2.6},
     ["detect", "decide", "restart", "start-up", "restore", "1st step", "kill->step"]),
    # In process: the agent's phases, none of the restart mode's own even where the row has
    # them (the worker's restore and first step are the replacement's, within the phases).
    ({"launcher": "elasticft-inprocess", "kill_to_failure_s": 0.1, "restore_s": 0.3,
      "first_step_s": 0.3, "startup_s": 1.0, "kill_to_first_step_s": 0.8,
      "in_process": {"detect_s": 0.0, "survivors_out_s": 0.1, "abort_s": 0.01, "reap_s": 0.1,
                     "fork_s": 0.02, "start_s": 0.2, "join_s": 0.08, "regroup_s": 0.3,
                     "restore_s": 0.2, "redo_s": 0.27, "total_s": 0.78}},
     ["detect", "decide", "out", "abort", "reap", "fork", "start-up", "join", "regroup",
      "restore", "redo", "total", "kill->step"]),
    # On a torch with reconfigure: the group's rebuild in place, within the regroup.
    ({"launcher": "elasticft-inprocess", "kill_to_first_step_s": 0.7,
      "in_process": {"detect_s": 0.0, "survivors_out_s": 0.1, "regroup_s": 0.2,
                     "rebuild_s": 0.01, "total_s": 0.6}},
     ["decide", "out", "regroup", "rebuild", "total", "kill->step"]),
    # The spare: no fork; and a phase the event left out is not measured.
    ({"launcher": "elasticft-spare", "kill_to_first_step_s": 0.6,
      "in_process": {"detect_s": 0.0, "survivors_out_s": 0.03, "reap_s": 0.01,
                     "regroup_s": 0.04, "restore_redo_s": 0.48, "total_s": 0.52}},
     ["decide", "out", "reap", "regroup", "total", "kill->step"]),
    # A run that measured nothing (the launcher failed) has a row of dashes.
    ({"launcher": "elasticft-run"}, []),
])
def test_a_modes_phase_row_has_its_own_phases_and_dashes_elsewhere(
        row: dict[str, Any], measured: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from recovery_large_phases import phase_table

    header, line = phase_table([row])
    assert header.split()[0] == "launcher" and line.split()[0] == row["launcher"]
    cells = line.split()[1:]
    assert len(cells) == len(PHASE_HEADERS)
    assert measured_phases(cells) == measured


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
    # as new as the newest one seen landed on every rank before the kill (a copy may land
    # unlogged), and at most the one after the newest logged (the kill may come between a save
    # call and its log).
    elasticft = rows["elasticft-run"]
    assert "-" not in elasticft[1:8], "\n".join(lines)
    resumed, last_save, landed = map(int, elasticft[5:8])
    assert landed <= resumed <= last_save + 1, "\n".join(lines)
    survivors = {line.split(":")[0]: line for line in lines if "rank 0 ran in" in line}
    assert "rank 0 ran in 1 process(es)" in survivors["elasticft-inprocess"], lines
    assert "rank 0 ran in 2 process(es)" in survivors["elasticft-run"], lines
    assert "in-process phases" in survivors["elasticft-inprocess"], lines
    # The phase table: its columns in a recovery's order, a row per launcher in the run's
    # order; the restart mode has its own phases and none of the in-process ones, and the
    # in-process mode the reverse (presence and order only: the seconds are the machine's).
    header = lines.index(next(line for line in lines if line.startswith("phases (s):"))) + 1
    assert lines[header].split() == ["launcher", "detect", "decide", "out", "abort", "reap",
                                     "fork", "restart", "start-up", "join", "regroup",
                                     "rebuild", "restore", "redo", "1st", "step", "total",
                                     "kill->step"], lines
    table = {line.split()[0]: line.split()[1:] for line in lines[header + 1:header + 3]}
    assert list(table) == ["elasticft-run", "elasticft-inprocess"], lines
    measured = {name: measured_phases(cells) for name, cells in table.items()}
    assert measured["elasticft-run"] == ["detect", "decide", "restart", "start-up", "restore",
                                         "1st step", "kill->step"], lines
    assert {"out", "reap", "regroup", "total", "kill->step"} <= set(
        measured["elasticft-inprocess"]), lines
    assert not {"restart", "1st step"} & set(measured["elasticft-inprocess"]), lines
    # The group rebuilt in place where this torch has reconfigure, else a new group.
    in_place = reconfigure.unsupported() is None
    assert ("rebuild" in measured["elasticft-inprocess"]) == in_place, lines


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
