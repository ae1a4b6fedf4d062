"""Silent data corruption with real worker processes (gloo DDP) and the agent's checkpoint
service: a bit flipped in one rank's parameters is named from the snapshots' fingerprints."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.ckpt.integrity.sdcwatch import LAG_ENV
from elasticft.ckpt.persisting import durable, rejected
from elasticft.ckpt.service import CheckpointService
from elasticft.config import CheckpointConfig
from elasticft.events import EventLog, read_events
from tests.conftest import ROOT, free_port
from tests.forked import killed, start_forked

# The training every worker below shares: after the optimizer step of step FLIP_STEP, rank
# FLIP_RANK flips mantissa bit 16 of one weight (what a device that computes a wrong value leaves
# behind); with FLIP_ONCE (a file) only the first time (a transient fault: a step redone after a
# rollback is computed right). Each step waits a moment, as a real step would take; rank 0 logs
# its loss (repr: every bit) to LOSS_LOG. The model's set-up defines model, optim, ckpt,
# restore() (the step restored, or None), first_weight() and state(step).
_LOOP = """
flip_rank, flip_step = int(os.environ["FLIP_RANK"]), int(os.environ["FLIP_STEP"])
once = os.environ.get("FLIP_ONCE")
start = restore() or 0
for step in range(start + 1, int(os.environ["STEPS"]) + 1):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    if rank == flip_rank and step == flip_step and not (once and os.path.exists(once)):
        if once:
            open(once, "w").close()
        with torch.no_grad():
            first_weight().view(-1).view(torch.int32)[3] ^= 1 << 16
    ckpt.save(step, state(step)).wait()
    if rank == 0 and os.environ.get("LOSS_LOG"):
        with open(os.environ["LOSS_LOG"], "a") as log:
            log.write(f"{step} {loss.item()!r}\\n")
    dist.barrier()
    time.sleep(float(os.environ["STEP_S"]))
dist.barrier()
"""

# DDP on a tiny model, restored from the newest snapshot it may take. One parameter: DDP's
# gradient bucket is then the same after a restart as before. With several, DDP reorders its
# buckets after its first iteration, so a restarted job's first all-reduce sums the elements of
# 4 ranks in another order than an uninterrupted run's and the losses differ in the last bits
# (2 ranks sum in any order alike).
_WORKER = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from elasticft.ckpt import Checkpointer, capture
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer.from_env(optimizers=[optim])
    def restore():
        restored = ckpt.restore(model, optim)
        return restored[0] if restored is not None else None
    def first_weight():
        return model.module[0].weight
    def state(step):
        return capture(model, optim, {"step": step})
""") + _LOOP


# HSDP on a (replicate=2, shard=2) mesh: ranks 0 and 2 hold one half of every parameter, ranks
# 1 and 3 the other; rank FLIP_RANK flips a bit of its local shard.
_HSDP_WORKER = textwrap.dedent("""
    import os, time, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from elasticft.ckpt import Checkpointer
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer.from_env(optimizers=[optim])
    def restore():
        return None
    def first_weight():
        return model[0].weight.to_local()
    def state(step):
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd, "extra": {"step": step}}
""") + _LOOP


# What the workers of _run import, imported once before they are forked.
WORKER_IMPORTS = ("torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
                  "torch.nn.parallel", "elasticft.ckpt")


def _run(tmp_path: Path, job_env: dict[str, str], world: int, flip_rank: int,
         every: int = 2, script: str = _WORKER, nodes: int = 1) -> list[dict]:
    """Runs ``world`` workers (forked from one interpreter: :mod:`tests.forked`) on ``nodes``
    checkpoint services (agents' stand-ins in this process; with several, joined by a TCPStore
    as the round's store), ticking them as an agent's monitor does; the sdc events they logged.

    A step waits 0.5 s: the services, ticked every 0.05 s, see each fingerprinted step while
    the workers' three memory slots still hold it (for 1.5 s at least)."""
    per_node = world // nodes
    services, groups = [], []
    stores: list = []
    if nodes > 1:
        stores.append(TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        stores += [TCPStore("127.0.0.1", stores[0].port, is_master=False)
                   for _ in range(nodes - 1)]
    for n in range(nodes):
        services.append(CheckpointService(
            CheckpointConfig(ckpt_persist_every=0, ckpt_fingerprint_every=every,
                             ckpt_peer_backup=False),
            event_dir=tmp_path / "events" / f"n{n}"))
        workers = tuple(WorkerInfo(local_rank=r, global_rank=n * per_node + r, world_size=world)
                        for r in range(per_node))
        groups.append(GroupInfo(run_id="sdc-test", node_id=f"n{n}",
                                run_dir=tmp_path if nodes == 1 else tmp_path / f"n{n}",
                                round=0, group_rank=n, group_world_size=nodes, restart_count=0,
                                workers=workers))
    port = free_port()
    try:
        children = []
        for service, group in zip(services, groups, strict=True):
            service.on_rendezvous(group, stores[group.group_rank] if stores else None)
            service.on_workers_started(group)
            children += [(dict(job_env, **service.worker_env(group, worker),
                               RANK=str(worker.global_rank), LOCAL_RANK=str(worker.local_rank),
                               WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port), PYTHONPATH=str(ROOT),
                               FLIP_RANK=str(flip_rank), FLIP_STEP="3", STEP_S="0.5",
                               STEPS="6"), ["-c", script])
                         for worker in group.workers]
        job = start_forked(children, WORKER_IMPORTS, dict(job_env, PYTHONPATH=str(ROOT)), ROOT)
        with killed(job):
            deadline = time.monotonic() + 150
            while job.poll() is None:
                assert time.monotonic() < deadline, "the job did not finish"
                for service, group in zip(services, groups, strict=True):
                    service.check(group)
                time.sleep(0.05)
        assert job.returncode == 0, "a worker failed (see its output)"
        for service, group in zip(services, groups, strict=True):
            service.check(group)
        for service in services:
            service.fingerprints.wait(30)
    finally:
        for service in services:
            service.close()
    return [e for e in read_events(tmp_path / "events") if e["kind"].startswith("sdc_")]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hsdp_compares_the_replicate_dimension_not_the_shard_dimension(
        tmp_path: Path, job_env) -> None:
    events = _run(tmp_path, job_env, world=4, flip_rank=3, script=_HSDP_WORKER)
    # The shards differ by nature (ranks 0 and 1 hold different halves) and raise nothing; rank
    # 3's replica set is {1, 3}, two replicas: undecidable, and only that set.
    assert events, "no sdc event"
    assert {e["kind"] for e in events} == {"sdc_undecidable"}
    assert all(e["ranks"] == [1, 3] for e in events)
    assert events[0]["step"] == 4
    sets = {fp["rank"]: fp["replica_set"] for fp in events[0]["fingerprints"]}
    assert sorted(sets) == [1, 3] and sets[1] == sets[3]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replicas_on_two_nodes_are_compared_by_the_leader(tmp_path: Path, job_env) -> None:
    # Two nodes of two ranks each; rank 3 (node n1) diverges. Neither node alone has a
    # majority against it (n1 sees ranks 2 and 3 split): only the whole job's comparison on
    # the leader names it.
    events = _run(tmp_path, job_env, world=4, flip_rank=3, nodes=2)
    assert events, "no sdc event"
    first = events[0]
    assert first["kind"] == "sdc_suspect"
    assert (first["step"], first["ranks"], first["nodes"]) == (4, [3], ["n1"])
    assert first["node"] == "n0", "the leader reports"
    assert sorted(fp["rank"] for fp in first["fingerprints"]) == [0, 1, 2, 3]
    assert all(e["kind"] == "sdc_suspect" and e["ranks"] == [3] for e in events)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_replicas_on_two_nodes_are_decided_by_the_nodes_health(
        tmp_path: Path, job_env) -> None:
    # One rank per node; rank 1 (node n1) diverges. Neither the bytes nor a second reading
    # on one node can say which side is wrong; node n1's agent had logged a critical health
    # finding (what the diagnostics' node health check writes), node n0's none: n1 is named.
    log = EventLog(tmp_path / "events" / "n1", "n1")
    log.emit("detection", detector="node_health", message="GPU 0: 1 uncorrectable ECC error",
             critical=True, check="gpu")
    log.close()
    events = _run(tmp_path, job_env, world=2, flip_rank=1, nodes=2)
    undecided = [e for e in events if e["kind"] == "sdc_undecidable"]
    assert undecided and (undecided[0]["step"], undecided[0]["ranks"]) == (4, [0, 1])
    decided = [e for e in events if e["kind"] == "sdc_suspect"]
    assert decided, events
    first = decided[0]
    assert (first["step"], first["ranks"], first["nodes"], first["decided_by"]) == \
        (4, [1], ["n1"], "health")
    # The evidence: every node's health as published with its fingerprints.
    assert first["health"]["n1"] == {
        "ok": False, "detail": "node_health: GPU 0: 1 uncorrectable ECC error"}
    assert first["health"]["n0"]["ok"] is True
    assert sorted(fp["rank"] for fp in first["fingerprints"]) == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_elasticft_run_names_the_rank_elasticft_chaos_flipped(tmp_path: Path, job_env) -> None:
    """The whole path: elasticft-run with --ckpt-fingerprint-every, `elasticft chaos bitflip`
    on a live rank of four (it says which parameter it flipped before which save), the event
    naming that rank, its node and parameter at the first fingerprinted step after the flip
    with every rank's digest and the newest agreed step, `elasticft status` (its line and
    --json) and `elasticft report`. One node's four DDP ranks compared: the service path of
    one node without an agent stays the HSDP test's."""
    script = tmp_path / "train.py"
    script.write_text(_WORKER.replace(
        "time.sleep(float(os.environ[\"STEP_S\"]))",
        "time.sleep(float(os.environ[\"STEP_S\"]))\n"
        "    if step == 2: open(os.environ[\"READY\"], \"a\").close()"))
    assert "READY" in script.read_text()
    run_dir = tmp_path / "run"
    env = dict(job_env, PYTHONPATH=str(ROOT), FLIP_RANK="-1", FLIP_STEP="0", STEP_S="1.0",
               STEPS="9", READY=str(tmp_path / "ready"))
    bin_dir = Path(sys.executable).parent
    chaos = subprocess.Popen(
        [str(bin_dir / "elasticft"), "chaos", "bitflip", "--run-dir", str(run_dir), "--rank",
         "3", "--when-exists", str(tmp_path / "ready"), "--timeout", "200"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run = subprocess.run(
            [str(bin_dir / "elasticft-run"), "--standalone", "--nproc-per-node", "4",
             "--monitor-interval", "0.2", "--run-dir", str(run_dir), "--ckpt-persist-every",
             "0", "--ckpt-fingerprint-every", "2", str(script)],
            env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        out, err = chaos.communicate(timeout=60)
    finally:
        chaos.kill()
        chaos.wait()
    assert chaos.returncode == 0, err
    match = re.search(r"flipped one bit of rank 3's parameter of shape \[16, 8\] before its "
                      r"save of step (\d+)", out)
    assert match, out
    flipped = int(match.group(1))
    events = [e for e in read_events(run_dir) if e["kind"].startswith("sdc_")]
    assert events, run.stderr[-3000:]
    assert all(e["kind"] == "sdc_suspect" and e["ranks"] == [3] for e in events)
    first = events[0]
    step = first["step"]
    assert step == flipped + flipped % 2   # the first fingerprinted step (every 2)
    assert first["items"] == ["model.0.weight"]
    (node,) = first["nodes"]
    # The newest step every fingerprint agreed, a clean restore: the fingerprinted step before,
    # or the one before it where a loaded machine's agent looked only after the memory slots
    # had moved past it.
    assert first["agreed_step"] in (step - 2, step - 4) and first["agreed_step"] > 0, first
    digests = {fp["rank"]: fp["digest"] for fp in first["fingerprints"]}
    assert sorted(digests) == [0, 1, 2, 3]
    assert len({digests[0], digests[1], digests[2]}) == 1 and digests[3] != digests[0]
    said = subprocess.run([str(bin_dir / "elasticft"), "status", "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=60)
    assert said.returncode == 0, said.stderr
    assert (f"silent data corruption: {len(events)} suspect, 0 undecidable (last: step "
            in said.stdout), said.stdout
    assert f"rank(s) [3] on ['{node}']" in said.stdout, said.stdout
    status = subprocess.run([str(bin_dir / "elasticft"), "status", "--run-dir", str(run_dir),
                             "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["sdc"] == {"suspect": len(events), "undecidable": 0,
                                                "steps_redone": 0}
    report = subprocess.run([str(bin_dir / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["sdc"] == {"suspect": len(events), "undecidable": 0,
                                                "steps_redone": 0}


# ------------------------------------------------------------------------------------------------
# ckpt_sdc_action evict: the job rolls back to the newest agreed step and redoes the steps.

BIN = Path(sys.executable).parent


def _launch(tmp_path: Path, job_env: dict[str, str], name: str, nproc: int,
            flags: list[str], **worker: str) -> tuple[subprocess.CompletedProcess, Path]:
    """One elasticft-run (one node) of the DDP worker; its result and run directory. Its steps
    wait STEP_S (default 0.5 s) as a real step would take; an uninterrupted reference, which
    only gives the losses, passes STEP_S="0"."""
    run_dir = tmp_path / name
    env = {**job_env, "PYTHONPATH": str(ROOT), "STEP_S": "0.5", "FLIP_RANK": "-1",
           "FLIP_STEP": "0", "LOSS_LOG": str(tmp_path / f"{name}.loss"), **worker}
    script = tmp_path / "train.py"
    script.write_text(_WORKER)
    run = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
         "--monitor-interval", "0.1", "--max-restarts", "3", "--run-dir", str(run_dir),
         *flags, str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return run, run_dir


def _losses(path: Path) -> tuple[dict[int, str], dict[int, int]]:
    """The loss each step ended with (a redone step's last), and how often each was logged."""
    values: dict[int, str] = {}
    logged: dict[int, int] = {}
    for line in path.read_text().splitlines():
        step, loss = line.split()
        values[int(step)] = loss
        logged[int(step)] = logged.get(int(step), 0) + 1
    return values, logged


SDC_EVICT = ["--ckpt-persist-every", "2", "--ckpt-fingerprint-every", "2",
             "--ckpt-sdc-action", "evict"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_replicas_are_reported_undecidable_then_decided_by_recomputation(
        tmp_path: Path, job_env) -> None:
    """Two DDP ranks; rank 1 computes step 3 wrongly once. Step 4's fingerprints differ with no
    majority: undecidable (and so do step 3's, still in memory: the first divergent step). Under
    evict both ranks restore step 2 and compute step 3 again; it agrees, and rank 1, whose first
    result differs from it, is named (rank 0's first result equals it: at step 4 rank 0 would
    differ too, the all-reduce of step 4 having spread rank 1's error). The losses are an
    uninterrupted run's."""
    steps = "8"
    _launch(tmp_path, job_env, "reference", 2, [], STEPS=steps, STEP_S="0")  # no need to wait
    remote = ["--ckpt-remote-dir", str(tmp_path / "remote"), "--ckpt-keep", "100"]
    # Steps of 1 s. Step 3's first results stay in memory until the watch reads them, however
    # late (the next test makes it late).
    _, run_dir = _launch(tmp_path, job_env, "faulty", 2, SDC_EVICT + remote, STEPS=steps,
                         FLIP_RANK="1", FLIP_STEP="3", FLIP_ONCE=str(tmp_path / "flipped"),
                         STEP_S="1.0")
    events = read_events(run_dir)
    sdc = [e for e in events if e["kind"].startswith("sdc_")]
    kinds = [(e["kind"], e.get("step"), e.get("ranks")) for e in sdc]
    assert kinds[0] == ("sdc_undecidable", 4, [0, 1]), kinds
    response = next(e for e in sdc if e["kind"] == "sdc_response")
    assert (response["remedy"], response["restore_at_most"]) == ("recompute", 2), response
    decided = [e for e in sdc if e["kind"] == "sdc_suspect"]
    assert decided, kinds
    assert (decided[0]["step"], decided[0]["ranks"], decided[0]["decided_by"]) == \
        (3, [1], "recomputation"), decided[0]
    assert len(decided) == 1 and not [e for e in sdc if e["kind"] == "sdc_undecidable"][1:]
    restores = [e["step"] for e in events if e["kind"] == "restore"]
    assert restores == [None, 2], restores  # the first attempt started from nothing
    recovered = [e for e in sdc if e["kind"] == "sdc_recovered"]
    assert len(recovered) == 1 and recovered[0]["step"] == 2
    values, logged = _losses(tmp_path / "faulty.loss")
    reference, _ = _losses(tmp_path / "reference.loss")
    assert values == reference
    redone = recovered[0]["steps_redone"]
    assert redone >= 2 and sum(n - 1 for n in logged.values()) == redone, (logged, redone)
    report = subprocess.run([str(BIN / "elasticft"), "report", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(report.stdout)["sdc"]["steps_redone"] == redone
    # No step after the corruption is kept: the local and the remote directory hold none of
    # the steps written before the rollback after step 2, and a relaunch of the run (its
    # local directory lost: from the remote one) resumes from a step written after it.
    (rejection,) = [e for e in events if e["kind"] == "sdc_rejected"]
    newest = recovered[0]["newest_before"]
    assert rejection["restore_at_most"] == 2 and newest >= 4
    for root in (run_dir / "ckpt", tmp_path / "remote"):
        kept = durable.list_steps(root)
        assert not [s for s in kept if 2 < s <= newest], (root, sorted(kept))
        assert rejected.records(root), root
    shutil.rmtree(run_dir / "ckpt")
    _launch(tmp_path, job_env, "faulty", 2, SDC_EVICT + remote, STEPS=steps)
    again = [e for e in read_events(run_dir) if e["kind"] == "restore"][-1]
    assert again["source"] == "remote", again
    assert again["step"] <= 2 or (
        again["step"] > newest and durable.committed_steps(tmp_path / "remote")[again["step"]][
            "committed_at"] > rejection["time"]), (again, rejection)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_late_watch_still_decides_by_recomputation_from_the_held_first_results(
        tmp_path: Path, job_env) -> None:
    """The previous test with the agent's watch made late (the seam LAG_ENV): it compares a
    step's fingerprints only once the workers hold a step two newer, so the memory slots have
    rotated twice past it, as on a loaded host. Step 3's first results, the evidence the
    recomputation needs, must still be there: rank 1 is named by recomputation all the same."""
    _, run_dir = _launch(tmp_path, job_env, "late", 2, SDC_EVICT, STEPS="12", FLIP_RANK="1",
                         FLIP_STEP="3", FLIP_ONCE=str(tmp_path / "flipped"),
                         **{LAG_ENV: "2"})
    events = read_events(run_dir)
    sdc = [e for e in events if e["kind"].startswith("sdc_")]
    kinds = [(e["kind"], e.get("step"), e.get("ranks")) for e in sdc]
    first = sdc[0]
    # Step 4, or step 6 where a loaded host's agent started the check after step 4 had gone.
    assert (first["kind"], first["ranks"]) == ("sdc_undecidable", [0, 1]), kinds
    assert first["step"] in (4, 6) and first["agreed_step"] == 2, first
    response = next(e for e in sdc if e["kind"] == "sdc_response")
    assert (response["remedy"], response["restore_at_most"]) == ("recompute", 2), response
    assert "computing step 3 again" in response["reason"], response
    decided = [e for e in sdc if e["kind"] == "sdc_suspect"]
    assert decided, kinds
    suspect = decided[0]
    assert (suspect["step"], suspect["ranks"], suspect["decided_by"]) == \
        (3, [1], "recomputation"), suspect
    # The evidence: both ranks' first results of step 3, read from the held snapshots after
    # the slots had rotated past them, and the recomputed ones; rank 0's are equal.
    again = {fp["rank"]: fp["digest"] for fp in suspect["fingerprints"]}
    assert suspect["first_results"]["0"] == again[0] == again[1] != \
        suspect["first_results"]["1"], suspect
    restores = [e["step"] for e in events if e["kind"] == "restore"]
    assert restores == [None, 2], restores


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_evict_blacklists_the_node_and_the_job_redoes_the_steps_from_the_agreed_one(
        tmp_path: Path, job_env, etcd_server) -> None:
    """Three agents as nodes on an etcd-v3 rendezvous, --nnodes 2:2, two DDP ranks each: two
    nodes train (4 ranks) and the third waits as the standby. Rank 3 computes step 5 wrongly
    once. Step 6's fingerprints name it; its node is blacklisted with reason sdc and leaves;
    the standby takes its place, every rank restores step 4 or 2 (the newest step at which every
    fingerprint agreed; the new node from the survivor's memory) and the steps after it are
    redone: the losses are an uninterrupted run's, bit for bit, and the report counts the steps
    redone."""
    from tests.cluster import Job, losses_of
    from tests.recovery.test_faults import blacklist_of, standbys

    steps = 16
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    _launch(reference_dir, job_env, "run", 4, [], STEPS=str(steps), STEP_S="0")
    job_dir = tmp_path / "job"  # the job's run directories only, for `elasticft report`
    job_dir.mkdir()
    script = job_dir / "train.py"
    script.write_text(_WORKER)
    # A step waits 1 s, so a memory slot holds a step for 3 s: time enough, on a loaded machine,
    # for the agents to compare step 6 or 8 (a clean-clone run at 0.5 s compared only step 10).
    env = {**job_env, "PYTHONPATH": str(ROOT), "STEP_S": "1.0", "STEPS": str(steps),
           "FLIP_RANK": "3", "FLIP_STEP": "5", "FLIP_ONCE": str(tmp_path / "flipped"),
           "LOSS_LOG": str(job_dir / "loss.log")}
    remote = tmp_path / "remote"
    job = Job(job_dir, env, etcd_server.endpoint, "sdc-job", script, steps,
              extra_agent=["--nproc-per-node", "2", *SDC_EVICT, "--ckpt-remote-dir",
                           str(remote), "--ckpt-persist-every", "1", "--ckpt-keep", "100"])
    try:
        for name in ("a", "b", "c"):
            job.start(name)
        job.wait_for("two nodes in a round and one standby",
                     lambda: len(job.events("workers_started")) >= 2
                     and standbys(job.endpoint, job.job_id) == 1, timeout=180)
        faulty = job.wait_for("the sdc verdict", lambda: next(
            (e["nodes"][0] for e in job.events("sdc_response") if e["nodes"]), None),
            timeout=180)
        standby = next(n for n in "abc" if n != faulty and not job.nodes[n].events(
            "rendezvous"))
        codes = {name: node.wait(240) for name, node in job.nodes.items()}
    finally:
        job.close()
    assert codes[faulty] != 0 and all(c == 0 for n, c in codes.items() if n != faulty), \
        (codes, job.outputs())
    suspect = job.events("sdc_suspect")[0]
    # The first fingerprinted step after the corruption (step 5) names rank 3: step 6, or 8 when
    # a loaded machine's agent looked only after the memory slots had moved past step 6.
    assert (suspect["ranks"], suspect["nodes"]) == ([3], [faulty]), suspect
    assert suspect["step"] in (6, 8), suspect
    # The newest compared step before the corruption agreed: 4, or 2 when step 4 was passed by
    # the same way (then recovery goes back further).
    agreed = suspect["agreed_step"]
    assert agreed in (2, 4), suspect
    eviction = next(e for e in job.events("eviction") if e["evicted"] == faulty)
    assert eviction["blacklisted"] and eviction["by"] == "self"
    assert blacklist_of(etcd_server.endpoint)[faulty].startswith("sdc: rank(s) [3] diverged")
    started = job.nodes[standby].events("workers_started")
    assert started and started[-1]["world_size"] == 4, job.outputs()
    # Every node restored the agreed step, the standby's ranks from the survivor's memory:
    # nothing after the corruption was kept.
    restored = {e["node"]: e["step"] for e in job.events("restore") if e["step"] is not None}
    assert restored and set(restored.values()) == {agreed}, restored
    assert standby in restored
    losses = losses_of(job_dir / "loss.log")
    reference, _ = _losses(reference_dir / "run.loss")
    assert losses.values == reference, job.outputs()
    (recovered,) = job.events("sdc_recovered")
    # The agent counts the steps from the restored one to the newest it saw saved; the step in
    # flight when the job was stopped may have logged its loss before its save reached the
    # agent (a loaded machine), and is redone without being counted.
    redone = recovered["steps_redone"]
    assert redone >= 2 and losses.recomputed - 1 <= redone <= losses.recomputed, \
        (redone, losses.logged)
    report = subprocess.run([str(BIN / "elasticft"), "report", str(job_dir), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    assert json.loads(report.stdout)["sdc"] == {"suspect": len(job.events("sdc_suspect")),
                                                "undecidable": 0,
                                                "steps_redone": redone}
    # No step after the corruption is kept anywhere: not in a node's directory, not in the
    # remote one, not in a peer's backup store; each place that held steps before the verdict
    # (the standby's held none) keeps the rejection's record. Every step persists: step 5,
    # the corrupted one, is on disk (and backed up) half a step before step 6 is compared; and
    # every step is kept, so that retention cannot be what removed it.
    newest = recovered["newest_before"]
    survivors = [n for n in "abc" if n != faulty]
    for node in [None, *survivors]:
        root = job.nodes[node].run_dir / "ckpt" if node else None
        places = [remote] if root is None else [root / f"node-{node}",
                                                root / "peer-backups" / f"node-{node}"]
        for place in places:
            kept = durable.list_steps(place)
            assert not [s for s in kept if agreed < s <= newest], (place, sorted(kept))
            assert node == standby or rejected.records(place), place
    rejections = job.events("sdc_rejected")
    assert {e["node"] for e in rejections} == set(survivors), rejections
    assert any(e["removed"] for e in rejections), rejections  # a corrupted step was persisted
