"""A node lost with no standby, end to end (real etcd, two ``elasticft-run`` agents as nodes of
two gloo workers each, ``examples/train_3d.py --inprocess``): TP2 x DP2 on 4 ranks, one node
SIGKILLed with its agent and workers.

* In process: the surviving node's two workers (one whole TP group, so a whole DP replica)
  keep their processes, renumber (the leader is the node killed, so ranks 2 and 3 become 0 and
  1), regroup in the new round, take the planner's TP2 x DP1 with gradient accumulation 2, and
  go on from the newest step they hold in memory. Their losses are those of a reference run
  that restarts into TP2 x DP1 (accumulation 2) from that step's DCP checkpoint.
* Restart, with the reason in the event log: the same loss under FSDP2 (``--fsdp``), whose
  state is sharded over DP, so the lost replica's shards are held by no survivor.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticft import chaos
from elasticft.events import read_events
from tests.cluster import FAST_RDZV
from tests.conftest import BIN, EXAMPLES, pids_by_rank, wait_or_explain
from tests.servers import EtcdServer

pytestmark = pytest.mark.slow
TRAINER = EXAMPLES / "train_3d.py"
PLAN = ["--plan-model", str(EXAMPLES / "train_3d_model.json"), "--plan-hardware", "cpu",
        "--layout", "2,1,*"]
STEPS = 8
KILL_AFTER = 3
GROW_STEPS = 40
"""Long enough for the second node's agent to start and ask to join before the first ends, on
a loaded machine too (24 steps left a margin of 0.2 s once)."""


def _losses(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pids(path: Path) -> dict[int, list[int]]:
    return pids_by_rank(path) if path.exists() else {}


def _final(path: Path) -> dict[int, dict[str, Any]]:
    return {e["step"]: e for e in _losses(path)}  # a redone step's last entry counts


class TwoNodes:
    """Two agents as nodes of one job, two workers each."""

    def __init__(self, tmp: Path, env: dict[str, str], endpoint: str, *train: str,
                 steps: int = STEPS) -> None:
        self.tmp, self.env, self.endpoint = tmp, {**env, "OMP_NUM_THREADS": "1"}, endpoint
        self.loss_log, self.pid_log = tmp / "loss.jsonl", tmp / "pids.log"
        self.train = [str(TRAINER), "--inprocess", "--steps", str(steps), "--step-sleep",
                      "0.3", "--loss-log", str(self.loss_log), "--pid-log", str(self.pid_log),
                      *train]
        self.agents: dict[str, subprocess.Popen[str]] = {}

    def start(self, name: str) -> None:
        cmd = [str(BIN / "elasticft-run"), "--nnodes", "1:2", "--nproc-per-node", "2",
               "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", self.endpoint,
               "--rdzv-id", "shrink", "--rdzv-conf", FAST_RDZV, "--local-addr", "127.0.0.1",
               "--node-id", name, "--run-dir", str(self.tmp / f"run-{name}"),
               "--max-restarts", "3", "--monitor-interval", "0.1", "--ckpt-persist-every",
               "0", *PLAN, *self.train]
        with (self.tmp / f"{name}.log").open("w") as out:
            self.agents[name] = subprocess.Popen(cmd, env=self.env, cwd=self.tmp, stdout=out,
                                                 stderr=subprocess.STDOUT, text=True,
                                                 start_new_session=True)

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.output(n)[-3000:]}" for n in self.agents)

    def events(self, name: str, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.tmp / f"run-{name}") if e["kind"] == kind]

    def kill_leader(self) -> tuple[str, str]:
        """SIGKILLs the rendezvous leader's node, its agent and workers; returns (lost,
        survivor)."""
        lost, _ = chaos.leader_agent(self.endpoint, "shrink")
        agent = psutil.Process(self.agents[lost].pid)
        for proc in [*agent.children(recursive=True), agent]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        self.agents[lost].wait(30)
        return lost, next(n for n in self.agents if n != lost)

    def close(self) -> None:
        for proc in self.agents.values():
            if proc.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    for child in psutil.Process(proc.pid).children(recursive=True):
                        child.kill()
                proc.kill()
                proc.wait()


def _run_to_node_loss(job: TwoNodes) -> tuple[str, dict[int, list[int]]]:
    """Both nodes train TP2 x DP2 to step KILL_AFTER; the leader's node is then killed and the
    survivor runs to the end. Returns the survivor's name and the pids by rank before the
    loss."""
    job.start("a")
    job.start("b")
    deadline = time.monotonic() + 150
    while not (any(e["step"] >= KILL_AFTER for e in _losses(job.loss_log))
               and len(_pids(job.pid_log)) == 4):  # each rank writes its own line
        assert time.monotonic() < deadline, job.outputs()
        assert all(p.poll() is None for p in job.agents.values()), job.outputs()
        time.sleep(0.1)
    before = pids_by_rank(job.pid_log)
    _, survivor = job.kill_leader()
    code = wait_or_explain(job.agents[survivor], 240, job.outputs)
    assert code == 0, job.outputs()
    return survivor, before


def _launch(tmp: Path, env: dict[str, str], nproc: int, name: str, *train: str) -> str:
    cmd = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
           "--run-dir", str(tmp / f"run-{name}"), *PLAN, str(TRAINER), *train]
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def _reference_losses(tmp: Path, env: dict[str, str], nproc: tuple[int, int], steps: int,
                      start: int) -> dict[int, float]:
    """The reference's losses, run once the step the elastic job resumed from is known: the
    layout before the change on one node (``nproc[0]`` ranks) to ``start``, with a DCP checkpoint
    of that step, then a restart on ``nproc[1]`` ranks (the layout after the change) from it to
    ``steps``. A step's loss does not depend on ``--steps`` (a constant learning rate, each
    step's batch seeded by the step), so the first part stops at ``start`` and saves only it."""
    ckpt, ref_log, restart_log = tmp / "ref-ckpt", tmp / "ref.jsonl", tmp / "restart.jsonl"
    _launch(tmp, env, nproc[0], "ref", "--steps", str(start), "--ckpt-dir", str(ckpt),
            "--ckpt-every", str(start), "--loss-log", str(ref_log))
    _launch(tmp, env, nproc[1], "restart", "--steps", str(steps), "--ckpt-dir", str(ckpt),
            "--ckpt-every", str(steps), "--loss-log", str(restart_log))
    want = {s: e["loss"] for s, e in _final(ref_log).items()}
    want.update({s: e["loss"] for s, e in _final(restart_log).items()})
    return want


def _assert_losses(job: TwoNodes, steps: int, start: int, layout: tuple[int, int, int],
                   want: dict[int, float]) -> None:
    """Every step has a loss, those after ``start`` trained in ``layout`` (TP, DP, accumulation),
    with the reference's losses, bitwise (JSON keeps a float exact)."""
    got = _final(job.loss_log)
    assert sorted(got) == list(range(1, steps + 1))
    assert {(e["tp"], e["dp"], e["grad_accum"]) for s, e in got.items() if s > start} == {
        layout}
    assert {s: e["loss"] for s, e in got.items()} == want


@pytest.mark.timeout(420)
def test_a_node_lost_without_standby_shrinks_in_process_to_tp2_dp1(
        etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path) -> None:
    job = TwoNodes(tmp_path, job_env, etcd_server.endpoint)
    try:
        survivor, before = _run_to_node_loss(job)
    finally:
        job.close()

    text = job.output(survivor)
    reshapes = job.events(survivor, "reshape")
    assert [e["in_process"] for e in reshapes] == [True], job.outputs()
    assert reshapes[0]["old"].startswith("TP2xPP1xDP2") and \
        reshapes[0]["new"] == "TP2xPP1xDP1 (grad accum 2)", reshapes
    assert reshapes[0]["moves"] == {"2": 0, "3": 1}, reshapes  # the survivor was ranks 2, 3
    assert not job.events(survivor, "restart"), text[-4000:]
    assert len(job.events(survivor, "workers_started")) == 1
    assert len(job.events(survivor, "recover_in_process")) == 1, text[-4000:]
    # No process was started: the survivor's ranks 2 and 3 went on as ranks 0 and 1.
    after = pids_by_rank(job.pid_log)
    assert after[0][-1] == before[2][0] and after[1][-1] == before[3][0], (before, after)
    assert len({p for pids in after.values() for p in pids}) == 4, after
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+) \(source=memory\) in "
                                          r"TP2xPP1xDP1 \(grad accum 2\)", text)]
    assert len(resumed) == 1 and resumed[0] >= KILL_AFTER - 1, text[-4000:]
    start = resumed[0]

    # The reference: TP2 x DP2 to that step, restarted into TP2 x DP1 (accumulation 2) from it.
    _assert_losses(job, STEPS, start, (2, 1, 2),
                   _reference_losses(tmp_path, job_env, (4, 2), STEPS, start))


@pytest.mark.timeout(420)
def test_fsdp2_sharded_over_dp_cannot_shrink_in_process_and_restarts_with_the_reason(
        etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path) -> None:
    job = TwoNodes(tmp_path, job_env, etcd_server.endpoint, "--fsdp")
    try:
        survivor, _ = _run_to_node_loss(job)
        reshapes = job.events(survivor, "reshape")
        assert [e["in_process"] for e in reshapes] == [False], job.outputs()
        assert reshapes[0]["sharded_over"] == ["dp"]
        assert "sharded over DP (FSDP2)" in reshapes[0]["reason"], reshapes
        assert reshapes[0]["action"] == "restart_in_place", reshapes  # the policy's answer
        restarts = job.events(survivor, "restart")
        assert len(restarts) == 1 and "sharded over DP (FSDP2)" in restarts[0]["cause"], \
            restarts
        assert not job.events(survivor, "recover_in_process")
        final = _final(job.loss_log)
        assert sorted(final) == list(range(1, STEPS + 1))
        assert final[STEPS]["dp"] == 1
    finally:
        job.close()


@pytest.mark.timeout(420)
def test_a_node_that_arrives_later_grows_tp2_dp1_back_to_tp2_dp2_in_process(
        etcd_server: EtcdServer, job_env: dict[str, str], tmp_path: Path) -> None:
    job = TwoNodes(tmp_path, job_env, etcd_server.endpoint, steps=GROW_STEPS)
    try:
        job.start("a")
        deadline = time.monotonic() + 150
        while not (_losses(job.loss_log) and len(_pids(job.pid_log)) == 2):
            assert time.monotonic() < deadline, job.outputs()
            assert job.agents["a"].poll() is None, job.outputs()
            time.sleep(0.1)
        before = pids_by_rank(job.pid_log)
        job.start("b")  # the node comes back: it waits to join the running job
        for name in ("a", "b"):
            assert wait_or_explain(job.agents[name], 240, job.outputs) == 0, job.outputs()
    finally:
        job.close()

    reshapes = job.events("a", "reshape")
    assert [e["in_process"] for e in reshapes] == [True], job.outputs()
    # Both the join and the reshape it brought were the policy's answers.
    assert [(e["change"], e["action"]) for e in job.events("a", "membership")] == [
        ("join", "regroup_in_process")], job.outputs()
    assert reshapes[0]["action"] == "regroup_in_process", reshapes
    assert reshapes[0]["world"] == [2, 4] and reshapes[0]["new"] == \
        "TP2xPP1xDP2 (grad accum 1)", reshapes
    assert not job.events("a", "restart"), job.outputs()
    assert len(job.events("a", "workers_started")) == 1
    assert len(job.events("a", "recover_in_process")) == 1, job.outputs()
    # The survivors kept their processes under their new ranks; the newcomers healed from them.
    moves = {int(k): v for k, v in reshapes[0]["moves"].items()}
    after = pids_by_rank(job.pid_log)
    for old, new in moves.items():
        assert after[new][-1] == before[old][0], (before, after, moves)
    assert len({p for pids in after.values() for p in pids}) == 4, after
    healed = [e for e in job.events("b", "restore") if e.get("source") == "replica"]
    assert healed, job.outputs()
    text = job.output("a") + job.output("b")
    resumed = [int(m) for m in re.findall(r"resumed from step (\d+) \(source=\w+\) in "
                                          r"TP2xPP1xDP2", text)]
    assert len(resumed) == 1 and resumed[0] >= 1, text[-4000:]
    start = resumed[0]
    got_lines = _losses(job.loss_log)
    redone = len(got_lines) - len({e["step"] for e in got_lines})
    assert redone <= 1, got_lines

    # The reference: TP2 x DP1 (accumulation 2) to that step, restarted into TP2 x DP2 from it.
    _assert_losses(job, GROW_STEPS, start, (2, 2, 1),
                   _reference_losses(tmp_path, job_env, (2, 4), GROW_STEPS, start))
