"""Rejected steps: persisted steps that hold state computed after silent data corruption.

When the replicas' fingerprints disagree and the job rolls back to the newest step at which
they agreed (:mod:`elasticft.ckpt.integrity.sdcwatch`), every step after it that was written
before the verdict holds corrupted state. Each place that keeps persisted steps (a node's local
directory, the remote directory, a peer's backup store) then gets a *rejection record*, a small
JSON file ``rejected-<time>-<pid>.json`` beside the step directories: the agreed step
(``after``), the time of the rejection (``at``), the steps it removed and why. A step after
``after`` written no later than ``at`` is never offered to a load again, in this job or in a
relaunch of the same run, even one that lands late (a copy in flight when the verdict came);
a step written after ``at`` (the redone steps, or a later run's) is. The records are kept: a
relaunch logs from them why the steps it could have taken are gone.

Every writer adds a file of its own, so nodes that reject in the same shared directory at
once never overwrite each other's record.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticft.ckpt.persisting.diskfile import atomic_write, fsync_dir

logger = logging.getLogger(__name__)

PREFIX = "rejected-"


def record(root: Path, after: int, steps: Sequence[int], reason: str,
           at: float | None = None) -> dict[str, Any] | None:
    """Writes a rejection record into ``root`` (a directory that exists; else nothing, there is
    nothing to reject there). Returns the record."""
    if not root.is_dir():
        return None
    entry = {"after": after, "at": time.time() if at is None else at,
             "steps": sorted(steps), "reason": reason}
    atomic_write(root / f"{PREFIX}{time.time_ns()}-{os.getpid()}.json",
                 json.dumps(entry).encode())
    fsync_dir(root)
    return entry


def records(root: Path) -> list[dict[str, Any]]:
    """Every rejection record in ``root``, oldest first (an unreadable one is skipped)."""
    found = []
    try:
        paths = sorted(p for p in root.iterdir()
                       if p.name.startswith(PREFIX) and p.name.endswith(".json"))
    except OSError:
        return []
    for path in paths:
        try:
            entry = json.loads(path.read_bytes())
            found.append({"after": int(entry["after"]), "at": float(entry["at"]),
                          "steps": [int(s) for s in entry.get("steps", [])],
                          "reason": str(entry.get("reason", ""))})
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning("unreadable rejection record %s: ignored", path)
    return found


def rejecting(step: int, written_at: float | None,
              entries: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The record that rejects ``step`` written at ``written_at`` (None: unknown, taken as
    before every record), else None."""
    for entry in entries:
        if step > entry["after"] and (written_at is None or written_at <= entry["at"]):
            return entry
    return None


def explain(root: Path, newest_kept: int | None, entries: Sequence[Mapping[str, Any]]
            ) -> list[str]:
    """One line per record that took steps newer than ``newest_kept`` (the newest step
    ``root`` still offers): why a load does not find them."""
    lines = []
    for entry in entries:
        newer = [s for s in entry["steps"] if newest_kept is None or s > newest_kept]
        if newer:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry["at"]))
            lines.append(f"{root}: step(s) {newer} skipped: rejected at {when}, after step "
                         f"{entry['after']} ({entry['reason']})")
    return lines
