"""What losing a whole node costs, with the rendezvous' default options, on a real etcd server.

A *node* is one agent and its workers on this machine (``--local-addr 127.0.0.1``, one etcd
server on loopback). Once training is past ``--fault-step`` and every node is in place, every
process of one participating node (not the leader, not a standby) is SIGKILLed at once, as when
a machine dies; the bench then follows the loss log (polled every 20 ms) and prints the seconds
from the kill to the first step logged by the job that goes on. A step logged within
:data:`IN_FLIGHT_S` of the kill is the one whose collective had already completed, not recovery.

Setups:

* ``standby``: ``--nnodes 2:2``, 1 worker per node, a third agent waiting as a standby
  (``examples/train_plain.py``). The standby takes the lost node's place.
* ``inprocess``: the ``standby`` setup with ``examples/train_inprocess.py`` (elasticft-run
  only): the survivor's worker keeps its process and regroups in the new round.
* ``shrink``: ``--nnodes 1:2``, 2 workers per node, no standby. elasticft-run trains
  ``examples/train_3d.py`` with ``--layout 2,1,*`` (TP2 x DP2): the survivor re-plans
  TP2 x DP1 with gradient accumulation 2 and resumes from its DCP checkpoint. torchrun has no
  planner, so it trains the plain script over the nodes that remain.

Launchers: ``elasticft`` (``elasticft-run``, ``--rdzv-backend etcd-v3``, default options) and
``torchrun`` (torch's ``c10d`` rendezvous, its store hosted by the first agent, which is never
the one killed: losing it ends a torchrun job). Each run is given up ``--cap`` seconds after
the kill.

    .venv/bin/python bench/node_loss.py                       # both setups, both launchers
    .venv/bin/python bench/node_loss.py --setups standby --launchers elasticft
    .venv/bin/python bench/node_loss.py --setups standby inprocess --launchers elasticft
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)

from elasticft import chaos  # noqa: E402
from elasticft.events import read_events  # noqa: E402
from tests.servers import EtcdServer  # noqa: E402

BIN = Path(sys.executable).parent
PLAIN = ROOT / "examples" / "train_plain.py"
THREE_D = ROOT / "examples" / "train_3d.py"
INPROCESS = ROOT / "examples" / "train_inprocess.py"
IN_FLIGHT_S = 0.5
"""A step logged this soon after the kill was already in flight."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_log(path: Path) -> list[tuple[int, str]]:
    """(step, layout) per logged line; the layout of train_3d's JSON lines, else ''."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError, KeyError):
                data = json.loads(line)
                found.append((int(data["step"]),
                              f"TP{data['tp']}xDP{data['dp']} accum {data['grad_accum']}"))
        elif len(line.split()) == 2:
            found.append((int(line.split()[0]), ""))
    return found


class Run:
    """The nodes of one launcher and setup, under ``tmp``."""

    def __init__(self, launcher: str, setup: str, tmp: Path, endpoint: str, steps: int) -> None:
        self.launcher, self.setup, self.tmp, self.steps = launcher, setup, tmp, steps
        self.endpoint = endpoint if launcher == "elasticft" else f"127.0.0.1:{free_port()}"
        self.loss_log = tmp / "loss.log"
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}
        self.env = clean_job_env()
        # One job per setup: the etcd server is shared, and an earlier setup's lost node stays
        # quarantined in its job.
        self.job_id = f"node-loss-{launcher}-{setup}"

    def command(self, name: str) -> list[str]:
        standby = self.setup in ("standby", "inprocess")
        nnodes, nproc = ("2:2", "1") if standby else ("1:2", "2")
        three_d = self.launcher == "elasticft" and not standby
        script = THREE_D if three_d else INPROCESS if self.setup == "inprocess" else PLAIN
        train = ["--steps", str(self.steps), "--loss-log", str(self.loss_log)]
        if script is not INPROCESS:  # its checkpoints are elasticft's
            train += ["--ckpt-dir", str(self.tmp / "ckpt"), "--ckpt-every", "2"]
        train += (["--step-sleep", "0.1"] if three_d else
                  ["--step-time", "0.1", "--batch-size", "4"])
        common = ["--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-id", self.job_id,
                  "--rdzv-endpoint", self.endpoint, "--max-restarts", "3",
                  "--local-addr", "127.0.0.1"]
        if self.launcher == "elasticft":
            return [str(BIN / "elasticft-run"), *common, "--rdzv-backend", "etcd-v3",
                    "--node-id", name, "--run-dir", str(self.tmp / f"run-{name}"),
                    *(["--layout", "2,1,*"] if three_d else []), str(script), *train]
        return [str(BIN / "torchrun"), *common, "--rdzv-backend", "c10d",
                "--log-dir", str(self.tmp / f"logs-{name}"), str(script), *train]

    def start(self, name: str) -> None:
        with (self.tmp / f"{name}.log").open("w") as out:
            self.nodes[name] = subprocess.Popen(
                self.command(name), env=self.env, cwd=self.tmp, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)

    def started_workers(self) -> set[str]:
        """(elasticft) The nodes whose workers have started."""
        return {e["node"] for e in read_events(self.tmp) if e["kind"] == "workers_started"}

    def victim(self) -> str:
        """A participating node that is neither the leader (elasticft) nor the store's host
        (torchrun: the first node), and not the standby."""
        if self.launcher == "torchrun":
            return "b"
        leader, _ = chaos.leader_agent(self.endpoint, self.job_id)
        return next(n for n in sorted(self.started_workers()) if n != leader)

    def close(self) -> None:
        for proc in self.nodes.values():
            with contextlib.suppress(chaos.ChaosError):
                chaos.kill_process_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


def wait(what: str, check, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def measure(launcher: str, setup: str, args: argparse.Namespace, endpoint: str) -> str:
    tmp = Path(tempfile.mkdtemp(prefix=f"node-loss-{launcher}-{setup}-"))
    run = Run(launcher, setup, tmp, endpoint, args.steps)
    names = ("a", "b") if setup == "shrink" else ("a", "b", "c")
    try:
        for name in names:
            run.start(name)
            if launcher == "torchrun" and name == "a":
                time.sleep(2.0)  # the first node hosts the c10d store
        wait(f"step {args.fault_step}", lambda: len(read_log(run.loss_log)) >= args.fault_step,
             args.start_timeout)
        if launcher == "elasticft":
            wait("two nodes training", lambda: len(run.started_workers()) >= 2, 30)
        time.sleep(args.settle)  # a standby in place, steady steps
        victim = run.victim()
        logged = len(read_log(run.loss_log))
        killed = chaos.kill_process_tree(run.nodes[victim].pid)
        t0 = time.monotonic()
        first = None
        while time.monotonic() - t0 < args.cap:
            lines = read_log(run.loss_log)
            now = time.monotonic()
            if now - t0 < IN_FLIGHT_S:
                logged = len(lines)  # the step in flight at the kill is not recovery
            elif len(lines) > logged:
                first = (now - t0, lines[logged])
                break
            time.sleep(0.02)
        killed_text = f"node {victim} ({len(killed)} processes)"
        if first is None:
            return (f"{launcher:9s} {setup:9s} killed {killed_text}: no step within "
                    f"{args.cap:.0f} s")
        seconds, (step, layout) = first
        return (f"{launcher:9s} {setup:9s} killed {killed_text}: kill -> first step "
                f"{seconds:6.2f} s (step {step}{', ' + layout if layout else ''})")
    finally:
        run.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=["standby", "shrink"],
                        choices=["standby", "inprocess", "shrink"])
    parser.add_argument("--launchers", nargs="+", default=["elasticft", "torchrun"],
                        choices=["elasticft", "torchrun"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--fault-step", type=int, default=8)
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds between --fault-step and the kill")
    parser.add_argument("--cap", type=float, default=90.0)
    parser.add_argument("--start-timeout", type=float, default=150.0)
    parser.add_argument("--keep", action="store_true", help="keep the runs' directories")
    args = parser.parse_args()
    print(f"# node loss, {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
          f"{len(os.sched_getaffinity(0))} CPUs, python "
          f"{platform.python_version()}, default rendezvous options")
    base = Path(tempfile.mkdtemp(prefix="node-loss-etcd-"))
    (base / "data").mkdir(mode=0o700)
    server = EtcdServer(base / "data", base / "etcd.log")
    server.start()
    try:
        for setup in args.setups:
            for launcher in args.launchers:
                if setup == "inprocess" and launcher == "torchrun":
                    continue  # torchrun has no in-process recovery: its standby row holds
                print(measure(launcher, setup, args, server.endpoint), flush=True)
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
