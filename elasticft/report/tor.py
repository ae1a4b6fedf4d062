"""A run's wall time split into the phases of the Training Overhead Ratio model.

TOR (Lu et al., "Training Overhead Ratio: A Practical Reliability Metric for Large Language Model
Training Systems") is optimal time over observed time. The optimal time is what the run's useful
work would take at the healthy step time: ``T_opt = N * t_healthy``, with ``N`` the steps that
moved training forward and ``t_healthy`` the median duration of an uninterrupted step (checkpoint
time excluded). The observed time is the wall time of the run's allocations (time queued between
two Slurm allocations is shown but not counted).

Every second of observed time gets exactly one label, so the phases add up to the wall time:

=================  =============================================================================
healthy            the time of every step that moved training forward, up to ``t_healthy`` each
                   (steps faster than the median make it a little less than the optimal time)
slow steps         what those steps took beyond ``t_healthy`` (fail-slow, and noise around it)
slow recovery      that excess in the first steps after a restart, until a step is healthy again
checkpoint stall   time steps spent saving (``ckpt_s`` of the step records), and the last
                   save of an allocation that ended on Slurm's time limit or a preemption
detection          from the last finished step to the agent's failure event (includes the work
                   of the step in flight, which is lost)
repair             from the failure to the restarted workers' first step (stop, rendezvous,
                   start, load the checkpoint), less that step's own ``t_healthy``
rollback           steps computed again after a restart (their number was reached before)
startup            launch to the first step of an allocation, less that step's ``t_healthy``
shutdown           last step to the end of the run
=================  =============================================================================

ETTR is the time in steps that moved training forward (healthy + slow + slow recovery) over the
wall time; MTBF is wall time over the number of failures. A preemption (a cloud's or Kubernetes'
notice, :mod:`elasticft.preemption`) is not a failure: it is listed apart, with what was saved
and how long before the deadline, and its cost shows in the phases (the last save, the next
allocation's start-up and the steps it computes again).

On a short run, start-up and shutdown (paid once per launch) can be most of the wall time: TOR
then measures the launch more than the reliability. The report says so when they are more than
:data:`LAUNCH_NOTE_SHARE` of it, with the TOR of the time between them.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from elasticft.steps import StepRecord

PHASES = (
    "healthy",
    "slow_steps",
    "slow_recovery",
    "checkpoint_stall",
    "detection",
    "repair",
    "rollback",
    "startup",
    "shutdown",
)
# A step no slower than this times t_healthy ends a slow recovery.
HEALTHY_TOLERANCE = 1.2
LAUNCH_NOTE_SHARE = 0.2
"""Start-up and shutdown above this share of the wall time get a note in the report."""


@dataclasses.dataclass
class Fault:
    """One failure and what it cost."""

    time: float
    attempt: int
    failure_class: str
    ranks: tuple[int, ...]
    action: str
    reason: str
    detection_s: float = 0.0
    repair_s: float = 0.0
    rollback_s: float = 0.0
    rollback_steps: int = 0
    slow_recovery_s: float = 0.0
    in_process: dict[str, float] = dataclasses.field(default_factory=dict)
    """The phases of an in-process recovery (its ``recover_in_process`` event), if it was one."""

    @property
    def total_s(self) -> float:
        return self.detection_s + self.repair_s + self.rollback_s + self.slow_recovery_s

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ranks"] = list(self.ranks)
        data["total_s"] = self.total_s
        return data


@dataclasses.dataclass
class Preemption:
    """One preemption notice the run acted on (its ``preemption_*`` events)."""

    time: float
    provider: str
    notice: str
    """termination, or rebalance (a risk without a deadline)."""
    action: str = ""
    durable: bool | None = None
    step: int | None = None
    save_s: float = 0.0
    before_deadline_s: float | None = None

    def saved(self) -> str:
        if self.durable is None:
            return "nothing"
        step = f"step {self.step}" if self.step is not None else "newest"
        return f"{step} ({self.save_s:.1f} s)" if self.durable else "NOT confirmed"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Span:
    """A labelled interval of the timeline (for the plot)."""

    start: float
    end: float
    phase: str


@dataclasses.dataclass
class Analysis:
    run_id: str
    start: float
    end: float
    observed_s: float
    queued_s: float
    healthy_step_s: float
    steps_done: int
    first_step: int
    last_step: int
    phases: dict[str, float]
    faults: list[Fault]
    allocations: int
    reference_rank: int
    spans: list[Span]
    steps: list[StepRecord]
    end_state: str
    end_reason: str = ""
    """Why the run ended, as its launcher said (empty for a success)."""
    preemptions: list[Preemption] = dataclasses.field(default_factory=list)
    """Notices the run acted on; not failures (MTBF counts none of them)."""

    @property
    def step_source(self) -> str:
        """explicit (the script's records), optimizer (the optimizer's own step count, recorded
        by elasticft), or counted (no step count: steps redone after a restore look like
        progress)."""
        if not self.steps or not self.steps[0].automatic:
            return "explicit"
        return "counted" if any(r.counted for r in self.steps) else "optimizer"

    @property
    def optimal_s(self) -> float:
        return self.steps_done * self.healthy_step_s

    @property
    def tor(self) -> float:
        return self.optimal_s / self.observed_s if self.observed_s > 0 else 0.0

    @property
    def ettr(self) -> float:
        productive = sum(self.phases[p] for p in ("healthy", "slow_steps", "slow_recovery"))
        return productive / self.observed_s if self.observed_s > 0 else 0.0

    @property
    def launch_s(self) -> float:
        """Start-up and shutdown: what every launch pays once."""
        return self.phases["startup"] + self.phases["shutdown"]

    @property
    def tor_between_launch_and_exit(self) -> float:
        """TOR of the time after start-up and before shutdown."""
        between = self.observed_s - self.launch_s
        return self.optimal_s / between if between > 0 else 0.0

    @property
    def mtbf_s(self) -> float | None:
        return self.observed_s / len(self.faults) if self.faults else None

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "end_state": self.end_state,
            "end_reason": self.end_reason,
            "observed_s": self.observed_s,
            "optimal_s": self.optimal_s,
            "queued_s": self.queued_s,
            "tor": self.tor,
            "ettr": self.ettr,
            "mtbf_s": self.mtbf_s,
            "failures": len(self.faults),
            "healthy_step_s": self.healthy_step_s,
            "steps_done": self.steps_done,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "allocations": self.allocations,
            "reference_rank": self.reference_rank,
            "step_source": self.step_source,
            "step_numbers": STEP_SOURCE_LINES[self.step_source],
            "phases_s": dict(self.phases),
            "faults": [f.to_json() for f in self.faults],
            "preemptions": [p.to_json() for p in self.preemptions],
        }


# When ranks fail together, the most specific class names the fault (a crash makes its peers
# fail with connection errors, not the other way round); the agent's policy orders them alike.
_CAUSE_ORDER = ("user_code", "signal_crash", "elasticft", "hang", "slow", "numeric",
                "infrastructure", "stop_requested")


def _cause_rank(failure_class: str) -> int:
    return _CAUSE_ORDER.index(failure_class) if failure_class in _CAUSE_ORDER else len(_CAUSE_ORDER)


class ReportError(ValueError):
    """The run directory has too little to report on; the message says what is missing."""


class StepsUnknown(ReportError):
    """Too few step records to tell the healthy step time; the event log still has the rest
    (:mod:`elasticft.report.eventsonly`)."""


@dataclasses.dataclass
class _Segment:
    """One agent lifetime (one allocation of the job) on the reference node."""

    start: float
    end: float
    node: str
    events: list[dict[str, Any]]


def _segments(events: Sequence[dict[str, Any]], node: str) -> list[_Segment]:
    segments: list[_Segment] = []
    for event in events:
        if event.get("node") != node:
            continue
        # A relaunch's launcher writes its "relaunch" event just before its run_start: the
        # allocation begins there, not at the end of the one before.
        opened = bool(segments) and all(e["kind"] == "relaunch" for e in segments[-1].events)
        if (event["kind"] in ("run_start", "relaunch") and not opened) or not segments:
            segments.append(_Segment(event["time"], event["time"], node, []))
        segment = segments[-1]
        # The launcher's own start-up (Python, torch import) is part of the wall time.
        segment.start = min(segment.start, float(event.get("process_started") or event["time"]))
        segment.events.append(event)
        segment.end = max(segment.end, event["time"])
    return segments


def _reference(steps: dict[int, list[StepRecord]]) -> int:
    ranks = [r for r, records in steps.items() if records]
    if not ranks:
        raise StepsUnknown(
            "no step records under <run_dir>/steps (the workers stepped no torch optimizer and "
            "wrote none to $ELASTICFT_STEP_LOG)"
        )
    return min(ranks)


def _reference_node(events: Sequence[dict[str, Any]], rank: int) -> str:
    for event in events:
        if event["kind"] == "workers_started" and str(rank) in event.get("pids", {}):
            return event["node"]
    nodes = [e["node"] for e in events if e["kind"] == "run_start"]
    if not nodes:
        raise ReportError("no run_start event in the event log; is this a run directory?")
    return nodes[0]


def healthy_step_time(records: Sequence[StepRecord], attempt_of: Sequence[int]) -> float:
    """Median duration of consecutive steps of one attempt, checkpoint time excluded."""
    durations = [
        b.time - a.time - b.ckpt_s
        for i, (a, b) in enumerate(itertools.pairwise(records))
        if attempt_of[i] == attempt_of[i + 1] and b.step == a.step + 1
    ]
    if not durations:
        raise StepsUnknown("fewer than two consecutive steps recorded; cannot tell the healthy "
                           "step time")
    return statistics.median(durations)


def analyze(events: Sequence[dict[str, Any]], steps: dict[int, list[StepRecord]]) -> Analysis:
    """Splits the run into TOR phases; see the module docstring for the definitions."""
    run_ids = sorted({str(e.get("run_id", "")) for e in events if e["kind"] == "run_start"})
    if len(run_ids) > 1:
        # Allocations of one run (a Slurm requeue) share its id; several ids are several runs,
        # e.g. the parent of many run directories, and one timeline of them means nothing.
        shown = ", ".join(run_ids[:3]) + (", ..." if len(run_ids) > 3 else "")
        raise ReportError(f"holds the event logs of {len(run_ids)} runs ({shown}); give the "
                          "directory of one run, e.g. elasticft-runs/<run-id>")
    rank = _reference(steps)
    node = _reference_node(events, rank)
    segments = _segments(events, node)
    if not segments:
        raise ReportError("no events of the reference node; is this a run directory?")
    run_id = next((e.get("run_id", "") for e in events if e["kind"] == "run_start"), "")
    # Step records that fall inside an allocation (a killed agent's segment ends at its last
    # event; extend it to the last record before the next allocation starts).
    records = sorted(steps[rank], key=lambda r: r.time)
    for i, segment in enumerate(segments):
        nxt = segments[i + 1].start if i + 1 < len(segments) else float("inf")
        inside = [r.time for r in records if segment.start <= r.time < nxt]
        if inside:
            segment.end = max(segment.end, max(inside))
    records = [r for r in records if any(s.start <= r.time <= s.end for s in segments)]

    # Marks: the events that change what the time between two marks means.
    marks: list[tuple[float, str, Any]] = []
    attempt_counter = 0
    # Allocations that ended in a last save: Slurm's time limit, a preemption.
    time_limited: set[int] = set()
    preemptions: list[Preemption] = []
    for si, segment in enumerate(segments):
        marks.append((segment.start, "segment_start", si))
        seen_failure_attempts: set[int] = set()
        pending_fault: Fault | None = None
        for event in segment.events:
            kind = event["kind"]
            if kind == "workers_started":
                attempt_counter += 1
                marks.append((event["time"], "workers_started", attempt_counter))
            elif kind == "failure" and event.get("attempt") not in seen_failure_attempts:
                seen_failure_attempts.add(event.get("attempt"))
                pending_fault = Fault(
                    time=event["time"], attempt=int(event.get("attempt", 0)),
                    failure_class=str(event.get("failure_class", "unknown")),
                    ranks=(int(event.get("rank", -1)),), action="", reason="",
                )
                marks.append((event["time"], "failure", pending_fault))
            elif kind == "failure" and pending_fault is not None:
                pending_fault.ranks = (*pending_fault.ranks, int(event.get("rank", -1)))
                cls = str(event.get("failure_class", "unknown"))
                if _cause_rank(cls) < _cause_rank(pending_fault.failure_class):
                    pending_fault.failure_class = cls
            elif kind == "decision" and pending_fault is not None and not pending_fault.action:
                pending_fault.action = str(event.get("action", ""))
                pending_fault.reason = str(event.get("reason", ""))
            elif kind == "recover_in_process" and pending_fault is not None:
                pending_fault.in_process = dict(event.get("phases", {}))
            elif kind == "slurm_time_limit":
                time_limited.add(si)
            elif kind == "preemption_notice":
                preemptions.append(Preemption(event["time"], str(event.get("provider", "?")),
                                              str(event.get("notice", "termination"))))
            elif kind == "preemption_decision" and preemptions:
                preemptions[-1].action = str(event.get("action", ""))
                if preemptions[-1].action in ("save_and_stop", "stop"):
                    time_limited.add(si)
            elif kind == "preemption_saved" and preemptions:
                last = preemptions[-1]
                last.durable, last.step = bool(event.get("durable")), event.get("step")
                last.save_s = float(event.get("duration_s") or 0.0)
                last.before_deadline_s = event.get("before_deadline_s")
        marks.append((segment.end, "segment_end", si))
    for record in records:
        marks.append((record.time, "step", record))
    order = {"segment_start": 0, "workers_started": 1, "step": 2, "failure": 3,
             "segment_end": 4}
    marks.sort(key=lambda m: (m[0], order[m[1]]))

    # Attempt of each step record, for the healthy step time.
    attempt_of, current = [], 0
    for _, kind, payload in marks:
        if kind == "workers_started":
            current = payload
        elif kind == "step":
            attempt_of.append(current)
    t_h = healthy_step_time(records, attempt_of)

    phases = dict.fromkeys(PHASES, 0.0)
    spans: list[Span] = []
    faults: list[Fault] = []

    def add(phase: str, start: float, seconds: float) -> None:
        if seconds <= 0:
            return
        phases[phase] += seconds
        spans.append(Span(start, start + seconds, phase))

    first_step = records[0].step - 1 if records else 0
    best = first_step  # highest step reached so far
    prev_time, prev_kind = marks[0][0], marks[0][1]
    in_segment = False
    last_fault: Fault | None = None
    recovering = False  # after a restart, until a healthy step
    observed = queued = 0.0
    for time, kind, payload in marks:
        gap = time - prev_time
        if kind == "segment_start":
            if prev_kind == "segment_end":
                queued += gap
                spans.append(Span(prev_time, time, "queued"))
            in_segment = True
            prev_time, prev_kind = time, kind
            continue
        if not in_segment:
            prev_time, prev_kind = time, kind
            continue
        observed += gap
        if kind == "workers_started":
            add("repair" if recovering else "startup", prev_time, gap)
            if last_fault is not None and recovering:
                last_fault.repair_s += gap
        elif kind == "step":
            record: StepRecord = payload
            first_of_attempt = prev_kind in ("workers_started", "segment_start", "failure")
            work = min(gap, t_h + record.ckpt_s) if first_of_attempt else gap
            overhead = gap - work
            if overhead > 0:
                phase = "repair" if recovering else "startup"
                add(phase, prev_time, overhead)
                if recovering and last_fault is not None:
                    last_fault.repair_s += overhead
            start = prev_time + overhead
            if record.step <= best:
                add("rollback", start, work)
                if last_fault is not None:
                    last_fault.rollback_s += work
                    last_fault.rollback_steps += 1
            else:
                ckpt = min(record.ckpt_s, work)
                add("checkpoint_stall", start + work - ckpt, ckpt)
                compute = work - ckpt
                healthy = min(compute, t_h)
                add("healthy", start, healthy)
                excess = compute - healthy
                # (The first step of an attempt is assumed healthy, so it cannot end it.)
                if recovering and not first_of_attempt and compute <= HEALTHY_TOLERANCE * t_h:
                    recovering = False
                if recovering:
                    add("slow_recovery", start + healthy, excess)
                    if last_fault is not None:
                        last_fault.slow_recovery_s += excess
                else:
                    add("slow_steps", start + healthy, excess)
                best = record.step
        elif kind == "failure":
            fault: Fault = payload
            add("detection", prev_time, gap)
            fault.detection_s = gap
            faults.append(fault)
            last_fault, recovering = fault, True
        elif kind == "segment_end":
            # The tail of an allocation that ended in a last save (time limit, preemption) is
            # that checkpoint.
            tail = "checkpoint_stall" if payload in time_limited else "shutdown"
            add("repair" if prev_kind == "failure" else tail, prev_time, gap)
            if prev_kind == "failure" and last_fault is not None:
                last_fault.repair_s += gap
            in_segment = False
        prev_time, prev_kind = time, kind

    end_event = next((e for e in reversed(events) if e["kind"] == "run_end"), None)
    return Analysis(
        run_id=str(run_id),
        start=segments[0].start,
        end=segments[-1].end,
        observed_s=observed,
        queued_s=queued,
        healthy_step_s=t_h,
        steps_done=best - first_step,
        first_step=first_step,
        last_step=best,
        phases=phases,
        faults=faults,
        allocations=len(segments),
        reference_rank=rank,
        spans=spans,
        steps=records,
        end_state=str(end_event.get("state")) if end_event else "running or killed",
        end_reason=str(end_event.get("reason") or "") if end_event else "",
        preemptions=preemptions,
    )


STEP_SOURCE_LINES = {
    "explicit": "step numbers: the script's own records ($ELASTICFT_STEP_LOG)",
    "optimizer": "step numbers: the optimizer's own step count, read at each optimizer.step() "
                 "(it follows every restore; the script writes no step records)",
    "counted": "step numbers: not known (the optimizer keeps no step count, the script writes "
               "no step records): optimizer.step() calls counted and timed, so steps redone "
               "after a restore count as progress; write step records to $ELASTICFT_STEP_LOG "
               "for exact rollback",
}
"""The one line of the report that says where its step numbers came from, by step source."""


def _steps_line(a: Analysis) -> str:
    """Steps by number, or, where the real step is not known, by count and time."""
    healthy = f"healthy step {a.healthy_step_s * 1000:.1f} ms"
    if a.step_source == "counted":
        return f"  {a.steps_done} optimizer steps (real step numbers not known), {healthy}"
    return f"  steps {a.first_step} -> {a.last_step} ({a.steps_done} that counted), {healthy}"


def _launch_note(a: Analysis) -> list[str]:
    """What TOR means when start-up and shutdown are much of the run (a short run)."""
    share = a.launch_s / a.observed_s if a.observed_s > 0 else 0.0
    if share <= LAUNCH_NOTE_SHARE:
        return []
    between = f"between them TOR is {a.tor_between_launch_and_exit:.3f}"
    return [f"  start-up and shutdown are {share:.0%} of this {a.observed_s:.1f} s run. A launch "
            "pays them once, so",
            f"  this run's TOR mostly measures its launch; {between}" if share > 0.5 else
            f"  a longer run scores higher; {between}"]


def format_report(a: Analysis) -> str:
    lines = [
        f"elasticft report: run {a.run_id} ({a.end_state}), {a.allocations} allocation(s), "
        f"reference rank {a.reference_rank}",
        _steps_line(a),
        f"  observed {a.observed_s:.1f} s, optimal {a.optimal_s:.1f} s"
        + (f", queued between allocations {a.queued_s:.1f} s (not counted)" if a.queued_s else ""),
        *([f"  ended: {a.end_reason}"] if a.end_reason else []),
        f"  {STEP_SOURCE_LINES[a.step_source]}",
        "",
        f"  TOR   {a.tor:.3f}   (optimal / observed time)",
        f"  ETTR  {a.ettr:.3f}   (time in steps that counted / wall time)",
        "  MTBF  " + (f"{a.mtbf_s:.1f} s over {len(a.faults)} failure(s)" if a.mtbf_s
                      else f"no failures in {a.observed_s:.1f} s"),
        *_launch_note(a),
        "",
        "  where the time went:",
    ]
    for phase in PHASES:
        seconds = a.phases[phase]
        share = seconds / a.observed_s if a.observed_s else 0.0
        lines.append(f"    {phase.replace('_', ' '):<17}{seconds:9.2f} s  {share:7.1%}")
    lines.append(f"    {'total':<17}{sum(a.phases.values()):9.2f} s")
    lines += _preemption_lines(a)
    if a.faults:
        lines += ["", "  failures:",
                  "    #  at (s)  class            ranks   action            detect  repair  "
                  "rollback (steps)  slow rec.  total"]
        for i, f in enumerate(a.faults, 1):
            ranks = ",".join(map(str, sorted(set(f.ranks))))
            lines.append(
                f"    {i:<2}{f.time - a.start:7.1f}  {f.failure_class:<16} {ranks:<7} "
                f"{f.action:<17}{f.detection_s:6.2f}s {f.repair_s:6.2f}s "
                f"{f.rollback_s:6.2f}s ({f.rollback_steps:>3}) {f.slow_recovery_s:8.2f}s "
                f"{f.total_s:6.2f}s"
            )
            if f.in_process:
                lines.append("       in process: " + ", ".join(
                    f"{phase_name(name)} {seconds:.2f} s"
                    for name, seconds in f.in_process.items()))
    return "\n".join(lines)


def _preemption_lines(a: Analysis) -> list[str]:
    if not a.preemptions:
        return []
    lines = ["", f"  preemptions: {len(a.preemptions)} (not failures)",
             "    #  at (s)  source      notice       action          saved            "
             "before deadline"]
    for i, p in enumerate(a.preemptions, 1):
        left = f"{p.before_deadline_s:.1f} s" if p.before_deadline_s is not None else "-"
        lines.append(f"    {i:<2}{p.time - a.start:7.1f}  {p.provider:<11} {p.notice:<12} "
                     f"{p.action or '-':<15} {p.saved():<16} {left}")
    return lines


def phase_name(key: str) -> str:
    """An in-process recovery's phase as the report and ``elasticft status`` name it (pure):
    ``survivors_out_s`` → "survivors out", ``restore_redo_s`` (restore and redo, when no
    worker said when its restore ended) → "restore+redo"."""
    return key.removesuffix("_s").replace("restore_redo", "restore+redo").replace("_", " ")
