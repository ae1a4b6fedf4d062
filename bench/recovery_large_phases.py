"""The phase table of bench/recovery_large.py: one row per launcher, one column per phase of
its recovery, from the kill of the last rank to the job's first step after it.

The modes recover in different ways, so a phase a mode does not go through is ``-`` in its
row. The restart modes (``elasticft-run``, torchrun) stop every worker and start new ones:

=========  ===================================================================================
detect     the SIGKILL → the agent's ``failure`` event (elasticft only: torchrun logs none)
decide     that failure → the agent's decision (``elasticft-run``); in process, the agent's
           ``detect`` phase (failure seen → decision)
restart    the decision → the new worker's process start (torchrun: from the SIGKILL, its
           detection and decision included)
start-up   the new worker's process start → its model built (torch's import, the group)
restore    its checkpoint loaded into the model and optimizer
1st step   its first step
=========  ===================================================================================

The in-process modes (``elasticft-inprocess``, ``elasticft-newgroup``, ``elasticft-spare``)
keep the survivors and start one replacement; their columns are the phases of the agent's
``recover_in_process`` event (:func:`elasticft.inprocess.recovery_timing.phases`): ``out``
(survivors out of their training call), ``abort``, ``reap``, ``fork``, ``start-up`` (the
replacement's, from its fork to its ``InProcess()``; the spare, started before the failure, has
none), ``join``, ``regroup`` (decision → every worker in the new group: it spans reap, fork,
start-up and join), ``rebuild`` (the group's rebuild in place by torch's reconfigure, within
the regroup: from every worker ready to the group formed; ``-`` where a new group is made),
``restore`` and ``redo`` (the step in flight, done again), and ``total`` (failure seen → the
last first step). The in-process phases overlap (the survivors restore while the replacement
starts), so a row does not add up; ``kill->step``, the SIGKILL → the restarted rank's first
step, is every mode's whole recovery, measured the same way for all by the bench itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (header, key in a restart mode's row, key in the in-process phases)
    ("detect", "kill_to_failure_s", ""),
    ("decide", "failure_to_decision_s", "detect_s"),
    ("out", "", "survivors_out_s"),
    ("abort", "", "abort_s"),
    ("reap", "", "reap_s"),
    ("fork", "", "fork_s"),
    ("restart", "restart_s", ""),
    ("start-up", "startup_s", "start_s"),
    ("join", "", "join_s"),
    ("regroup", "", "regroup_s"),
    ("rebuild", "", "rebuild_s"),
    ("restore", "restore_s", "restore_s"),
    ("redo", "", "redo_s"),
    ("1st step", "first_step_s", ""),
    ("total", "", "total_s"),
    ("kill->step", "kill_to_first_step_s", ""),
)
"""The table's columns, in the order of a recovery."""

WIDTH = 11


def phase_cells(row: Mapping[str, Any]) -> list[float | None]:
    """One launcher's phases in :data:`COLUMNS`' order (pure), None where the mode has no
    such phase or the run did not measure it. A row with in-process phases (its
    ``in_process``) takes every in-process column from them and of the rest only the ones
    that are every mode's (detect, kill->step)."""
    in_process: Mapping[str, float] | None = row.get("in_process")
    cells: list[float | None] = []
    for header, own, phase in COLUMNS:
        if in_process and phase:
            value = in_process.get(phase)
        elif in_process and header not in ("detect", "kill->step"):
            value = None
        else:
            value = row.get(own) if own else None
        cells.append(float(value) if value is not None else None)
    return cells


def phase_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The table's lines (pure): a header, then a line per launcher, seconds to the ms."""
    lines = [f"{'launcher':<20}" + "".join(f"{header:>{WIDTH}}" for header, _, _ in COLUMNS)]
    for row in rows:
        cells = phase_cells(row)
        lines.append(f"{row['launcher']:<20}" + "".join(
            f"{'-' if value is None else f'{value:.3f}':>{WIDTH}}" for value in cells))
    return lines
