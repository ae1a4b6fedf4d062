"""Several elasticft-run agents on one machine as separate nodes, rendezvousing through a real
etcd: a survivor going on alone, the blacklist, an etcd restart mid-run, a late node, an
unreachable etcd, and plain torchrun with the backend. A warm standby replacing a killed leader
is tested with the recovery faults (tests/recovery/test_faults.py)."""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticft.events import read_events
from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.membership import read_status
from tests.conftest import BIN, EXAMPLES
from tests.servers import EtcdServer

pytestmark = pytest.mark.slow
TRAIN = str(EXAMPLES / "train_plain.py")
# Small timeouts keep failover quick: a dead node is dropped after 1 s x 3 missed heartbeats.
FAST_RDZV = "join_timeout=90,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


class Node:
    """One elasticft-run agent (its own --node-id) with its workers."""

    def __init__(self, name: str, tmp: Path, process: subprocess.Popen[str], log: Path) -> None:
        self.name = name
        self.run_dir = tmp / f"run-{name}"
        self.process = process
        self.log = log

    def kill(self) -> float:
        """SIGKILLs the agent and its workers (each worker has its own session)."""
        agent = psutil.Process(self.process.pid)
        victims = [*agent.children(recursive=True), agent]
        killed_at = time.time()
        for proc in victims:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        return killed_at

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"node {self.name} did not finish in {timeout} s; log {self.log}:\n"
                        + self.output()[-3000:])

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def events(self, kind: str) -> list[dict[str, Any]]:
        if not self.run_dir.exists():
            return []
        return [e for e in read_events(self.run_dir) if e["kind"] == kind]


def start_node(
    name: str, tmp: Path, env: dict[str, str], endpoint: str, nnodes: str, job: str,
    train_args: list[str], rdzv_conf: str = FAST_RDZV, tool: str = "elasticft-run",
    nproc: int = 2, script: str = TRAIN, node_id: str | None = "",
) -> Node:
    """Starts one agent; elasticft-run gets ``--node-id name`` unless ``node_id`` says
    otherwise (None: no --node-id, the agent's default)."""
    log = tmp / f"{name}.log"
    args = [
        "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
        "--rdzv-conf", rdzv_conf, "--local-addr", "127.0.0.1", "--max-restarts", "3",
    ]
    if tool == "elasticft-run":
        args += ["--run-dir", str(tmp / f"run-{name}")]
        if node_id is not None:
            args += ["--node-id", node_id or name]
    else:  # not torchrun's default, a new /tmp/torchelastic_* that nobody removes
        args += ["--log-dir", str(tmp / f"logs-{name}")]
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(BIN / tool), *args, script, *train_args],
            env=env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )
    return Node(name, tmp, process, log)


def elasticft(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "elasticft"), *args], env=env, capture_output=True, text=True, timeout=60
    )


def job_status(endpoint: str, job: str, env: dict[str, str]) -> dict[str, Any]:
    """What `elasticft status --json` prints, read in-process (polling the CLI costs seconds)."""
    settings = EtcdSettings.from_conf(endpoint, {})
    client = LazyClient(settings)
    try:
        return read_status(client, Keys(settings.root, job), settings).to_json()
    finally:
        client.close()


def cli_status(endpoint: str, job: str, env: dict[str, str]) -> str:
    done = elasticft("status", "--rdzv-endpoint", endpoint, "--rdzv-id", job, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def wait_until(what: str, check: Callable[[], Any], timeout: float, nodes: list[Node]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        for node in nodes:
            if node.process.poll() is not None:
                pytest.fail(f"node {node.name} exited ({node.process.returncode}) while waiting "
                            f"for {what}:\n{node.output()[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def train_args(tmp: Path, steps: int, step_time: float = 0.25) -> list[str]:
    return ["--steps", str(steps), "--batch-size", "4", "--ckpt-dir", str(tmp / "ckpt"),
            "--ckpt-every", "5", "--step-time", str(step_time), "--loss-log", str(tmp / "loss.log")]


@pytest.mark.timeout(180)
def test_blacklisted_node_is_refused_with_the_reason_then_joins_after_remove(
    etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    endpoint = etcd_server.endpoint
    added = elasticft("blacklist", "add", "bad", "--reason", "GPU 3 ECC errors",
                      "--rdzv-endpoint", endpoint, env=job_env)
    assert added.returncode == 0, added.stderr
    listed = elasticft("blacklist", "list", "--rdzv-endpoint", endpoint, env=job_env)
    assert "bad: GPU 3 ECC errors" in listed.stdout

    # The verdict lives in etcd: it survives an etcd restart.
    etcd_server.restart()
    refused = start_node("bad", tmp_path, job_env, endpoint, "1", "bl-job",
                         train_args(tmp_path, steps=3, step_time=0))
    assert refused.wait(90) != 0
    out = refused.output()
    assert "node 'bad' is blacklisted: GPU 3 ECC errors" in out
    assert "Traceback" not in out
    assert not refused.events("workers_started")

    removed = elasticft("blacklist", "remove", "bad", "--rdzv-endpoint", endpoint, env=job_env)
    assert removed.returncode == 0, removed.stderr
    again = start_node("bad", tmp_path, job_env, endpoint, "1", "bl-job2",
                       train_args(tmp_path, steps=3, step_time=0))
    assert again.wait(120) == 0, again.output()[-3000:]


@pytest.mark.timeout(240)
def test_etcd_restart_mid_run_then_survivor_re_rendezvouses_alone(
    etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    endpoint, job = etcd_server.endpoint, "restart-job"
    args = train_args(tmp_path, steps=60, step_time=0.25)
    conf = FAST_RDZV.replace("keep_alive_max_attempt=3", "keep_alive_max_attempt=5")
    # One worker per node: 60 steps on 4 workers would not fit 2 cores within the timeout.
    a = start_node("a", tmp_path, job_env, endpoint, "1:2", job, args, rdzv_conf=conf, nproc=1)
    b = start_node("b", tmp_path, job_env, endpoint, "1:2", job, args, rdzv_conf=conf, nproc=1)

    def both_training() -> bool:
        return all(n.events("steady") for n in (a, b)) and all(
            n.events("rendezvous")[-1]["group_world_size"] == 2 for n in (a, b)
        )

    wait_until("both nodes training together", both_training, 120, [a, b])
    etcd_server.restart(down_s=1.0)
    time.sleep(3)  # training goes on across the outage
    assert a.process.poll() is None and b.process.poll() is None

    # The next rendezvous, after the restart, works: b dies and a goes on alone (--nnodes 1:2).
    killed_at = b.kill()
    assert a.wait(180) == 0, a.output()[-3000:]
    rounds = a.events("rendezvous")
    assert rounds[-1]["group_world_size"] == 1
    alone = [e for e in a.events("workers_started") if e["time"] > killed_at]
    print(f"\nMEASURED node loss with --nnodes 1:2: SIGKILL of b -> a's workers restarted alone "
          f"in {alone[0]['time'] - killed_at:.2f} s")
    assert "Traceback" not in "\n".join(
        line for line in a.output().splitlines() if not line.startswith("[default")
    )


# Runs train_plain.py, but a SIGTERM (the agent stopping its workers) takes 3 s to act on,
# longer than the 1 s last call: as a real job's workers do when they flush or save on exit.
SLOW_TO_STOP = f"""
import runpy, signal, sys, time
def stop(signum, frame):
    time.sleep(3)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
sys.argv[0] = {TRAIN!r}
runpy.run_path({TRAIN!r}, run_name="__main__")
"""


@pytest.mark.timeout(180)
def test_late_node_and_a_slow_to_stop_node_meet_in_one_round(
    etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    """a trains alone (--nnodes 1:2); b arrives, so a must stop its workers and join b's round.
    Stopping takes 3 s, longer than the last call: b's round waits for a instead of closing
    alone, which would make a a late joiner that stops b's round in turn, for ever."""
    endpoint, job = etcd_server.endpoint, "late-job"
    script = tmp_path / "slow_to_stop.py"
    script.write_text(SLOW_TO_STOP)
    args = train_args(tmp_path, steps=40, step_time=0.25)
    a = start_node("a", tmp_path, job_env, endpoint, "1:2", job, args, nproc=1,
                   script=str(script))
    wait_until("a training alone", lambda: a.events("steady"), 90, [a])
    b = start_node("b", tmp_path, job_env, endpoint, "1:2", job, args, nproc=1,
                   script=str(script))

    def together() -> bool:
        return all(n.events("rendezvous") and n.events("rendezvous")[-1]["group_world_size"] == 2
                   for n in (a, b))

    wait_until("a and b in one round", together, 60, [a, b])
    assert a.wait(120) == 0, a.output()[-3000:]
    assert b.wait(60) == 0, b.output()[-3000:]
    # a: round 0 alone, then one round with b; no rounds closed alone in between.
    why = "\n".join(f"--- {n.name}\n{n.output()[-4000:]}" for n in (a, b))
    assert [e["group_world_size"] for e in a.events("rendezvous")] == [1, 2], why
    assert [e["group_world_size"] for e in b.events("rendezvous")] == [2], why
    assert "keeps round 1 open: 1 live participant(s) of round 0 on their way" in b.output()


@pytest.mark.timeout(90)
def test_unreachable_etcd_is_a_one_line_error(job_env: dict[str, str], tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    node = start_node("lonely", tmp_path, job_env, f"127.0.0.1:{port}", "1", "nojob",
                      ["--steps", "1"], rdzv_conf="join_timeout=5")
    code = node.wait(60)
    out = node.output()
    assert code != 0
    # While it waits, it says so at once, with the deadline, so a mistyped endpoint is seen.
    assert re.search(rf"waiting for etcd at 127.0.0.1:{port} .*; giving up in [0-5] s", out), out
    assert f"cannot reach etcd at 127.0.0.1:{port} within" in out
    assert "Traceback" not in out


@pytest.mark.smoke
@pytest.mark.timeout(120)
def test_plain_torchrun_trains_with_etcd_v3(
    etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    node = start_node("t", tmp_path, job_env, etcd_server.endpoint, "1", "torchrun-job",
                      train_args(tmp_path, steps=3, step_time=0), tool="torchrun",
                      rdzv_conf=FAST_RDZV + ",node_id=t")
    assert node.wait(120) == 0, node.output()[-3000:]
    status = job_status(etcd_server.endpoint, "torchrun-job", job_env)
    assert status["round"]["world_size"] == 1 and status["round"]["leader"] == "t"


@pytest.mark.timeout(90)
def test_bad_rdzv_conf_is_a_usage_error(job_env: dict[str, str], tmp_path: Path) -> None:
    node = start_node("conf", tmp_path, job_env, "127.0.0.1:2379", "1", "conf-job",
                      ["--steps", "1"], rdzv_conf="protocol=https")
    assert node.wait(60) == 2
    out = node.output()
    assert "--rdzv-conf protocol=https needs ca_cert=PATH" in out and "Traceback" not in out
