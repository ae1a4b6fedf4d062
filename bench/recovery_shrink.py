"""A node lost with no standby, TP2 x DP2 on 4 ranks shrinking to TP2 x DP1 (gradient
accumulation 2), and a node that arrives later growing it back: the time to the first step in
the new layout, in process against the restart mode, on a real etcd server.

Two ``elasticft-run`` agents on this machine are two nodes of two workers each (``--nnodes
1:2``, ``--local-addr 127.0.0.1``), training ``examples/train_3d.py`` with the planner
(``--plan-model examples/train_3d_model.json --layout 2,1,*``); the bench follows the loss log
(polled every 20 ms).

* ``shrink``: once training is past ``--fault-step``, every process of the node that does not
  lead the rendezvous is SIGKILLed at once; kill -> first step in TP2 x DP1.
* ``grow``: one node trains alone (TP2 x DP1) past ``--fault-step``; the second node's agent is
  then started; its start -> first step in TP2 x DP2 (its interpreter's start and torch's
  import included, which a standby already waiting would have paid), and the pause of
  training: the last step logged in TP2 x DP1 -> the first in TP2 x DP2.

Modes: ``restart``, DCP checkpoints every step (``--ckpt-dir``): the agent restarts its workers
in the new layout, which load the newest checkpoint into the new mesh; ``inprocess``
(``--inprocess``, snapshots of every step in the agent's memory): the running workers keep their
processes, regroup in the new round and take the new layout in place; after a growth the new
ranks heal from a data-parallel replica's memory.

    .venv/bin/python bench/recovery_shrink.py                      # both cases and modes
    .venv/bin/python bench/recovery_shrink.py --cases shrink --modes inprocess --runs 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)
from node_loss import read_log, wait  # noqa: E402

from elasticft import chaos  # noqa: E402
from elasticft.events import read_events  # noqa: E402
from tests.servers import EtcdServer  # noqa: E402

BIN = Path(sys.executable).parent
THREE_D = ROOT / "examples" / "train_3d.py"
PLAN = ["--plan-model", str(ROOT / "examples" / "train_3d_model.json"), "--plan-hardware",
        "cpu", "--layout", "2,1,*"]


def measure(case: str, mode: str, args: argparse.Namespace, endpoint: str, run: int) -> str:
    tmp = Path(tempfile.mkdtemp(prefix=f"recovery-{case}-{mode}-"))
    job_id = f"{case}-{mode}-{run}"
    loss_log = tmp / "loss.log"
    train = ["--steps", str(args.steps), "--loss-log", str(loss_log), "--step-sleep", "0.1"]
    train += ["--inprocess"] if mode == "inprocess" else ["--ckpt-dir", str(tmp / "ckpt")]
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    env = {**clean_job_env(), "OMP_NUM_THREADS": "1"}
    def start(name: str) -> None:
        cmd = [str(BIN / "elasticft-run"), "--nnodes", "1:2", "--nproc-per-node", "2",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", job_id,
                   "--local-addr", "127.0.0.1", "--node-id", name, "--run-dir",
                   str(tmp / f"run-{name}"), "--max-restarts", "3", "--ckpt-persist-every",
               "0", *PLAN, str(THREE_D), *train]
        with (tmp / f"{name}.log").open("w") as out:
            nodes[name] = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)

    before, after = ("DP2", "DP1") if case == "shrink" else ("DP1", "DP2")
    try:
        for name in ("a", "b") if case == "shrink" else ("a",):
            start(name)
        wait(f"step {args.fault_step} in TP2x{before}",
             lambda: any(s >= args.fault_step and before in lay
                         for s, lay in read_log(loss_log)), args.start_timeout)
        if case == "shrink":
            survivor, _ = chaos.leader_agent(endpoint, job_id)
            victim = next(n for n in nodes if n != survivor)
            killed = chaos.kill_process_tree(nodes[victim].pid)
            what = f"killed node {victim} ({len(killed)} processes): kill"
        else:
            survivor, what = "a", "node b started:   start"
            start("b")
        t0 = time.monotonic()
        first = None
        old_steps, old_at = -1, t0
        while time.monotonic() - t0 < args.cap:
            lines = read_log(loss_log)
            changed = [(s, lay) for s, lay in lines if after in lay]
            if changed:
                first = (time.monotonic() - t0, changed[0])
                break
            if len(lines) != old_steps:  # a step in the old layout: training still goes on
                old_steps, old_at = len(lines), time.monotonic()
            time.sleep(0.02)
        settle = time.monotonic() + 15  # the recovery's event comes once every rank resumed
        while True:
            kinds = [e["kind"] for e in read_events(tmp / f"run-{survivor}")]
            if {"recover_in_process", "restart"} & set(kinds) or time.monotonic() > settle:
                break
            time.sleep(0.1)
        how = (f"{kinds.count('recover_in_process')} in process, {kinds.count('restart')} "
               "restart")
        if first is None:
            return f"{case:6s} {mode:9s} {what}: no step within {args.cap:.0f} s ({how})"
        seconds, (step, layout) = first
        stall = "" if case == "shrink" else \
            f", {t0 + seconds - old_at:5.2f} s after the last step in the old layout"
        return (f"{case:6s} {mode:9s} {what} -> first step {seconds:6.2f} s{stall} (step "
                f"{step}, {layout}; {how})")
    finally:
        for proc in nodes.values():
            with contextlib.suppress(chaos.ChaosError):
                chaos.kill_process_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["shrink", "grow"],
                        choices=["shrink", "grow"])
    parser.add_argument("--modes", nargs="+", default=["restart", "inprocess"],
                        choices=["restart", "inprocess"])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--fault-step", type=int, default=8)
    parser.add_argument("--cap", type=float, default=90.0)
    parser.add_argument("--start-timeout", type=float, default=150.0)
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    print(f"# recovery shrink, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{len(os.sched_getaffinity(0))} CPUs, python {platform.python_version()}, CPU, gloo, "
          f"load average {os.getloadavg()[0]:.1f}, default rendezvous options")
    base = Path(tempfile.mkdtemp(prefix="recovery-shrink-etcd-"))
    (base / "data").mkdir(mode=0o700)
    server = EtcdServer(base / "data", base / "etcd.log")
    server.start()
    try:
        for run in range(args.runs):
            for case in args.cases:
                for mode in args.modes:
                    print(measure(case, mode, args, server.endpoint, run), flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
