"""The TOR phase split on hand-made timelines, whose right answer is worked out by hand."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from elasticft.cli import main as cli_main
from elasticft.events import EventLog
from elasticft.report.tor import ReportError, analyze, format_report, phase_name
from elasticft.steps import StepRecord, StepRecorder, read_steps


def ev(t: float, kind: str, node: str = "n0", **payload):
    return {"time": t, "mono": t, "node": node, "kind": kind, **payload}


def steps(pairs, rank: int = 0, ckpt: dict[int, float] | None = None):
    ckpt = ckpt or {}
    return [StepRecord(t, s, rank, ckpt.get(s, 0.0)) for t, s in pairs]


def crash_run():
    """Steps 1-20 at 1 s each, a crash, restart from the step-15 checkpoint, steps 16-30."""
    events = [
        ev(0.0, "run_start", run_id="r", process_started=-1.0),
        ev(2.0, "workers_started", attempt=0, pids={"0": 10, "1": 11}),
        ev(23.0, "failure", attempt=0, rank=1, failure_class="signal_crash"),
        ev(23.0, "failure", attempt=0, rank=0, failure_class="infrastructure"),
        ev(23.0, "decision", attempt=0, action="restart_in_place", reason="crash"),
        ev(25.0, "workers_started", attempt=1, pids={"0": 12, "1": 13}),
        ev(42.0, "run_end", state="succeeded", exit_code=0),
    ]
    records = [(3.0 + i, i + 1) for i in range(20)]  # steps 1..20 at t=3..22
    records += [(27.0 + i, 16 + i) for i in range(15)]  # steps 16..30 at t=27..41
    return events, {0: steps(records), 1: steps(records, rank=1)}


def test_crash_run_phases_add_up_to_wall_time():
    a = analyze(*crash_run())
    assert a.observed_s == pytest.approx(43.0)  # from the process start at -1 s
    assert a.healthy_step_s == pytest.approx(1.0)
    assert a.steps_done == 30 and a.last_step == 30
    assert a.tor == pytest.approx(30 / 43)
    p = a.phases
    assert p["healthy"] == pytest.approx(30.0)
    assert p["startup"] == pytest.approx(3.0)  # -1 -> 2 launch, 2 -> 3 is step 1 itself
    assert p["detection"] == pytest.approx(1.0)  # last step at 22, failure at 23
    assert p["repair"] == pytest.approx(3.0)  # 23 -> 25 restart, 25 -> 27 less one step
    assert p["rollback"] == pytest.approx(5.0)  # steps 16-20 again
    assert p["shutdown"] == pytest.approx(1.0)
    assert sum(p.values()) == pytest.approx(a.observed_s)
    assert a.ettr == pytest.approx(30 / 43)
    assert a.mtbf_s == pytest.approx(43.0)
    (fault,) = a.faults
    assert fault.failure_class == "signal_crash"  # the crash, not its collateral
    assert sorted(fault.ranks) == [0, 1]
    assert (fault.detection_s, fault.repair_s, fault.rollback_steps) == (1.0, 3.0, 5)
    assert fault.rollback_s == pytest.approx(5.0)
    text = format_report(a)
    assert "TOR   0.698" in text and "signal_crash" in text


def test_checkpoint_stall_slow_steps_and_slow_recovery():
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(0.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(10.5, "failure", attempt=0, rank=0, failure_class="hang"),
        ev(11.0, "workers_started", attempt=1, pids={"0": 2}),
        ev(30.0, "run_end", state="succeeded"),
    ]
    # 1 s steps; step 5 saves for 0.5 s; steps 6-10 are 1 s; restart from 10 (no rollback);
    # steps 11-12 take 3 s (slow recovery), then healthy again; step 14 is slow (2 s).
    times = [1, 2, 3, 4, 5.5, 6.5, 7.5, 8.5, 9.5, 10.5]
    records = list(zip(times, range(1, 11), strict=True))
    records += [(12.0, 11), (15.0, 12), (16.0, 13), (18.0, 14), (19.0, 15)]
    a = analyze(events, {0: steps(records, ckpt={5: 0.5})})
    assert a.healthy_step_s == pytest.approx(1.0)
    assert a.phases["checkpoint_stall"] == pytest.approx(0.5)
    assert a.phases["slow_recovery"] == pytest.approx(2.0)  # step 12: 3 s for a 1 s step
    assert a.phases["slow_steps"] == pytest.approx(1.0)  # step 14
    assert a.phases["rollback"] == 0.0
    assert a.phases["healthy"] == pytest.approx(15.0)
    assert sum(a.phases.values()) == pytest.approx(30.0)
    assert a.faults[0].slow_recovery_s == pytest.approx(2.0)
    assert a.ettr == pytest.approx(18.0 / 30.0)


def test_requeued_run_counts_allocations_not_the_queue():
    events = [
        ev(0.0, "run_start", run_id="slurm-7"),
        ev(1.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(6.2, "slurm_time_limit", node="n0"),
        ev(8.0, "run_end", state="requeued"),
        ev(100.0, "run_start", run_id="slurm-7"),
        ev(101.0, "workers_started", attempt=0, pids={"0": 5}),
        ev(107.5, "run_end", state="succeeded"),
    ]
    records = [(2.0 + i, i + 1) for i in range(5)]  # 1..5 at t=2..6
    records += [(102.0 + i, 6 + i) for i in range(5)]  # 6..10 at t=102..106
    a = analyze(events, {0: steps(records)})
    assert a.allocations == 2
    assert a.queued_s == pytest.approx(92.0)
    assert a.observed_s == pytest.approx(15.5)
    assert a.phases["checkpoint_stall"] == pytest.approx(2.0)  # 6 -> 8: the time-limit save
    assert a.tor == pytest.approx(10 / 15.5)
    assert a.faults == []
    assert a.mtbf_s is None


def test_several_runs_in_one_directory_is_a_clear_error():
    events, records = crash_run()
    other = [ev(50.0, "run_start", run_id="another"), ev(51.0, "run_end", state="succeeded")]
    with pytest.raises(ReportError, match=r"2 runs \(another, r\); give the directory of one"):
        analyze(events + other, records)


def test_missing_step_records_is_a_clear_error():
    with pytest.raises(ReportError, match="ELASTICFT_STEP_LOG"):
        analyze([ev(0.0, "run_start")], {})


def test_recorder_files_round_trip_and_cli(tmp_path, capsys):
    log = EventLog(tmp_path, "n0")
    log.emit("run_start", run_id="x")
    log.emit("workers_started", attempt=0, pids={"0": 1})
    (tmp_path / "steps").mkdir()
    recorder = StepRecorder(tmp_path / "steps" / "rank0.jsonl")
    for step in range(1, 6):
        recorder.record(step, ckpt_s=0.01 if step == 3 else None)
    recorder.close()
    with open(tmp_path / "steps" / "rank0.jsonl", "a") as f:
        f.write('{"time": 1.0, "st')  # a torn last line is skipped
    log.emit("run_end", state="succeeded")
    log.close()
    assert [r.step for r in read_steps(tmp_path)[0]] == [1, 2, 3, 4, 5]
    assert read_steps(tmp_path)[0][2].ckpt_s == pytest.approx(0.01)
    assert cli_main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps_done"] == 5
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_steps_faster_than_the_median_leave_no_phase_negative():
    """Healthy counts each step's own time up to the median; a faster step is not an excess of
    minus its saving elsewhere (the table showed 'slow steps -0.06 s')."""
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(0.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(12.0, "run_end", state="succeeded"),
    ]
    # Steps of 1, 1, 0.5, 1, 1, 2, 1, 0.5, 1, 1 s: median 1 s.
    gaps = [1, 1, 0.5, 1, 1, 2, 1, 0.5, 1, 1]
    times = list(itertools.accumulate(gaps))
    a = analyze(events, {0: steps([(t, i + 1) for i, t in enumerate(times)])})
    assert a.healthy_step_s == pytest.approx(1.0)
    assert min(a.phases.values()) >= 0.0, a.phases
    assert a.phases["healthy"] == pytest.approx(9.0)  # 8 steps of 1 s, 2 of 0.5 s
    assert a.phases["slow_steps"] == pytest.approx(1.0)  # the 2 s step
    assert sum(a.phases.values()) == pytest.approx(a.observed_s)
    assert a.tor == pytest.approx(10 / 12)  # the optimal time counts every step at the median
    assert not re.search(r"\s-\d", format_report(a)), format_report(a)


@pytest.mark.parametrize(
    ("launch_s", "noted"),
    [(0.5, False), (1.0, False), (3.0, True), (30.0, True)],
)
def test_a_short_run_says_start_up_dominates_and_what_tor_means_there(launch_s: float,
                                                                       noted: bool):
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(launch_s, "workers_started", attempt=0, pids={"0": 1}),
        ev(launch_s + 11.0, "run_end", state="succeeded"),
    ]
    records = [(launch_s + 1.0 + i, i + 1) for i in range(10)]  # 10 steps of 1 s, 1 s shutdown
    a = analyze(events, {0: steps(records)})
    text = format_report(a)
    assert ("start-up and shutdown are" in text) is noted, text
    if noted:
        share = (launch_s + 1.0) / (launch_s + 11.0)
        assert f"start-up and shutdown are {share:.0%} of this {launch_s + 11.0:.1f} s run" in text
        assert "between them TOR is 1.000" in text, text
        assert a.tor_between_launch_and_exit == pytest.approx(1.0)


def test_the_plot_shows_the_whole_run():
    """Its time axis runs from the launch to the end of the shutdown, not to the last step."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from elasticft.report.plot import draw_timeline

    a = analyze(*crash_run())
    fig = draw_timeline(a)
    try:
        for axis in fig.axes:
            assert axis.get_xlim() == pytest.approx((0.0, a.end - a.start))
        assert a.end - a.start == pytest.approx(43.0)  # last step at 41, the run ends at 42
    finally:
        plt.close(fig)


def test_an_in_process_recovery_is_a_fault_with_its_phases():
    """Rank 1 crashes at 23; rank 0 keeps its process (no workers_started); both resume from
    step 20 at 24.5 (one step redone: 21, in flight at the crash)."""
    phases = {"detect_s": 0.01, "survivors_out_s": 0.02, "abort_s": 0.0, "reap_s": 0.05,
              "fork_s": 0.02, "start_s": 0.3, "join_s": 0.2, "regroup_s": 0.6, "restore_s": 0.05,
              "redo_s": 0.15, "total_s": 0.81}
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(0.0, "workers_started", attempt=0, pids={"0": 10, "1": 11}),
        ev(23.0, "failure", attempt=0, rank=1, failure_class="signal_crash"),
        ev(23.0, "decision", attempt=0, action="recover_in_process", reason="crash"),
        ev(23.1, "worker_replaced", attempt=1, pids={"0": 10, "1": 12}, replaced={"1": 12}),
        ev(23.9, "recover_in_process", attempt=1, generation=1, phases=phases),
        ev(30.0, "run_end", state="succeeded"),
    ]
    records = [(1.0 + i, i + 1) for i in range(21)]  # steps 1..21 at t=1..21
    records += [(24.5 + i, 21 + i) for i in range(5)]  # 21 again, then 22..25
    a = analyze(events, {0: steps(records)})
    (fault,) = a.faults
    assert fault.action == "recover_in_process" and fault.in_process == phases
    assert fault.rollback_steps == 1
    assert sum(a.phases.values()) == pytest.approx(a.observed_s)
    text = format_report(a)
    assert "recover_in_process" in text
    assert ("in process: detect 0.01 s, survivors out 0.02 s, abort 0.00 s, reap 0.05 s, "
            "fork 0.02 s, start 0.30 s, join 0.20 s, regroup 0.60 s, restore 0.05 s, "
            "redo 0.15 s, total 0.81 s") in text


@pytest.mark.parametrize(("key", "shown"), [
    ("detect_s", "detect"),
    ("survivors_out_s", "survivors out"),
    ("restore_s", "restore"),
    ("redo_s", "redo"),
    ("restore_redo_s", "restore+redo"),  # no worker said when its restore ended
])
def test_the_report_names_each_phase(key: str, shown: str) -> None:
    assert phase_name(key) == shown
