"""Several agents of one job on one host with default options, through a real etcd: each
claims a name of its own (the host name, then ``<host>-2``, ``<host>-3``), so they meet in one
round, train, recover from a SIGKILLed worker and a SIGKILLed agent, under elasticft-run and
plain torchrun alike; two agents given the same --node-id are refused with one line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticft.rendezvous.identity import claim_node_id
from tests.rendezvous.test_rdzv_multinode import (
    FAST_RDZV,
    Node,
    job_status,
    start_node,
    train_args,
    wait_until,
)
from tests.servers import EtcdServer

HOST = socket.gethostname()


def _claim_in_child(run_id: str, explicit: str | None, endpoint: str = ""
                    ) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        from elasticft.rendezvous.identity import claim_node_id
        try:
            print(claim_node_id({run_id!r}, {explicit!r}, endpoint={endpoint!r}).node_id)
        except ValueError as e:
            print("refused:", e)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)


@pytest.mark.parametrize(("held", "explicit", "expected"), [
    ((), None, HOST),
    ((None,), None, f"{HOST}-2"),
    ((None, None), None, f"{HOST}-3"),
    (("a",), "b", "b"),
    (("a",), None, HOST),
])
def test_a_second_process_gets_the_next_free_name(
    held: tuple[str | None, ...], explicit: str | None, expected: str
) -> None:
    run_id = f"claims-{len(held)}-{explicit}-{expected}"
    claims = []
    for name in held:
        # Each default claim in this process must get a name of its own: claim from children.
        if name is None:
            claims.append(_claim_in_child_holding(run_id))
        else:
            claims.append(claim_node_id(run_id, name))
    try:
        assert _claim_in_child(run_id, explicit).stdout.strip() == expected
    finally:
        for claim in claims:
            if isinstance(claim, subprocess.Popen):
                claim.kill()
                claim.wait()
            else:
                claim.release()


def _claim_in_child_holding(run_id: str) -> subprocess.Popen[str]:
    """A child that claims a default name and holds it until killed."""
    code = textwrap.dedent(f"""
        import sys, time
        from elasticft.rendezvous.identity import claim_node_id
        claim = claim_node_id({run_id!r})
        print(claim.node_id, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    child.stdout.readline()  # the name is held once it is printed
    return child


def test_a_claim_is_the_same_name_again_in_its_own_process_and_free_after_release() -> None:
    first = claim_node_id("again")
    assert claim_node_id("again").node_id == first.node_id == HOST
    assert claim_node_id("again", HOST).node_id == HOST
    assert _claim_in_child("again", None).stdout.strip() == f"{HOST}-2"
    first.release()
    assert _claim_in_child("again", None).stdout.strip() == HOST


def test_one_job_id_at_two_rendezvous_endpoints_is_two_jobs() -> None:
    held = claim_node_id("shared-id", "x", endpoint="etcd-a:2379")
    try:
        assert _claim_in_child("shared-id", "x", "etcd-b:2379").stdout.strip() == "x"
        assert _claim_in_child("shared-id", "x", "etcd-a:2379").stdout.startswith("refused:")
    finally:
        held.release()


def test_an_explicit_duplicate_on_this_host_is_refused_naming_both_processes() -> None:
    held = claim_node_id("dup", "trainer")
    try:
        out = _claim_in_child("dup", "trainer").stdout
    finally:
        held.release()
    assert out.startswith("refused: node id 'trainer' of job 'dup' is already taken"), out
    assert f"({HOST}, pid {os.getpid()})" in out
    assert "give each agent its own --node-id" in out


def _worker_pid(node: Node, tool: str) -> int | None:
    """A running worker of ``node``: from its events under elasticft-run (a warm spare
    interpreter runs the same command line), else the agent's child that has a RANK."""
    if tool == "elasticft-run":
        started = node.events("workers_started")
        return next(iter(started[-1]["pids"].values())) if started else None
    for child in psutil.Process(node.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "RANK" in child.environ():
                return child.pid
    return None


def _kill_one_worker(node: Node, nodes: list[Node], tool: str) -> None:
    pid = wait_until("a worker to kill", lambda: _worker_pid(node, tool), 60, nodes)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _loss_lines(tmp: Path) -> int:
    log = tmp / "loss.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tool", ["elasticft-run", "torchrun"])
def test_three_agents_on_one_host_with_default_ids_train_and_recover(
    tool: str, etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    endpoint, job = etcd_server.endpoint, f"one-host-{tool}"
    args = train_args(tmp_path, steps=40, step_time=0.25)
    nodes = [start_node(f"agent{i}", tmp_path, job_env, endpoint, "2:3", job, args, tool=tool,
                        node_id=None, nproc=1, rdzv_conf=FAST_RDZV) for i in range(3)]
    try:
        _train_and_recover(tool, nodes, endpoint, job, job_env, tmp_path)
    finally:
        for node in nodes:
            if node.process.poll() is None:
                node.kill()


def _train_and_recover(tool: str, nodes: list[Node], endpoint: str, job: str,
                       job_env: dict[str, str], tmp_path: Path) -> None:

    def full() -> dict[str, Any] | None:
        s = job_status(endpoint, job, job_env)
        return s if s["round"] and len(s["participants"]) == 3 else None

    first = wait_until("one round of 3 agents", full, 120, nodes)
    assert {m["node_id"] for m in first["participants"]} == {HOST, f"{HOST}-2", f"{HOST}-3"}

    # A SIGKILLed worker: the job goes on (restart in place or a new round of all three).
    _kill_one_worker(nodes[0], nodes, tool)

    def restarted() -> bool:
        s = job_status(endpoint, job, job_env)
        return bool(s["round"]) and len(s["participants"]) == 3 and (
            (tool == "torchrun" and s["round"]["round"] > first["round"]["round"])
            or (tool == "elasticft-run" and bool(nodes[0].events("restart"))))

    wait_until("recovery from the killed worker", restarted, 120, nodes)
    # Training again (not still starting its process group) before the next fault.
    lines = _loss_lines(tmp_path)
    wait_until("steps after the recovery", lambda: _loss_lines(tmp_path) > lines + 2, 120, nodes)

    # A SIGKILLed agent: the other two go on in a round of two and finish the job.
    gone = nodes[2]
    gone.kill()
    survivors = nodes[:2]

    def round_of_two() -> dict[str, Any] | None:
        s = job_status(endpoint, job, job_env)
        ok = s["round"] and s["round"]["world_size"] == 2 and len(s["participants"]) == 2
        return s if ok else None

    wait_until("a round of the two survivors", round_of_two, 120, survivors)
    for node in survivors:
        assert node.wait(180) == 0, node.output()[-3000:]
    last_step = int((tmp_path / "loss.log").read_text().split()[-2])
    assert last_step == 40


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_agents_given_the_same_node_id_the_second_is_refused_in_one_line(
    etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path
) -> None:
    endpoint, job = etcd_server.endpoint, "same-id"
    args = train_args(tmp_path, steps=200, step_time=0.25)
    first = start_node("first", tmp_path, job_env, endpoint, "2", job, args, node_id="twin",
                       nproc=1)
    try:
        wait_until("the first agent in etcd",
                   lambda: job_status(endpoint, job, job_env)["joining"], 60, [first])
        second = start_node("second", tmp_path, job_env, endpoint, "2", job, args,
                            node_id="twin", nproc=1)
        assert second.wait(60) == 2
        out = second.output()
        assert f"node id 'twin' of job '{job}' is already taken by a live agent on this host " \
               f"({HOST}, pid {first.process.pid})" in out, out
        assert "give each agent its own --node-id" in out and "Traceback" not in out
        assert first.process.poll() is None, "the agent that holds the id goes on"
    finally:
        first.kill()
