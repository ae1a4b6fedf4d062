"""The job digest: what the leader keeps of every node's summary, and what it leaves out.

:func:`build_digest` is pure, so it is tested with tables of made-up nodes. The last tests judge
the same job twice, once with every rank's view (as every node read every summary before) and
once through the digest, and check that the hang verdict and its culprits are the same.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from elasticft.config import DiagConfig
from elasticft.diag import detectors as d
from elasticft.diag import verdict
from elasticft.diag.digest import (
    Digest,
    DigestLimits,
    build_digest,
    decode_digest,
    encode_digest,
    job_view,
)
from elasticft.diag.hangcheck import hang_limits
from elasticft.diag.summary import NodeSummary, RemoteNode

COMM = 0xABC


def _rank(rank: int, *, seq: int = 42, waiting: float | None = None, state: str | None = None,
          hb: float | None = 0.05, steps: int = 10) -> d.RankView:
    """A rank of a job of one communicator; ``waiting``: in flight at call ``seq`` that long."""
    in_flight = () if waiting is None else (d.InFlight("all_reduce", COMM, seq, waiting, "ring"),)
    return d.RankView(rank, "", pid=1000 + rank, process_state=state, heartbeat_age_s=hb,
                      in_flight=in_flight, comm_seqs={COMM: seq}, steps=steps)


def _job(views: list[d.RankView], per_node: int = 8, busy: dict[int, float] | None = None,
         silent: tuple[int, ...] = ()) -> list[RemoteNode]:
    """Nodes of ``per_node`` ranks each, as the leader read them (fresh unless in ``silent``)."""
    nodes = []
    for start in range(0, len(views), per_node):
        group_rank = start // per_node
        name = f"n{group_rank}"
        chunk = tuple(dataclasses.replace(v, node=name) for v in views[start:start + per_node])
        node_busy = {v.rank: (busy or {}).get(v.rank, 0.1) for v in chunk}
        fresh = group_rank not in silent
        nodes.append(RemoteNode(group_rank, NodeSummary(name, group_rank, 5, chunk, node_busy),
                                0.2 if fresh else 9.0, fresh))
    return nodes


def _kept(views: list[d.RankView], **kwargs) -> tuple[list[int], Digest]:
    digest = build_digest(_job(views, **kwargs), 0, 1)
    return sorted(v.rank for n in digest.nodes for v in n.views), digest


LIMITS = DigestLimits()


@pytest.mark.parametrize("name, views, kept, omitted", [
    ("small job: every rank", [_rank(r) for r in range(16)], list(range(16)), 0),
    ("healthy large job: a few ranks outside collectives, lowest step first",
     [_rank(r, steps=10 + (r % 3 != 0)) for r in range(256)], [0, 3, 6, 9], 252),
    ("a stopped rank and a late heartbeat",
     [_rank(r, waiting=1.0, state={77: "T"}.get(r), hb={200: 1.5}.get(r, 0.05))
      for r in range(256)], [0, 77, 200], 253),
    ("the rank behind and the longest waiter",
     [_rank(r, waiting=None if r == 150 else 2.0 + (r == 31), seq=41 if r == 150 else 42)
      for r in range(256)], [0, 31, 150], 253),
    ("a silent node's ranks are not judged on old facts",
     [_rank(r) for r in range(16)], list(range(8, 16)), 0),
])
def test_what_the_digest_keeps(name, views, kept, omitted):
    silent = (0,) if "silent" in name else ()
    got, digest = _kept(views, silent=silent)
    assert got == kept, name
    assert digest.omitted == omitted, name
    assert [s.group_rank for s in digest.silent] == list(silent)
    # Round trip: what a reader decodes is what the leader built.
    assert decode_digest(encode_digest(digest)) == digest


def test_positions_name_the_newest_call_and_the_ranks_behind():
    views = [_rank(r, waiting=None if r in (5, 9) else 1.5, seq=41 if r in (5, 9) else 42)
             for r in range(128)]
    _, digest = _kept(views)
    assert digest.positions[COMM] == {
        "members": 128, "newest": 42, "lowest": 41, "lowest_ranks": [5, 9], "at_lowest": 2,
        "longest": {"rank": 0, "comm_seq": 42, "age_s": 1.5}}


def test_caps_hold_whatever_the_number_of_ranks():
    everyone_stopped = [_rank(r, state="T", waiting=3.0) for r in range(512)]
    kept, digest = _kept(everyone_stopped)
    assert len(kept) == LIMITS.max_views and digest.omitted == 512 - LIMITS.max_views
    # A healthy job's digest is the same size at 128 and at 2048 ranks.
    sizes = [len(encode_digest(build_digest(_job([_rank(r) for r in range(n)]), 0, 1)))
             for n in (128, 2048)]
    assert sizes[1] < 1.2 * sizes[0], sizes
    many_silent = build_digest(_job([_rank(r) for r in range(8 * 200)],
                                    silent=tuple(range(100))), 0, 1)
    assert len(many_silent.silent) == LIMITS.max_silent and many_silent.silent_count == 100


def test_busy_times_of_a_large_job_keep_the_busiest_and_the_middle():
    busy = {r: 0.1 + 0.001 * (r % 7) for r in range(256)}
    busy[200] = 0.5
    digest = build_digest(_job([_rank(r) for r in range(256)], busy=busy), 0, 1)
    kept = {r: b for n in digest.nodes for r, b in n.busy.items()}
    assert len(kept) == LIMITS.top_busy and 200 in kept
    assert digest.busy_stats is not None and digest.busy_stats.count == 256
    # Each kept rank is compared with the median of ALL its peers, as find_slow does.
    found = d.find_slow_among({200: 0.5}, digest.busy_stats, 1.5, 0.05)
    others = [b for r, b in busy.items() if r != 200]
    assert [(s.rank, s.peers_median_s) for s in found] == [(200, statistics.median(others))]
    assert d.find_slow(busy, 1.5, 0.05)[0].rank == 200


def test_a_reader_leaves_out_its_own_node_and_adds_the_digests_age():
    digest = build_digest(_job([_rank(r) for r in range(16)], silent=(1,)), 0, 3, LIMITS, "n0")
    view = job_view(digest, own_group_rank=0, digest_age_s=0.5)
    assert view.views == () and [n.node for n in view.silent] == ["n1"]
    assert view.silent[0].age_s == pytest.approx(9.5)
    other = job_view(digest, own_group_rank=1, digest_age_s=0.5)
    assert [v.rank for v in other.views] == list(range(8))
    assert {v.view_age_s for v in other.views} == {0.7}  # the leader's 0.2 s + the digest's 0.5 s


# -- the same verdicts through the digest -------------------------------------------------------

LIMITS_HANG = dataclasses.replace(hang_limits(DiagConfig()), min_samples=3)


def _judge(local: list[d.RankView], remote: list[d.RankView]) -> verdict.HangVerdict:
    views = local + remote
    evidence = []
    for v in views:
        call = max(v.in_flight, key=lambda c: c.age_s, default=None)
        evidence.append(verdict.RankEvidence(
            v.rank, v.process_state or "S", v.heartbeat_age_s, 0.0 if v in local else None,
            None, None, None if call is None else _call(call),
            in_flight=tuple(_call(c) for c in v.in_flight), comm_positions=dict(v.comm_seqs),
            facts_age_s=v.view_age_s))
    return verdict.judge(verdict.JobSnapshot(tuple(evidence), (0.01,) * 5), LIMITS_HANG)


def _call(call: d.InFlight) -> verdict.Call:
    return verdict.Call(call.op, call.comm, call.comm_seq, call.age_s)


@pytest.mark.parametrize("name, make", [
    ("a remote rank stopped while all wait",
     lambda r: _rank(r, waiting=None if r == 300 else 4.0, state="T" if r == 300 else None,
                     hb=3.0 if r == 300 else 0.05, seq=41 if r == 300 else 42)),
    ("a remote rank alive outside collectives: working, not a hang",
     lambda r: _rank(r, waiting=None if r == 300 else 9.0, seq=41 if r == 300 else 42)),
    ("every rank stuck in the same call",
     lambda r: _rank(r, waiting=9.0 - r * 0.001)),
    ("every rank stuck, a remote rank one call behind the others",
     lambda r: _rank(r, waiting=9.0 - r * 0.001, seq=41 if r == 300 else 42)),
    ("healthy", lambda r: _rank(r, steps=10 + r % 2)),
])
def test_the_verdict_through_the_digest_is_the_verdict_on_every_rank(name, make):
    ranks = [make(r) for r in range(512)]
    nodes = _job(ranks)
    local = [v for v in nodes[0].summary.views]  # this node: group rank 0, ranks 0-7
    full_remote = [dataclasses.replace(v, view_age_s=0.2)
                   for n in nodes[1:] for v in n.summary.views]
    through = list(job_view(build_digest(nodes, 0, 1), 0, 0.0).views)
    assert len(through) <= LIMITS.max_views
    full = _judge(local, full_remote)
    digest = _judge(local, through)
    assert (digest.kind, digest.hang) == (full.kind, full.hang), name
    if full.kind == "working":  # the ranks waited for: some of them, never another
        assert digest.culprits and set(digest.culprits) <= set(full.culprits), name
    else:
        assert digest.culprits == full.culprits, name
