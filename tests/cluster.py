"""A job of several elasticft-run agents as nodes on this machine, for the recovery tests and
the recovery benchmark: start nodes (optionally inside a network namespace), wait for training
progress, read the loss log, and clean up every process and namespace the test made."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES
from tests.servers import EtcdServer
from tests.tuned_run import tuned_run

API = EXAMPLES / "train_elasticft.py"
PLAIN = EXAMPLES / "train_plain.py"
# A dead node is dropped after 3 missed 1-second keep-alives; a round closes 1 s after the last
# join. Small values keep a failover to seconds.
FAST_RDZV = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
AGENT_FLAGS = [
    "--max-restarts", "3", "--monitor-interval", "0.1", "--shutdown-timeout", "5",
    "--hang-initial-timeout-s", "10", "--ckpt-persist-every", "2",
]
AGENT_TUNING = {"hang_collective_floor_s": 8, "hang_min_samples": 3}
"""Tuning constants (Python API only) the agents run with: a hang is learned from 3 steps."""


class Node:
    """One elasticft-run agent with its workers."""

    def __init__(self, name: str, run_dir: Path, process: subprocess.Popen[str], log: Path
                 ) -> None:
        self.name = name
        self.run_dir = run_dir
        self.process = process
        self.log = log

    def kill(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            agent = psutil.Process(self.process.pid)
            for proc in [*agent.children(recursive=True), agent]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGCONT)
                    proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"node {self.name} did not finish in {timeout} s:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        if not self.run_dir.exists():
            return []
        return [e for e in read_events(self.run_dir) if kind is None or e["kind"] == kind]


class Job:
    """Nodes of one job sharing a loss log and a checkpoint directory under ``tmp``."""

    def __init__(self, tmp: Path, env: dict[str, str], endpoint: str, job_id: str,
                 script: Path, steps: int, step_time: float = 0.15,
                 extra_agent: list[str] | None = None, extra_train: list[str] | None = None,
                 extra_tuning: dict[str, object] | None = None, nproc_per_node: int = 1
                 ) -> None:
        self.tmp = tmp
        # One thread per worker, as torchrun sets for several workers per node: the reference
        # runs 2 workers on one node, and thread counts change float reduction order.
        self.env = {**env, "OMP_NUM_THREADS": "1"}
        self.endpoint = endpoint
        self.job_id = job_id
        self.script = script
        self.steps = steps
        self.loss_log = tmp / "loss.log"
        self.train_args = ["--steps", str(steps), "--batch-size", "4", "--step-time",
                           str(step_time), "--loss-log", str(self.loss_log),
                           *(extra_train or [])]
        if script == PLAIN:
            self.train_args += ["--ckpt-dir", str(tmp / "plain-ckpt"), "--ckpt-every", "3"]
        self.extra_agent = extra_agent or []
        self.tuning = {**AGENT_TUNING, **(extra_tuning or {})}
        self.nodes: dict[str, Node] = {}
        self.nproc_per_node = nproc_per_node

    def start(self, name: str, nnodes: str = "2:2", local_addr: str = "127.0.0.1",
              prefix: list[str] | None = None, env: dict[str, str] | None = None,
              rdzv_conf: str = FAST_RDZV) -> Node:
        run_dir = self.tmp / f"run-{name}"
        log = self.tmp / f"{name}.log"
        cmd = [*(prefix or []), *tuned_run(self.tuning), "--nnodes", nnodes,
               "--nproc-per-node", str(self.nproc_per_node), "--rdzv-backend", "etcd-v3",
               "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id,
               "--rdzv-conf", rdzv_conf, "--local-addr", local_addr, "--node-id", name,
               "--run-dir", str(run_dir), *AGENT_FLAGS, *self.extra_agent,
               str(self.script), *self.train_args]
        with log.open("w") as out:
            process = subprocess.Popen(cmd, env={**self.env, **(env or {})}, cwd=self.tmp,
                                       stdout=out, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True)
        node = Node(name, run_dir, process, log)
        self.nodes[name] = node
        return node

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 120) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = check()
            if result:
                return result
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout} s waiting for {what}\n" + self.outputs())

    def last_step(self) -> int:
        losses = losses_of(self.loss_log)
        return max(losses.logged) if losses.logged else 0

    def wait_step(self, step: int, timeout: float = 150) -> None:
        self.wait_for(f"step {step} in the loss log", lambda: self.last_step() >= step, timeout)

    def outputs(self) -> str:
        return "\n".join(f"--- {n.name} ---\n{n.output()[-2500:]}" for n in self.nodes.values())

    def logged(self, text: str) -> bool:
        """Whether any node's whole output contains ``text``."""
        return any(text in n.output() for n in self.nodes.values())

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.tmp) if kind is None or e["kind"] == kind]

    def close(self) -> None:
        for node in self.nodes.values():
            if node.process.poll() is None:
                node.kill()


class Losses:
    """A loss log: the value each step ended with, and how often each step was logged."""

    def __init__(self, values: dict[int, str], logged: dict[int, int]) -> None:
        self.values = values
        self.logged = logged

    @property
    def recomputed(self) -> int:
        """Steps logged more than once: done before the fault and done again after it."""
        return sum(n - 1 for n in self.logged.values())


def losses_of(path: Path) -> Losses:
    values: dict[int, str] = {}
    logged: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 2:
                continue
            step = int(parts[0])
            values[step] = parts[1]  # a step redone after the fault overwrites its first try
            logged[step] = logged.get(step, 0) + 1
    return Losses(values, logged)


def reference_losses(tmp: Path, env: dict[str, str], script: Path, steps: int, nproc: int = 2,
                     extra_train: tuple[str, ...] = ()) -> Losses:
    """An uninterrupted run of ``script`` on ``nproc`` workers (the world size of the faulty
    runs), with the script's options ``extra_train`` besides the usual ones."""
    loss_log = tmp / "loss.log"
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--run-dir", str(tmp / "run"), str(script), "--steps", str(steps),
           "--batch-size", "4", "--loss-log", str(loss_log), *extra_train]
    if script == PLAIN:
        cmd += ["--ckpt-dir", str(tmp / "plain-ckpt"), "--ckpt-every", "3"]
    done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return losses_of(loss_log)


class VethEtcd(EtcdServer):
    """The test etcd, reachable on the host end of a veth pair (for a node in a namespace)."""

    def __init__(self, data_dir: Path, log_path: Path, host: str) -> None:
        super().__init__(data_dir, log_path)
        self.host = host

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def wait_ready(self, timeout_s: float) -> None:
        import pyetcd

        deadline = time.monotonic() + timeout_s
        while True:
            client = pyetcd.client(host=self.host, port=self.client_port, timeout=2)
            try:
                client.status()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"etcd not ready; see {self.log_path}") from None
                time.sleep(0.2)
            finally:
                client.close()


class NetNamespace:
    """A network namespace joined to the host by a veth pair on a private /30.

    Both addresses are local to this machine; the namespace, the pair and the addresses are
    removed by :meth:`close`. The name carries this process's pid and the subnet is one no link
    uses yet, so two suites on one host do not meet; what a SIGKILLed earlier run left (its pid
    is gone) is removed first, and never a live run's namespace.
    """

    PREFIX = "eftns"

    def __init__(self) -> None:
        self._sweep_dead()
        self.name = f"{self.PREFIX}{os.getpid()}"
        self.host_link = f"{self.name}-h"
        self.node_link = f"{self.name}-n"
        subnet = self._free_subnet()
        self.host_addr = f"{subnet}.1"
        self.node_addr = f"{subnet}.2"
        self.close()
        for cmd in (
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_link, "type", "veth", "peer", "name",
             self.node_link],
            ["ip", "link", "set", self.node_link, "netns", self.name],
            ["ip", "addr", "add", f"{self.host_addr}/30", "dev", self.host_link],
            ["ip", "link", "set", self.host_link, "up"],
            ["ip", "-n", self.name, "addr", "add", f"{self.node_addr}/30", "dev", self.node_link],
            ["ip", "-n", self.name, "link", "set", self.node_link, "up"],
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True)

    @classmethod
    def _sweep_dead(cls) -> None:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            name = line.split()[0] if line.split() else ""
            pid = name[len(cls.PREFIX):]
            if name.startswith(cls.PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                cls._remove(name)

    @staticmethod
    def _free_subnet() -> str:
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        start = os.getpid() % 250
        for i in range(250):
            subnet = f"10.213.{(start + i) % 250 + 1}"
            if f" {subnet}." not in used:
                return subnet
        raise RuntimeError("no free 10.213.x.0/30 subnet for a test namespace")

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def close(self) -> None:
        self._remove(self.name)

    @staticmethod
    def _remove(name: str) -> None:
        """Deletes namespace ``name`` and its host-side link, whatever of them exists."""
        subprocess.run(["ip", "link", "del", f"{name}-h"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
