"""A node's diagnostics summary, and the job view a node judges with.

A *summary* is what one agent publishes about its ranks into the round's store (key
``elasticft.diag.summary.<group rank>``): per rank the pid, process state, heartbeat age, steps,
the oldest call in flight per communicator (op, communicator key, its number there, age), the
newest call number per communicator, and the median busy time per step. It carries a counter its
publisher increments at every publication, so readers judge freshness on their own clock
(:mod:`elasticft.diag.exchange`). The same per-rank encoding is used by the job digest
(:mod:`elasticft.diag.digest`).

A :class:`JobView` is what the monitor gets from the exchange at every check: the other nodes'
fresh ranks (``view_age_s`` set), their busy times, and the nodes that went silent.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

from elasticft.diag.detectors import BusyStats, InFlight, RankView

SCHEMA = 1
KEY_PREFIX = "elasticft.diag.summary."
"""Store key of a node's summary: this prefix and the node's group rank."""


def summary_key(group_rank: int) -> str:
    return f"{KEY_PREFIX}{group_rank}"


@dataclasses.dataclass(frozen=True)
class NodeSummary:
    """What one node's monitor published about its ranks."""

    node: str
    group_rank: int
    seq: int
    """Incremented by the publisher at every publication (freshness without clocks)."""
    views: tuple[RankView, ...]
    busy: Mapping[int, float]
    """Rank -> median busy seconds per recent step (ranks with enough steps only)."""


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def rank_json(view: RankView, busy: float | None = None) -> dict[str, Any]:
    """One rank's facts as summaries and digests carry them."""
    return {
        "rank": view.rank,
        "pid": view.pid,
        "state": view.process_state,
        "hb": _round(view.heartbeat_age_s),
        "steps": view.steps,
        "step_age": _round(view.step_age_s),
        "in_flight": [[c.op, f"{c.comm:x}", c.comm_seq, round(c.age_s, 3), c.source]
                      for c in view.in_flight],
        "comm_seqs": {f"{comm:x}": n for comm, n in view.comm_seqs.items()},
        "busy": _round(busy, 6),
    }


def rank_from_json(r: Mapping[str, Any], node: str) -> tuple[RankView, float | None]:
    """The inverse of :func:`rank_json`; raises KeyError, TypeError or ValueError."""
    view = RankView(
        rank=int(r["rank"]), node=node, pid=r.get("pid"), process_state=r.get("state"),
        heartbeat_age_s=r.get("hb"), steps=int(r.get("steps", 0)),
        step_age_s=float(r.get("step_age") or 0.0),
        in_flight=tuple(InFlight(str(op), int(comm, 16), int(n), float(age), str(src))
                        for op, comm, n, age, src in r.get("in_flight", ())),
        comm_seqs={int(c, 16): int(n) for c, n in r.get("comm_seqs", {}).items()})
    busy = r.get("busy")
    return view, None if busy is None else float(busy)


def encode_summary(node: str, group_rank: int, seq: int, views: Iterable[RankView],
                   busy: Mapping[int, float]) -> bytes:
    """The JSON a node publishes (a few hundred bytes per rank)."""
    ranks = [rank_json(v, busy.get(v.rank)) for v in views]
    return json.dumps({"v": SCHEMA, "node": node, "group_rank": group_rank, "seq": seq,
                       "ranks": ranks}, separators=(",", ":")).encode()


def decode_summary(data: bytes | str) -> NodeSummary:
    """Parses a published summary; raises ValueError on anything malformed."""
    try:
        doc = json.loads(data)
        if doc.get("v") != SCHEMA:
            raise ValueError(f"summary schema {doc.get('v')!r}, expected {SCHEMA}")
        node = str(doc["node"])
        views, busy = [], {}
        for r in doc["ranks"]:
            view, value = rank_from_json(r, node)
            views.append(view)
            if value is not None:
                busy[view.rank] = value
        return NodeSummary(node, int(doc["group_rank"]), int(doc["seq"]), tuple(views), busy)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"malformed diagnostics summary: {e}") from e


@dataclasses.dataclass(frozen=True)
class RemoteNode:
    """Another node of the round, as this node last read it (directly or through a digest)."""

    group_rank: int
    summary: NodeSummary | None
    """None: nothing read from it yet in this round."""
    age_s: float
    """Seconds since its summary last changed (or since this round began, if none yet)."""
    fresh: bool
    name: str = ""
    """Its node id when known without its summary (a digest lists silent nodes by name)."""
    published: bool | None = None
    """Whether it ever published in this round, when known without its summary."""

    @property
    def node(self) -> str:
        if self.summary is not None:
            return self.summary.node
        return self.name or f"group rank {self.group_rank}"


@dataclasses.dataclass(frozen=True)
class JobView:
    """The other nodes' fresh ranks, and the silent nodes, at one instant."""

    views: tuple[RankView, ...] = ()
    busy: Mapping[int, float] = dataclasses.field(default_factory=dict)
    node_of: Mapping[int, str] = dataclasses.field(default_factory=dict)
    silent: tuple[RemoteNode, ...] = ()
    """Nodes of the round whose summary is missing or older than the staleness limit."""
    busy_stats: BusyStats | None = None
    """Set when ``busy`` holds only some ranks (a digest of a large job): the job-wide busy
    times' middle, so that a rank's peers' median is still exact."""
    digest: Mapping[str, Any] | None = None
    """What the digest this view came from left out and where the job stands per communicator
    (for the hang event); None when every node was read directly."""

    def silent_json(self, limit: int = 32) -> list[dict[str, Any]]:
        return [{"node": n.node, "group_rank": n.group_rank, "silent_s": round(n.age_s, 1),
                 "published": n.summary is not None or bool(n.published)}
                for n in self.silent[:limit]]
