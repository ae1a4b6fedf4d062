"""`elasticft status --run-dir`: a run's in-process recoveries with their phases, and its
restarts of whole worker groups, from the event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.events import EventLog
from elasticft.report.status import format_recoveries, recoveries


@pytest.mark.timeout(30)
def test_status_counts_in_process_recoveries_and_restarts(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "node-a")
    log.emit("recover_in_process", generation=1, replaced={"1": 4242},
             phases={"detect_s": 0.05, "survivors_out_s": 0.01, "regroup_s": 0.63,
                     "restore_redo_s": 0.1, "total_s": 0.8})
    log.emit("restart", attempt=2, cause="in-process recovery failed", counted=False)
    log.emit("restart", attempt=3, cause="signal_crash", counted=True)
    log.close()
    found, restarts = recoveries(tmp_path)
    assert [e["generation"] for e in found] == [1] and restarts == 1
    lines = format_recoveries(found, restarts).splitlines()
    assert lines[0] == "recoveries: 1 in process, 1 restart(s)"
    assert "node-a  generation 1, replaced rank(s) 1: detect 0.05 s, survivors out 0.01 s, " \
           "regroup 0.63 s, restore+redo 0.10 s, total 0.80 s" in lines[1]
    assert format_recoveries([], 0) == "recoveries: 0 in process, 0 restart(s)"


@pytest.mark.timeout(30)
def test_silent_data_corruption_is_counted(tmp_path: Path) -> None:
    from elasticft.events import read_events, sdc_line

    assert sdc_line([]) == ({"suspect": 0, "undecidable": 0, "steps_redone": 0},
                            "silent data corruption: none found")
    log = EventLog(tmp_path, "node-a")
    log.emit("sdc_undecidable", step=4, ranks=[0, 1], nodes=["a", "b"], reason="no majority")
    log.emit("sdc_suspect", step=6, ranks=[1], nodes=["b"], reason="node b fails its check")
    # The round's leader after the rollback (ckpt_sdc_action evict): restored 4, held 7.
    log.emit("sdc_recovered", step=4, restore_at_most=4, newest_before=7, steps_redone=3)
    log.close()
    counts, line = sdc_line(read_events(tmp_path))
    assert counts == {"suspect": 1, "undecidable": 1, "steps_redone": 3}
    assert line == ("silent data corruption: 1 suspect, 1 undecidable (last: step 6, named "
                    "rank(s) [1] on ['b']: node b fails its check); 3 step(s) redone because "
                    "of it")
