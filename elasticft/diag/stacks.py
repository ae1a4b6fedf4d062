"""Stack traces of live workers with py-spy, evidence for the hang verdict (ByteRobust).

``py-spy dump --nonblocking`` reads a process's memory without pausing it, so it also works on a
stopped or wedged worker and never perturbs a healthy one. Dumps run in parallel with a timeout;
a worker whose stack cannot be read gets an empty dump. :func:`stack_signature` reduces a dump to
the main thread's frames, which the verdict (:mod:`elasticft.diag.verdict`) compares between
ranks (stack outliers) and between two samples of one rank (a stack that moves).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

_LINE_NO = re.compile(r":\d+\)")


def py_spy_path() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump_one(pid: int, timeout_s: float, exe: str) -> str:
    try:
        done = subprocess.run([exe, "dump", "--nonblocking", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.warning("py-spy dump of pid %d failed: %s", pid, e)
        return ""
    if done.returncode != 0:
        logger.warning("py-spy dump of pid %d failed: %s", pid, done.stderr.strip()[:200])
        return ""
    return done.stdout


def dump_stacks(pids: Mapping[int, int], timeout_s: float = 10.0) -> dict[int, str]:
    """Rank -> py-spy dump text ('' when unavailable) for each rank's pid."""
    exe = py_spy_path()
    if exe is None or not pids:
        return {rank: "" for rank in pids}
    with ThreadPoolExecutor(max_workers=min(8, len(pids))) as pool:
        futures = {rank: pool.submit(dump_one, pid, timeout_s, exe) for rank, pid in pids.items()}
        return {rank: future.result() for rank, future in futures.items()}


def stack_signature(dump: str, line_numbers: bool = False) -> str:
    """The main thread's frames from a ``py-spy dump``, without line numbers unless asked.

    The main thread is the one named "MainThread", else the first one listed. An empty
    signature means no stack could be read. With line numbers two samples of the same process
    tell whether its Python is moving.
    """
    blocks: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            blocks.append((line, []))
        elif blocks and line.startswith(" ") and line.strip():
            frame = line.strip()
            blocks[-1][1].append(frame if line_numbers else _LINE_NO.sub(")", frame))
    if not blocks:
        return ""
    main = next((b for b in blocks if '"MainThread"' in b[0]), blocks[0])
    return "\n".join(main[1])
