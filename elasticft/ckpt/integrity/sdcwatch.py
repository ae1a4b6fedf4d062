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

Under ``ckpt_sdc_action`` ``evict`` the watch also acts
(:func:`elasticft.ckpt.integrity.sdc.respond`):

* **The agreed step stays in memory.** Every node holds a shared lock on each local worker's
  slot of the newest agreed step (a second open file of its own, so no other reader's unlock
  frees it): the workers' writer never overwrites a slot being read, so that step survives
  any number of later saves (one of the slots is taken by it). The leader publishes the
  step (``elasticft.sdc.<round>.agreed``); the others pin it when they read it.
* **So do the first results after it.** A decision by recomputation compares the first
  divergent step's results with the same step computed again, and finds that step in memory
  (:meth:`FingerprintWatch._first_divergence`). The memory tier rotates its slots with every
  save, and a watch that runs late (a loaded host) would find it gone. So every node also holds
  its workers' slots of the step after the newest agreed one, in a slot the service adds to
  ``ckpt_memory_slots`` for it (:func:`evidence_slots`), from the tick at which every local
  worker has written it until a newer step agrees (the hold moves to the step after that one)
  or the workers restart after a rollback (the undecided finding keeps the digests). With
  ``ckpt_fingerprint_every`` 2 that is every step a divergence first seen at a compared step
  can have begun at but the compared step itself, whose fingerprints the finding holds.
* **A verdict** (``elasticft.sdc.<round>.verdict``, or at once in a one-node job) gives every
  node the newest step the next attempt may restore (:attr:`restore_at_most`, handed to the
  workers, :data:`elasticft.ckpt.settings.ENV_RESTORE_AT_MOST`) and makes the watch return a
  :class:`~elasticft.addon.api.Detection` to the agent: ``node_suspect`` on the named node (the
  policy evicts it when the job can go on without it, else restarts it), a restart elsewhere.
* **After the restart** only snapshots the new attempt wrote are fingerprinted; an undecided
  step that comes round again is decided by
  :func:`~elasticft.ckpt.integrity.sdc.decide_by_recomputation`, else by the nodes' health;
  a step computed again that names nobody is an ``sdc_undecidable`` event too. Both carry the
  first results' digests (``first_results``) beside the recomputed fingerprints.

Every node publishes its health (:attr:`health`, :mod:`elasticft.ckpt.integrity.nodehealth`)
with its fingerprints: a split between replicas on two nodes is decided by it
(:func:`~elasticft.ckpt.integrity.sdc.decide_by_health`), and the events carry it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from elasticft.addon.api import Detection, GroupInfo
from elasticft.addon.classify import FailureClass
from elasticft.ckpt.integrity.fingerprint import Fingerprint, fingerprint_slot
from elasticft.ckpt.integrity.sdc import (
    Finding,
    Remedy,
    Response,
    Verdict,
    compare,
    decide_by_health,
    decide_by_recomputation,
    decide_undecided,
    respond,
)
from elasticft.ckpt.memory.nodeslots import NodeSlots
from elasticft.ckpt.memory.slot import Slot
from elasticft.ckpt.memory.slotformat import COMPLETE
from elasticft.config import CheckpointConfig

logger = logging.getLogger(__name__)

LAG_ENV = "EFT_TEST_SDC_WATCH_LAG_STEPS"
"""Test seam: after reading a step's fingerprints, the watch compares them and acts only once
the workers hold a step this many steps newer (at most :data:`LAG_LIMIT_S`, or until the watch
closes), as the thread of an agent on a loaded host does when it runs late: the memory slots
have rotated meanwhile. Not an ``ELASTICFT_`` name: those are options, and an unknown one is
refused."""
LAG_LIMIT_S = 60.0

EVIDENCE_NEEDS_SLOTS = 4
"""The memory slots per worker that holding the evidence needs: the agreed step's, the
evidence's, the newest snapshot's and one to write the next into."""


def evidence_slots(config: CheckpointConfig) -> int:
    """The memory slots per worker the service adds to ``ckpt_memory_slots`` for the watch to
    hold the first results after the agreed step (see the module's docstring): one under
    ``ckpt_sdc_action`` evict, else none."""
    return int(config.ckpt_sdc_action == "evict" and config.ckpt_fingerprint_every > 0)


class FingerprintWatch:
    """Fingerprints due steps on a thread of its own and reports what the comparison finds."""

    def __init__(self, slots: NodeSlots, every: int, layout: tuple[int, int, int] | None,
                 emit: Callable[..., None], action: str = "report", lag_steps: int = 0
                 ) -> None:
        self.slots = slots
        self.every = every
        self.layout = layout
        self.action = action
        self.restore_at_most: int | None = None
        """The newest step the next attempt may restore (None: any): set by a verdict, cleared
        once a step after every step held before it agrees again."""
        self.newest_before: int | None = None
        """The newest step held when the verdict came (the steps up to it are redone)."""
        self.suspect_reason: str | None = None
        """Why this node is suspect (``sdc: ...``), while its detection is handled."""
        self.pinned_step: int | None = None
        self._agreed_seen: int | None = None
        self._pins: list[Slot] = []
        self.evidence_step: int | None = None
        """The step after the agreed one whose first results this node holds (see the module's
        docstring), or None."""
        self._evidence: list[Slot] = []
        self._evidence_lock = threading.Lock()
        """Held while the evidence changes hands (the agent's thread and the check's)."""
        self._evidence_warned = False
        self._detection: Detection | None = None
        self._halted = False
        """A verdict was applied: nothing more is checked until the workers restart."""
        self._since = 0.0
        """Snapshots completed before this time (a previous attempt's) are not fingerprinted."""
        self._recompute: dict[int, Finding] = {}
        """Undecided findings by step, decided when the step is computed again."""
        self._recomputed: set[int] = set()
        self._lock = threading.Lock()
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
        self._deletes = True
        """Whether the round's store deletes keys (a TCPStore does; etcd's store does not)."""
        self.health: Callable[[], tuple[bool | None, str]] | None = None
        """This node's health check: (passed, what it found); None: not checked. Set by the
        service; its outcome goes with the node's fingerprints."""
        self._health: dict[str, tuple[bool | None, str]] = {}
        """Each node's health as published with the step being compared."""
        self._node_of: dict[int, str] = {}
        """Each rank's node, for the step being compared."""
        self.lag_steps = lag_steps
        """See :data:`LAG_ENV` (0: none)."""

    def tick(self, group: GroupInfo) -> None:
        """Starts the check of the next due step every local worker holds, unless one runs."""
        alone = self.store is None or group.group_world_size < 2
        if self.every <= 0 or (alone and len(group.workers) < 2):
            return
        if not alone and self.action == "evict":
            self._poll(group)
        self._hold_evidence(group)
        if (self._thread is not None and self._thread.is_alive()) or self._halted:
            return
        due = [s for s in self._fresh_steps(group)
               if (s % self.every == 0 or s in self._recompute) and s > self._checked]
        if not due:
            return
        # The oldest due step still held, not the newest: every node then checks the same
        # steps in the same order, and the leader finds each node's fingerprints of them.
        step = min(due)
        self._checked = step
        self._thread = threading.Thread(target=self._check, args=(group, step),
                                        name="elasticft-fingerprints", daemon=True)
        self._thread.start()

    def _fresh_steps(self, group: GroupInfo) -> set[int]:
        """Steps every local worker holds complete, written by this attempt's workers."""
        common: set[int] | None = None
        for worker in group.workers:
            steps = {h.step for h in self.slots.slot_set(worker.local_rank).complete().values()
                     if h.rank == worker.global_rank and h.world_size == worker.world_size
                     and h.completed_at >= self._since}
            common = steps if common is None else common & steps
        return common or set()

    def restarted(self, group: GroupInfo, started_at: float) -> None:
        """A new attempt's workers started: a halted watch resumes with their snapshots."""
        with self._lock:
            rolled_back = self._halted or self.restore_at_most is not None
            if rolled_back:
                self._since = started_at
                self._checked = -1
            self._halted = False
            self._detection = None
        if rolled_back:
            # The previous attempt's first results were read (the undecided finding holds
            # their digests) or are of no use any more: the new attempt's take their place.
            self._release_evidence()

    def detection(self) -> Detection | None:
        """What a verdict asks of the agent (once), else None."""
        with self._lock:
            found, self._detection = self._detection, None
            return found

    def stopped(self, newest: int | None) -> None:
        """The workers stopped holding ``newest``: the steps up to it are redone."""
        if self.restore_at_most is not None and newest is not None:
            self.newest_before = max(self.newest_before or -1, newest)

    def agree_limit(self, group: GroupInfo, store: Any) -> None:
        """Every node of a new round publishes its restore limit and the newest step it held,
        and all take the lowest limit and the newest step (a node that joins knows nothing)."""
        mine = {"at_most": self.restore_at_most, "newest": self.newest_before}
        store.set(_round_key(group.round, f"limit.{group.group_rank}"), json.dumps(mine))
        limits = [json.loads(store.get(_round_key(group.round, f"limit.{r}")))
                  for r in range(group.group_world_size)]
        at_most = [x["at_most"] for x in limits if x["at_most"] is not None]
        newest = [x["newest"] for x in limits if x["newest"] is not None]
        with self._lock:
            if at_most:
                self.restore_at_most = min(at_most)
                self.newest_before = max(newest, default=None)

    def redone(self) -> tuple[int | None, int | None]:
        """(restore_at_most, newest_before) of the rollback under way."""
        return self.restore_at_most, self.newest_before

    def wait(self, timeout_s: float) -> None:
        """Waits for the check under way, at most ``timeout_s``."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Ends the watch: a leader's wait for the other nodes stops now (at the end of a job
        they may never publish), and the check under way gets ``timeout_s`` to finish."""
        self._closing.set()
        self.wait(timeout_s)
        self._unpin()
        self._release_evidence()

    def fingerprints(self, group: GroupInfo, step: int) -> list[Fingerprint]:
        """Each local worker's fingerprint of ``step`` (those whose snapshot still holds it)."""
        found = []
        for worker in group.workers:
            slots = self.slots.slot_set(worker.local_rank)
            for index, header in slots.complete().items():
                if (header.step != step or header.rank != worker.global_rank
                        or header.completed_at < self._since):
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
            self._lag(group, step)
            nodes = {w.global_rank: group.node_id for w in group.workers}
            self._health = {group.node_id: self._own_health()}
            if self.store is not None and group.group_world_size > 1:
                gathered = self._gather(group, step, fps)
                if gathered is None:
                    return  # another node compares
                fps, nodes = gathered
            self._node_of = nodes
            findings = compare(fps, nodes)
            self.checks += 1
            took = time.monotonic() - started
            logger.debug("fingerprints of step %d: %d ranks, %.3f s", step, len(fps), took)
            digests = {f.rank: f.digest for f in fps}
            if findings and all(f.kind is Verdict.AGREE for f in findings):
                self.agreed_step = step
                self._agreed(group, step)
            response: Response | None = None
            # The first results of a set computed again, reported with its findings.
            first_of: dict[str, Mapping[int, str]] = {}
            undecided = self._recompute.pop(step, None)
            if undecided is not None:
                first_of[undecided.replica_set] = undecided.digests
                self._recomputed.add(step)
                decided = decide_by_recomputation(undecided, digests)
                if decided.kind is Verdict.UNDECIDABLE:
                    decided = decide_by_health(decided, self._healthy())
                if decided.kind is Verdict.SUSPECT:
                    self._report(decided, fps, first=undecided.digests)
                    response = respond(decided, self.action, self.agreed_step, True)
                elif not any(f.replica_set == decided.replica_set and f.kind is not Verdict.AGREE
                             for f in findings):
                    # Said, not left silent: the rollback named nobody (a set that still
                    # differs is reported below, with its first results).
                    self._report(dataclasses.replace(decided, reason=(
                        f"replicas {list(decided.suspects)} computed step {step} again: the "
                        "results do not tell which first result was wrong (every side's "
                        "changed, or none did, or one is missing); still undecidable")),
                        fps, first=undecided.digests)
            for finding in findings:
                if finding.kind is Verdict.AGREE:
                    continue
                self._report(finding, fps, first=first_of.get(finding.replica_set))
                if finding.kind is Verdict.UNDECIDABLE:
                    again = ({f.rank: f.digest for f in self.fingerprints(group, step)}
                             if self._local(finding, group) else {})
                    decided = decide_undecided(
                        finding, {r: again.get(r) for r in finding.suspects}, self._healthy())
                    if decided.kind is not Verdict.UNDECIDABLE:
                        self._report(decided, fps)
                        finding = decided
                answer = respond(finding, self.action, self.agreed_step,
                                 step in self._recomputed)
                if answer.kind is Remedy.RECOMPUTE:
                    first = self._first_divergence(group, finding, nodes) or finding
                    self._recompute[first.step] = first
                    answer = respond(first, self.action, self.agreed_step, False)  # its step
                if response is None or response.kind is Remedy.NONE:
                    response = answer
            if response is not None and response.kind is not Remedy.NONE:
                self._decide(group, step, response)
        except Exception:  # a diagnosis must never take the agent down
            logger.exception("fingerprint check of step %d failed", step)

    def _lag(self, group: GroupInfo, step: int) -> None:
        """The test seam :data:`LAG_ENV`: waits until the workers hold a step ``lag_steps``
        newer than ``step``."""
        if self.lag_steps <= 0:
            return
        deadline = time.monotonic() + LAG_LIMIT_S
        while (max(self._fresh_steps(group), default=-1) < step + self.lag_steps
               and time.monotonic() < deadline and not self._closing.wait(0.02)):
            pass

    # -- acting on a finding (ckpt_sdc_action evict) -------------------------------------------

    def _first_divergence(self, group: GroupInfo, finding: Finding, nodes: dict[int, str]
                          ) -> Finding | None:
        """The finding at the earliest step after the agreed one at which ``finding``'s ranks
        already differed, from the snapshots this node still holds (all of its ranks must be
        local); None: none held. Data parallelism spreads a wrong value to every replica with
        the next all-reduce: only at the first divergent step does the healthy replica's state
        equal a recomputation, so that step is the one computed again and compared."""
        if self.agreed_step is None or not self._local(finding, group):
            return None
        ranks = set(finding.suspects)
        for step in range(self.agreed_step + 1, finding.step):
            fps = [f for f in self.fingerprints(group, step) if f.rank in ranks]
            if len(fps) < len(ranks):
                continue
            for earlier in compare(fps, nodes):
                if earlier.kind is Verdict.UNDECIDABLE and earlier.replica_set == \
                        finding.replica_set:
                    logger.info("replicas %s first differed at step %d (held in memory): "
                                "that step is computed again", sorted(ranks), step)
                    return earlier
            return None  # they agreed there: the divergence came later
        return None

    def _own_health(self) -> tuple[bool | None, str]:
        if self.health is None:
            return None, "not checked"
        try:
            return self.health()
        except Exception as e:  # a check that breaks says nothing either way
            logger.exception("node health check for the fingerprints failed")
            return None, f"the check failed: {type(e).__name__}: {e}"

    def _healthy(self) -> dict[str, bool | None]:
        """Each node's health check outcome, as gathered with the step compared."""
        return {node: ok for node, (ok, _) in self._health.items()}

    def _agreed(self, group: GroupInfo, step: int) -> None:
        if self.action != "evict":
            return
        if self.store is not None and group.group_world_size > 1:
            self.store.set(_round_key(group.round, "agreed"), str(step))
        else:
            self._pin(group, step)

    def _decide(self, group: GroupInfo, step: int, response: Response) -> None:
        verdict = {"remedy": response.kind.value, "reason": response.reason, "step": step,
                   "restore_at_most": response.restore_at_most, "nodes": list(response.nodes),
                   "ranks": list(response.ranks)}
        logger.error("silent data corruption at step %d: %s", step, response.reason)
        self._emit("sdc_response", **verdict)
        if self.store is not None and group.group_world_size > 1:
            self.store.set(_round_key(group.round, "verdict"), json.dumps(verdict))
        else:
            self._apply(group, verdict)

    def _poll(self, group: GroupInfo) -> None:
        """Reads what the leader published this round (the agreed step, a verdict)."""
        try:
            key = _round_key(group.round, "agreed")
            if self.store.check([key]):
                step = int(self.store.get(key))
                if step != self._agreed_seen:
                    self._agreed_seen = step  # tried once: a step no longer held stays so
                    self._pin(group, step)
            key = _round_key(group.round, "verdict")
            if not self._halted and self.store.check([key]):
                self._apply(group, json.loads(self.store.get(key)))
        except Exception:
            logger.exception("could not read the fingerprints' verdict of round %d", group.round)

    def _apply(self, group: GroupInfo, verdict: dict[str, Any]) -> None:
        """This node's part of a verdict: the restore limit, and a detection for the agent."""
        with self._lock:
            if self._halted:
                return
            self._halted = True
            at_most = verdict.get("restore_at_most")
            if at_most is not None:
                self.restore_at_most = (at_most if self.restore_at_most is None
                                        else min(self.restore_at_most, at_most))
                self.stopped(self.slots.newest_common_step(group.workers))
            named = group.node_id in verdict["nodes"]
            local = {w.global_rank for w in group.workers}
            ranks = tuple(r for r in verdict["ranks"] if r in local)
            message = f"silent data corruption at step {verdict['step']}: {verdict['reason']}"
            if named:
                # A node named after a recomputation leaves only where another can take its
                # place; alone, its state agrees again and the run goes on.
                if at_most is None and group.group_world_size < 2:
                    logger.warning("node %s named (%s); the only node of the job stays",
                                   group.node_id, verdict["reason"])
                    self._halted = False
                    return
                self.suspect_reason = f"sdc: rank(s) {list(ranks)} diverged at step " \
                                      f"{verdict['step']}"
                self._detection = Detection(FailureClass.NUMERIC, ranks, "sdc", message,
                                            node_suspect=True, evidence=verdict)
            elif at_most is not None:
                self._detection = Detection(FailureClass.NUMERIC, ranks, "sdc", message,
                                            evidence=verdict)
            else:
                self._halted = False

    def settle(self) -> None:
        """The workers restored: the detection was handled (the restore limit stays until a
        step after the redone ones agrees)."""
        self.suspect_reason = None

    def _pin(self, group: GroupInfo, step: int) -> None:
        """Holds every local worker's slot of ``step`` (see the module's docstring)."""
        pins = self._hold(group, step, self._since)
        if pins is None:
            return
        with self._lock:
            old, self._pins, self.pinned_step = self._pins, pins, step
            if self.restore_at_most is not None and (self.newest_before is None
                                                     or step > self.newest_before):
                logger.info("step %d agrees after the redone steps: restores are free again",
                            step)
                self.restore_at_most = self.newest_before = None
        for p in old:
            p.close()
        self._hold_evidence(group)

    def _hold(self, group: GroupInfo, step: int, since: float) -> list[Slot] | None:
        """A shared lock on every local worker's newest slot of ``step`` completed at ``since``
        or later (this attempt's), each through an open file of its own (so no other reader's
        unlock frees it); None, holding nothing, when a worker's slot no longer holds it (or
        does not yet)."""
        pins: list[Slot] = []
        for worker in group.workers:
            slots = self.slots.slot_set(worker.local_rank)
            pin = None
            for index, header in sorted(slots.complete().items(),
                                        key=lambda ih: -ih[1].generation):
                if (header.step != step or header.rank != worker.global_rank
                        or header.completed_at < since):
                    continue
                slot = slots.get(index)
                pin = Slot.open_existing(slot.path) if slot is not None else None
                if pin is not None and not pin.try_lock(exclusive=False):
                    pin.close()
                    pin = None
                if pin is not None:
                    held = pin.header()
                    if (held is None or held.state != COMPLETE or held.step != step
                            or held.completed_at < since):
                        pin.close()
                        pin = None
                break
            if pin is None:
                for p in pins:
                    p.close()
                logger.debug("step %d not held by local rank %d: not pinned", step,
                             worker.local_rank)
                return None
            pins.append(pin)
        return pins

    def _hold_evidence(self, group: GroupInfo) -> None:
        """Under ``evict``, holds the first results of the step after the newest agreed one as
        soon as every local worker has written them, until a newer step agrees (the evidence
        then moves to the step after it) or the workers restart: the first divergent step a
        recomputation needs (:meth:`_first_divergence`) is then still there, however late the
        comparison runs. Called on every tick and when a step is pinned."""
        base = max((s for s in (self.agreed_step, self.pinned_step) if s is not None),
                   default=None)
        if self.action != "evict" or base is None or self._halted:
            return
        step = base + 1
        if self.evidence_step == step or step not in self._fresh_steps(group):
            return
        with self._evidence_lock:
            if self.evidence_step == step:
                return
            pins = self._hold(group, step, self._since)
            if pins is None:
                return
            usable = min(self.slots.usable(self.slots.slot_set(w.local_rank), pin)
                         for w, pin in zip(group.workers, pins, strict=True))
            if usable < EVIDENCE_NEEDS_SLOTS:
                # Two held slots would leave the writer only the newest snapshot's: every
                # later save would be skipped until a newer step agrees, which it cannot.
                for p in pins:
                    p.close()
                if not self._evidence_warned:
                    self._evidence_warned = True
                    logger.warning(
                        "the memory cap leaves %d memory slots per worker, fewer than the %d "
                        "that holding the step after the agreed one takes: a decision by "
                        "recomputation may find that step gone (raise --ckpt-memory-cap-mb)",
                        usable, EVIDENCE_NEEDS_SLOTS)
                return
            old, self._evidence, self.evidence_step = self._evidence, pins, step
        logger.debug("holding step %d's first results (the step after the agreed one)", step)
        for p in old:
            p.close()

    def _release_evidence(self) -> None:
        with self._evidence_lock:
            old, self._evidence, self.evidence_step = self._evidence, [], None
        for p in old:
            p.close()

    def _unpin(self) -> None:
        with self._lock:
            old, self._pins = self._pins, []
        for p in old:
            p.close()

    @staticmethod
    def _local(finding: Finding, group: GroupInfo) -> bool:
        """Whether every rank of ``finding`` is this node's (its snapshots can be read again)."""
        return set(finding.suspects) <= {w.global_rank for w in group.workers}

    def _gather(self, group: GroupInfo, step: int, fps: list[Fingerprint]
                ) -> tuple[list[Fingerprint], dict[int, str]] | None:
        """Publishes this node's fingerprints of ``step``; on the leader, every node's (None
        on the other nodes). A node that has not published in time is left out."""
        store = self.store
        mine = {"node": group.node_id, "health": list(self._health[group.node_id]),
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
            ok, detail = record.get("health") or (None, "not published")
            self._health[record["node"]] = (ok, str(detail))
            for f in record["fingerprints"]:
                gathered.append(Fingerprint(
                    rank=f["rank"], step=f["step"], world_size=f["world_size"],
                    replica_set=f["replica_set"], digest=f["digest"],
                    items=tuple((str(n), int(c)) for n, c in f["items"]), nbytes=f["nbytes"]))
                nodes[f["rank"]] = record["node"]
            if self._deletes:
                try:
                    store.delete_key(key)
                except (RuntimeError, NotImplementedError):
                    # The rendezvous's store (etcd's, behind a prefix) deletes nothing: its
                    # keys go with the round.
                    self._deletes = False
        return gathered, nodes

    def _report(self, finding: Finding, fps: list[Fingerprint],
                first: Mapping[int, str] | None = None) -> None:
        """Logs ``finding`` as an event with its evidence: the set's fingerprints, and for a
        step computed again, ``first``, the first results' digests (``first_results``)."""
        self.findings.append(finding)
        evidence: list[dict[str, Any]] = [f.to_json() for f in fps
                                          if f.rank in finding.digests]
        kind = "sdc_suspect" if finding.kind is Verdict.SUSPECT else "sdc_undecidable"
        logger.error("silent data corruption %s at step %d: %s (items %s)",
                     "suspected" if kind == "sdc_suspect" else "undecidable", finding.step,
                     finding.reason, list(finding.items)[:5])
        set_nodes = sorted({self._node_of.get(r, "?") for r in finding.digests})
        health = {n: {"ok": self._health[n][0], "detail": self._health[n][1]}
                  for n in set_nodes if n in self._health}
        more: dict[str, Any] = {}
        if first is not None:
            more["first_results"] = {str(r): d for r, d in sorted(first.items())}
        self._emit(kind, step=finding.step, ranks=list(finding.suspects),
                   nodes=list(finding.nodes), reason=finding.reason,
                   decided_by=finding.decided_by or None, health=health,
                   items=list(finding.items)[:20], agreed_step=self.agreed_step,
                   fingerprints=evidence, **more)


def _key(round_: int, step: int, group_rank: int) -> str:
    return f"elasticft.sdc.{round_}.{step}.{group_rank}"


def _round_key(round_: int, what: str) -> str:
    return f"elasticft.sdc.{round_}.{what}"
