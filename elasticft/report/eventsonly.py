"""What a run's event log alone tells, for runs whose steps are not known.

TOR and ETTR need to know when each step finished (:mod:`elasticft.steps`). A run whose
workers wrote no step records and stepped no torch optimizer (diagnostics off, a script without
an optimizer, a run killed before its first step) still has its event log: the wall time of every
allocation, each failure and its class, the restarts, and the time from each failure to the
restarted workers. :func:`summarize` reads those; the report prints them with the reason TOR and
ETTR are absent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class FailureSummary:
    time: float
    attempt: int
    failure_class: str
    ranks: tuple[int, ...]
    lost_s: float
    """From the failure to the next start of workers (or the end of the allocation)."""


@dataclasses.dataclass(frozen=True)
class EventSummary:
    run_id: str
    end_state: str
    start: float
    observed_s: float
    restarts: int
    failures: tuple[FailureSummary, ...]
    why_no_tor: str
    end_reason: str = ""
    """Why the run ended, as its launcher said (empty for a success)."""

    @property
    def lost_s(self) -> float:
        return sum(f.lost_s for f in self.failures)

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "end_state": self.end_state, "end_reason": self.end_reason,
            "observed_s": self.observed_s,
            "tor": None, "ettr": None, "why_no_tor": self.why_no_tor,
            "restarts": self.restarts, "failures": len(self.failures), "lost_s": self.lost_s,
            "faults": [dataclasses.asdict(f) | {"ranks": list(f.ranks)} for f in self.failures],
        }


def summarize(events: Sequence[dict[str, Any]], why_no_tor: str) -> EventSummary:
    """Wall time (per node's allocations, the longest node counts), failures and restarts."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        by_node.setdefault(str(event.get("node", "")), []).append(event)
    observed, start = 0.0, min((e["time"] for e in events), default=0.0)
    for node_events in by_node.values():
        total, began, last = 0.0, None, None
        for event in node_events:
            if event["kind"] == "run_start":
                if began is not None and last is not None:
                    total += last - began
                began = min(event["time"], float(event.get("process_started") or event["time"]))
                start = min(start, began)
            began = event["time"] if began is None else began
            last = event["time"]
        if began is not None and last is not None:
            total += last - began
        observed = max(observed, total)

    failures: list[FailureSummary] = []
    for node_events in by_node.values():
        seen: dict[int, int] = {}  # attempt -> index in failures (ranks failing together)
        for i, event in enumerate(node_events):
            if event["kind"] != "failure":
                continue
            attempt = int(event.get("attempt", 0))
            rank = int(event.get("rank", -1))
            if attempt in seen:
                old = failures[seen[attempt]]
                failures[seen[attempt]] = dataclasses.replace(old, ranks=(*old.ranks, rank))
                continue
            after = next((e["time"] for e in node_events[i + 1:]
                          if e["kind"] in ("workers_started", "run_start", "run_end")),
                         node_events[-1]["time"])
            seen[attempt] = len(failures)
            failures.append(FailureSummary(event["time"], attempt,
                                           str(event.get("failure_class", "unknown")),
                                           (rank,), max(0.0, after - event["time"])))
    ends = [e for e in events if e["kind"] == "run_end"]
    restarts = max((int(e.get("restarts", 0)) for e in ends), default=None)
    if restarts is None:
        started = [e for e in events if e["kind"] == "workers_started"]
        restarts = max(0, len(started) - 1)
    run_id = next((str(e.get("run_id", "")) for e in events if e["kind"] == "run_start"), "")
    return EventSummary(
        run_id=run_id,
        end_state=str(ends[-1].get("state")) if ends else "running or killed",
        start=start,
        observed_s=observed,
        restarts=restarts,
        failures=tuple(sorted(failures, key=lambda f: f.time)),
        why_no_tor=why_no_tor,
        end_reason=str(ends[-1].get("reason") or "") if ends else "",
    )


def format_summary(s: EventSummary) -> str:
    lines = [
        f"elasticft report: run {s.run_id} ({s.end_state})",
        *([f"  ended: {s.end_reason}"] if s.end_reason else []),
        f"  TOR and ETTR not computed: {s.why_no_tor}",
        f"  wall time {s.observed_s:.1f} s, {s.restarts} restart(s), {len(s.failures)} "
        f"failure(s), {s.lost_s:.1f} s from failures to restarted workers",
    ]
    if s.failures:
        lines += ["", "  failures:", "    #  at (s)  class            ranks   lost"]
        for i, f in enumerate(s.failures, 1):
            ranks = ",".join(map(str, sorted(set(f.ranks))))
            lines.append(f"    {i:<2}{f.time - s.start:7.1f}  {f.failure_class:<16} {ranks:<7} "
                         f"{f.lost_s:6.2f}s")
    return "\n".join(lines)
