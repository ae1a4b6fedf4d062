"""The run's timeline: an append-only JSONL event log, one file per agent process.

Every agent appends one JSON object per line to ``<event_dir>/events-<node>-<pid>.jsonl``; one
file per agent means agents of several nodes sharing a directory never interleave writes. Each
event carries ``time`` (wall clock, seconds since the epoch), ``mono`` (this process's monotonic
clock, for durations), ``node`` and ``kind``; the rest is the kind's own payload.

Kinds written by the agent (later subsystems add theirs; readers ignore what they do not know):

=================  ============================================================================
``run_start``      the agent started: run id, entrypoint, args, script (real path), nnodes,
                   nproc_per_node, max_restarts
``rendezvous``     a round completed: round, group_rank, group_world_size, master addr/port
``workers_started``  pids by local rank and global rank, restart count, host
``steady``         the workers have been running for ``steady_after`` seconds without failure
``failure``        one failed worker: rank, class, exit code, signal, exception, evidence
``decision``       the policy's action and its reason
``restart``        a worker group restart begins: attempt number, cause
``checkpoint``     a checkpoint became durable (written by the checkpoint subsystem): step,
                   bytes, seconds, cause (periodic, flush, final, request: ...)
``snapshot_skipped``  a worker's save found no free memory slot: rank, step, reason
``restore``        what an attempt's workers resumed from (checkpoint subsystem): step (None:
                   nothing), source tier, where (its directory), restart count
``backoff``        the wait before a restart after a communication fault repeated before the
                   first step: wait_s, repeats, reason
``relaunch``       a launch of a job that ran before: the previous launch's script arguments,
                   those that changed, the newest committed step in its checkpoint directory
``stop``           the agent stops: reason, exit code
``run_end``        last event of the agent: state, exit code, restarts, wall time
=================  ============================================================================
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EVENT_FILE_GLOB = "events-*.jsonl"


class EventLog:
    """Appends events for one agent; thread-safe, each line flushed when written."""

    def __init__(
        self,
        directory: Path,
        node: str,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.node = node
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        safe_node = "".join(c if c.isalnum() or c in "-_." else "_" for c in node)
        self.path = self.directory / f"events-{safe_node}-{os.getpid()}.jsonl"
        # Owner-only: events name hosts, pids and failure messages.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file = os.fdopen(fd, "a", buffering=1)

    def emit(self, kind: str, **payload: Any) -> dict[str, Any]:
        event = {"time": self._clock(), "mono": self._monotonic(), "node": self.node, "kind": kind}
        event.update(payload)
        line = json.dumps(event, default=str, separators=(",", ":"))
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")
        return event

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()


def failures_heard_lines(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """When each node heard of each failure across nodes and from whom (``failure_heard``
    events), and lines saying so: one per recovery, the node that knew first, then the others
    with how long after its record they heard."""
    heard = [e for e in events if e.get("kind") == "failure_heard"]
    if not heard:
        return [], "failure heard across nodes: none"
    by_recovery: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in heard:
        by_recovery.setdefault((int(event.get("round", -1)), int(event.get("index", 0))),
                               []).append(event)
    lines = []
    for (round_, index), found in sorted(by_recovery.items()):
        source = found[0].get("source")
        nodes = ", ".join(
            f"{e.get('node')} (first)" if e.get("node") == e.get("source")
            else f"{e.get('node')} after {float(e.get('after_s', 0.0)):.3f} s"
            for e in sorted(found, key=lambda e: float(e.get("heard", 0.0))))
        lines.append(f"failure heard (round {round_}, recovery {index}) from node {source}: "
                     f"{nodes}; cause: {found[0].get('cause')}")
    return heard, "\n  ".join(lines)


def snapshots_skipped_line(events: list[dict[str, Any]]) -> tuple[int, str]:
    """How many saves workers could not take (``snapshot_skipped``), and a line saying so."""
    skipped = [e for e in events if e.get("kind") == "snapshot_skipped"]
    if not skipped:
        return 0, "snapshots skipped: 0"
    last = skipped[-1]
    return len(skipped), (f"snapshots skipped: {len(skipped)} (last: step {last.get('step')} of "
                          f"rank {last.get('rank')}: {last.get('reason')})")


def iter_event_files(directory: Path) -> Iterator[Path]:
    yield from sorted(Path(directory).rglob(EVENT_FILE_GLOB))


def read_events(directory: Path) -> list[dict[str, Any]]:
    """All events under ``directory`` (recursively), merged and sorted by wall time.

    A torn last line (an agent killed mid-write) is skipped, never fatal.
    """
    events: list[dict[str, Any]] = []
    for path in iter_event_files(directory):
        with open(path) as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    events.sort(key=lambda e: e.get("time", 0.0))
    return events


def sdc_line(events: list[dict[str, Any]]) -> tuple[dict[str, int], str]:
    """How many silent-data-corruption findings the fingerprint watch logged (``sdc_suspect``:
    a rank named; ``sdc_undecidable``: two replicas differ), the steps redone because of them
    (``sdc_recovered``, after a rollback under ``ckpt_sdc_action`` evict), and a line saying so."""
    suspects = [e for e in events if e.get("kind") == "sdc_suspect"]
    undecided = [e for e in events if e.get("kind") == "sdc_undecidable"]
    redone = sum(int(e.get("steps_redone") or 0) for e in events
                 if e.get("kind") == "sdc_recovered")
    counts = {"suspect": len(suspects), "undecidable": len(undecided), "steps_redone": redone}
    if not suspects and not undecided:
        return counts, "silent data corruption: none found"
    last = (suspects or undecided)[-1]
    named = "named" if last.get("kind") == "sdc_suspect" else "undecidable between"
    return counts, (f"silent data corruption: {len(suspects)} suspect, {len(undecided)} "
                    f"undecidable (last: step {last.get('step')}, {named} rank(s) "
                    f"{last.get('ranks')} on {last.get('nodes')}: {last.get('reason')}); "
                    f"{redone} step(s) redone because of it")
