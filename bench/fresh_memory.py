"""What new memory costs on this machine, by how long ago it was freed.

A restarted worker fills gigabytes of memory the process never had: the restore's optimizer
state, the first step's gradients and temporaries. On bare metal each new 4 KiB page costs the
same (the kernel zeroes it). In a VM that reports free memory to its host (virtio-balloon free
page reporting, as Firecracker's guests do; ``page_reporting.page_reporting_order`` on the
kernel's command line), the host takes back memory the guest left free for about two seconds,
and the guest's next touch of it faults at the host too, inside the kernel's page zeroing.

Per round, in one process: fill ``--gb`` GB, free it, wait, fill it again; the second fill's
wall and system seconds are printed against the wait. Not a test: the numbers are the machine's.

    python bench/fresh_memory.py --gb 3
"""

from __future__ import annotations

import argparse
import datetime
import platform
import resource
import time
from pathlib import Path

import numpy as np


def fill(gb: float) -> tuple[np.ndarray, float, float]:
    """A new array of ``gb`` GB written once; its wall and system seconds."""
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    array = np.ones(int(gb * (1 << 30)) // 4, dtype=np.float32)
    wall = time.perf_counter() - started
    return array, wall, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before.ru_stime


def page_reporting() -> str:
    """The kernel's free page reporting setting from its command line, or "none"."""
    try:
        cmdline = Path("/proc/cmdline").read_text()
    except OSError:
        cmdline = ""
    return next((word for word in cmdline.split() if "page_reporting" in word), "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--waits", default="0,1,3,6,10,0",
                        help="seconds between freeing and filling again, one round each")
    args = parser.parse_args(argv)
    reporting = page_reporting()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    print(f"fresh_memory: {platform.machine()}, {now} UTC; free page reporting on the kernel "
          f"command line: {reporting}")
    for wait in (float(w) for w in args.waits.split(",")):
        array, _, _ = fill(args.gb)
        del array
        time.sleep(wait)
        array, wall, system = fill(args.gb)
        del array
        print(f"{args.gb:g} GB filled {wait:g} s after {args.gb:g} GB was freed: {wall:.2f} s "
              f"({args.gb / wall:.1f} GB/s), of it {system:.2f} s system", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
