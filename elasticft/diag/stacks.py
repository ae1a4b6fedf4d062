"""Stack traces of live workers with py-spy, for culprit localisation of hangs (ByteRobust).

``py-spy dump --nonblocking`` reads a process's memory without pausing it, so it also works on a
stopped or wedged worker and never perturbs a healthy one. Dumps run in parallel with a timeout;
a worker whose stack cannot be read gets an empty dump (itself a sign that something is wrong).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)


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
