"""In-process recovery across nodes with only the failed rank new (real etcd, two elasticft-run
agents as two nodes of 2 workers each, gloo): a worker of one node dies, every node hears of it
through the job's store at once, the nodes agree there on the next generation, and the dead
worker's node starts just its replacement. Every other worker, on both nodes, keeps its process
and the losses are an uninterrupted 4-worker run's, bit for bit (the DDP made again starts with
the buckets of the one before it: :mod:`elasticft.inprocess.ddp_buckets`); also when the dead
worker's sockets stay open (nothing raises in any survivor: only the news interrupts them). A
node lost with its agent sends the others to the next rendezvous round, which waits on a thread
while the agent watches its workers: a survivor killed there is replaced in that round."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from elasticft import chaos
from elasticft.events import read_events
from elasticft.report.status import recoveries
from elasticft.report.tor import analyze
from elasticft.steps import read_steps
from tests.cluster import Job, Losses, losses_of, reference_losses
from tests.conftest import BIN, EXAMPLES, clean_job_env, made_once, pids_by_rank
from tests.recovery.test_faults import (  # noqa: F401  (fixtures)
    LONG,
    STEPS,
    blacklist_of,
    make_job,
    quarantine_of,
    with_standby,
)
from tests.servers import EtcdServer

# Also on the second torch (scripts/compat.sh): there the reconfigure path, here a new group.
pytestmark = [pytest.mark.slow, pytest.mark.smoke]
INPROCESS = EXAMPLES / "train_inprocess.py"
FAILED_RANK = 3
"""A rank of the second node (group rank 1 holds ranks 2 and 3)."""
CRASH_AT = 6


def _first(reference: Losses, steps: int) -> Losses:
    return Losses({s: v for s, v in reference.values.items() if s <= steps},
                  {s: n for s, n in reference.logged.items() if s <= steps})


def _bit_exact(losses: Losses, reference: Losses, steps: int = STEPS) -> None:
    """Every step logged, each loss the uninterrupted run's, bit for bit."""
    reference = _first(reference, steps)
    assert losses.values == reference.values, (losses.values, reference.values)


@pytest.fixture(scope="session")
def reference4(tmp_path_factory: pytest.TempPathFactory) -> Losses:
    """An uninterrupted run of the in-process example on 4 workers (made once per test run),
    :data:`LONG` steps: a step's loss does not depend on ``--steps``, so its first N steps are an
    N-step run's (:func:`_first`)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_", "SLURM_"))}
    env["PYTHONUNBUFFERED"] = "1"

    def run() -> dict[str, dict[int, Any]]:
        losses = reference_losses(tmp_path_factory.mktemp("inprocess4"), env, INPROCESS, LONG,
                                  nproc=4)
        return {"values": losses.values, "logged": losses.logged}

    made = made_once(tmp_path_factory, "reference-inprocess-4", run)
    return Losses({int(s): v for s, v in made["values"].items()},
                  {int(s): n for s, n in made["logged"].items()})


def _run_with_crash(job: Job) -> tuple[str, str]:
    """Starts nodes a and b; returns (the failed rank's node, the other node)."""
    job.start("a")
    job.start("b")
    job.wait_for("a and b in one round", lambda: len(job.events("workers_started")) >= 2)
    failed = next(n for n, node in job.nodes.items()
                  if str(FAILED_RANK) in node.events("workers_started")[0]["pids"])
    return failed, next(n for n in job.nodes if n != failed)


def _check_only_the_failed_rank_replaced(job: Job, reference: Losses, pid_log: Path,
                                         failed: str, other: str) -> None:
    for name in ("a", "b"):
        code = job.nodes[name].wait(150)
        assert code == 0, f"node {name} exited {code}\n{job.outputs()}"
    losses = losses_of(job.loss_log)
    _bit_exact(losses, reference)
    assert losses.recomputed <= 1
    pids = pids_by_rank(pid_log)
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 1, 2: 1, 3: 2}, pids
    for name in (failed, other):
        node = job.nodes[name]
        assert not node.events("restart"), job.outputs()
        assert len(node.events("workers_started")) == 1, job.outputs()
        done = node.events("recover_in_process")
        assert len(done) == 1, job.outputs()
        assert "agree_s" in done[0]["phases"] and "rendezvous_s" not in done[0]["phases"]
        heard = node.events("failure_heard")
        assert len(heard) == 1, heard
        assert heard[0]["index"] == 0
    assert job.nodes[failed].events("recover_in_process")[0]["replaced"].keys() == {"3"}
    assert job.nodes[other].events("recover_in_process")[0]["replaced"] == {}
    assert [e["action"] for e in job.nodes[failed].events("decision")] == ["recover_in_process"]
    # Every node heard from the same node, the one that knew first.
    sources = {e["source"] for e in read_events(job.tmp) if e["kind"] == "failure_heard"}
    assert len(sources) == 1, sources
    report = subprocess.run([str(BIN / "elasticft"), "report", str(job.tmp)], env=job.env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "failure heard" in report.stdout, report.stdout


@pytest.mark.timeout(300)
def test_a_worker_killed_on_one_node_only_its_rank_gets_a_new_process(
        etcd_server: EtcdServer, make_job, reference4: Losses,  # noqa: F811
        tmp_path: Path) -> None:
    """With 4 ranks a gradient's sum depends on where it lies in DDP's buckets: the losses
    after the recovery are exact because the DDP made again starts with the rebuilt buckets of
    the one before it."""
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=STEPS, nproc_per_node=2,
                   extra_train=["--pid-log", str(pid_log), "--fault-rank", str(FAILED_RANK),
                                "--crash-at-step", str(CRASH_AT), "--crash-mode", "after-save"])
    failed, other = _run_with_crash(job)
    _check_only_the_failed_rank_replaced(job, reference4, pid_log, failed, other)


@pytest.mark.timeout(300)
def test_a_silent_death_on_one_node_is_heard_by_every_node(
        etcd_server: EtcdServer, make_job, reference4: Losses,  # noqa: F811
        tmp_path: Path) -> None:
    pid_log, keeper = tmp_path / "pids.log", tmp_path / "keeper.pid"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=STEPS, nproc_per_node=2,
                   extra_train=["--pid-log", str(pid_log), "--fault-rank", str(FAILED_RANK),
                                "--crash-at-step", str(CRASH_AT), "--crash-mode", "keep-sockets",
                                "--keeper-pid", str(keeper)])
    try:
        failed, other = _run_with_crash(job)
        _check_only_the_failed_rank_replaced(job, reference4, pid_log, failed, other)
        # Nothing raised in the other node's survivors: the news interrupted them.
        heard = job.nodes[other].events("failure_heard")[0]
        assert heard["source"] == failed, heard
    finally:
        if keeper.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(keeper.read_text()), signal.SIGKILL)


@pytest.mark.timeout(300)
def test_a_second_worker_killed_after_the_survivors_joined_is_replaced_too(
        etcd_server: EtcdServer, make_job, reference4: Losses,  # noqa: F811
        tmp_path: Path) -> None:
    """Rank 3 dies; as soon as the other node's workers joined the next generation, rank 1 (a
    survivor of the first recovery, on the other node) is SIGKILLed: it is replaced in a
    generation after it, with no restart."""
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=STEPS, nproc_per_node=2,
                   extra_train=["--pid-log", str(pid_log), "--fault-rank", str(FAILED_RANK),
                                "--crash-at-step", str(CRASH_AT), "--crash-mode",
                                "after-save"])
    failed, other = _run_with_crash(job)
    second = int(job.nodes[other].events("workers_started")[0]["pids"]["1"])
    joined = job.nodes[other].run_dir / "inprocess" / other / "joined-l1.json"

    def rank_1_joined() -> bool:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(joined.read_text()).get("generation") == 1
        return False

    job.wait_for("rank 1 in the next generation", rank_1_joined)
    os.kill(second, signal.SIGKILL)
    for name in ("a", "b"):
        code = job.nodes[name].wait(150)
        assert code == 0, f"node {name} exited {code}\n{job.outputs()}"
    _bit_exact(losses_of(job.loss_log), reference4)
    pids = pids_by_rank(pid_log)
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 2, 2: 1, 3: 2}, pids
    for name in (failed, other):
        node = job.nodes[name]
        assert not node.events("restart"), job.outputs()
        assert len(node.events("workers_started")) == 1, job.outputs()
        assert [e["index"] for e in node.events("failure_heard")] == [0, 1]
        assert node.events("recover_in_process"), job.outputs()
    replaced = {rank for e in read_events(job.tmp) if e["kind"] == "worker_replaced"
                for rank in e["replaced"]}
    assert replaced == {"1", "3"}, replaced


@pytest.mark.timeout(300)
def test_a_rank_whose_own_step_is_missing_is_not_given_its_replicas_random_state(
        etcd_server: EtcdServer, make_job, tmp_path: Path) -> None:  # noqa: F811
    """One worker per node, each rank's RNG seeded apart (nanoGPT's ``1337 + rank``) and drawn
    every step. Rank 1 is SIGKILLed after its step 6, before its save (once rank 0's save of
    step 6 is whole, so the failure cannot end it first): the newest step it holds
    is 5, while rank 0's step 6 (the same model and optimizer) is in the other node's memory,
    a replica the peer channel serves. Its RNG state is rank 0's though: restored as rank 1's,
    rank 1 would draw rank 0's numbers from then on. The losses are an uninterrupted run's."""
    noise = ("--rank-seeded-noise",)
    (tmp_path / "reference").mkdir()
    reference = reference_losses(tmp_path / "reference", clean_job_env(), INPROCESS, STEPS,
                                 extra_train=noise)
    job = make_job(etcd_server.endpoint, INPROCESS, steps=STEPS,
                   extra_train=[*noise, "--fault-rank", "1", "--crash-at-step", str(CRASH_AT),
                                "--crash-mode", "before-save-after-peers"])
    job.start("a")
    job.start("b")
    for name in ("a", "b"):
        code = job.nodes[name].wait(150)
        assert code == 0, f"node {name} exited {code}\n{job.outputs()}"
    _bit_exact(losses_of(job.loss_log), reference)
    said = [p for p in job.tmp.glob("run-*/logs/**/stderr.log")
            if "step 6 of rank 1 is only rank 0's replica" in p.read_text()]
    assert said, job.outputs()
    assert not any(node.events("restart") for node in job.nodes.values()), job.outputs()


@pytest.mark.timeout(300)
def test_a_lost_node_is_replaced_by_the_standby_and_the_other_nodes_workers_keep_theirs(
        etcd_server: EtcdServer, make_job, reference4: Losses,  # noqa: F811
        tmp_path: Path) -> None:
    """Node b's agent and workers SIGKILLed with a standby waiting: the survivor's 2 workers keep
    their processes and regroup with the standby's in the next round; the standby's workers,
    holding nothing, get the step from the survivor's node. The recovery is counted by
    ``elasticft status`` and ``elasticft report``."""
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=LONG, step_time=0.25,
                   nproc_per_node=2, extra_train=["--pid-log", str(pid_log)])
    standby = with_standby(job)
    survivor, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    lost = next(n for n in job.nodes if n not in (survivor, standby))
    chaos.kill_node(job.tmp, lost)
    for name in (survivor, standby):
        code = job.nodes[name].wait(180)
        assert code == 0, f"node {name} exited {code}\n{job.outputs()}"
    losses = losses_of(job.loss_log)
    _bit_exact(losses, reference4, LONG)
    assert losses.recomputed <= 1
    pids = pids_by_rank(pid_log)
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 1, 2: 2, 3: 2}, pids
    # The lost node was evicted by the leader and quarantined, not blacklisted.
    evictions = [e for e in job.events("eviction") if e["evicted"] == lost]
    assert evictions and evictions[0]["by"] == "leader", job.events("eviction")
    reason = quarantine_of(etcd_server.endpoint, job.job_id).get(lost, "")
    assert reason.startswith("node disappeared"), reason
    assert lost not in blacklist_of(etcd_server.endpoint)
    node = job.nodes[survivor]
    assert not node.events("restart"), job.outputs()
    assert len(node.events("workers_started")) == 1, job.outputs()
    assert [e["action"] for e in node.events("decision")] == ["recover_in_process"]
    done = node.events("recover_in_process")
    assert len(done) == 1 and done[0]["replaced"] == {}, job.outputs()
    assert {"detect_s", "abort_s", "regroup_s", "restore_s", "redo_s", "total_s",
            "agree_s", "rendezvous_s"} <= set(done[0]["phases"]), done[0]["phases"]
    assert "1 in-process recoveries in this process" in node.output()
    assert job.nodes[standby].events("workers_started")[-1]["world_size"] == 4
    # The standby's workers held nothing: the survivor's node served them the step from the
    # replica in its workers' memory, over the peer channel.
    restored = job.nodes[standby].events("restore")
    assert restored and restored[-1]["source"] in ("peer", "replica", "node"), restored
    # Counted by `elasticft status` and `elasticft report` over the job's run directories.
    found, restarts = recoveries(job.tmp)
    assert len(found) == 1 and restarts == 0
    analysis = analyze(read_events(job.tmp), read_steps(job.tmp))
    assert [f.action for f in analysis.faults] == ["recover_in_process"]
    assert analysis.faults[0].in_process == done[0]["phases"]


@pytest.mark.timeout(300)
def test_a_survivor_killed_while_the_next_round_waits_is_replaced_in_it(
        etcd_server: EtcdServer, make_job, reference4: Losses,  # noqa: F811
        tmp_path: Path) -> None:
    """Node b's agent and workers SIGKILLed with no standby: node a's agent waits in the next
    round with its workers running, watching them. Its rank 1 is SIGKILLed there: the agent
    sees it at once (``survivor_died_in_round``) and, when a node comes to the round, replaces
    just that rank in the round's generation; rank 0 keeps its process."""
    pid_log = tmp_path / "pids.log"
    job = make_job(etcd_server.endpoint, INPROCESS, steps=LONG, step_time=0.25,
                   nproc_per_node=2, extra_train=["--pid-log", str(pid_log)])
    job.start("a")
    job.start("b")
    job.wait_for("a and b in one round", lambda: len(job.events("workers_started")) >= 2)
    job.wait_step(CRASH_AT)
    survivor, _ = chaos.leader_agent(etcd_server.endpoint, job.job_id)
    lost = next(n for n in job.nodes if n != survivor)
    node = job.nodes[survivor]
    chaos.kill_node(job.tmp, lost)
    waiting = job.wait_for("the survivor's agent in the next round",
                           lambda: node.events("next_round"), timeout=60)[0]
    assert waiting["survivors"] == [0, 1] and waiting["limit_s"] > 0, waiting
    victim = int(node.events("workers_started")[0]["pids"]["1"])
    os.kill(victim, signal.SIGKILL)
    died = job.wait_for("its death seen while the round waits",
                        lambda: node.events("survivor_died_in_round"), timeout=30)[0]
    assert (died["rank"], died["pid"]) == (1, victim), died
    assert not node.events("rendezvous")[1:], "the round closed before a node came"
    job.start("c")
    for name in (survivor, "c"):
        code = job.nodes[name].wait(180)
        assert code == 0, f"node {name} exited {code}\n{job.outputs()}"
    _bit_exact(losses_of(job.loss_log), reference4, LONG)
    pids = pids_by_rank(pid_log)
    assert {r: len(p) for r, p in pids.items()} == {0: 1, 1: 2, 2: 2, 3: 2}, pids
    assert not node.events("restart"), job.outputs()
    assert len(node.events("workers_started")) == 1, job.outputs()
    done = node.events("recover_in_process")
    assert len(done) == 1 and done[0]["replaced"].keys() == {"1"}, job.outputs()
    assert "rendezvous_s" in done[0]["phases"], done[0]["phases"]
    assert done[0]["limits"] == {"rendezvous_s": waiting["limit_s"]}, done[0]
