"""A node lost with no standby, TP2 x DP2 on 4 ranks shrinking to TP2 x DP1 (gradient
accumulation 2): kill -> first step, in process against the restart mode, on a real etcd server.

Two ``elasticft-run`` agents on this machine are two nodes of two workers each (``--nnodes
1:2``, ``--local-addr 127.0.0.1``), training ``examples/train_3d.py`` with the planner
(``--plan-model examples/train_3d_model.json --layout 2,1,*``). Once training is past
``--fault-step``, every process of the node that does not lead the rendezvous is SIGKILLed at
once; the bench follows the loss log (polled every 20 ms) and prints the seconds from the kill
to the first step logged in the new layout.

* ``restart``: DCP checkpoints every step (``--ckpt-dir``); the survivor's agent restarts its
  workers in TP2 x DP1, which load the newest checkpoint into the new mesh.
* ``inprocess``: ``--inprocess`` (snapshots of every step in the agent's memory); the
  survivor's workers keep their processes, regroup in the new round, take the new layout in
  place and restore the newest step they hold from memory.

    .venv/bin/python bench/recovery_shrink.py                      # both modes, one run each
    .venv/bin/python bench/recovery_shrink.py --modes inprocess --runs 3
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


def measure(mode: str, args: argparse.Namespace, endpoint: str, run: int) -> str:
    tmp = Path(tempfile.mkdtemp(prefix=f"recovery-shrink-{mode}-"))
    job_id = f"shrink-{mode}-{run}"
    loss_log = tmp / "loss.log"
    train = ["--steps", str(args.steps), "--loss-log", str(loss_log), "--step-sleep", "0.1"]
    train += ["--inprocess"] if mode == "inprocess" else ["--ckpt-dir", str(tmp / "ckpt")]
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    env = {**clean_job_env(), "OMP_NUM_THREADS": "1"}
    try:
        for name in ("a", "b"):
            cmd = [str(BIN / "elasticft-run"), "--nnodes", "1:2", "--nproc-per-node", "2",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", job_id,
                   "--local-addr", "127.0.0.1", "--node-id", name, "--run-dir",
                   str(tmp / f"run-{name}"), "--max-restarts", "3", "--ckpt-persist-every",
                   "0", *PLAN, str(THREE_D), *train]
            with (tmp / f"{name}.log").open("w") as out:
                nodes[name] = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True)
        wait(f"step {args.fault_step} in TP2xDP2",
             lambda: any(s >= args.fault_step and "DP2" in lay for s, lay in read_log(loss_log)),
             args.start_timeout)
        leader, _ = chaos.leader_agent(endpoint, job_id)
        victim = next(n for n in nodes if n != leader)
        killed = chaos.kill_process_tree(nodes[victim].pid)
        t0 = time.monotonic()
        first = None
        while time.monotonic() - t0 < args.cap:
            shrunk = [(s, lay) for s, lay in read_log(loss_log) if "DP1" in lay]
            if shrunk:
                first = (time.monotonic() - t0, shrunk[0])
                break
            time.sleep(0.02)
        events = read_events(tmp / f"run-{leader}")
        kinds = [e["kind"] for e in events]
        how = (f"{kinds.count('recover_in_process')} in process, {kinds.count('restart')} "
               "restart")
        if first is None:
            return f"{mode:9s} killed node {victim}: no step within {args.cap:.0f} s ({how})"
        seconds, (step, layout) = first
        return (f"{mode:9s} killed node {victim} ({len(killed)} processes): kill -> first step "
                f"{seconds:6.2f} s (step {step}, {layout}; {how})")
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
            for mode in args.modes:
                print(measure(mode, args, server.endpoint, run), flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
