"""CPU time the hypervisor takes from this VM ("steal"), which slows every step like any other
load: benchmarks print it so that a run on a busy host is read as such."""

from __future__ import annotations

from pathlib import Path


def cpu_times() -> tuple[int, int]:
    """(all CPU ticks, ticks stolen by the hypervisor) from /proc/stat; (0, 0) elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPU time the host took between two :func:`cpu_times` readings."""
    return (after[1] - before[1]) / max(after[0] - before[0], 1)
