"""In-process recovery across nodes, run again and again: how many runs end with every loss an
uninterrupted run's, bit for bit, for each place the restored step comes from.

Two ``elasticft-run`` agents as two nodes (etcd-v3 on this host), 1 or 2 workers each, train
``examples/train_inprocess.py`` as a user launches it (no ``OMP_NUM_THREADS`` unless the
launcher sets it, as torchrun does for several workers per node), with ``--rank-seeded-noise``
(each rank's RNG seeded apart, as nanoGPT does, and drawn every step). The last rank is
SIGKILLed around its save of ``--crash-at-step``; where that leaves the step decides the
source of the restore:

* ``after-save``: the save is complete; every rank restores that step from its own memory;
* ``before-save``: killed before it; the rank's own newest step is the one before, and the
  other node holds a data-parallel replica of the newer one (with another rank's RNG states);
* ``mid-save``: killed while its copy runs, so either of the above, as the race falls.

For each (workers per node, fault) it runs one uninterrupted job, then ``--runs`` faulty ones,
and prints the count of exact runs, the restore sources the agents logged, and the first step
that differed in a run that was not exact. Exit status 1 when a run was not exact.

    .venv/bin/python bench/inprocess_repeat.py --runs 20
    .venv/bin/python bench/inprocess_repeat.py --runs 5 --workers 1 --faults mid-save
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)

from elasticft.events import read_events  # noqa: E402
from tests.cluster import Job, losses_of  # noqa: E402
from tests.servers import EtcdServer  # noqa: E402

INPROCESS = ROOT / "examples" / "train_inprocess.py"
FAULTS = ("after-save", "before-save", "mid-save")


def job(base: Path, name: str, endpoint: str, args: argparse.Namespace, workers: int,
        fault: str | None) -> tuple[dict[int, str], list[str]]:
    """One two-node job to its end: (rank 0's loss per step, the restore sources logged)."""
    work = base / name
    work.mkdir()
    train = ["--rank-seeded-noise"]
    if fault is not None:
        train += ["--fault-rank", str(2 * workers - 1), "--crash-at-step",
                  str(args.crash_at_step), "--crash-mode", fault]
    ran = Job(work, clean_job_env(), endpoint, f"repeat-{name}", INPROCESS, args.steps,
              step_time=args.step_time, nproc_per_node=workers, extra_train=train)
    if workers == 1:
        ran.env.pop("OMP_NUM_THREADS")  # as a user launches it: torchrun sets it for 2 or more
    try:
        ran.start("a")
        ran.start("b")
        for node in ran.nodes.values():
            code = node.wait(args.cap)
            if code != 0:
                raise RuntimeError(f"{name}: node {node.name} exited {code}\n{ran.outputs()}")
        sources = [f"{e['node']}:{e.get('source')}" for e in read_events(work)
                   if e["kind"] == "restore" and e.get("step")]
        return losses_of(ran.loss_log).values, sources
    finally:
        ran.close()
        shutil.rmtree(work, ignore_errors=True)


def first_difference(losses: dict[int, str], reference: dict[int, str]) -> str:
    for step in sorted(reference):
        if losses.get(step) != reference[step]:
            return f"step {step}: {losses.get(step)} against {reference[step]}"
    return "every step equal, more steps logged"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--workers", default="1,2", help="workers per node, comma-separated")
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--crash-at-step", type=int, default=12)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--cap", type=float, default=150.0)
    args = parser.parse_args()
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown --faults {unknown}; choose from {', '.join(FAULTS)}")
    import torch

    print(f"# in-process recovery across nodes, repeated, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{platform.node()}, {len(os.sched_getaffinity(0))} CPUs, torch {torch.__version__}; "
          f"2 nodes, gloo, {args.steps} steps, the last rank killed at step "
          f"{args.crash_at_step}, {args.runs} runs per row", flush=True)
    base = Path(tempfile.mkdtemp(prefix="inprocess-repeat-"))
    (base / "data").mkdir(mode=0o700)
    server = EtcdServer(base / "data", base / "etcd.log")
    server.start()
    inexact = 0
    started = time.monotonic()
    try:
        for workers in (int(w) for w in args.workers.split(",")):
            reference, _ = job(base, f"reference-{workers}", server.endpoint, args, workers,
                               None)
            for fault in faults:
                exact, sources = 0, collections.Counter[str]()
                for run in range(args.runs):
                    losses, restored = job(base, f"{workers}-{fault}-{run}", server.endpoint,
                                           args, workers, fault)
                    sources.update(restored)
                    if losses == reference:
                        exact += 1
                    else:
                        inexact += 1
                        print(f"  {workers}x2 {fault} run {run + 1}: DIFFERENT at "
                              f"{first_difference(losses, reference)}; restored from "
                              f"{restored}", flush=True)
                seen = ", ".join(f"{s} x{n}" for s, n in sorted(sources.items()))
                print(f"2 nodes x {workers} workers  {fault:11s}  exact {exact} of "
                      f"{args.runs}  restores: {seen}", flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    took = time.monotonic() - started
    print(f"# took {took // 60:.0f} min {took % 60:.0f} s (load average "
          f"{os.getloadavg()[0]:.1f})")
    sys.exit(1 if inexact else 0)


if __name__ == "__main__":
    main()
