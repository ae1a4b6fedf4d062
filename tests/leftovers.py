"""What a run may leave on its host, found from its run directory: shared-memory rings and
checkpoint segments named after its agents, torch's temporary log directory, live processes,
anything in /dev/shm or the temporary directory named after its processes or run; and what its
live processes hold there by name (:func:`held_by_name`), which a SIGKILL would leave behind."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import psutil

from elasticft.ckpt.memory.shm import NAME_PREFIX, SHM_DIR
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


def shared_roots() -> tuple[Path, ...]:
    return (SHM_DIR, Path(tempfile.gettempdir()))


_INSTALLED = tuple({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
                    Path(__file__).resolve().parents[1]})
"""Where the interpreter, its packages and this checkout are."""


def held_by_name(pids: Iterable[int], allowed: Path) -> list[str]:
    """Files in /dev/shm or the temporary directory that these processes hold open or mapped
    under a name: what would stay if they were SIGKILLed now. Files with no name (unlinked,
    ``O_TMPFILE``, memfd) go with their last holder. ``allowed`` (the test's own directory,
    which holds the run directory) does not count."""
    roots = [f"{root}/" for root in shared_roots()]
    found = set()
    for pid in pids:
        paths = []
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    paths.append(os.readlink(fd))
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6:
                    paths.append(fields[5])
        for path in paths:
            if path.endswith(" (deleted)") or not any(path.startswith(r) for r in roots):
                continue
            # The checkout and its environment may themselves live in /tmp (a CI clone): the
            # libraries mapped from there are the installation, not something the run made.
            if not any(Path(path).is_relative_to(keep) for keep in (allowed, *_INSTALLED)):
                found.add(f"pid {pid}: {path}")
    return sorted(found)


def held_without_name(pid: int, root: Path = SHM_DIR) -> list[str]:
    """The files in ``root``'s file system that ``pid`` maps and that have no name there."""
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        return sorted({line.split(maxsplit=5)[5]
                       for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                       if line.endswith(" (deleted)") and f" {root}/" in line})
    return []


def unnamed_slots(pid: int) -> list[int]:
    """Sizes of the checkpoint slots ``pid`` holds open in /dev/shm with no name, once a worker
    has sized them (an agent's slots are empty until then)."""
    sizes = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError, PermissionError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                size = fd.stat().st_size
                if target.startswith(f"{SHM_DIR}/") and target.endswith(" (deleted)") \
                        and size > 4096:
                    sizes.append(size)
    return sizes


def named_after(pids: Iterable[int], run_ids: Iterable[str]) -> list[Path]:
    """Entries of /dev/shm and the temporary directory that name one of these processes (a word
    of the name) or runs (anywhere in it), torch's log directories included (one level down)."""
    words, ids = {str(pid) for pid in pids}, [str(r) for r in run_ids if r]
    entries = [p for root in shared_roots() for p in root.iterdir()]
    entries += [p for root in shared_roots() for p in root.glob("torchelastic_*/*")]
    return sorted(p for p in entries if words & set(re.split(r"[^0-9A-Za-z]+", p.name))
                  or any(r in p.name for r in ids))
