"""What a run may leave on its host, found from its run directory: shared-memory rings and
checkpoint segments named after its agents, torch's temporary log directory, live processes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import psutil

from elasticft.ckpt.shm import NAME_PREFIX, SHM_DIR
from elasticft.events import read_events
from elasticft.procs import gone


def agent_pids(run_dir: Path) -> set[int]:
    return {int(e["pid"]) for e in read_events(run_dir) if e["kind"] == "run_start"}


def shm_entries(pids: set[int], ring_base: Path = SHM_DIR) -> list[Path]:
    """Ring directories (``elasticft-<uid>-<pid>-<tag>`` in ``ring_base``) and checkpoint
    segments (``elasticft-ckpt-<pid>-...`` in /dev/shm) of these agents."""
    rings = {f"elasticft-{os.getuid()}-{pid}-" for pid in pids}
    segments = {f"{NAME_PREFIX}-{pid}-" for pid in pids}
    found = [p for p in ring_base.iterdir() if any(p.name.startswith(n) for n in rings)]
    found += [p for p in SHM_DIR.iterdir() if any(p.name.startswith(n) for n in segments)]
    return sorted(found)


def run_processes(run_dir: Path, marker: str) -> list[psutil.Process]:
    """Live processes of the run: its workers (by pid) and anything whose command line holds
    ``marker`` (warm interpreters share the workers' command line)."""
    worker_pids = {int(pid) for e in read_events(run_dir) if e["kind"] == "workers_started"
                   for pid in e.get("pids", {}).values()}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if proc.info["pid"] in worker_pids or marker in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return [p for p in found if p.pid != os.getpid()]


def assert_nothing_left(run_dir: Path, marker: str | None = None,
                        ring_base: Path = SHM_DIR) -> None:
    events = read_events(run_dir)
    pids = agent_pids(run_dir)
    assert pids and all(gone(pid) for pid in pids), pids
    assert shm_entries(pids, ring_base) == []
    run_ids = {str(e["run_id"]) for e in events if e["kind"] == "run_start"}
    tmp = Path(tempfile.gettempdir())
    assert [p for p in tmp.glob("torchelastic_*/*") if p.name.split("_")[0] in run_ids] == []
    assert run_processes(run_dir, marker or str(run_dir.parent)) == []
