"""The timing of an in-process recovery: its phases, and the limits each phase must keep.

A recovery under way (:class:`Recovery`) carries the agent's own marks: when it saw the
failure, decided, published the generation, reaped the failed processes and started their
replacements. The workers' records add theirs (out of the failed call, torn down, joined,
restored, first step). :func:`phases` turns both into the seconds of each phase for the event
log and ``elasticft report``; :func:`first_step_limit` derives the first step's limit from what the
survivors measured of their steps before the failure, so that a slow first step (a compiled
model, a long step) is not taken for a stuck recovery.
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
    """Monotonic time by which every worker must have joined the new group (teardown and
    regroup); the first step then has its own limit (:func:`first_step_limit`)."""
    joined_at: float | None = None
    """Monotonic time when the agent saw every worker in the new group."""
    first_step_s: float = 0.0
    """The first step's limit, set then."""
    times: dict[str, float] = dataclasses.field(default_factory=dict)
    """The agent's own wall-clock marks: ``reaped`` (the failed processes gone), ``fork`` and
    ``forked`` (the replacements' start)."""


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
    the script's import of elasticft's recovery, torch's import included); join: from there
    to its ``InProcess.run`` (its ``init_process_group``, which meets the survivors, and its
    set-up); regroup: decision →
    the last worker in the new group; restore: from there to the last worker's end of its
    restore (``restored``, in the records of the workers that report one); redo: from there to
    the last worker's first step (the step in flight at the failure, done again); where no
    worker reports its restore's end, the two are one phase, restore_redo; total: failure
    seen → the last first step.
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
    starts = [(float(r["imported"]) - max(float(r["started"]), times.get("fork", 0.0)),
               float(r["joined"]) - float(r["imported"])) for r in records.values()
              if {"started", "imported", "joined"} <= r.keys()]
    if starts:
        out["start_s"] = max(s for s, _ in starts)
        out["join_s"] = max(j for _, j in starts)
    if joined is not None:
        out["regroup_s"] = joined - recovery.decided_at
    if joined is not None and restored is not None:
        out["restore_s"] = restored - joined
    if restored is not None and resumed is not None:
        out["redo_s"] = resumed - restored
    elif joined is not None and resumed is not None:
        out["restore_redo_s"] = resumed - joined
    if resumed is not None:
        out["total_s"] = resumed - recovery.seen_at
    return {k: round(max(v, 0.0), 4) for k, v in out.items()}
