"""A real two-node Slurm cluster for tests: munged, slurmctld and a slurmd per node, as root.

Everything lives in a temporary directory: a generated munge key and socket, slurm.conf and
cgroup.conf, state and spool directories, logs. The daemons listen on free loopback ports, so
the cluster never touches the machine's own Slurm or munge. Both nodes are this host (a slurmd
each, on ports of their own): a job of one node runs on either, a job of two on both. Client
commands reach it through ``SLURM_CONF`` (see :meth:`SlurmCluster.env`). Teardown stops the
daemons by their pids.

The binaries come from Debian's ``slurm-wlm`` and ``munge`` packages; when they are missing
the fixture fails with the install command instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port

REQUIRED = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "sinfo")
NODES = ("eftest1", "eftest2")
PARTITION = "debug"


class SlurmCluster:
    """One controller and two compute nodes on 127.0.0.1, configured in ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctld_port = free_port()
        self.slurmd_ports = {node: free_port() for node in NODES}

    # ------------------------------------------------------------------------------------------

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(base if base is not None else os.environ)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(
            cmd, env=self.env(), capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr}")
        return done.stdout

    def job_field(self, job_id: str, field: str) -> str | None:
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        for token in out.split():
            key, _, value = token.partition("=")
            if key == field:
                return value
        return None

    def wait_job(self, job_id: str, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(1.0)
        raise AssertionError(
            f"job {job_id}: {what} did not happen within {timeout:g} s; "
            f"job: {self.run('scontrol', '-o', 'show', 'job', job_id, check=False)}\n"
            f"slurmctld log tail: {self.log_tail('slurmctld.log')}"
        )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / "log" / name
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    # ------------------------------------------------------------------------------------------

    def write_config(self) -> None:
        r = self.root
        for sub in ("munge", "state", "spool", "log", "run"):
            (r / sub).mkdir(mode=0o700, exist_ok=True)
        (r / "plugstack.conf").write_text("")
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=elasticfttest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={self.ctld_port}",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # A requeued job may start again only after its credential expires
                    # (default 120 s); keep that short for the tests.
                    f"AuthInfo=socket={self.munge_socket},cred_expire=10",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool' / '%n'}",
                    f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'run' / 'slurmd-%n.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
                    f"PlugStackConfig={r / 'plugstack.conf'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "SchedulerType=sched/builtin",
                    # Pending jobs are otherwise looked at every 60 s: a requeued job whose
                    # credential expired would wait up to a minute for its next start.
                    "SchedulerParameters=sched_interval=1",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "KillWait=10",
                    "MinJobAge=600",
                    "InactiveLimit=0",
                    "SlurmdTimeout=60",
                    "MessageTimeout=20",
                    *(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 "
                      f"Port={port} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                      for node, port in self.slurmd_ports.items()),
                    f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES "
                    "MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self) -> None:
        self.write_config()
        key = self.root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True,
                       capture_output=True)
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            ["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
             f"--key-file={key}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
             f"--log-file={self.root / 'log' / 'munged.log'}",
             f"--seed-file={self.root / 'munge' / 'seed'}"],
        )
        self._wait(lambda: self.munge_socket.exists(), 20, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self._ok("scontrol", "ping"), 60, "slurmctld to answer ping")
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, 90, f"nodes {', '.join(NODES)} to become idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "w")  # noqa: SIM115 - kept for the daemon
        self.procs[name] = subprocess.Popen(
            cmd, env=self.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def _ok(self, *cmd: str) -> bool:
        try:
            return subprocess.run(cmd, env=self.env(), capture_output=True,
                                  timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _nodes_idle(self) -> bool:
        try:
            out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False)
        except subprocess.TimeoutExpired:
            return False
        return out.split() == ["idle"] * len(NODES)

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}: "
                        f"{(self.root / 'log' / (name + '.out')).read_text(errors='replace')}"
                        f"\n{self.log_tail(name + '.log')}"
                    )
            if predicate():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}; "
                           f"slurmctld log: {self.log_tail('slurmctld.log')}\n"
                           f"slurmd log: {self.log_tail(f'slurmd-{NODES[0]}.log')}")

    def stop(self) -> None:
        # Cancel what is left so slurmd does not leave job processes behind, then stop the
        # daemons in reverse order of start.
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self._ok("scancel", "--full", f"--partition={PARTITION}")
        for name in (*(f"slurmd-{node}" for node in NODES), "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def missing_binaries() -> list[str]:
    return [b for b in REQUIRED if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    if missing:
        pytest.fail(
            f"Slurm test cluster needs {', '.join(missing)}; install them with "
            "`apt-get install -y slurm-wlm munge` (the suite's setup script does)",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail("the Slurm test cluster starts slurmd, which must run as root", pytrace=False)
    root = tmp_path_factory.mktemp("slurm")
    os.chmod(root, 0o755)
    cluster = SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
