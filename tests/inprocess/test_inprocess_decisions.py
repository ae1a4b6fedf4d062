"""In-process recovery's pure parts, by tables: which errors a regroup repairs, when the agent
may recover in process, what the policy decides, the phases of a recovery, and the order in
which a process group is torn down and made again (through the backend seam, no torch group)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import ActionKind, FailureFacts, decide
from elasticft.ckpt.control import report_restored
from elasticft.ckpt.settings import ENV_CONTROL
from elasticft.inprocess import InProcess, groups, peer_failure, protocol, worker
from elasticft.inprocess.agent_side import blocker, leaver_blocker
from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.groups import GroupOps, tear_down
from elasticft.inprocess.protocol import Generation, InProcessSettings, worker_file
from elasticft.inprocess.recovery_timing import Recovery, first_step_limit, phases
from elasticft.jsonfile import write_json

GLOO_CLOSED = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:912. "
               "This is typically caused by a remote worker crashing.")


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("error", "repairable"), [
    (RuntimeError(GLOO_CLOSED), True),
    (RuntimeError("Read error [127.0.0.1]:3275: Connection reset by peer"), True),
    (ConnectionResetError("connection reset by peer (NIC flap)"), True),
    (dist.DistBackendError("NCCL communicator was aborted on rank 1"), True),
    (dist.DistNetworkError("Broken pipe"), True),
    (TimeoutError("timed out waiting for the store"), True),
    (_chained(RuntimeError("step failed"), ConnectionResetError("reset")), True),
    # Not repaired by a regroup: bugs, and device faults that may leave CUDA unusable.
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x3)"), False),
    (ValueError("bad batch"), False),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (dist.DistBackendError("NCCL error: unhandled cuda error"), False),
    (RuntimeError("CUDA error: device-side assert triggered"), False),
    (_chained(ConnectionResetError("reset"), RuntimeError("CUDA error: ECC error")), False),
])
def test_which_errors_a_regroup_repairs(error: BaseException, repairable: bool) -> None:
    assert peer_failure(error) is repairable


BASE = {"armed": True, "nodes": 1, "recovering": False, "failed": 1, "workers": 2,
        "replaceable": None}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("change", "why"), [
    ({}, None),
    ({"failed": 0}, None),  # every worker raised and waits: all regroup, none replaced
    ({"armed": False}, "do not all run under elasticft.inprocess.InProcess"),
    ({"nodes": 2}, "failed in a job of 2 nodes"),  # this node's worker, no shared store
    ({"nodes": 2, "across_nodes": True}, None),  # only the failed rank new, every node agrees
    ({"nodes": 2, "across_nodes": True, "failed": 2}, None),  # the other nodes' survive
    # A failure during a recovery across nodes begins the next one; the third restarts.
    ({"nodes": 2, "across_nodes": True, "recovering": True, "chained": 1}, None),
    ({"nodes": 2, "across_nodes": True, "recovering": True, "chained": 2}, "2 in a row"),
    ({"recovering": True, "chained": 1, "across_nodes": True}, "during an in-process recovery"),
    ({"nodes": 2, "failed": 0}, None),  # another node's: a new round, this node regroups
    ({"nodes": 2, "failed": 0, "shared_store": True}, "share_tcp_store"),
    ({"shared_store": True}, None),  # one node: the generation's store is a fresh one
    ({"recovering": True}, "during an in-process recovery"),
    ({"failed": 2}, "no worker survived"),
    ({"workers": 1}, "no worker survived"),
    ({"replaceable": "the workers run in a MultiprocessContext"}, "MultiprocessContext"),
])
def test_when_the_agent_may_recover_in_process(change: dict, why: str | None) -> None:
    answer = blocker(**{**BASE, **change})
    if why is None:
        assert answer is None
    else:
        assert answer is not None and why in answer


def _failure(cls: FailureClass) -> FailureRecord:
    return FailureRecord(rank=1, local_rank=1, pid=101, exitcode=-9, failure_class=cls)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("facts", "why"), [
    # a survivor that left before its teardown was over (the hard limit, its device): its
    # replacement joins the same generation
    ({}, None),
    ({"replacement_left": True}, "a replacement failed"),
    ({"formed": True}, "its group had formed"),
    # it aborted and went on to the generation's store: what it left there keeps a replacement
    # of its rank from forming the group until the recovery is overdue
    ({"began_regroup": True}, "it had begun the regroup (its torn record)"),
    ({"formed": True, "began_regroup": True}, "its group had formed"),
])
def test_when_a_leavers_replacement_may_join_the_same_generation(facts: dict,
                                                                 why: str | None) -> None:
    found = leaver_blocker(**{"replacement_left": False, "formed": False,
                              "began_regroup": False, **facts})
    assert (found is None) if why is None else (found is not None and found.startswith(why))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("cls", "in_process", "used", "kind"), [
    (FailureClass.SIGNAL_CRASH, True, 0, ActionKind.RECOVER_IN_PROCESS),
    (FailureClass.HANG, True, 0, ActionKind.RECOVER_IN_PROCESS),
    (FailureClass.INFRASTRUCTURE, True, 1, ActionKind.RECOVER_IN_PROCESS),
    (FailureClass.UNKNOWN, True, 0, ActionKind.RECOVER_IN_PROCESS),
    (FailureClass.SIGNAL_CRASH, False, 0, ActionKind.RESTART_IN_PLACE),
    (FailureClass.NUMERIC, True, 0, ActionKind.RESTART_IN_PLACE),
    (FailureClass.SLOW, True, 0, ActionKind.RESTART_IN_PLACE),
    (FailureClass.STOP_REQUESTED, True, 0, ActionKind.RESTART_IN_PLACE),
    (FailureClass.USER_CODE, True, 0, ActionKind.STOP),
    (FailureClass.SIGNAL_CRASH, True, 2, ActionKind.STOP),  # counted against --max-restarts
])
def test_the_policy_recovers_in_process_what_a_replacement_repairs(
        cls: FailureClass, in_process: bool, used: int, kind: ActionKind) -> None:
    action = decide(FailureFacts((_failure(cls),), restarts_used=used, max_restarts=2,
                                 in_process=in_process))
    assert action.kind is kind
    if kind is ActionKind.RECOVER_IN_PROCESS:
        assert f"in-process recovery {used + 1} of --max-restarts 2" in action.reason


_SURVIVOR = {"failed": 100.02, "aborted": 100.03, "joined": 100.6, "resumed": 100.8}
# the replacement: no abort of its own; its process started, imported, joined
_REPLACEMENT = {"started": 100.09, "reached": 100.4, "joined": 100.7, "resumed": 100.9}
_BEFORE = {"detect_s": 0.05, "survivors_out_s": 0.02, "abort_s": 0.01, "reap_s": 0.25,
           "fork_s": 0.02, "start_s": 0.31, "join_s": 0.3, "regroup_s": 0.65}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("restored", "after"), [
    # no worker reports its restore's end: restore and redo stay one phase
    ((None, None), {"restore_redo_s": 0.2}),
    # both restore (a collective: they end together), then redo the step in flight
    ((100.75, 100.76), {"restore_s": 0.06, "redo_s": 0.14}),
    # only the replacement reports it (the survivor's script restores by itself, unreported)
    ((None, 100.72), {"restore_s": 0.02, "redo_s": 0.18}),
    # a restore that ends before the last worker joined (a local one): no negative phase
    ((100.65, None), {"restore_s": 0.0, "redo_s": 0.25}),
], ids=["unreported", "both", "replacement-only", "before-the-last-join"])
def test_phases_of_a_recovery_from_the_workers_records(
        restored: tuple[float | None, float | None], after: dict[str, float]) -> None:
    recovery = Recovery(1, "crash", seen_at=100.0, decided_at=100.05, published_at=100.1,
                        replaced={1: 4242}, deadline=0.0)
    recovery.times.update(reaped=100.3, fork=100.06, forked=100.08)
    records = {0: dict(_SURVIVOR), 1: dict(_REPLACEMENT)}
    for local_rank, at in enumerate(restored):
        if at is not None:
            records[local_rank]["restored"] = at
    found = phases(recovery, records)
    assert list(found) == [*_BEFORE, *after, "total_s"]
    assert found == {**_BEFORE, **after, "total_s": 0.9}


@pytest.mark.timeout(30)
def test_a_group_rebuilt_in_place_has_its_rebuild_as_a_phase_the_slowest_ranks() -> None:
    """torch's reconfigure: each worker's ``joined`` record says how long its rebuild took
    (every rank's handle in → the group formed); the phase is the slowest, after the regroup."""
    recovery = Recovery(1, "crash", seen_at=100.0, decided_at=100.05, published_at=100.1,
                        replaced={1: 4242}, deadline=0.0)
    recovery.times.update(reaped=100.3, fork=100.06, forked=100.08)
    records = {0: {**_SURVIVOR, "rebuild_s": 0.004}, 1: {**_REPLACEMENT, "rebuild_s": 0.011}}
    found = phases(recovery, records)
    assert found["rebuild_s"] == 0.011
    assert list(found)[list(found).index("regroup_s") + 1] == "rebuild_s"
    # A new group (torch without reconfigure): no such phase.
    assert "rebuild_s" not in phases(recovery, {0: dict(_SURVIVOR), 1: dict(_REPLACEMENT)})


@pytest.mark.timeout(30)
def test_the_coordinator_reads_only_records_of_the_current_workers(tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    coordinator.reset()
    pids = {0: 10, 1: 11}
    assert not coordinator.armed(pids)
    for local_rank, pid in pids.items():
        write_json(worker_file(coordinator.directory, "armed", local_rank),
                   {"pid": pid, "generation": 0})
    assert coordinator.armed(pids)
    assert not coordinator.armed({0: 10, 1: 12})  # a new process of local rank 1: not armed
    write_json(worker_file(coordinator.directory, "failed", 0),
               {"pid": 10, "generation": 0, "failed": 5.0, "cause": "RuntimeError: closed"})
    write_json(worker_file(coordinator.directory, "failed", 1),
               {"pid": 11, "generation": 1, "failed": 4.0, "cause": "stale"})
    assert coordinator.waiting(pids) == {0: (5.0, "RuntimeError: closed")}
    coordinator.reset()
    assert not coordinator.armed(pids) and coordinator.waiting(pids) == {}


@pytest.mark.timeout(30)
def test_a_published_generation_is_a_live_store_the_workers_read(tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    coordinator.reset()
    generation = coordinator.publish("127.0.0.1", world_size=2)
    assert Generation.read(coordinator.directory) == generation
    assert generation.generation == 1 == coordinator.generation
    client = dist.TCPStore("127.0.0.1", generation.master_port, is_master=False)
    client.set("k", "v")
    assert client.get("k") == b"v"
    env = coordinator.replacement_env({"RANK": "1", "MASTER_PORT": "1"}, generation, 3,
                                      "ELASTICFT_ATTEMPT")
    assert env["MASTER_PORT"] == str(generation.master_port)
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env[protocol.GENERATION_ENV] == "1" and env["ELASTICFT_ATTEMPT"] == "3"
    assert coordinator.publish("127.0.0.1", 2).generation == 2
    coordinator.close()


@pytest.mark.timeout(60)
def test_a_new_rounds_generation_is_joined_in_the_agents_store(tmp_path: Path) -> None:
    """A generation of a new rendezvous round: the round's store is the one an agent hosts
    (:meth:`ElasticftAgent._host_worker_store`), where the other nodes' new workers connect;
    the survivor joins it as a client, its rank 0 too."""
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    coordinator.reset()
    round_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    generation = coordinator.publish_round("127.0.0.1", round_store.port, world_size=1)
    assert Generation.read(coordinator.directory) == generation
    assert generation.generation == 1
    try:
        groups.regroup("gloo", 0, generation, 10.0, GroupOps())
        assert dist.get_world_size() == 1
        assert round_store.num_keys() > 0  # the group's keys went to the agent's store
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        coordinator.close()


class _Ops:
    """The backend seam, recording what a teardown and a regroup call, in order."""

    def __init__(self, with_abort: bool = True) -> None:
        self.calls: list[str] = []
        ops = GroupOps(destroy=lambda: self.calls.append("destroy"),
                       init=lambda backend, **kw: self.calls.append(
                           f"init {backend} rank={kw['rank']} world={kw['world_size']}"))
        if with_abort:
            ops.abort = lambda: self.calls.append("abort")
        self.ops = ops


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("backend", "with_abort", "calls", "how"), [
    # The same calls on every backend: the abort, then a destroy of what is still registered.
    ("gloo", True, ["abort", "destroy"], "abort"),
    ("nccl", True, ["abort", "destroy"], "abort"),
    ("cuda:nccl,cpu:gloo", True, ["abort", "destroy"], "abort"),
    ("nccl", False, ["destroy"], "destroy"),  # a torch without the abort
    ("gloo", False, ["destroy"], "destroy"),
])
def test_teardown_aborts_then_destroys_what_is_left_on_every_backend(
        backend: str, with_abort: bool, calls: list[str], how: str) -> None:
    ops = _Ops(with_abort)
    assert tear_down(backend, ops.ops) == how
    assert ops.calls == calls


@pytest.mark.timeout(30)
def test_without_an_agent_the_function_runs_once_and_its_errors_pass() -> None:
    runs = []
    recovery = InProcess(InProcessSettings(directory=None), ops=_Ops().ops)
    assert recovery.run(lambda x: runs.append(x) or x * 2, 21) == 42
    with pytest.raises(ConnectionResetError):
        recovery.run(_raise, ConnectionResetError("reset"))
    assert runs == [21] and recovery.recoveries == 0


def _raise(error: BaseException) -> None:
    raise error


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restore", ["checkpointer", "restore_done"])
def test_a_survivor_waits_for_the_next_generation_and_rejoins_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore: str) -> None:
    """One process, a real gloo group of one: the first call raises a peer failure; the
    worker reports it, tears its group down through the seam, waits for the generation the
    "agent" publishes, rejoins on its store and runs the function again, which restores (the
    checkpointer's report of it, or the script's own ``restore_done``) and steps: its
    ``resumed`` record says when the restore ended, between its join and its first step."""
    control = tmp_path / "ckpt-control"
    control.mkdir()
    monkeypatch.setenv(ENV_CONTROL, str(control))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    directory = tmp_path / "ip"
    calls: list[str] = []
    ops = GroupOps(destroy=lambda: (calls.append("destroy"), dist.destroy_process_group()),
                   init=lambda *a, **kw: (calls.append("init"),
                                          dist.init_process_group(*a, **kw)))
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30), ops=ops)
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    entries = []
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    def train() -> str:
        entries.append(dist.get_world_size())
        if len(entries) == 1:
            failed = worker_file(directory, "failed", 0)

            def agent() -> None:  # the agent's side: publishes once the failure is reported
                deadline = time.monotonic() + 20
                while not failed.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                coordinator.publish("127.0.0.1", world_size=1)

            threading.Thread(target=agent, daemon=True).start()
            raise RuntimeError(GLOO_CLOSED)
        time.sleep(0.02)  # the restore
        if restore == "checkpointer":  # what Checkpointer.restore reports as it returns
            report_restored(control, 0, 4, "memory", "", ["memory"])
        else:
            recovery.restore_done()
        time.sleep(0.02)  # the step redone
        optimizer.step()
        return "done"

    try:
        assert recovery.run(train) == "done"
        assert entries == [1, 1] and calls == ["destroy", "init"]
        assert recovery.generation == 1 and recovery.recoveries == 1
        joined = coordinator._record("joined", 0, os.getpid(), 1)
        assert joined is not None and joined["aborted"] >= joined["failed"]
        resumed = coordinator._record("resumed", 0, os.getpid(), 1)
        assert resumed is not None
        assert joined["joined"] + 0.02 <= resumed["restored"] <= resumed["resumed"] - 0.02
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        coordinator.close()


@pytest.mark.timeout(60)
def test_a_reentry_finds_no_gradient_of_the_step_the_failure_cut_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A survivor whose optimizer stepped, then failed after a backward (a loop that zeroes the
    gradients after its step holds them until then): the function is entered again with every
    gradient None, as a fresh process has them, though the script restores by itself."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    directory = tmp_path / "ip"
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30))
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    grads_at_entry = []

    def train() -> None:
        grads_at_entry.append(param.grad)
        if len(grads_at_entry) == 1:
            param.sum().backward()
            optimizer.step()
            param.sum().backward()  # the next step's backward: then the peer fails
            threading.Thread(target=_publish_once_failed, args=(coordinator, directory),
                             daemon=True).start()
            raise RuntimeError(GLOO_CLOSED)
        recovery.restore_done()

    try:
        recovery.run(train)
        assert grads_at_entry == [None, None] and recovery.recoveries == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        coordinator.close()


def _publish_once_failed(coordinator: InProcessCoordinator, directory: Path) -> None:
    """The agent's side: publishes the next generation once rank 0 reported its failure."""
    failed = worker_file(directory, "failed", 0)
    deadline = time.monotonic() + 20
    while not failed.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    coordinator.publish("127.0.0.1", world_size=1)


@pytest.mark.timeout(60)
def test_no_generation_in_time_raises_for_the_agents_restart(tmp_path: Path) -> None:
    """A survivor whose agent publishes nothing (it decided a full restart, or it is another
    node's failure) gives up after its timeout with the original error as the cause."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", store), rank=0,
                            world_size=1)
    recovery = InProcess(InProcessSettings(directory=tmp_path / "ip", timeout_s=0.3))
    try:
        with pytest.raises(worker.RecoveryTimeout, match="no in-process regroup") as raised:
            recovery.run(_raise, RuntimeError(GLOO_CLOSED))
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert not dist.is_initialized() and recovery.recoveries == 0
        failed = worker_file(tmp_path / "ip", "failed", 0).read_text()
        assert "Connection closed by peer" in failed
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("records", "limit"), [
    ([], 30.0),  # nothing measured: the floor
    ([{"first_s": 2.0, "step_s": 0.1}], 30.0),
    ([{"first_s": 40.0, "step_s": 1.0}, {"first_s": 10.0}], 83.0),  # a compiled model's start
    ([{"step_s": 20.0}, {}], 60.0),  # long steps, a replacement that measured nothing
])
def test_the_first_steps_limit_comes_from_what_the_survivors_measured(
        records: list[dict], limit: float) -> None:
    assert first_step_limit(records) == limit


@pytest.mark.timeout(30)
def test_a_recovery_is_overdue_by_its_phase(tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0, teardown_limit_s=2.0)
    coordinator.reset()
    pids = {0: 10, 1: 11}
    write_json(worker_file(coordinator.directory, "failed", 0),
               {"pid": 10, "generation": 0, "first_s": 50.0, "step_s": 1.0})
    coordinator.generation = 1
    coordinator.recovery = Recovery(1, "crash", 0.0, 0.0, 0.0, {1: 11},
                                    deadline=100.0 + coordinator.join_limit_s)
    assert not coordinator.overdue(106.0, pids)
    assert coordinator.overdue(108.0, pids)  # not joined within teardown + regroup
    for local_rank, pid in pids.items():
        write_json(worker_file(coordinator.directory, "joined", local_rank),
                   {"pid": pid, "generation": 1})
    assert not coordinator.overdue(108.0, pids)  # joined: the first step's limit from now
    assert coordinator.recovery.first_step_s == 103.0
    assert not coordinator.overdue(210.0, pids)
    assert coordinator.overdue(212.0, pids)


@pytest.mark.timeout(30)
def test_the_interrupt_notice_ends_one_generation_and_a_full_start_clears_it(
        tmp_path: Path) -> None:
    from elasticft.inprocess.interrupt import notice
    from elasticft.inprocess.protocol import INTERRUPT_FILE
    from elasticft.jsonfile import read_json

    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    coordinator.reset()
    assert notice(coordinator.directory, read_json) == -1
    coordinator.interrupt()
    assert notice(coordinator.directory, read_json) == 0  # generation 0 is over
    coordinator.publish("127.0.0.1", 2)
    assert notice(coordinator.directory, read_json) == 0  # generation 1 is not
    coordinator.interrupt()
    assert notice(coordinator.directory, read_json) == 1
    coordinator.reset()  # new workers: the notice was for the old ones
    assert not (coordinator.directory / INTERRUPT_FILE).exists()
    assert notice(coordinator.directory, read_json) == -1  # generation.json too
    coordinator.close()


@pytest.mark.timeout(30)
def test_a_new_agent_starts_its_workers_in_a_directory_cleared_of_a_dead_agents_files(
        tmp_path: Path) -> None:
    """An agent SIGKILLed in a recovery left its notice, its published generation, its
    workers' records and a spare's assignment: the next agent's first start clears them, so
    its workers (generation 0) are not told that their generation is over."""
    from elasticft.inprocess.interrupt import notice
    from elasticft.inprocess.protocol import Assignment
    from elasticft.jsonfile import read_json

    dead = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    dead.reset()
    dead.interrupt()
    generation = dead.publish("127.0.0.1", 2)
    write_json(worker_file(dead.directory, "failed", 0), {"pid": 10, "generation": 0})
    Assignment(generation, 1, {"RANK": "1"}).write(dead.directory, "1")
    assert notice(dead.directory, read_json) == 0

    fresh = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0)
    fresh.reset()  # the new agent's first start of its workers
    assert fresh.worker_env()[protocol.GENERATION_ENV] == "0"
    assert notice(fresh.directory, read_json) == -1
    assert sorted(p.name for p in fresh.directory.iterdir()) == []
    dead.close()


@pytest.mark.timeout(10)
def test_a_generation_carries_each_local_ranks_new_variables_whole(tmp_path: Path) -> None:
    from elasticft.inprocess.protocol import Generation

    reshaped = Generation(3, "10.0.0.1", 29500, 2,
                          {"0": {"RANK": "0", "ELASTICFT_DP": "1"}, "1": {"RANK": "1"}})
    reshaped.write(tmp_path)
    assert Generation.read(tmp_path) == reshaped
    assert reshaped.env_of(1) == {"RANK": "1"} and reshaped.env_of(5) == {}
    Generation(4, "10.0.0.1", 29500, 2).write(tmp_path)
    assert Generation.read(tmp_path).env == {}


@pytest.mark.timeout(10)
def test_every_generation_tells_the_workers_the_agents_deadline_of_the_regroup(
        tmp_path: Path) -> None:
    coordinator = InProcessCoordinator(tmp_path / "ip", timeout_s=5.0, teardown_limit_s=2.0)
    coordinator.reset()
    try:
        assert Generation(1, "127.0.0.1", 1, 2).regroup_by == 0.0  # none told: its own timeout
        coordinator.regroup_by = 1000.0 + coordinator.join_limit_s  # the recovery's deadline
        published = coordinator.publish("127.0.0.1", 2)
        adopted = coordinator.adopt("10.0.0.1", 29500, 2)
        round_ = coordinator.publish_round("10.0.0.1", 29500, 2, {"0": {"RANK": "0"}})
        for generation in (published, adopted, round_):
            assert generation.regroup_by == 1007.0
        assert Generation.read(coordinator.directory) == round_  # what the survivor reads
    finally:
        coordinator.close()
