"""The report says why a run ended, with and without step records."""

from __future__ import annotations

from elasticft.report.eventsonly import format_summary, summarize
from elasticft.report.tor import analyze, format_report
from tests.report.test_tor import crash_run, ev

WHY = "the same failure before the first step of two attempts in a row, not restarted"


def test_the_reason_a_run_ended_is_reported() -> None:
    events, records = crash_run()
    stopped = [*events[:-1], ev(42.0, "run_end", state="failed", exit_code=1, reason=WHY)]
    analysis = analyze(stopped, records)
    assert f"  ended: {WHY}" in format_report(analysis).splitlines()
    assert analysis.to_json()["end_reason"] == WHY
    summary = summarize(stopped, "no step records")
    assert f"  ended: {WHY}" in format_summary(summary).splitlines()
    assert summary.to_json()["end_reason"] == WHY


def test_a_success_has_no_reason_line() -> None:
    analysis = analyze(*crash_run())
    assert analysis.end_reason == ""
    assert "ended:" not in format_report(analysis)
