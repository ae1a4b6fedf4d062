"""The pure recovery policy, exhaustively over failure classes and budgets, and its answers to
changes of membership and the choice of the just-in-time checkpoint."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import (
    ActionKind,
    ChangeFacts,
    CheckpointSource,
    FailureFacts,
    FailureSignature,
    decide,
    decide_change,
    root_cause,
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
