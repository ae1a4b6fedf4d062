"""The rendezvous round decisions (elasticft.rendezvous.protocol), as tables of cases."""

from __future__ import annotations

import dataclasses

import pytest

from elasticft.rendezvous.protocol import (
    MoveKind,
    RoundPoll,
    decide,
    restart_needed,
    round_may_close,
    select_participants,
    waits_as_standby,
)

# A coordinator "me" of round 3 with 2..4 nodes, nothing decided yet.
BASE = RoundPoll(round=3, node_id="me", min_nodes=2, max_nodes=4, coordinator="me", joined=1,
                 last_round=2, last_call_s=30.0, waited_s=5.0, join_timeout_s=600.0)

DECIDE_CASES = [
    # (what changes from BASE, verdict, fast poll)
    ({}, MoveKind.WAIT, True),
    ({"joined": 4}, MoveKind.CLOSE, False),
    ({"joined": 5}, MoveKind.CLOSE, False),
    ({"joined": 2, "quorum_for_s": 10.0}, MoveKind.WAIT, True),
    ({"joined": 2, "quorum_for_s": 30.0}, MoveKind.CLOSE, False),
    # a full round waits for a live participant of the previous round, past the last call
    ({"joined": 4, "previous_remaining": 1, "quorum_for_s": 1.0}, MoveKind.WAIT, True),
    ({"joined": 4, "previous_remaining": 1, "quorum_for_s": 30.0}, MoveKind.WAIT, True),
    ({"joined": 4, "previous_remaining": 1, "quorum_for_s": 90.0}, MoveKind.CLOSE, False),
    # any round waits past the last call for a live participant of the previous round that is
    # stopping its workers, else two nodes take turns closing a round alone; not for ever
    ({"joined": 2, "previous_remaining": 1, "quorum_for_s": 30.0}, MoveKind.WAIT, True),
    ({"joined": 2, "previous_remaining": 1, "quorum_for_s": 89.0}, MoveKind.WAIT, True),
    ({"joined": 2, "previous_remaining": 1, "quorum_for_s": 90.0}, MoveKind.CLOSE, False),
    ({"joined": 2, "previous_remaining": 0, "quorum_for_s": 30.0}, MoveKind.CLOSE, False),
    ({"joined": 2, "previous_remaining": 1, "quorum_for_s": 35.0, "rejoin_s": 5.0},
     MoveKind.CLOSE, False),
    # everyone alive is in: a shrink (or a restart of all) closes at once, without the last
    # call; a node whose death is not known yet, or a scale-up, still gets it
    ({"joined": 2, "previous_size": 3, "previous_remaining": 0, "quorum_for_s": 0.0},
     MoveKind.CLOSE, False),
    ({"joined": 3, "previous_size": 3, "previous_remaining": 0, "quorum_for_s": 0.0},
     MoveKind.CLOSE, False),
    ({"joined": 2, "previous_size": 3, "previous_remaining": 1, "quorum_for_s": 0.0},
     MoveKind.WAIT, True),
    ({"joined": 3, "previous_size": 2, "previous_remaining": 0, "quorum_for_s": 0.0},
     MoveKind.WAIT, True),
    ({"joined": 1, "previous_size": 3, "previous_remaining": 0}, MoveKind.WAIT, True),
    ({"joined": 2, "previous_size": 3, "previous_remaining": None, "quorum_for_s": 0.0,
      "coordinator": "other"}, MoveKind.WAIT, False),
    # the gate: the previous round is full and running, so no round of standbys
    ({"joined": 4, "may_close": False}, MoveKind.WAIT, False),
    # not the coordinator: only waits, slowly
    ({"coordinator": "other", "joined": 4}, MoveKind.WAIT, False),
    ({"coordinator": None}, MoveKind.WAIT, False),
    # the result is out
    ({"result": ("a", "me")}, MoveKind.PARTICIPANT, False),
    ({"result": ("a", "b", "c", "d")}, MoveKind.STANDBY, False),
    ({"result": ("a", "b")}, MoveKind.LATE, False),
    ({"result": ("a", "me"), "job_closed": True}, MoveKind.PARTICIPANT, False),
    # the round closed and its result is gone, or this node joined a round already past
    ({"last_round": 3}, MoveKind.LATE, False),
    ({"last_round": 7, "coordinator": "other"}, MoveKind.LATE, False),
    ({"job_closed": True}, MoveKind.CLOSED, False),
    ({"joined_present": False, "joined": 4}, MoveKind.REJOIN, False),
    ({"waited_s": 600.0}, MoveKind.TIMEOUT, False),
    ({"waited_s": 900.0, "coordinator": "other"}, MoveKind.TIMEOUT, False),
    # a standby of a full job has no join timeout (as in torch's redundancy list)
    ({"waited_s": 900.0, "standby": True, "may_close": False}, MoveKind.WAIT, False),
    ({"waited_s": 900.0, "standby": True, "job_closed": True}, MoveKind.CLOSED, False),
]


@pytest.mark.parametrize(("change", "verdict", "fast"), DECIDE_CASES)
def test_decide(change: dict, verdict: MoveKind, fast: bool) -> None:
    decision = decide(dataclasses.replace(BASE, **change))
    assert (decision.kind, decision.fast) == (verdict, fast), decision.reason
    assert decision.reason


GATE_CASES = [
    # (round, previous size, previous restarted, previous remaining, may close)
    (0, None, False, None, True),  # the first round
    (3, None, False, None, True),  # the previous result is gone
    (3, 2, False, 2, True),  # the previous round had room (max 4)
    (3, 4, False, 4, False),  # full and all still there: standbys wait
    (3, 4, False, None, False),  # full, not counted (not the coordinator)
    (3, 4, True, 4, True),  # a participant came back to rendezvous
    (3, 4, False, 3, True),  # a participant's lease expired
]


@pytest.mark.parametrize(("round_", "size", "restarted", "remaining", "expected"), GATE_CASES)
def test_round_may_close(round_: int, size: int | None, restarted: bool, remaining: int | None,
                         expected: bool) -> None:
    assert round_may_close(round_, size, restarted, remaining, max_nodes=4) is expected


@pytest.mark.parametrize(("size", "restarted", "expected"), [
    (None, False, False), (2, False, False), (4, False, True), (4, True, False),
])
def test_waits_as_standby(size: int | None, restarted: bool, expected: bool) -> None:
    assert waits_as_standby(size, restarted, max_nodes=4) is expected


SELECT_CASES = [
    # (joined in join order, previous participants in rank order, max, expected ranks)
    (["a", "b", "c"], [], 4, ("a", "b", "c")),
    (["c", "a", "b"], [], 4, ("a", "b", "c")),  # newcomers ranked by node id
    (["c", "a", "b"], [], 2, ("a", "c")),  # ... after first come, first served
    (["s", "b", "a"], ["a", "b"], 4, ("a", "b", "s")),  # old ranks kept, newcomer last
    (["s", "b", "a"], ["b", "a"], 4, ("b", "a", "s")),
    (["s", "b"], ["a", "b"], 2, ("b", "s")),  # a is gone: the standby takes its place
    (["t", "s", "b", "a"], ["a", "b"], 3, ("a", "b", "t")),  # previous first, then join order
    (["a", "b", "c"], ["a", "b", "c"], 2, ("a", "b")),
    ([], ["a"], 2, ()),
]


@pytest.mark.parametrize(("joined", "previous", "max_nodes", "expected"), SELECT_CASES)
def test_select_participants(joined: list[str], previous: list[str], max_nodes: int,
                             expected: tuple[str, ...]) -> None:
    assert select_participants(joined, previous, max_nodes) == expected


RESTART_CASES = [
    # (round size, last round, restart requested, next round joined, answer) for round 5, max 4
    (4, 5, False, 0, 0),  # nothing happens
    (4, 5, False, 2, 0),  # standbys wait while the job is full: no restart
    (3, 5, False, 1, 1),  # room, and a node waits for it
    (3, 5, False, 0, 0),
    (4, 5, True, 0, 1),  # a participant came back to rendezvous
    (4, 5, True, 3, 3),
    (4, 6, False, 0, 1),  # a round closed without this node
]


@pytest.mark.parametrize(("size", "last", "restart", "joined", "answer"), RESTART_CASES)
def test_restart_needed(size: int, last: int, restart: bool, joined: int, answer: int) -> None:
    assert restart_needed(5, size, last, restart, joined, max_nodes=4, round_remaining=size) \
        == answer


@pytest.mark.parametrize(("remaining", "joined", "answer"), [
    (3, 1, 1),  # a participant was lost and a standby waits: it takes the place
    (3, 0, 0),  # lost, nobody waits: the workers' own failure decides
    (4, 2, 0),  # all alive, full: the standbys keep waiting
    (None, 2, 0),
])
def test_restart_when_a_participant_is_lost(remaining: int | None, joined: int,
                                            answer: int) -> None:
    assert restart_needed(5, 4, 5, False, joined, max_nodes=4, round_remaining=remaining) \
        == answer


def test_only_group_rank_0_leads() -> None:
    from elasticft.rendezvous.handler import RoundView

    assert [RoundView(3, rank, 2).is_leader for rank in (0, 1)] == [True, False]
