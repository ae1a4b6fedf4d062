"""The timing of an in-process recovery: its phases, and the limits each phase must keep.

A recovery under way (:class:`Recovery`) carries the agent's own marks: when it saw the
failure, decided, published the generation, reaped the failed processes and started their
replacements. The workers' records add theirs (out of the failed call, torn down, joined,
restored, first step). :func:`phases` turns both into the seconds of each phase for the event
log and ``elasticft report``; :func:`first_step_limit` derives the first step's limit from what the
survivors measured of their steps before the failure, so that a slow first step (a compiled
model, a long step) is not taken for a stuck recovery.

**Bounded from the interrupt.** Once the agent has told the survivors that their generation is
over (the interrupt notice, or the published generation), each has the teardown's hard limit to
report ``failed`` (it left the training function) and then the same limit to be in the new
group. A survivor whose main thread never leaves (a C call that does not return, one that holds
the GIL, so that even its monitor thread cannot run) reports nothing at all:
:func:`overruns` names it once its limit from the notice has passed, and the agent kills it and
replaces it in the same recovery, as it does the failed rank. The decision is pure, over a
:class:`SurvivorState` per survivor; what it saw goes to the event log with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass
class Recovery:
    """One in-process recovery under way."""

    generation: int
    cause: str
    seen_at: float
    """Wall clock when the agent saw the failure."""
    decided_at: float
    published_at: float
    replaced: dict[int, int]
    """Local rank → pid of its replacement."""
    deadline: float
    """Wall clock by which every worker must have joined the new group (teardown and regroup),
    the one deadline of the phase: the generation tells it to the survivors; the first step
    then has its own limit (:func:`first_step_limit`)."""
    joined_at: float | None = None
    """Wall clock when the agent saw every worker in the new group."""
    first_step_s: float = 0.0
    """The first step's limit, set then."""
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    """The agent's own wall-clock marks: ``reaped`` (the failed processes gone), ``fork`` and
    ``forked`` (the replacements' start)."""
    notified_at: float | None = None
    """Wall clock when the survivors were told that their generation is over (the interrupt
    notice, else the published generation): their limits (:func:`overruns`) count from it."""
    at_step: bool = False
    """The notice asked them to stop at their next step boundary (no peer failed)."""


GRACE_S = 5.0
"""What the agent adds to a survivor's own hard limit before it kills it: the survivor's own
bound (its teardown's, its monitor's) ends it first when it can."""


@dataclasses.dataclass(frozen=True)
class SurvivorState:
    """What the agent's files say of one survivor of a recovery under way."""

    local_rank: int
    pid: int | None
    failed_at: float | None = None
    """Wall clock of its ``failed`` record of the generation that ended (None: none yet)."""
    torn_down: bool = False
    """It wrote ``torn``: its teardown and health check are over (it waits for the others in
    the regroup, which the recovery's own deadline bounds)."""
    left: bool = False
    """It wrote ``left``: its own limit ended it, and it exits by itself."""
    joined: bool = False
    """It is in the new generation's group."""


@dataclasses.dataclass(frozen=True)
class Overrun:
    """A survivor past its limit: the agent kills it and replaces it in the same recovery."""

    local_rank: int
    pid: int | None
    reason: str
    evidence: dict[str, Any]
    """What the decision saw, for the event log."""


def overruns(survivors: Sequence[SurvivorState], *, notified_at: float | None, now: float,
             limit_s: float, step_wait_s: float = 0.0, at_step: bool = False,
             grace_s: float = GRACE_S) -> list[Overrun]:
    """The survivors to kill (pure; wall-clock times).

    One that reported ``failed`` has twice ``limit_s`` (and ``grace_s``) from then to report
    ``torn``: its teardown, then its health check, each run under that limit. One that reported
    nothing has ``limit_s`` from the notice (``notified_at``) to report ``failed``, after
    ``step_wait_s`` when the notice asked for a step boundary (``at_step``), since its monitor
    ends its groups only then. One torn down (it waits in the regroup, for the others), joined,
    or left by itself is no longer the agent's to end.
    """
    found = []
    for survivor in survivors:
        if survivor.torn_down or survivor.joined or survivor.left:
            continue
        if survivor.failed_at is not None:
            due = survivor.failed_at + 2 * limit_s + grace_s
            reason = (f"still in its teardown {now - survivor.failed_at:.1f} s after it reported "
                      f"its failure: it overran the hard limit ({limit_s:.0f} s for the "
                      f"teardown, and as much for the health check)")
            since = {"failed_at": survivor.failed_at}
        elif notified_at is not None:
            allowed = limit_s + (step_wait_s if at_step else 0.0)
            due = notified_at + allowed + grace_s
            reason = (f"did not report its failure within {allowed:.0f} s of the interrupt "
                      f"notice: its main thread does not leave the training function (a call "
                      f"that does not return, or one that holds the GIL)")
            since = {"notified_at": notified_at, "at_step": at_step}
        else:
            continue
        if now > due:
            found.append(Overrun(survivor.local_rank, survivor.pid, reason, {
                **since, "limit_s": limit_s, "grace_s": grace_s, "seen_at": now,
                "over_s": round(now - due, 3)}))
    return found


FIRST_STEP_FLOOR_S = 30.0
"""The first step's limit when the workers measured nothing longer."""


def first_step_limit(records: Sequence[Mapping[str, Any]]) -> float:
    """How long the first step after a regroup may take (pure), from what the survivors
    measured before the failure (their ``failed`` records): twice the slowest start-up to a
    first step (``first_s``: a replacement repeats it, compilation included) and three steps
    (``step_s``), and never under :data:`FIRST_STEP_FLOOR_S`."""
    first = max((float(r.get("first_s", 0.0)) for r in records), default=0.0)
    step = max((float(r.get("step_s", 0.0)) for r in records), default=0.0)
    return max(FIRST_STEP_FLOOR_S, 2.0 * first + 3.0 * step)


def phases(recovery: Recovery, records: Mapping[int, Mapping[str, Any]]) -> dict[str, float]:
    """The recovery's phases in seconds (pure), from the agent's times and the workers' records.

    detect: failure seen → decision; survivors_out: failure seen → the last survivor out of
    its training call; abort: the slowest survivor's teardown of its groups; reap: decision →
    the failed processes gone; fork: the replacements' processes started; start: a
    replacement's start-up (its process start, or the fork for a pre-started interpreter →
    the script's ``InProcess()``: its imports, its model, its ``init_process_group``, which
    meets the survivors); join: from there to its ``InProcess.run`` armed; regroup: decision →
    the last worker in the new group; rebuild (a group rebuilt in place by torch's
    reconfigure): from every rank's handle in to the group formed, the slowest rank's;
    restore: from the regroup to the last worker's end of its restore (``restored``, in the
    records of the workers that report one); redo: from there to the last worker's first step
    (the step in flight at the failure, done again); where no worker reports its restore's
    end, the two are one phase, restore_redo; total: failure seen → the last first step.
    """
    def latest(key: str) -> float | None:
        values = [float(r[key]) for r in records.values() if key in r]
        return max(values) if values else None

    aborts = [float(r["aborted"]) - float(r["failed"]) for r in records.values()
              if "aborted" in r and "failed" in r]
    joined, resumed, left = latest("joined"), latest("resumed"), latest("failed")
    restored = latest("restored")
    out = {"detect_s": recovery.decided_at - recovery.seen_at}
    if left is not None:  # the last survivor out of its training call (a collective, often)
        out["survivors_out_s"] = left - recovery.seen_at
    out["abort_s"] = max(aborts) if aborts else 0.0
    times = recovery.times
    if "reaped" in times:
        out["reap_s"] = times["reaped"] - recovery.decided_at
    if "fork" in times and "forked" in times:
        out["fork_s"] = times["forked"] - times["fork"]
    # A warm interpreter started long before the failure: its start-up counts from the fork.
    starts = [(float(r["reached"]) - max(float(r["started"]), times.get("fork", 0.0)),
               float(r["joined"]) - float(r["reached"])) for r in records.values()
              if {"started", "reached", "joined"} <= r.keys()]
    if starts:
        out["start_s"] = max(s for s, _ in starts)
        out["join_s"] = max(j for _, j in starts)
    if joined is not None:
        out["regroup_s"] = joined - recovery.decided_at
    rebuilt = [float(r["rebuild_s"]) for r in records.values() if "rebuild_s" in r]
    if rebuilt:  # in place (torch's reconfigure): every rank ready → the group formed
        out["rebuild_s"] = max(rebuilt)
    if joined is not None and restored is not None:
        out["restore_s"] = restored - joined
    if restored is not None and resumed is not None:
        out["redo_s"] = resumed - restored
    elif joined is not None and resumed is not None:
        out["restore_redo_s"] = resumed - joined
    if resumed is not None:
        out["total_s"] = resumed - recovery.seen_at
    return {k: round(max(v, 0.0), 4) for k, v in out.items()}
