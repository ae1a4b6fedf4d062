"""The hang verdict as a table: each row a job snapshot and the verdict it must give."""

from __future__ import annotations

import dataclasses

import pytest

from elasticft.config import DiagConfig
from elasticft.diag.hangcheck import hang_limits
from elasticft.diag.stacks import stack_signature
from elasticft.diag.verdict import (
    Call,
    JobSnapshot,
    RankEvidence,
    group_stacks,
    judge,
    stacks_wanted,
)

LIMITS = hang_limits(DiagConfig())
"""The ``hang_*`` options' defaults."""
HISTORY = [0.01] * 50  # 5 x p99 = 0.05 s: the 3 s floor rules
AR = "all_reduce"


def waiting(rank: int, age: float, cpu: float = 0.01, source: str = "py", seq: int = 31,
            gpu: bool | None = None) -> RankEvidence:
    return RankEvidence(rank, "S", 0.1, cpu, None, gpu, Call(AR, 0x1A, seq, age, source))  # type: ignore[arg-type]


MAIN = "wait (x.py)\nstep (t.py)"
ELSEWHERE = "compute (m.py)\nstep (t.py)"


def sampled(rank: int, stack: str, age: float = 3.5, seq: int = 31) -> RankEvidence:
    """A rank waiting in the collective whose stack py-spy read ('' when it could not)."""
    return dataclasses.replace(waiting(rank, age, seq=seq), stack=stack,
                               comm_positions={0x1A: seq})


def positioned(rank: int, age: float, seq: int, facts_age_s: float = 0.0,
               comm: int = 0x1A) -> RankEvidence:
    """A rank waiting in call ``seq`` of ``comm``, its position known on 0x1A."""
    positions = {0x1A: seq} if comm == 0x1A else {0x1A: 41, comm: seq}
    return RankEvidence(rank, "S", 0.1, 0.01, None, None, Call(AR, comm, seq, age),
                        comm_positions=positions, facts_age_s=facts_age_s)


CASES = [
    # (name, ranks, history, kind, hang, culprits)
    ("nobody waits", [RankEvidence(0, "R", 0.1, 1.0), RankEvidence(1, "R", 0.1, 1.0)],
     HISTORY, "healthy", False, ()),
    ("SIGSTOP: stopped, stale heartbeat, peer waits",
     [RankEvidence(0, "T", 2.5, 0.0), waiting(1, 2.4)], HISTORY, "frozen", True, (0,)),
    ("stopped but peer has not waited past staleness yet",
     [RankEvidence(0, "T", 2.5, 0.0), waiting(1, 1.0)], HISTORY, "healthy", False, ()),
    ("stopped inside the collective itself",
     [RankEvidence(0, "T", 3.0, 0.0, call=Call(AR, 0x1A, 31, 3.0)), waiting(1, 3.0)],
     HISTORY, "frozen", True, (0,)),
    ("zombie while peer waits", [RankEvidence(0, "Z", 5.0), waiting(1, 2.5)],
     HISTORY, "frozen", True, (0,)),
    ("process gone while peer waits", [RankEvidence(0, None, 5.0), waiting(1, 2.5)],
     HISTORY, "frozen", True, (0,)),
    ("D without CPU, stale heartbeat", [RankEvidence(0, "D", 4.0, 0.0), waiting(1, 3.0)],
     HISTORY, "frozen", True, (0,)),
    ("D but CPU advancing (page-cache writeback of torch.save)",
     [RankEvidence(0, "D", 4.0, 0.6), waiting(1, 40.0)], HISTORY, "working", False, (0,)),
    ("busy 40 s outside collectives at 100% CPU",
     [RankEvidence(0, "R", 0.1, 1.0, stack_top="evaluate (train.py)"), waiting(1, 40.0)],
     HISTORY, "working", False, (0,)),
    ("rank 0 in torch.save 60 s, GIL held so heartbeat stale, CPU busy",
     [RankEvidence(0, "R", 60.0, 0.9), waiting(1, 60.0)], HISTORY, "working", False, (0,)),
    ("data loader stalled 30 s: sleeping, beating, no CPU",
     [RankEvidence(0, "S", 0.1, 0.0), waiting(1, 30.0)], HISTORY, "working", False, (0,)),
    ("stopped while the peer blocks outside recorded collectives (no step for 3 s)",
     [RankEvidence(0, "T", 2.5, 0.0), RankEvidence(1, "S", 0.1, 0.0, step_age_s=3.0)],
     HISTORY, "frozen", True, (0,)),
    ("stopped, peer still stepping", [RankEvidence(0, "T", 2.5, 0.0),
                                      RankEvidence(1, "R", 0.1, 1.0, step_age_s=0.5)],
     HISTORY, "healthy", False, ()),
    ("end of run: rank 0 exited, rank 1 finishing outside collectives",
     [RankEvidence(0, "Z", 5.0), RankEvidence(1, "R", 0.1, 1.0, step_age_s=4.0)],
     HISTORY, "healthy", False, ()),
    ("a long step alone on every rank (evaluation), nobody in a collective",
     [RankEvidence(0, "S", 0.1, 0.0, step_age_s=50.0),
      RankEvidence(1, "S", 0.1, 0.0, step_age_s=50.0)], HISTORY, "healthy", False, ()),
    ("end of run: every recorder silent, nobody in a collective (interpreters exiting)",
     [RankEvidence(0, "R", 8.2, step_age_s=8.3), RankEvidence(1, "R", 8.2, step_age_s=8.3)],
     HISTORY, "healthy", False, ()),
    ("recorder silent but its process running, peer stepping outside collectives",
     [RankEvidence(0, "R", 8.2, step_age_s=8.3), RankEvidence(1, "R", 0.1, step_age_s=8.3)],
     HISTORY, "healthy", False, ()),
    ("rank behind: never entered the collective its peer waits in, alive outside collectives",
     [waiting(0, 6.0, seq=42), RankEvidence(1, "S", 0.1, 0.0, step_age_s=6.0)],
     HISTORY, "working", False, (1,)),
    ("rank behind and stopped: the peer waits in the collective it never entered",
     [waiting(0, 6.0, seq=42), RankEvidence(1, "T", 6.0, 0.0, step_age_s=6.0)],
     HISTORY, "frozen", True, (1,)),
    ("busy past the ceiling", [RankEvidence(0, "R", 0.1, 1.0), waiting(1, 1801.0)],
     HISTORY, "busy_too_long", True, (0,)),
    ("all in the same collective, idle, past the floor", [waiting(0, 3.5), waiting(1, 3.5)],
     HISTORY, "stuck", True, ()),
    ("all in the same collective past the floor, no CPU, but one stack moving",
     [waiting(0, 3.5), RankEvidence(1, "S", 0.1, 0.01, True, None, Call(AR, 0x1A, 31, 3.5))],
     HISTORY, "working", False, (1,)),
    ("all in the same collective, within the floor", [waiting(0, 2.5), waiting(1, 2.5)],
     HISTORY, "healthy", False, ()),
    ("adaptive: slow collectives stretch the timeout", [waiting(0, 20.0), waiting(1, 20.0)],
     [5.0] * 50, "healthy", False, ()),
    ("adaptive: 5 x p99 passed", [waiting(0, 26.0), waiting(1, 26.0)],
     [5.0] * 50, "stuck", True, ()),
    ("first step: no history, 60 s in the first collective", [waiting(0, 60.0), waiting(1, 60.0)],
     [], "healthy", False, ()),
    ("fewer durations than hang_min_samples: the start-up timeout still rules",
     [waiting(0, 60.0), waiting(1, 60.0)], [0.01] * 9, "healthy", False, ()),
    ("first step: no history, past the start-up timeout", [waiting(0, 601.0), waiting(1, 601.0)],
     [], "stuck", True, ()),
    ("all in a collective but one burns CPU (gloo side still working)",
     [waiting(0, 10.0, cpu=0.9), waiting(1, 10.0)], HISTORY, "working", False, (0,)),
    # GPU: the recorder beats while the stream is stuck, and a host spinning on the stream shows
    # CPU: only the NCCL end events count.
    ("GPU: NCCL kernel end event not reached, host spinning",
     [waiting(0, 5.0, cpu=1.0, source="nccl", gpu=False)], HISTORY, "stuck", True, ()),
    ("GPU: kernels still completing", [waiting(0, 5.0, cpu=1.0, source="nccl", gpu=True)],
     HISTORY, "working", False, (0,)),
    ("GPU: first compile, no history", [waiting(0, 60.0, cpu=1.0, source="nccl", gpu=False)],
     [], "healthy", False, ()),
    ("different collectives, nothing completing", [waiting(0, 4.0, seq=30), waiting(1, 4.0)],
     HISTORY, "stuck", True, ()),
    # Who a stuck job waits for: process state, heartbeat, positions, then stacks.
    ("stuck: a rank stopped inside the call, its heartbeat still fresh",
     [RankEvidence(0, "T", 0.1, 0.0, call=Call(AR, 0x1A, 31, 3.5)), waiting(1, 3.5)],
     HISTORY, "stuck", True, (0,)),
    ("stuck: a rank's recorder silent past the staleness (GIL held in C code)",
     [RankEvidence(0, "S", 8.0, 0.0, call=Call(AR, 0x1A, 31, 3.5)), waiting(1, 3.5)],
     HISTORY, "stuck", True, (0,)),
    ("stuck: a rank behind on the communicator never reached the call its peer waits in",
     [positioned(0, 4.0, 42), positioned(1, 4.0, 41)], HISTORY, "stuck", True, (1,)),
    ("stuck: a rank known only from facts older than the wait is not called behind",
     [positioned(0, 5.0, 42), positioned(1, 5.0, 3, facts_age_s=6.0, comm=0x2B)],
     HISTORY, "stuck", True, ()),
    ("stuck: a rank known from facts newer than the wait is called behind",
     [positioned(0, 5.0, 42), positioned(1, 5.0, 3, facts_age_s=1.0, comm=0x2B)],
     HISTORY, "stuck", True, (1,)),
    ("stuck: stacks disagree and nothing else is known: the minority is named",
     [sampled(0, MAIN), sampled(1, MAIN), sampled(2, ELSEWHERE)], HISTORY, "stuck", True, (2,)),
    ("stuck: every stack alike: nobody named",
     [sampled(0, MAIN), sampled(1, MAIN), sampled(2, MAIN)], HISTORY, "stuck", True, ()),
    ("stuck: two stacks against two, no majority: nobody named",
     [sampled(0, MAIN), sampled(1, MAIN), sampled(2, ELSEWHERE), sampled(3, ELSEWHERE)],
     HISTORY, "stuck", True, ()),
    ("stuck: one stack could not be read while the others agree: that rank is named",
     [sampled(0, MAIN), sampled(1, MAIN), sampled(2, "")], HISTORY, "stuck", True, (2,)),
    ("stuck: no stack could be read (no py-spy, no permission): stacks name nobody",
     [sampled(0, ""), sampled(1, ""), sampled(2, "")], HISTORY, "stuck", True, ()),
    ("stuck: a rank behind outranks a stack outlier",
     [sampled(0, MAIN, seq=42), sampled(1, MAIN, seq=41), sampled(2, ELSEWHERE, seq=42)],
     HISTORY, "stuck", True, (1,)),
    ("stacks disagree but the wait is within the timeout: healthy",
     [sampled(0, MAIN, age=2.5), sampled(1, ELSEWHERE, age=2.5), sampled(2, MAIN, age=2.5)],
     HISTORY, "healthy", False, ()),
    ("a frozen rank is the culprit whatever the stacks say",
     [dataclasses.replace(RankEvidence(0, "T", 2.5, 0.0), stack=MAIN),
      sampled(1, ELSEWHERE, age=2.4), sampled(2, ELSEWHERE, age=2.4)],
     HISTORY, "frozen", True, (0,)),
]


@pytest.mark.parametrize("name,ranks,history,kind,hang,culprits", CASES, ids=[c[0] for c in CASES])
def test_verdict_table(name: str, ranks: list[RankEvidence], history: list[float], kind: str,
                       hang: bool, culprits: tuple[int, ...]) -> None:
    verdict = judge(JobSnapshot(tuple(ranks), history), LIMITS)
    assert (verdict.kind, verdict.hang, verdict.culprits) == (kind, hang, culprits), verdict.what
    assert set(verdict.evidence) == {r.rank for r in ranks}


@pytest.mark.parametrize("name,ranks,history,kind,hang,culprits", CASES, ids=[c[0] for c in CASES])
def test_stacks_are_wanted_for_the_ranks_of_a_hang_the_other_evidence_finds(
        name: str, ranks: list[RankEvidence], history: list[float], kind: str, hang: bool,
        culprits: tuple[int, ...]) -> None:
    bare = JobSnapshot(tuple(dataclasses.replace(r, stack=None, stack_changed=None)
                             for r in ranks), history)
    cheap = judge(bare, LIMITS)
    assert stacks_wanted(bare, LIMITS) == ({*cheap.culprits, *cheap.waiting} if cheap.hang
                                           else set())


def test_culprits_named_by_their_stacks_alone_say_so() -> None:
    alone = judge(JobSnapshot((sampled(0, MAIN), sampled(1, MAIN), sampled(2, ELSEWHERE)),
                              HISTORY), LIMITS)
    assert alone.culprits == (2,) and alone.named_by_stacks
    behind = judge(JobSnapshot((sampled(0, MAIN, seq=42), sampled(1, MAIN, seq=41),
                                sampled(2, ELSEWHERE, seq=42)), HISTORY), LIMITS)
    assert behind.culprits == (1,) and not behind.named_by_stacks


def test_frozen_verdict_names_its_evidence() -> None:
    verdict = judge(JobSnapshot((RankEvidence(0, "T", 2.5, 0.0), waiting(1, 2.4)), HISTORY),
                    LIMITS)
    assert "stopped (state T)" in verdict.evidence[0]
    assert "heartbeat 2.5 s old" in verdict.evidence[0]
    assert "in all_reduce #31" in verdict.evidence[1]
    assert verdict.to_json()["culprits"] == [0]


def test_stuck_verdict_carries_the_stack_groups_and_the_culprits_reason() -> None:
    verdict = judge(JobSnapshot((sampled(0, MAIN), sampled(1, MAIN), sampled(2, ELSEWHERE)),
                                HISTORY), LIMITS)
    assert verdict.culprits == (2,)
    assert verdict.evidence[2].startswith("stack differs from the majority: compute (m.py)")
    assert verdict.stacks is not None
    assert verdict.stacks.to_json() == {"healthy": [0, 1], "outliers": {"2": "compute (m.py)"},
                                        "shared_comm": "1a", "unreadable": []}
    positions = judge(JobSnapshot((positioned(0, 4.0, 42), positioned(1, 4.0, 41)), HISTORY),
                      LIMITS)
    assert positions.evidence[1].startswith("never reached all_reduce #42 on comm 1a")
    assert positions.stacks is None  # no stack sampled: none in the event either


def test_stack_grouping_names_the_minority_and_the_group_it_shares() -> None:
    main = 'Thread 1 (idle): "MainThread"\n    wait (x.py:3)\n    step (t.py:9)\n'
    other = 'Thread 2 (active): "MainThread"\n    compute (m.py:77)\n'
    assert stack_signature(main) == "wait (x.py)\nstep (t.py)"
    assert stack_signature(main, line_numbers=True) == "wait (x.py:3)\nstep (t.py:9)"
    signatures = {0: stack_signature(main), 1: stack_signature(main.replace(":3", ":4")),
                  2: stack_signature(other), 3: ""}
    groups = group_stacks(signatures, {r: {1, 10 + r // 2} for r in range(4)})
    assert groups.healthy == (0, 1) and groups.unreadable == (3,)
    assert set(groups.outliers) == {2, 3} and groups.outliers[2] == "compute (m.py)"
    assert groups.shared_comm == 11  # the smaller group ranks 2 and 3 share
    nothing = group_stacks({0: "", 1: ""})
    assert (nothing.outliers, nothing.unreadable) == ({}, (0, 1))


def test_working_verdict_says_what_the_busy_rank_does() -> None:
    verdict = judge(JobSnapshot((RankEvidence(0, "R", 0.1, 1.0, stack_top="evaluate (t.py)"),
                                 waiting(1, 40.0)), HISTORY), LIMITS)
    assert "rank 0" in verdict.what and "evaluate (t.py)" in verdict.what
    assert "CPU 100%" in verdict.what


def test_the_hang_options_map_onto_the_verdicts_limits(tmp_path) -> None:
    from elasticft.diag.monitor import hang_limits
    from elasticft.run import parse

    script = tmp_path / "train.py"
    script.write_text("")
    _, config = parse(["--standalone", "--hang-busy-ceiling-s", "900", str(script)])
    assert hang_limits(config.diag).busy_ceiling_s == 900.0
    tuned = dataclasses.replace(config.diag, hang_collective_floor_s=8.0)  # Python API only
    assert hang_limits(tuned).collective_floor_s == 8.0
    _, config = parse(["--standalone", str(script)])
    assert hang_limits(config.diag).collective_floor_s == 3.0
    assert hang_limits(config.diag).busy_ceiling_s == 1800.0
