"""The pure recovery policy (:mod:`elasticft.addon.policy`), exhaustively over small cases:
failure classes and budgets, the root cause, repeated failures, what counts against a node and
evicts it, replicas, the checkpoint source, the leader's verdict on departed nodes, a diverged
loss, its answers to changes of membership (growth, reshape, a leaving survivor) and the choice
of the just-in-time checkpoint."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from elasticft.addon.api import Detection, GroupInfo, WorkerInfo
from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import (
    ActionKind,
    ChangeFacts,
    CheckpointSource,
    DepartedNode,
    FailureFacts,
    FailureSignature,
    checkpoint_source,
    decide,
    decide_change,
    is_node_offence,
    judge_departed,
    replicas_intact,
    root_cause,
    suspect_reason,
)


def failure(rank: int, cls: FailureClass) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=rank, pid=100 + rank, exitcode=1, failure_class=cls)


RESTARTABLE = [c for c in FailureClass if c is not FailureClass.USER_CODE]


@pytest.mark.parametrize(
    ("cls", "used", "budget"),
    list(itertools.product(RESTARTABLE, range(3), range(3))),
)
def test_restartable_failures_restart_within_budget(cls: FailureClass, used: int, budget: int):
    action = decide(FailureFacts((failure(0, cls),), restarts_used=used, max_restarts=budget))
    if used < budget:
        assert action.kind is ActionKind.RESTART_IN_PLACE
        assert f"restart {used + 1} of --max-restarts {budget}" in action.reason
        assert action.exit_code == 0
    else:
        assert action.kind is ActionKind.STOP
        assert action.exit_code == 1
        assert "no restarts left" in action.reason
    assert cls.value in action.reason


@pytest.mark.parametrize(("used", "allowed"), list(itertools.product(range(3), range(3))))
def test_user_errors_stop_unless_allowed(used: int, allowed: int) -> None:
    facts = FailureFacts(
        (failure(1, FailureClass.USER_CODE),),
        restarts_used=0,
        max_restarts=5,
        user_error_restarts_used=used,
        restart_on_user_error=allowed,
    )
    action = decide(facts)
    if used < allowed:
        assert action.kind is ActionKind.RESTART_IN_PLACE
        assert action.consumes_user_error_restart
    else:
        assert action.kind is ActionKind.STOP
        assert action.exit_code == 1
        assert "user-code error, not restarted" in action.reason
        assert "rank 1" in action.reason
    assert action.fails_again == (action.kind is ActionKind.STOP)


def test_user_error_is_root_cause_over_collateral_connection_errors() -> None:
    failures = (failure(0, FailureClass.INFRASTRUCTURE), failure(3, FailureClass.USER_CODE))
    assert root_cause(failures).rank == 3
    action = decide(FailureFacts(failures, restarts_used=0, max_restarts=3))
    assert action.kind is ActionKind.STOP


def test_suspect_node_is_evicted_when_others_can_go_on() -> None:
    facts = FailureFacts(
        (failure(0, FailureClass.HANG),), restarts_used=0, max_restarts=3,
        node_suspect=True, can_evict=True,
    )
    assert decide(facts).kind is ActionKind.EVICT_NODE
    alone = FailureFacts(
        (failure(0, FailureClass.HANG),), restarts_used=0, max_restarts=3, node_suspect=True,
    )
    assert decide(alone).kind is ActionKind.RESTART_IN_PLACE


def test_the_evidence_against_a_suspect_node_leads_the_reason_of_its_eviction() -> None:
    # Silent data corruption found by the fingerprints: the blacklist entry says so first;
    # never a just-in-time checkpoint (the healthy replicas hold the spread error too).
    facts = FailureFacts(
        (failure(2, FailureClass.NUMERIC),), restarts_used=0, max_restarts=3,
        node_suspect=True, suspect_evidence="sdc: rank(s) [2] diverged at step 6",
        can_evict=True, replicas_intact=True, jit_available=True,
    )
    action = decide(facts)
    assert action.kind is ActionKind.EVICT_NODE
    assert action.reason.startswith("sdc: rank(s) [2] diverged at step 6; evicting this node")
    assert action.checkpoint is CheckpointSource.SNAPSHOT
    plain = decide(dataclasses.replace(facts, suspect_evidence=""))
    assert plain.reason.startswith("this node is suspect hardware (failed health check)")


GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                  "Connection closed by peer [127.0.0.1]:44960. This is typically caused by a "
                  "remote worker crashing.")


@pytest.mark.parametrize(
    ("messages", "expected_rank"),
    [
        # rank 0's barrier reports rank 1's fault: rank 1's own error is the cause
        ({0: GLOO_PEER_GONE, 1: "connection reset by peer while loading shard 3"}, 1),
        ({0: "connection reset by peer while loading shard 3", 1: GLOO_PEER_GONE}, 0),
        ({0: GLOO_PEER_GONE, 1: GLOO_PEER_GONE}, 0),
        ({0: "store timed out", 1: "connection refused"}, 0),
        ({2: None, 1: GLOO_PEER_GONE}, 2),
    ],
)
def test_a_collectives_report_of_a_peer_gone_is_not_the_root_cause(
        messages: dict[int, str | None], expected_rank: int) -> None:
    failures = tuple(dataclasses.replace(failure(rank, FailureClass.INFRASTRUCTURE),
                                         message=message)
                     for rank, message in messages.items())
    assert root_cause(failures).rank == expected_rank
    assert root_cause(tuple(reversed(failures))).rank == expected_rank


def test_root_cause_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        root_cause(())


def raised(cls: FailureClass, exception: str | None = "RuntimeError",
           frame: str | None = "/job/train.py:12 in main", rank: int = 0) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=rank, pid=100 + rank, exitcode=1,
                         failure_class=cls, exception=exception, message="boom",
                         location=frame, user_frame=frame)


UNKNOWN_AT_12 = raised(FailureClass.UNKNOWN)
SAME = FailureSignature.of(UNKNOWN_AT_12)


@pytest.mark.parametrize(
    ("failure", "previous", "stepped", "used", "expected"),
    [
        # The same failure before the first step of two attempts in a row: stop.
        (UNKNOWN_AT_12, SAME, False, 1, ActionKind.STOP),
        (raised(FailureClass.ELASTICFT), FailureSignature.of(raised(FailureClass.ELASTICFT)),
         False, 1, ActionKind.STOP),
        # A step completed in this attempt, or nobody knows: restart.
        (UNKNOWN_AT_12, SAME, True, 1, ActionKind.RESTART_IN_PLACE),
        (UNKNOWN_AT_12, SAME, None, 1, ActionKind.RESTART_IN_PLACE),
        # The previous attempt stepped, or did not fail: restart.
        (UNKNOWN_AT_12, None, False, 1, ActionKind.RESTART_IN_PLACE),
        # Another place, another exception, another class: restart.
        (raised(FailureClass.UNKNOWN, frame="/job/train.py:13 in main"), SAME, False, 1,
         ActionKind.RESTART_IN_PLACE),
        (raised(FailureClass.UNKNOWN, exception="OSError"), SAME, False, 1,
         ActionKind.RESTART_IN_PLACE),
        (raised(FailureClass.ELASTICFT), SAME, False, 1, ActionKind.RESTART_IN_PLACE),
        # Causes outside the code may clear: restart.
        (raised(FailureClass.INFRASTRUCTURE),
         FailureSignature(FailureClass.INFRASTRUCTURE, "RuntimeError", "/job/train.py:12 in main"),
         False, 1, ActionKind.RESTART_IN_PLACE),
        (failure(0, FailureClass.SIGNAL_CRASH), None, False, 1, ActionKind.RESTART_IN_PLACE),
        # No restarts left: the budget's stop, not this one.
        (UNKNOWN_AT_12, SAME, False, 3, ActionKind.STOP),
    ],
)
def test_a_failure_repeated_before_the_first_step_stops(
    failure: FailureRecord, previous: FailureSignature | None, stepped: bool | None, used: int,
    expected: ActionKind,
) -> None:
    facts = FailureFacts((failure,), restarts_used=used, max_restarts=3,
                         step_completed=stepped, previous_failure=previous)
    action = decide(facts)
    assert action.kind is expected
    repeat = "the same failure before the first step of two attempts in a row" in action.reason
    assert repeat == (expected is ActionKind.STOP and used < 3), action.reason
    assert action.fails_again == repeat, "a scheduler resubmits only what may not fail again"
    if repeat:
        assert action.exit_code == 1
        assert f"{3 - used} of --max-restarts 3 left unused" in action.reason
        assert failure.user_frame in action.reason


@pytest.mark.parametrize(("used", "allowed", "expected"), [
    (0, 2, ActionKind.STOP),  # granted restarts are not spent on a failure that repeats
    (0, 0, ActionKind.STOP),
])
def test_user_code_granted_restarts_stop_on_a_repeat(used: int, allowed: int,
                                                     expected: ActionKind) -> None:
    bug = raised(FailureClass.USER_CODE, exception="ValueError")
    facts = FailureFacts((bug,), restarts_used=0, max_restarts=3, user_error_restarts_used=used,
                         restart_on_user_error=allowed, step_completed=False,
                         previous_failure=FailureSignature.of(bug))
    action = decide(facts)
    assert action.kind is expected
    if allowed:
        assert f"{allowed - used} of --restart-on-user-error {allowed} left unused" in \
            action.reason


@pytest.mark.parametrize(("record", "signature"), [
    (UNKNOWN_AT_12, ("unknown", "RuntimeError", "/job/train.py:12 in main")),
    (dataclasses.replace(UNKNOWN_AT_12, user_frame=None), ("unknown", "RuntimeError",
                                                           "/job/train.py:12 in main")),
    (dataclasses.replace(UNKNOWN_AT_12, user_frame="/job/a.py:3 in f"),
     ("unknown", "RuntimeError", "/job/a.py:3 in f")),
    (raised(FailureClass.UNKNOWN, exception=None), None),
    (raised(FailureClass.UNKNOWN, frame=None), None),
    (raised(FailureClass.STOP_REQUESTED), None),
    (raised(FailureClass.INFRASTRUCTURE), None),
    (failure(0, FailureClass.HANG), None),
])
def test_failure_signature(record: FailureRecord, signature: tuple[str, str, str] | None) -> None:
    got = FailureSignature.of(record)
    assert (None if got is None else tuple(got.to_json().values())) == signature


# What counts against a node, replicas, the checkpoint source, departed nodes.

def reported(cls: FailureClass, message: str = "", exception: str | None = None,
            rank: int = 0) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=0, pid=1, exitcode=1, failure_class=cls,
                         message=message, exception=exception)


@pytest.mark.parametrize(
    ("record", "offence"),
    [
        (reported(FailureClass.SIGNAL_CRASH), True),
        (reported(FailureClass.HANG, "hang: all_reduce ...; culprit: rank 1 on a"), True),
        (reported(FailureClass.HANG, "hang: step 5 in flight; culprit: not localised"), False),
        (reported(FailureClass.SLOW, "slow rank 1 on b: busy 300 ms per step vs 100 ms"), True),
        (reported(FailureClass.INFRASTRUCTURE, "CUDA error: uncorrectable ECC error"), True),
        (reported(FailureClass.INFRASTRUCTURE, "x", exception="NcclError"), True),
        (reported(FailureClass.INFRASTRUCTURE, "Connection closed by peer"), False),
        (reported(FailureClass.USER_CODE, "division by zero"), False),
        (reported(FailureClass.STOP_REQUESTED), False),
        (reported(FailureClass.UNKNOWN), False),
    ],
)
def test_what_counts_against_a_node(record: FailureRecord, offence: bool) -> None:
    assert is_node_offence(record) is offence


def test_pure_data_parallel_replicas() -> None:
    assert replicas_intact(2, [])
    assert replicas_intact(2, [0]) and replicas_intact(2, [1])
    assert not replicas_intact(2, [0, 1])
    assert not replicas_intact(1, [0])
    assert replicas_intact(1, [5])  # ranks outside the world are ignored
    assert not replicas_intact(0, [])


@pytest.mark.parametrize("lost", [set(c) for n in range(5) for c in
                                  itertools.combinations(range(8), n)])
def test_layout_replicas_exhaustively(lost: set[int]) -> None:
    # tp=2, pp=2, dp=2: shard (pp, tp) is held by ranks pp*4 + dp*2 + tp for dp in 0, 1.
    expected = all(
        not {p * 4 + d * 2 + t for d in range(2)} <= lost for p in range(2) for t in range(2)
    )
    assert replicas_intact(8, lost, (2, 2, 2)) is expected


def test_a_layout_that_does_not_match_has_no_replicas() -> None:
    assert not replicas_intact(8, [], (2, 2, 3))


@pytest.mark.parametrize(("intact", "available"), list(itertools.product([False, True], repeat=2)))
def test_checkpoint_source(intact: bool, available: bool) -> None:
    facts = FailureFacts((reported(FailureClass.SIGNAL_CRASH),), 0, 3, replicas_intact=intact,
                         jit_available=available)
    expected = CheckpointSource.JIT if intact and available else CheckpointSource.SNAPSHOT
    assert checkpoint_source(facts) is expected
    assert decide(facts).checkpoint is expected


@pytest.mark.parametrize(
    ("suspect", "offences", "limit", "can_evict"),
    list(itertools.product([False, True], range(4), range(3), [False, True])),
)
def test_hierarchy_restart_in_place_or_evict(suspect: bool, offences: int, limit: int,
                                             can_evict: bool) -> None:
    facts = FailureFacts((reported(FailureClass.SIGNAL_CRASH),), 0, 3, node_suspect=suspect,
                         node_offences=offences, repeat_offender_limit=limit,
                         can_evict=can_evict)
    repeat = 0 < limit <= offences
    reason = suspect_reason(facts)
    assert (reason is not None) is (suspect or repeat)
    action = decide(facts)
    if (suspect or repeat) and can_evict:
        assert action.kind is ActionKind.EVICT_NODE
        assert action.exit_code == 1
        assert ("failed health check" if suspect else "repeat offender") in action.reason
    else:
        assert action.kind is ActionKind.RESTART_IN_PLACE  # software fault / nowhere to go


def test_user_code_is_never_evicted() -> None:
    facts = FailureFacts((reported(FailureClass.USER_CODE, exception="TypeError"),), 0, 3,
                         node_suspect=True, can_evict=True, node_offences=9,
                         repeat_offender_limit=1)
    assert decide(facts).kind is ActionKind.STOP


def test_leader_quarantines_only_vanished_nodes() -> None:
    departed = [
        DepartedNode("dead", alive=False, blacklisted=False),
        DepartedNode("late", alive=True, blacklisted=False),
        DepartedNode("self-evicted", alive=False, blacklisted=True),
        DepartedNode("cut", alive=False, blacklisted=False),
    ]
    evictions = judge_departed(departed, previous_round=4)
    assert [e.node_id for e in evictions] == ["cut", "dead"]
    assert all("node disappeared: in round 4" in e.reason for e in evictions)
    assert judge_departed([], 0) == ()


# A diverged loss (NaN/inf or spike) restarts from the last snapshot, never a JIT checkpoint.

GROUP = GroupInfo("job", "node-a", Path("/tmp"), 1, 0, 1, 0,
                  tuple(WorkerInfo(r, r, 2, 100 + r) for r in range(2)))


def _facts(cls: FailureClass) -> FailureFacts:
    detection = Detection(cls, (1,), "loss_nan", "nan loss on rank 1 at step 7: loss is nan")
    return FailureFacts(detection.as_failures(GROUP), restarts_used=0, max_restarts=3,
                        replicas_intact=True, jit_available=True, can_evict=True)


def test_a_nan_loss_restarts_in_place_from_the_snapshot():
    action = decide(_facts(FailureClass.NUMERIC))
    assert action.kind is ActionKind.RESTART_IN_PLACE
    assert action.checkpoint is CheckpointSource.SNAPSHOT
    # The same facts for a hang would ask a healthy replica just in time.
    assert decide(_facts(FailureClass.HANG)).checkpoint is CheckpointSource.JIT


def test_a_nan_loss_is_not_held_against_the_node():
    [failure] = _facts(FailureClass.NUMERIC).failures
    assert failure.failure_class is FailureClass.NUMERIC
    assert not is_node_offence(failure)


def test_a_nan_loss_without_restarts_left_stops():
    facts = _facts(FailureClass.NUMERIC)
    spent = FailureFacts(facts.failures, restarts_used=3, max_restarts=3)
    assert decide(spent).kind is ActionKind.STOP
# Changes of membership: every one answered by a regroup in process or a restart, none spending
# a restart (a leaver's failed replacement is a failure, which the failure decision counts).
@pytest.mark.parametrize(("facts", "kind", "counted", "said"), [
    (ChangeFacts("join", "1 node(s) waiting", True), ActionKind.REGROUP_IN_PROCESS, False,
     "membership change: 1 node(s) waiting; the workers regroup in process"),
    (ChangeFacts("join", "2 node(s) waiting", False, "a recovery is under way"),
     ActionKind.RESTART_IN_PLACE, False,
     "membership change: 2 node(s) waiting; no regroup in process (a recovery is under way)"),
    (ChangeFacts("reshape", "ranks [(2, 4)] become [(0, 2)]", True,
                 "TP1 x DP4 -> TP1 x DP2: every survivor keeps its TP shard"),
     ActionKind.REGROUP_IN_PROCESS, False, "reshape in process: ranks [(2, 4)] become [(0, 2)]: "
     "TP1 x DP4 -> TP1 x DP2: every survivor keeps its TP shard"),
    (ChangeFacts("reshape", "ranks [(2, 4)] become [(0, 2)]", False,
                 "the state is sharded over DP (FSDP2)"),
     ActionKind.RESTART_IN_PLACE, False,
     "ranks [(2, 4)] become [(0, 2)]: they restart (the state is sharded over DP (FSDP2))"),
    (ChangeFacts("leaver", "local rank(s) [1] left the recovery of generation 2", True),
     ActionKind.REGROUP_IN_PROCESS, False, "its replacement joins the same generation"),
    (ChangeFacts("leaver", "local rank(s) [1] left the recovery of generation 2", False,
                 "its group had formed: a replacement cannot join it"),
     ActionKind.RESTART_IN_PLACE, True, "a failure of the recovery under way"),
], ids=["join", "join-blocked", "reshape-holds", "reshape-cannot-hold", "leaver",
        "leaver-unreplaceable"])
def test_a_change_of_membership_is_decided_with_its_reason(
        facts: ChangeFacts, kind: ActionKind, counted: bool, said: str) -> None:
    action = decide_change(facts)
    assert action.kind is kind
    assert said in action.reason
    assert action.spends_restart is counted
    assert not action.takes_jit  # the running workers keep their state


def test_a_failure_spends_a_restart_and_a_stop_does_not() -> None:
    crash = (failure(0, FailureClass.SIGNAL_CRASH),)
    assert decide(FailureFacts(crash, restarts_used=0, max_restarts=1)).spends_restart
    assert decide(FailureFacts(crash, restarts_used=0, max_restarts=1,
                               in_process=True)).spends_restart
    assert not decide(FailureFacts(crash, restarts_used=1, max_restarts=1)).spends_restart


# The just-in-time checkpoint: taken after the decision, by what it decided.
@pytest.mark.parametrize(("cls", "in_process", "nodes", "offending_here", "intact", "kind",
                          "source"), [
    (FailureClass.SIGNAL_CRASH, False, 1, True, True, ActionKind.RESTART_IN_PLACE,
     CheckpointSource.JIT),
    (FailureClass.SIGNAL_CRASH, False, 1, True, False, ActionKind.RESTART_IN_PLACE,
     CheckpointSource.SNAPSHOT),  # a shard lost every replica
    (FailureClass.SIGNAL_CRASH, True, 1, True, True, ActionKind.RECOVER_IN_PROCESS,
     CheckpointSource.SNAPSHOT),  # the survivors keep their state, restore their own snapshot
    (FailureClass.SIGNAL_CRASH, True, 2, False, True, ActionKind.RECOVER_IN_PROCESS,
     CheckpointSource.SNAPSHOT),  # another node's failure: this node's workers all survived
    (FailureClass.SIGNAL_CRASH, True, 2, True, True, ActionKind.RECOVER_IN_PROCESS,
     CheckpointSource.JIT),  # this node's rank failed: its replicas are asked, across nodes
    (FailureClass.USER_CODE, True, 1, False, True, ActionKind.STOP,
     CheckpointSource.JIT),  # not recovered in process: the replicas' state is saved
    (FailureClass.NUMERIC, True, 1, False, True, ActionKind.RESTART_IN_PLACE,
     CheckpointSource.SNAPSHOT),  # every replica holds the NaN
], ids=["restart", "restart-no-replica", "in-process", "in-process-other-node",
        "in-process-this-node-across-nodes", "stop", "divergence"])
def test_the_decision_chooses_the_just_in_time_checkpoint(
        cls: FailureClass, in_process: bool, nodes: int, offending_here: bool, intact: bool,
        kind: ActionKind, source: CheckpointSource) -> None:
    action = decide(FailureFacts((failure(0, cls),), restarts_used=0, max_restarts=3,
                                 in_process=in_process, nodes=nodes,
                                 offending_here=offending_here, replicas_intact=intact,
                                 jit_available=True))
    assert action.kind is kind
    assert action.checkpoint is source
    assert action.takes_jit is (source is CheckpointSource.JIT)


# A failure that comes back after an in-process recovery before the job passed the failure's
# step: the next recovery restarts every rank (another roll-back in the same processes would
# meet what the survivors kept); one past it is a new failure, recovered in process again.
@pytest.mark.parametrize(("failed_at", "newest", "kind", "said"), [
    (None, 20, ActionKind.RECOVER_IN_PROCESS, "in-process recovery 2 of --max-restarts 3"),
    (20, None, ActionKind.RECOVER_IN_PROCESS, "in-process recovery 2 of --max-restarts 3"),
    (20, 21, ActionKind.RECOVER_IN_PROCESS, "in-process recovery 2 of --max-restarts 3"),
    (20, 20, ActionKind.RESTART_IN_PLACE,
     "restart 2 of --max-restarts 3 of every rank, not in process (the failure came again at "
     "step 20 after an in-process recovery from a failure at step 20)"),
    (20, 19, ActionKind.RESTART_IN_PLACE, "came again at step 19"),
], ids=["first", "no-records", "past-it", "same-step", "before-it"])
def test_a_failure_that_comes_back_after_an_in_process_recovery_restarts_every_rank(
        failed_at: int | None, newest: int | None, kind: ActionKind, said: str) -> None:
    hang = (failure(1, FailureClass.HANG),)
    action = decide(FailureFacts(hang, restarts_used=1, max_restarts=3, in_process=True,
                                 newest_step=newest, in_process_failed_at=failed_at))
    assert action.kind is kind
    assert said in action.reason
    assert action.spends_restart


@pytest.mark.parametrize("cls", [FailureClass.SIGNAL_CRASH, FailureClass.INFRASTRUCTURE])
def test_a_second_crash_or_communication_error_at_the_same_step_is_recovered_in_process_again(
        cls: FailureClass) -> None:
    action = decide(FailureFacts((failure(1, cls),), restarts_used=1, max_restarts=3,
                                 in_process=True, newest_step=20, in_process_failed_at=20))
    assert action.kind is ActionKind.RECOVER_IN_PROCESS


def test_an_in_process_repeat_with_no_restart_left_stops() -> None:
    action = decide(FailureFacts((failure(1, FailureClass.HANG),), restarts_used=3,
                                 max_restarts=3, in_process=True, newest_step=20,
                                 in_process_failed_at=20))
    assert action.kind is ActionKind.STOP
