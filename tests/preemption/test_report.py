"""The report counts a preemption apart from failures: what was saved and how long before the
deadline, the last save as checkpoint stall, and no failure in MTBF (a hand-made timeline)."""

from __future__ import annotations

import pytest

from elasticft.report.tor import analyze, format_report
from tests.report.test_tor import ev, steps


def test_a_preempted_and_relaunched_run_counts_no_failure() -> None:
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(1.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(6.2, "preemption_notice", provider="aws", notice="termination", seconds_left=120.0),
        ev(6.2, "preemption_decision", action="save_and_stop", reason="..."),
        ev(7.0, "preemption_saved", durable=True, step=5, duration_s=0.8,
           before_deadline_s=119.2),
        ev(8.0, "run_end", state="preempted", exit_code=75),
        ev(100.0, "run_start", run_id="r"),
        ev(101.0, "workers_started", attempt=0, pids={"0": 5}),
        ev(107.5, "run_end", state="succeeded"),
    ]
    records = [(2.0 + i, i + 1) for i in range(5)]  # 1..5 at t=2..6
    records += [(102.0 + i, 6 + i) for i in range(5)]  # 6..10 at t=102..106
    a = analyze(events, {0: steps(records)})
    assert a.faults == [] and a.mtbf_s is None
    assert a.phases["checkpoint_stall"] == pytest.approx(2.0)  # 6 -> 8: the last save
    assert a.tor == pytest.approx(10 / 15.5)
    (p,) = a.preemptions
    assert (p.provider, p.action, p.durable, p.step, p.before_deadline_s) == \
        ("aws", "save_and_stop", True, 5, 119.2)
    text = format_report(a)
    assert "preemptions: 1 (not failures)" in text and "no failures" in text
    assert "step 5 (0.8 s)" in text and "119.2 s" in text
    assert a.to_json()["preemptions"][0]["step"] == 5


def test_a_rebalance_recommendation_that_training_survived_is_listed_too() -> None:
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(1.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(3.5, "preemption_notice", provider="aws", notice="rebalance"),
        ev(3.5, "preemption_decision", action="persist_and_continue", reason="..."),
        ev(3.9, "preemption_saved", durable=True, step=2, duration_s=0.4,
           before_deadline_s=None),
        ev(8.0, "run_end", state="succeeded"),
    ]
    a = analyze(events, {0: steps([(2.0 + i, i + 1) for i in range(5)])})
    assert a.phases["checkpoint_stall"] == 0.0 and a.phases["shutdown"] == pytest.approx(2.0)
    assert [(p.notice, p.action) for p in a.preemptions] == [("rebalance",
                                                              "persist_and_continue")]
    assert "rebalance" in format_report(a)


def test_a_relaunch_on_the_same_run_directory_is_the_next_allocation() -> None:
    """The relaunch's launcher writes "relaunch" just before its run_start: both open the new
    allocation, whose steps count (they did not, while "relaunch" closed the earlier one)."""
    events = [
        ev(0.0, "run_start", run_id="r"),
        ev(1.0, "workers_started", attempt=0, pids={"0": 1}),
        ev(6.5, "preemption_notice", provider="gcp", notice="termination"),
        ev(6.5, "preemption_decision", action="save_and_stop"),
        ev(7.0, "run_end", state="preempted", exit_code=75),
        ev(20.0, "relaunch", newest_step=5),
        ev(20.0, "run_start", run_id="r", process_started=18.0),
        ev(21.0, "workers_started", attempt=0, pids={"0": 5}),
        ev(27.5, "run_end", state="succeeded"),
    ]
    records = [(2.0 + i, i + 1) for i in range(5)] + [(22.0 + i, 6 + i) for i in range(5)]
    a = analyze(events, {0: steps(records)})
    assert (a.allocations, a.last_step, a.steps_done) == (2, 10, 10)
    assert a.queued_s == pytest.approx(11.0)  # 7 -> 18: between the launches
    assert a.observed_s == pytest.approx(7.0 + 9.5)
    assert sum(a.phases.values()) == pytest.approx(a.observed_s)
