"""The recovery part of the pure policy: offences, suspect nodes, replicas, the checkpoint
source, and the leader's verdict on departed nodes, exhaustively over small cases."""

from __future__ import annotations

import itertools

import pytest

from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import (
    ActionKind,
    CheckpointSource,
    DepartedNode,
    FailureFacts,
    checkpoint_source,
    decide,
    is_node_offence,
    judge_departed,
    replicas_intact,
    suspect_reason,
)


def failure(cls: FailureClass, message: str = "", exception: str | None = None,
            rank: int = 0) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=0, pid=1, exitcode=1, failure_class=cls,
                         message=message, exception=exception)


@pytest.mark.parametrize(
    ("record", "offence"),
    [
        (failure(FailureClass.SIGNAL_CRASH), True),
        (failure(FailureClass.HANG, "hang: all_reduce ...; culprit: rank 1 on a"), True),
        (failure(FailureClass.HANG, "hang: step 5 in flight; culprit: not localised"), False),
        (failure(FailureClass.SLOW, "slow rank 1 on b: busy 300 ms per step vs 100 ms"), True),
        (failure(FailureClass.INFRASTRUCTURE, "CUDA error: uncorrectable ECC error"), True),
        (failure(FailureClass.INFRASTRUCTURE, "x", exception="NcclError"), True),
        (failure(FailureClass.INFRASTRUCTURE, "Connection closed by peer"), False),
        (failure(FailureClass.USER_CODE, "division by zero"), False),
        (failure(FailureClass.STOP_REQUESTED), False),
        (failure(FailureClass.UNKNOWN), False),
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
    facts = FailureFacts((failure(FailureClass.SIGNAL_CRASH),), 0, 3, replicas_intact=intact,
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
    facts = FailureFacts((failure(FailureClass.SIGNAL_CRASH),), 0, 3, node_suspect=suspect,
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
    facts = FailureFacts((failure(FailureClass.USER_CODE, exception="TypeError"),), 0, 3,
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
