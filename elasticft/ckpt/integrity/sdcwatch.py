"""The agent's watch for silent data corruption: fingerprints of its workers' snapshots compared.

Every ``ckpt_fingerprint_every``-th step that all of the node's workers hold complete in shared
memory, a thread of the agent fingerprints each worker's snapshot of it
(:mod:`elasticft.ckpt.integrity.fingerprint`) and compares the replica sets
(:func:`elasticft.ckpt.integrity.sdc.compare`). A rank named is an ``sdc_suspect`` event with every
fingerprint of its set as the evidence. A set split with no majority is an ``sdc_undecidable``
event; the same snapshots are then fingerprinted a second time and the finding decided from
that (:func:`elasticft.ckpt.integrity.sdc.decide_undecided`), an ``sdc_suspect`` event when it
names a side. The training processes do nothing for it: their snapshot is already in memory, and the
hashing runs in the agent's process.

Across nodes the fingerprints go through the round's store, which the round's leader serves:
every node sets ``elasticft.sdc.<round>.<step>.<group rank>`` (its ranks' fingerprints and its
node id), and the leader's watch waits for every node's key of that step (at most
``gather_timeout_s``, checking without blocking), compares the whole job's replica sets and
removes the keys. Only the leader reports then. In a one-node job the node compares its own
ranks. :attr:`agreed_step` is the newest step at which every fingerprint agreed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticft.addon.api import GroupInfo
from elasticft.ckpt.integrity.fingerprint import Fingerprint, fingerprint_slot
from elasticft.ckpt.integrity.sdc import Finding, Verdict, compare, decide_undecided
from elasticft.ckpt.memory.nodeslots import NodeSlots

logger = logging.getLogger(__name__)


class FingerprintWatch:
    """Fingerprints due steps on a thread of its own and reports what the comparison finds."""

    def __init__(self, slots: NodeSlots, every: int, layout: tuple[int, int, int] | None,
                 emit: Callable[..., None]) -> None:
        self.slots = slots
        self.every = every
        self.layout = layout
        self._emit = emit
        self._thread: threading.Thread | None = None
        self._checked = -1
        self.agreed_step: int | None = None
        """The newest step at which every replica set's fingerprints agreed."""
        self.checks = 0
        self.findings: list[Finding] = []
        """Every finding that was not an agreement, in order."""
        self.store: Any = None
        """The round's store (set by the service at every rendezvous); None: this node only."""
        self.gather_timeout_s = 30.0
        self._closing = threading.Event()

    def tick(self, group: GroupInfo) -> None:
        """Starts the check of the next due step every local worker holds, unless one runs."""
        alone = self.store is None or group.group_world_size < 2
        if self.every <= 0 or (alone and len(group.workers) < 2):
            return
        if self._thread is not None and self._thread.is_alive():
            return
        due = [s for s in self.slots.common_steps(group.workers)
               if s % self.every == 0 and s > self._checked]
        if not due:
            return
        # The oldest due step still held, not the newest: every node then checks the same
        # steps in the same order, and the leader finds each node's fingerprints of them.
        step = min(due)
        self._checked = step
        self._thread = threading.Thread(target=self._check, args=(group, step),
                                        name="elasticft-fingerprints", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> None:
        """Waits for the check under way, at most ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Ends the watch: a leader's wait for the other nodes stops now (at the end of a job
        they may never publish), and the check under way gets ``timeout_s`` to finish."""
        self._closing.set()
        self.wait(timeout_s)

    def fingerprints(self, group: GroupInfo, step: int) -> list[Fingerprint]:
        """Each local worker's fingerprint of ``step`` (those whose snapshot still holds it)."""
        found = []
        for worker in group.workers:
            slots = self.slots.slot_set(worker.local_rank)
            for index, header in slots.complete().items():
                if header.step != step or header.rank != worker.global_rank:
                    continue
                slot = slots.get(index)
                fp = (fingerprint_slot(slot, step, worker.global_rank, self.layout)
                      if slot is not None else None)
                if fp is not None:
                    found.append(fp)
                break
        return found

    def _check(self, group: GroupInfo, step: int) -> None:
        try:
            started = time.monotonic()
            fps = self.fingerprints(group, step)
            nodes = {w.global_rank: group.node_id for w in group.workers}
            if self.store is not None and group.group_world_size > 1:
                gathered = self._gather(group, step, fps)
                if gathered is None:
                    return  # another node compares
                fps, nodes = gathered
            findings = compare(fps, nodes)
            self.checks += 1
            took = time.monotonic() - started
            logger.debug("fingerprints of step %d: %d ranks, %.3f s", step, len(fps), took)
            if findings and all(f.kind is Verdict.AGREE for f in findings):
                self.agreed_step = step
            for finding in findings:
                if finding.kind is Verdict.AGREE:
                    continue
                self._report(finding, fps)
                if finding.kind is Verdict.UNDECIDABLE and self._local(finding, group):
                    again = {f.rank: f.digest for f in self.fingerprints(group, step)}
                    decided = decide_undecided(
                        finding, {r: again.get(r) for r in finding.suspects}, {})
                    if decided.kind is not Verdict.UNDECIDABLE:
                        self._report(decided, fps)
        except Exception:  # a diagnosis must never take the agent down
            logger.exception("fingerprint check of step %d failed", step)

    @staticmethod
    def _local(finding: Finding, group: GroupInfo) -> bool:
        """Whether every rank of ``finding`` is this node's (its snapshots can be read again)."""
        return set(finding.suspects) <= {w.global_rank for w in group.workers}

    def _gather(self, group: GroupInfo, step: int, fps: list[Fingerprint]
                ) -> tuple[list[Fingerprint], dict[int, str]] | None:
        """Publishes this node's fingerprints of ``step``; on the leader, every node's (None
        on the other nodes). A node that has not published in time is left out."""
        store = self.store
        mine = {"node": group.node_id,
                "fingerprints": [dict(f.to_json(), world_size=f.world_size,
                                      items=[list(i) for i in f.items]) for f in fps]}
        store.set(_key(group.round, step, group.group_rank), json.dumps(mine))
        if group.group_rank != 0:
            return None
        keys = [_key(group.round, step, r) for r in range(group.group_world_size)]
        deadline = time.monotonic() + self.gather_timeout_s
        present = [k for k in keys if store.check([k])]
        while (len(present) < len(keys) and time.monotonic() < deadline
               and not self._closing.wait(0.1)):
            present = [k for k in keys if store.check([k])]
        if len(present) < len(keys):
            logger.warning("fingerprints of step %d: %d of %d nodes published within %.0f s "
                           "(or before the end); comparing those", step, len(present), len(keys),
                           self.gather_timeout_s)
        gathered: list[Fingerprint] = []
        nodes: dict[int, str] = {}
        for key in present:
            record = json.loads(store.get(key))
            for f in record["fingerprints"]:
                gathered.append(Fingerprint(
                    rank=f["rank"], step=f["step"], world_size=f["world_size"],
                    replica_set=f["replica_set"], digest=f["digest"],
                    items=tuple((str(n), int(c)) for n, c in f["items"]), nbytes=f["nbytes"]))
                nodes[f["rank"]] = record["node"]
            store.delete_key(key)
        return gathered, nodes

    def _report(self, finding: Finding, fps: list[Fingerprint]) -> None:
        self.findings.append(finding)
        evidence: list[dict[str, Any]] = [f.to_json() for f in fps
                                          if f.rank in finding.digests]
        kind = "sdc_suspect" if finding.kind is Verdict.SUSPECT else "sdc_undecidable"
        logger.error("silent data corruption %s at step %d: %s (items %s)",
                     "suspected" if kind == "sdc_suspect" else "undecidable", finding.step,
                     finding.reason, list(finding.items)[:5])
        self._emit(kind, step=finding.step, ranks=list(finding.suspects),
                   nodes=list(finding.nodes), reason=finding.reason,
                   items=list(finding.items)[:20], agreed_step=self.agreed_step,
                   fingerprints=evidence)


def _key(round_: int, step: int, group_rank: int) -> str:
    return f"elasticft.sdc.{round_}.{step}.{group_rank}"
