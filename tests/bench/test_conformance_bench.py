"""bench/conformance.py works before its whole matrix (50 min on 2 busy cores) is spent on it: its
quick subset, the default plain loop at two fault points, recovered in process bit for bit; and
how it judges a cell, on a table of event logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_conformance_bench_prints_a_row_per_cell_and_exits_0_when_each_is_exact() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "conformance.py"), "--quick",
                           "--markdown"], capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == ("| pattern | framework | ranks | fault point | result | recovery | "
                        "kill → first step |"), lines
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:4]]
    assert [row[:4] for row in rows] == [["default", "plain", "2", "after-save"],
                                         ["default", "plain", "2", "before-save"]], lines
    assert all(row[4:6] == ["exact", "in process"] for row in rows), lines
    # kill -> the first step after the recovery, in seconds
    assert all(float(row[6].removesuffix(" s")) > 0 for row in rows), lines
    assert lines[4].startswith("# 2 cells: 2 exact, 0 refused, 0 neither; took "), lines
    assert len(lines) == 5, lines
    assert "run directories kept" not in done.stdout  # removed, every cell being exact


def _decision(action: str, failed_at: int | None = None) -> dict:
    return {"kind": "decision", "action": action, "in_process_failed_at": failed_at}


@pytest.mark.parametrize(("events", "losses", "result"), [
    ([_decision("recover_in_process"), {"kind": "recover_in_process"}], "same", "exact"),
    ([_decision("recover_in_process"), {"kind": "recover_in_process"}], "other",
     "DIFFERENT at step 2 (rank 1; 1 (rank, step) differ)"),
    # a second failure during the in-process recovery: the restart it falls back to
    ([_decision("recover_in_process"), _decision("restart_in_place", failed_at=7)], "same",
     "exact"),
    # a restart after an in-process recovery that nothing cut short is a finding
    ([_decision("recover_in_process"), {"kind": "recover_in_process"},
      _decision("restart_in_place")], "same", "failed: in process, then restart: "),
    ([_decision("restart_in_place")], "same", "failed: restarted without a refusal line: "),
], ids=["in-process", "different", "fallback-restart", "restart-later", "restart-unrefused"])
def test_a_cell_is_judged_by_its_recoveries_and_its_results(
        tmp_path: Path, events: list[dict], losses: str, result: str) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import conformance
    finally:
        sys.path.remove(str(ROOT / "bench"))
    reference = {(0, 1): "1.0,aa", (1, 1): "1.5,bb", (0, 2): "0.9,cc", (1, 2): "1.4,dd"}
    ran = dict(reference) if losses == "same" else {**reference, (1, 2): "1.4,de"}

    def run(of: dict, happened: list[dict]) -> conformance.Run:
        return conformance.Run(tmp_path, 0, "", happened, of, None, None)

    judged = conformance.judge(run(ran, events), run(reference, []), "plain")
    assert judged.startswith(result), judged


@pytest.mark.parametrize(("argv", "said"), [
    (["--device", "cuda", "--only", "hf"], "the framework examples train on CPU with gloo only"),
    (["--backend", "nccl", "--only", "plain"], "--backend nccl needs --device cuda"),
], ids=["framework-on-cuda", "nccl-on-cpu"])
def test_a_placement_the_matrix_cannot_run_is_refused_in_one_line(argv: list[str],
                                                                   said: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "conformance.py"), *argv],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr.splitlines()[-1], done.stderr
