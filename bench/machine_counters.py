"""Counters of this process and of the machine, read before and after a step to say where its
time went: CPU by thread, the machine's CPU, the kernel's page counters, free memory. Linux only
(``/proc``); used by bench/recovery_large.py."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def process_age_s() -> float:
    """Seconds since this process started (its start-up: interpreter, imports, the model)."""
    from elasticft import procs  # the worker's path has the repository on it

    return time.time() - procs.started_at(os.getpid())


def meminfo_gb(field: str = "MemAvailable") -> float:
    """A field of /proc/meminfo in GB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1e6
    return 0.0


def thread_cpu() -> dict[str, list[float]]:
    """CPU seconds (user, system) of this process's threads so far, summed by thread name (the
    Python name where the thread is Python's, else the kernel's: torch's OpenMP threads)."""
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    totals: dict[str, list[float]] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = python_names.get(int(task.name)) or (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total = totals.setdefault(name, [0.0, 0.0])
        total[0] += int(fields[11]) / tick  # utime, field 14 of stat(5)
        total[1] += int(fields[12]) / tick  # stime, field 15
    return totals


def machine_cpu() -> list[int]:
    """Jiffies of the whole machine so far: user + nice, system + irq + softirq, idle + iowait."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return [values[0] + values[1], values[2] + values[5] + values[6], values[3] + values[4]]


VMSTAT = ("allocstall_normal", "allocstall_movable", "pgscan_direct", "pgsteal_direct",
           "pgscan_kswapd", "pgsteal_kswapd", "pgalloc_dma32", "workingset_refault_file",
           "compact_stall", "thp_fault_alloc", "pgfault", "pgfree", "pgalloc_normal")


def page_counters() -> dict[str, int]:
    """The kernel's counters of page allocation and reclaim (whole machine)."""
    counters = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, value = line.split()
        if name in VMSTAT:
            counters[name] = int(value)
    return counters


def process_cpu() -> dict[int, tuple[str, int]]:
    """Every process's CPU so far (user + system jiffies, its children not counted), by pid,
    with the start of its command line: who else ran during a step on a shared machine."""
    found: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended meanwhile
            continue
        # Paths shortened: the interpreter to its checkout (…/<checkout>/.venv/bin/python),
        # the script to its folder and name.
        command = " ".join("/".join(a.split("/")[-4 if i == 0 else -2:])
                           for i, a in enumerate(argv[:3]) if a)
        found[int(entry.name)] = (f"{command[:70]} ({entry.name})",
                                  int(fields[11]) + int(fields[12]))
    return found


def busiest(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
            count: int = 4) -> list[tuple[str, float]]:
    """The ``count`` processes that used the most CPU seconds between two :func:`process_cpu`
    readings, as (command line, seconds)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = [(command, (ticks - before.get(pid, (command, 0))[1]) / tick)
            for pid, (command, ticks) in after.items()]
    return sorted((u for u in used if u[1] >= 0.05), key=lambda u: -u[1])[:count]
