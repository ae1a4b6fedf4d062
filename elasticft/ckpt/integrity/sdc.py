"""Silent data corruption: which rank's replicated state diverged, judged from fingerprints.

A pure function over one step's :class:`~elasticft.ckpt.integrity.fingerprint.Fingerprint` of every
rank. Ranks are compared only within their replica set (the ranks holding the same shard).
In a set of three or more, a strict majority that agrees is taken as right and every rank
outside it is *suspect*: named with its node and the step. With two replicas (or a set split
with no strict majority) the bytes say that the set diverged, not which side is wrong: the
finding is *undecidable*, and :func:`decide_undecided` settles it from the next evidence, a
fingerprint recomputed from the same snapshots (memory that changes under a complete snapshot
is the faulty side) or the nodes' health checks (:func:`decide_by_health`: exactly one failing
node is the faulty side).

What the job does about a finding is :func:`respond`, by ``ckpt_sdc_action``. Under
``report`` nothing. Under ``evict`` a rank named makes its node leave the job (blacklisted
with reason ``sdc``, when the job can go on without it) and every node restore the newest step
at which every fingerprint agreed, and redo the steps after it; a set with no majority is
*recomputed*: every node restores that step and redoes the steps, and when the undecided step
comes round again :func:`decide_by_recomputation` names the side whose result changed (a
transient fault computes the same step differently the second time), which is then evicted
like a rank named at once, with nothing more to redo: the recomputed state agrees.

None of these reads a clock or does I/O; the agent gathers the facts and logs the answers.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Mapping, Sequence

from elasticft.ckpt.integrity.fingerprint import Fingerprint, differing_items
from elasticft.decision import Decision


class Verdict(enum.Enum):
    AGREE = "agree"
    """Every replica set's fingerprints are equal."""
    SUSPECT = "suspect"
    """A minority of a replica set differs from its majority: the minority is named."""
    UNDECIDABLE = "undecidable"
    """A replica set differs with no strict majority (two replicas): nobody can be named."""


@dataclasses.dataclass(frozen=True)
class Finding(Decision[Verdict]):
    """What one replica set's fingerprints say at one step."""

    step: int = -1
    replica_set: str = ""
    suspects: tuple[int, ...] = ()
    """The ranks named (SUSPECT), or every rank of the split set (UNDECIDABLE)."""
    nodes: tuple[str, ...] = ()
    """The suspects' nodes, in the same order."""
    digests: Mapping[int, str] = dataclasses.field(default_factory=dict)
    """Every rank of the set and its digest: the evidence."""
    items: tuple[str, ...] = ()
    """The items whose bytes differ (the first suspect against the majority)."""
    decided_by: str = ""
    """How an undecidable finding was settled: ``reread``, ``recomputation`` or ``health``
    (empty: by the majority, or not settled)."""


def compare(fingerprints: Sequence[Fingerprint], nodes: Mapping[int, str]) -> list[Finding]:
    """One finding per replica set of two or more ranks at one step, for ``fingerprints``
    (one per rank; ``nodes``: rank to node id). Sets of one rank have nothing to compare."""
    sets: dict[tuple[int, int, str], list[Fingerprint]] = collections.defaultdict(list)
    for fp in fingerprints:
        sets[(fp.step, fp.world_size, fp.replica_set)].append(fp)
    findings = []
    for (step, _, key), members in sorted(sets.items()):
        members.sort(key=lambda f: f.rank)
        if len(members) < 2:
            continue
        digests = {f.rank: f.digest for f in members}
        counts = collections.Counter(digests.values())
        ranks = [f.rank for f in members]
        if len(counts) == 1:
            findings.append(Finding(Verdict.AGREE, f"{len(members)} replicas agree",
                                    step=step, replica_set=key, digests=digests))
            continue
        (top, top_count), = counts.most_common(1)
        if top_count * 2 > len(members):
            named = tuple(f.rank for f in members if f.digest != top)
            majority = next(f for f in members if f.digest == top)
            first = next(f for f in members if f.digest != top)
            findings.append(Finding(
                Verdict.SUSPECT,
                f"rank(s) {list(named)} differ from {top_count} of {len(members)} replicas "
                f"at step {step}",
                step=step, replica_set=key, suspects=named,
                nodes=tuple(nodes.get(r, "?") for r in named), digests=digests,
                items=tuple(differing_items(first, majority))))
            continue
        findings.append(Finding(
            Verdict.UNDECIDABLE,
            f"replicas {ranks} differ at step {step} with no majority: the bytes cannot say "
            "which is wrong; deciding from the next evidence (a recomputed fingerprint, the "
            "nodes' health)",
            step=step, replica_set=key, suspects=tuple(ranks),
            nodes=tuple(nodes.get(r, "?") for r in ranks), digests=digests,
            items=tuple(differing_items(
                members[0], next(f for f in members if f.digest != members[0].digest)))))
    return findings


def decide_undecided(finding: Finding, recomputed: Mapping[int, str | None],
                     healthy: Mapping[str, bool | None]) -> Finding:
    """An UNDECIDABLE ``finding`` settled from the next evidence, or left undecidable.

    ``recomputed``: each rank's digest recomputed from the same snapshot (None: no longer
    held); a rank whose digest changed under a complete snapshot has faulty memory.
    ``healthy``: each node's health check (None: not checked); when exactly one of the
    set's nodes fails, its ranks are the suspects.
    """
    if finding.kind is not Verdict.UNDECIDABLE:
        return finding
    ranks = finding.suspects
    node_of = dict(zip(ranks, finding.nodes, strict=True))
    changed = tuple(r for r in ranks
                    if recomputed.get(r) is not None and recomputed[r] != finding.digests[r])
    if len(changed) == 1 or (changed and len(changed) < len(ranks)):
        return dataclasses.replace(
            finding, kind=Verdict.SUSPECT, suspects=changed, decided_by="reread",
            nodes=tuple(node_of[r] for r in changed),
            reason=f"rank(s) {list(changed)} read different bytes from the same snapshot of "
                   f"step {finding.step} on a second pass: their memory is faulty")
    return decide_by_health(finding, healthy)


def decide_by_health(finding: Finding, healthy: Mapping[str, bool | None]) -> Finding:
    """An UNDECIDABLE ``finding`` settled by its nodes' health checks (``healthy``: node id to
    its check's outcome; None or absent: not checked), or left undecidable.

    The replicas of a set on different nodes: when exactly one of the set's nodes fails its
    check and another passes, that node's ranks are named. Both failing, none failing, or the
    whole set on one node (its check cannot tell its own ranks apart) say nothing.
    """
    if finding.kind is not Verdict.UNDECIDABLE:
        return finding
    ranks = finding.suspects
    node_of = dict(zip(ranks, finding.nodes, strict=True))
    failing = sorted({node_of[r] for r in ranks if healthy.get(node_of[r]) is False})
    passing = {node_of[r] for r in ranks if healthy.get(node_of[r]) is True}
    if len(failing) == 1 and passing:
        named = tuple(r for r in ranks if node_of[r] == failing[0])
        return dataclasses.replace(
            finding, kind=Verdict.SUSPECT, suspects=named, nodes=(failing[0],) * len(named),
            decided_by="health",
            reason=f"node {failing[0]} fails its health check and its replicas' node(s) "
                   f"{sorted(passing)} pass: rank(s) {list(named)} diverged at step "
                   f"{finding.step}")
    return finding


def decide_by_recomputation(finding: Finding, recomputed: Mapping[int, str | None]) -> Finding:
    """An UNDECIDABLE ``finding`` settled by the same step computed again from the newest step
    that agreed (``recomputed``: each rank's new digest of ``finding.step``; None: none).

    When the recomputed digests agree, every rank whose first result differs from them is
    named: its device computed that step wrongly once. When they differ again, a rank whose
    result changed between the two computations is named, if not every rank's did; a rank
    that reproduces a wrong result (a persistent fault) cannot be told from a right one here,
    and the finding stays undecidable (the nodes' health is the next evidence:
    :func:`decide_by_health`). So does a set across nodes recomputed at a step after its first
    divergence (only a node holding every rank of the set finds that step): the all-reduce
    has spread the wrong value to every replica, and all of them compute it differently.
    """
    if finding.kind is not Verdict.UNDECIDABLE:
        return finding
    ranks = finding.suspects
    node_of = dict(zip(ranks, finding.nodes, strict=True))
    again = {r: recomputed.get(r) for r in ranks}
    if any(d is None for d in again.values()):
        return finding
    values = set(again.values())
    if len(values) == 1:
        (agreed,) = values
        named = tuple(r for r in ranks if finding.digests[r] != agreed)
        how = (f"the step computed again agrees on every replica, and rank(s) {list(named)} "
               f"had computed it differently the first time")
    else:
        named = tuple(r for r in ranks if again[r] != finding.digests[r])
        how = (f"the step computed again still differs, and rank(s) {list(named)} computed "
               f"it differently from their own first result")
    if not named or len(named) == len(ranks):
        return finding
    return dataclasses.replace(
        finding, kind=Verdict.SUSPECT, suspects=named, decided_by="recomputation",
        nodes=tuple(node_of[r] for r in named),
        reason=f"{how}: they diverged at step {finding.step}")


class Remedy(enum.Enum):
    NONE = "none"
    """Report only."""
    EVICT = "evict"
    """The named nodes leave the job (when it can go on without them); with a restore step,
    every node restores it and redoes the steps after it."""
    RECOMPUTE = "recompute"
    """Every node restores the restore step and redoes the steps after it; the undecided step
    is compared again (:func:`decide_by_recomputation`)."""


@dataclasses.dataclass(frozen=True)
class Response(Decision[Remedy]):
    restore_at_most: int | None = None
    """The newest step the next attempt may restore (None: any, no rollback)."""
    nodes: tuple[str, ...] = ()
    """The nodes to evict."""
    ranks: tuple[int, ...] = ()


def respond(finding: Finding, action: str, agreed_step: int | None,
            recomputed_before: bool) -> Response:
    """What the job does about ``finding`` under ``ckpt_sdc_action`` ``action``.

    ``agreed_step``: the newest step at which every fingerprint agreed (None: none yet, so a
    rollback starts from the beginning); ``recomputed_before``: this finding's step was
    already computed twice (a second recomputation would say nothing new).
    """
    if finding.kind is Verdict.AGREE:
        return Response(Remedy.NONE, "the replicas agree")
    if action != "evict":
        return Response(Remedy.NONE, "ckpt_sdc_action is report")
    at_most = agreed_step if agreed_step is not None else -1
    start = (f"step {agreed_step}, the newest at which every fingerprint agreed"
             if agreed_step is not None else "the beginning (no step agreed yet)")
    if finding.kind is Verdict.SUSPECT:
        if agreed_step is not None and agreed_step >= finding.step:
            return Response(Remedy.EVICT,
                            f"node(s) {list(finding.nodes)} evicted; the state computed again "
                            f"from step {agreed_step} agrees, nothing to redo",
                            nodes=finding.nodes, ranks=finding.suspects)
        return Response(Remedy.EVICT,
                        f"node(s) {list(finding.nodes)} evicted; restoring {start} and redoing "
                        f"the steps after it", restore_at_most=at_most,
                        nodes=finding.nodes, ranks=finding.suspects)
    if recomputed_before:
        return Response(Remedy.NONE, f"step {finding.step} was computed again already and "
                                     "still cannot say which replica is wrong")
    return Response(Remedy.RECOMPUTE,
                    f"no replica can be named: restoring {start} and computing step "
                    f"{finding.step} again on every replica", restore_at_most=at_most,
                    ranks=finding.suspects)
