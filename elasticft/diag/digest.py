"""The job digest: one small document, built by the round's leader, that the other nodes judge by.

Every node publishes its summary (:mod:`elasticft.diag.summary`) once per interval. Reading every
other node's summary at every node is O(N^2) reads and bytes across the job, so the leader
(group rank 0 of the round) alone reads them all, and publishes one digest (key
``elasticft.diag.digest``) that the others read instead: one read per node per poll, and bytes
that do not grow with N once the job has more than :attr:`DigestLimits.full_ranks` ranks.

What the detectors need from other nodes' ranks, and so what a digest keeps
(:func:`build_digest`, a pure function):

* a job of up to ``full_ranks`` ranks: every rank's view and busy time, as if read directly;
* a larger job: only the ranks that can decide a verdict or name a culprit, at most
  ``max_views``:

  - ranks whose process is stopped, exited or in D, or whose heartbeat is late (the frozen
    verdict and a stuck verdict's culprits, :func:`elasticft.diag.verdict.judge`);
  - per communicator with a call in flight (the ``max_comms`` waiting longest): the rank in
    flight longest (how long peers have waited), the rank in flight at the newest call, and the
    ranks at the lowest position (those that never reached the call others wait in);
  - a few ranks outside any collective, lowest step first (peers waiting for a rank that is
    alive outside collectives is *working*, not a hang);
  - the ``top_busy`` largest busy times, and the middle of all busy times
    (:class:`~elasticft.diag.detectors.BusyStats`), so that the slow-rank rule compares each
    rank with the median of all its peers as before;
  - how many ranks were left out, and per communicator the newest call and the lowest position
    with the ranks holding it (hang evidence).

* the silent nodes (summary missing or unchanged for the staleness limit), with how long.

Ages are durations on the leader's clock (since each node's summary last changed); a reader adds
how long ago the digest itself last changed on its own clock, so no two machines' clocks are ever
compared.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from elasticft.diag.detectors import BusyStats, RankView
from elasticft.diag.summary import (
    JobView,
    NodeSummary,
    RemoteNode,
    rank_from_json,
    rank_json,
)
from elasticft.procs import UNINTERRUPTIBLE_STATE, UNRESPONSIVE_STATES

DIGEST_KEY = "elasticft.diag.digest"
DIGEST_SCHEMA = 2
_ALARM_STATES = UNRESPONSIVE_STATES | {UNINTERRUPTIBLE_STATE}


@dataclasses.dataclass(frozen=True)
class DigestLimits:
    """How much of a larger job the digest keeps: its size is bounded by these, not the job's."""

    full_ranks: int = 64
    """Up to this many ranks in the job, the digest keeps every rank."""
    max_views: int = 64
    """Ranks whose view a larger job's digest keeps, the most important first."""
    max_comms: int = 8
    """Communicators with a call in flight whose positions it keeps, the longest wait first."""
    per_comm: int = 4
    """Ranks it keeps of those at a communicator's lowest position, and of those outside
    collectives (the fewest steps first)."""
    top_busy: int = 8
    """Ranks whose busy time it keeps, the busiest first (the rest only as their middle)."""
    alarm_heartbeat_s: float = 0.5
    """A rank whose heartbeat (every 0.1 s) is this late is always kept."""
    max_silent: int = 64
    """Silent nodes it names, the longest silent first (it counts all of them)."""


@dataclasses.dataclass(frozen=True)
class DigestNode(NodeSummary):
    """What the digest keeps of a fresh node's summary: the ranks that matter, and its age."""

    age_s: float
    """Seconds since its summary last changed, on the leader's clock."""


@dataclasses.dataclass(frozen=True)
class SilentNode:
    group_rank: int
    node: str
    silent_s: float
    published: bool


@dataclasses.dataclass(frozen=True)
class Digest:
    publisher: int
    """Group rank of the node that built it (the leader, or the successor standing in)."""
    seq: int
    nodes: tuple[DigestNode, ...]
    publisher_node: str = ""
    silent: tuple[SilentNode, ...] = ()
    busy_stats: BusyStats | None = None
    """None: ``nodes`` hold every busy time (a small job)."""
    ranks: int = 0
    """Fresh ranks the leader read."""
    omitted: int = 0
    """Fresh ranks whose view was left out."""
    silent_count: int = 0
    positions: Mapping[int, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    """Communicator -> members, newest call, lowest position and the ranks there, longest wait."""

    @property
    def token(self) -> tuple[int, int]:
        """Changes at every publication, whoever publishes (freshness without clocks)."""
        return (self.publisher, self.seq)

    def evidence(self) -> dict[str, Any]:
        return {"publisher": self.publisher, "ranks": self.ranks, "omitted": self.omitted,
                "silent_nodes": self.silent_count,
                "positions": {f"{c:x}": dict(p) for c, p in self.positions.items()}}


def _positions(views: Sequence[RankView], limits: DigestLimits
               ) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Per communicator with a call in flight (longest waits first): where its members stand;
    and the ranks to keep for them, most important first."""
    longest: dict[int, tuple[float, int, int]] = {}
    newest_in_flight: dict[int, tuple[int, int]] = {}
    for view in views:
        for call in view.in_flight:
            if call.age_s > longest.get(call.comm, (-1.0, 0, 0))[0]:
                longest[call.comm] = (call.age_s, view.rank, call.comm_seq)
            if call.comm_seq > newest_in_flight.get(call.comm, (-1, 0))[0]:
                newest_in_flight[call.comm] = (call.comm_seq, view.rank)
    chosen = sorted(longest, key=lambda c: (-longest[c][0], c))[:limits.max_comms]
    positions: dict[int, dict[str, Any]] = {}
    keep: list[int] = []
    for comm in chosen:
        members = [v for v in views if comm in v.comm_seqs]
        lowest = min((v.comm_seqs[comm] for v in members), default=0)
        at_lowest = sorted(v.rank for v in members if v.comm_seqs[comm] == lowest)
        age, waiter, seq = longest[comm]
        positions[comm] = {
            "members": len(members),
            "newest": max((v.comm_seqs[comm] for v in members), default=0),
            "lowest": lowest,
            "lowest_ranks": at_lowest[:limits.per_comm],
            "at_lowest": len(at_lowest),
            "longest": {"rank": waiter, "comm_seq": seq, "age_s": round(age, 3)},
        }
        keep += [waiter, newest_in_flight[comm][1]]
        if lowest < positions[comm]["newest"]:  # ranks behind the others: never reached
            keep += at_lowest[:limits.per_comm]
    return positions, keep


def select_ranks(views: Sequence[RankView], limits: DigestLimits
                 ) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """The ranks whose view a digest of a large job keeps (at most ``max_views``, most
    important first), and the positions per communicator."""
    alarm = sorted(
        (v for v in views if v.process_state in _ALARM_STATES or
         (v.heartbeat_age_s is not None and v.heartbeat_age_s > limits.alarm_heartbeat_s)),
        key=lambda v: (v.process_state not in UNRESPONSIVE_STATES, -(v.heartbeat_age_s or 0.0),
                       v.rank))
    positions, for_comms = _positions(views, limits)
    outside = sorted((v for v in views if not v.in_flight), key=lambda v: (v.steps, v.rank))
    ordered = [v.rank for v in alarm] + for_comms + [v.rank for v in outside[:limits.per_comm]]
    return list(dict.fromkeys(ordered))[:limits.max_views], positions


def build_digest(nodes: Sequence[RemoteNode], publisher: int, seq: int,
                 limits: DigestLimits = DigestLimits(), publisher_node: str = "") -> Digest:
    """The digest of every node as the leader read it (``fresh`` nodes' ranks; the others are
    silent)."""
    fresh = [n for n in nodes if n.fresh and n.summary is not None]
    silent_nodes = [n for n in nodes if not (n.fresh and n.summary is not None)]
    views = [v for n in fresh for v in n.summary.views]  # type: ignore[union-attr]
    busy = {r: b for n in fresh for r, b in n.summary.busy.items()}  # type: ignore[union-attr]
    if len(views) <= limits.full_ranks:
        kept, kept_busy, stats, positions = {v.rank for v in views}, busy, None, {}
    else:
        ranks, positions = select_ranks(views, limits)
        kept = set(ranks)
        top = sorted(busy, key=lambda r: (-busy[r], r))[:limits.top_busy]
        kept_busy = {r: busy[r] for r in top}
        stats = BusyStats.of(busy.values())
    digest_nodes = []
    for n in fresh:
        assert n.summary is not None
        node_views = tuple(v for v in n.summary.views if v.rank in kept)
        node_busy = {r: b for r, b in n.summary.busy.items() if r in kept_busy}
        if node_views or node_busy:
            digest_nodes.append(DigestNode(n.node, n.group_rank, n.summary.seq, node_views,
                                           node_busy, n.age_s))
    silent = tuple(SilentNode(n.group_rank, n.node, n.age_s, n.summary is not None)
                   for n in sorted(silent_nodes, key=lambda n: -n.age_s)[:limits.max_silent])
    return Digest(publisher, seq, tuple(digest_nodes), publisher_node, silent, stats,
                  len(views), len(views) - len(kept & {v.rank for v in views}),
                  len(silent_nodes), positions)


def encode_digest(digest: Digest) -> bytes:
    stats = digest.busy_stats
    return json.dumps({
        "v": DIGEST_SCHEMA, "publisher": digest.publisher, "seq": digest.seq,
        "publisher_node": digest.publisher_node,
        "ranks": digest.ranks, "omitted": digest.omitted, "silent_count": digest.silent_count,
        "nodes": [{"gr": n.group_rank, "node": n.node, "seq": n.seq, "age": round(n.age_s, 3),
                   "views": [rank_json(v, n.busy.get(v.rank)) for v in n.views],
                   "busy": {str(r): round(b, 6) for r, b in n.busy.items()}}
                  for n in digest.nodes],
        "silent": [[s.group_rank, s.node, round(s.silent_s, 1), s.published]
                   for s in digest.silent],
        "busy_stats": None if stats is None else [stats.count, stats.offset,
                                                   [round(b, 6) for b in stats.window]],
        "positions": {f"{c:x}": p for c, p in digest.positions.items()},
    }, separators=(",", ":")).encode()


def decode_digest(data: bytes | str) -> Digest:
    """Parses a published digest; raises ValueError on anything malformed."""
    try:
        doc = json.loads(data)
        if doc.get("v") != DIGEST_SCHEMA:
            raise ValueError(f"digest schema {doc.get('v')!r}, expected {DIGEST_SCHEMA}")
        nodes = []
        for n in doc["nodes"]:
            node = str(n["node"])
            views = tuple(rank_from_json(r, node)[0] for r in n["views"])
            busy = {int(r): float(b) for r, b in n["busy"].items()}
            nodes.append(DigestNode(node, int(n["gr"]), int(n["seq"]), views, busy,
                                    float(n["age"])))
        silent = tuple(SilentNode(int(g), str(name), float(age), bool(published))
                       for g, name, age, published in doc["silent"])
        stats = doc["busy_stats"]
        busy_stats = None if stats is None else BusyStats(
            int(stats[0]), int(stats[1]), tuple(float(b) for b in stats[2]))
        positions = {int(c, 16): p for c, p in doc["positions"].items()}
        return Digest(int(doc["publisher"]), int(doc["seq"]), tuple(nodes),
                      str(doc.get("publisher_node", "")), silent,
                      busy_stats, int(doc["ranks"]), int(doc["omitted"]),
                      int(doc["silent_count"]), positions)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed diagnostics digest: {e}") from e


def job_view(digest: Digest, own_group_rank: int, digest_age_s: float) -> JobView:
    """The job as a node sees it through ``digest`` (its own node left out): view ages are the
    leader's age of each summary plus ``digest_age_s``, how long ago the digest last changed."""
    views: list[RankView] = []
    busy: dict[int, float] = {}
    node_of: dict[int, str] = {}
    for n in digest.nodes:
        if n.group_rank == own_group_rank:
            continue
        age = round(n.age_s + digest_age_s, 3)
        views += [dataclasses.replace(v, view_age_s=age) for v in n.views]
        busy.update(n.busy)
        node_of.update({r: n.node for r in (*n.busy, *(v.rank for v in n.views))})
    silent = tuple(RemoteNode(s.group_rank, None, s.silent_s + digest_age_s, False, name=s.node,
                              published=s.published)
                   for s in digest.silent if s.group_rank != own_group_rank)
    return JobView(tuple(views), busy, node_of, silent, digest.busy_stats, digest.evidence())
