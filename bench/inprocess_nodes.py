"""In-process recovery across nodes: a worker of one node dies, and the job goes on with only
that rank new, when the survivors' collectives raise and when nothing raises in them.

Two ``elasticft-run`` agents as two nodes (etcd-v3 on this host, ``--local-addr 127.0.0.1``), 2
workers each, train ``examples/train_inprocess.py``. Rank 3 (the second node's) SIGKILLs itself
right after the save of ``--crash-at-step``:

* ``raising``: its sockets close with it, so the survivors' collectives with it raise;
* ``silent``: it first forks a child outside the job that keeps its sockets open
  (``--crash-mode keep-sockets``), as a dead NCCL peer looks from another node: nothing raises
  in any survivor, and only the news through the job's store interrupts them.

The bench polls the dying rank's process every 5 ms (its death: gone or a zombie) and the loss
log every 10 ms, and prints the seconds from the death to the first step logged after it (the
step redone), for each case, their ratio, and whether the silent case keeps within 1.2x the
raising case plus 0.3 s. It also checks that only rank 3 got a new process.

    .venv/bin/python bench/inprocess_nodes.py            # one run of each case
    .venv/bin/python bench/inprocess_nodes.py --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)

from tests.cluster import Job, losses_of  # noqa: E402
from tests.servers import EtcdServer  # noqa: E402

INPROCESS = ROOT / "examples" / "train_inprocess.py"
FAILED_RANK = 3
MODES = {"raising": "after-save", "silent": "keep-sockets"}


def _pids(path: Path) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) == 3:
            found.setdefault(int(parts[0]), set()).add(int(parts[1]))
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def measure(case: str, endpoint: str, tmp: Path, args: argparse.Namespace, run: int) -> float:
    """One job of ``case``: seconds from rank 3's death to the first step after it."""
    work = tmp / f"{case}-{run}"
    work.mkdir()
    pid_log, keeper = work / "pids.log", work / "keeper.pid"
    job = Job(work, clean_job_env(), endpoint, f"bench-{case}-{run}", INPROCESS, args.steps,
              step_time=args.step_time, nproc_per_node=2,
              extra_train=["--pid-log", str(pid_log), "--fault-rank", str(FAILED_RANK),
                           "--crash-at-step", str(args.crash_at_step), "--crash-mode",
                           MODES[case], "--keeper-pid", str(keeper)])
    try:
        job.start("a")
        job.start("b")
        victim = job.wait_for("rank 3's process", lambda: next(
            (int(e["pids"][str(FAILED_RANK)]) for e in job.events("workers_started")
             if str(FAILED_RANK) in e["pids"]), None), timeout=args.start_timeout)
        job.wait_step(args.crash_at_step - 1, timeout=args.start_timeout)
        while not _gone(victim):
            time.sleep(0.005)
        died = time.monotonic()
        first = args.crash_at_step + 1
        while time.monotonic() - died < args.cap:
            if first in losses_of(job.loss_log).values:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"{case}: no step {first} within {args.cap} s\n{job.outputs()}")
        seconds = time.monotonic() - died
        for node in job.nodes.values():
            node.wait(args.cap)
        processes = {rank: len(pids) for rank, pids in _pids(pid_log).items()}
        if processes != {0: 1, 1: 1, 2: 1, 3: 2}:
            raise RuntimeError(f"{case}: processes per rank {processes}, not only rank 3 new")
        return seconds
    finally:
        job.close()
        if keeper.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(keeper.read_text()), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--crash-at-step", type=int, default=6)
    parser.add_argument("--step-time", type=float, default=0.15)
    parser.add_argument("--cap", type=float, default=90.0)
    parser.add_argument("--start-timeout", type=float, default=150.0)
    args = parser.parse_args()
    print(f"# in-process recovery across nodes, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{platform.node()}, {len(os.sched_getaffinity(0))} CPUs, python "
          f"{platform.python_version()}; 2 nodes x 2 workers, gloo, rank {FAILED_RANK} killed")
    base = Path(tempfile.mkdtemp(prefix="inprocess-nodes-"))
    (base / "data").mkdir(mode=0o700)
    server = EtcdServer(base / "data", base / "etcd.log")
    server.start()
    times: dict[str, list[float]] = {case: [] for case in MODES}
    try:
        for run in range(args.runs):
            for case in MODES:
                seconds = measure(case, server.endpoint, base, args, run)
                times[case].append(seconds)
                print(f"run {run + 1} {case:8s} kill -> first step {seconds:.3f} s", flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    raising, silent = (statistics.median(times[c]) for c in MODES)
    target = 1.2 * raising + 0.3
    print(f"median: raising {raising:.3f} s, silent {silent:.3f} s, ratio "
          f"{silent / raising:.2f}; target silent <= 1.2 x raising + 0.3 s = {target:.3f} s: "
          f"{'met' if silent <= target else 'NOT met'}")


if __name__ == "__main__":
    main()
