"""bench/conformance.py works before its whole matrix (about half an hour) is spent on it: its
quick subset, the default plain loop at two fault points, recovered in process bit for bit."""

from __future__ import annotations

import subprocess
import sys

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
