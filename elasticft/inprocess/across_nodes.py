"""In-process recovery across nodes: a node's agent recovers together with the other nodes'.

Every node hears of the failure at once and only the failed rank gets a new
process (:mod:`elasticft.inprocess.failure_news`): the agent that knows first ends the generation
in the job's shared store, every other agent writes its node's interrupt notice as soon as it
sees that, and the agents agree there on the next generation, over the same world, on a store
one of them hosts (``InProcessCoordinator.host_store`` and ``adopt``); the failed worker's node
starts just that worker's replacement, its other workers regroup as survivors. A node lost with
its agent never joins that agreement: then the agents join the next rendezvous round with their
workers still running and watched (on a thread: :mod:`elasticft.inprocess.next_round`; a survivor
that dies meanwhile is replaced in that round; a warm standby takes the lost node's place there,
with its ranks) and
publish that round's worker address as the next generation
(``InProcessCoordinator.publish_round``; the survivor of rank 0 hosts the store, as torch's
``env://`` would; a node with a failed worker restarts its workers in that round). The other
nodes' new workers meet the survivors there. A round that gives this node's workers other
ranks or another world (a node lost with no standby, a node that joins:
:meth:`~elasticft.inprocess.agent_side.InProcessRecovery.grow`) is a *reshape*:
:func:`elasticft.inprocess.reshape.decide` judges whether the new layout holds every survivor's
state, and the policy (:func:`elasticft.addon.policy.decide_change`) decides from that whether
the survivors renumber and go on in process (the generation then carries each local rank's new
variables) or restart in that round, and why (a ``reshape`` event).

:class:`AcrossNodes` is that part of
:class:`~elasticft.inprocess.agent_side.InProcessRecovery` (its base): the agreement on the
next generation in the job's shared store, a failure heard from another node, and the next
rendezvous round with the workers still running, with its reshape.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

from elasticft.addon.api import Detection
from elasticft.addon.classify import FailureClass
from elasticft.addon.policy import ActionKind, ChangeFacts, decide_change
from elasticft.inprocess import next_round, reshape
from elasticft.inprocess.protocol import Generation
from elasticft.plan import worker as plan_worker
from elasticft.plan.api import Layout, PlanError

logger = logging.getLogger("elasticft.inprocess.agent_side")  # the recovery's log, as before

CHAINED_LIMIT = 2
"""In-process recoveries begun in a row before one completes: a failure during the last of them
(the third failure) restarts the group instead."""


class AcrossNodes:
    """The across-nodes methods of :class:`~elasticft.inprocess.agent_side.InProcessRecovery`
    (its coordinator, news, agent's side, event log and recovery state are the subclass's)."""

    def _across_nodes(self) -> bool:
        return (self._group().group_world_size > 1 and self.news is not None
                and self.news.available)

    def _agree_across_nodes(self, pids: dict[int, int | None], replace: list[int], cause: str,
                            faults: Mapping[int, bool]
                            ) -> tuple[Generation, dict[int, int]] | None:
        """Ends the generation on every node, agrees with the other agents on the next one
        (:mod:`elasticft.inprocess.failure_news`) and replaces this node's failed workers there;
        returns it and their pids. When a node is lost the agents take the next rendezvous
        round instead (None when this node's workers restarted in it)."""
        assert self.news is not None
        news = self.news
        self._times["agree"] = time.time()
        news.publish_ended(cause)
        spec = self._group().spec
        addr = getattr(spec, "local_addr", None) or socket.getfqdn()
        agreed = news.agree(lambda: self.coordinator.host_store(addr))
        news.done()
        self._times["agreed"] = time.time()
        if agreed.round:
            logger.warning("no generation across nodes: %s", agreed.reason)
            if replace:  # this node's failed workers restart in the round, with the others
                self.agent.rendezvous()
                self.agent.restart_in_round(f"{cause}; {agreed.reason}")
                return None
            return self._next_round_generation(pids)
        world = self._group().workers[0].world_size
        logger.warning("generation across nodes on node %s's store %s:%d (%s)", agreed.host,
                       agreed.master_addr, agreed.master_port, agreed.reason)
        return self._replace_in_process(replace, faults, lambda: self.coordinator.adopt(
            agreed.master_addr, agreed.master_port, world))

    def _recover_heard(self, record: Any, at: float) -> Detection | None:
        """Another node ended the generation (:class:`~elasticft.inprocess.failure_news.Ended`,
        heard at ``at``): this node's workers regroup with the others (a recovery under way
        here is superseded, up to :data:`CHAINED_LIMIT` in a row)."""
        cause = f"node {record.node} ended generation: {record.cause}"
        if self.recovering and self.chained >= CHAINED_LIMIT:
            return Detection(FailureClass.INFRASTRUCTURE, (), "inprocess",
                             f"{cause}, during in-process recovery {self.chained} in a row")
        failed = self._recover(cause, (), at, in_round=False, across=True)
        if failed is None:
            return None
        return Detection(FailureClass.INFRASTRUCTURE, (), "inprocess",
                         f"in-process recovery of node {record.node}'s failure failed: {failed}")

    def _next_round_generation(self, pids: dict[int, int | None]
                               ) -> tuple[Generation, dict[int, int]] | None:
        """A job of several nodes: a new rendezvous round with no worker stopped (a standby
        takes the lost node's place there), published as the survivors' next generation; a
        survivor that died while the round waited (:mod:`elasticft.inprocess.next_round`) is
        replaced there. Returns it and the replacements' pids. A round that renumbers this
        node's ranks restarts its workers in that round, through the agent's restart path
        (None)."""
        wg = self._group()
        before = [(w.global_rank, w.world_size) for w in wg.workers]
        old_layout = plan_worker.layout(self.agent.round_env(wg.workers[0].local_rank))
        self.agent.next_attempt()
        self._times["rendezvous"] = time.time()
        died = self._join_round_watching(wg, pids)
        self._times["rendezvoused"] = time.time()
        wg = self._group()
        # the same processes: torch's monitor compares ids and pids
        self.agent.workers.record_pids({w.local_rank: pids.get(w.local_rank) for w in wg.workers})
        after = [(w.global_rank, w.world_size) for w in wg.workers]
        if after == before:
            def publish() -> Generation:
                return self.coordinator.publish_round(
                    wg.master_addr or "127.0.0.1", wg.master_port or 0, after[0][1])

            if died:  # replaced in the round's generation, as a failed rank is
                return self._replace_in_process(died, {}, publish)
            return publish(), {}
        if died:
            cause = (f"local rank(s) {died} died while the round waited and round "
                     f"{self.agent.round()} renumbers this node's workers: they restart")
            logger.warning("no in-process regroup: %s", cause)
            self.agent.restart_in_round(cause)
            return None
        envs = {w.local_rank: self.agent.round_env(w.local_rank) for w in wg.workers}
        facts = self._reshape_facts(pids, before, after, old_layout, envs)
        layouts = reshape.decide(facts)  # whether the new layout holds every survivor's state
        action = decide_change(ChangeFacts(
            "reshape", f"round {self.agent.round()} gives this node's workers (rank, world "
            f"size) {after}, not {before}", layouts.in_process, layouts.reason))
        in_process = action.kind is ActionKind.REGROUP_IN_PROCESS
        self.events.emit("reshape", attempt=self.agent.attempt(), round=self.agent.round(),
                         in_process=in_process, reason=layouts.reason,
                         action=action.kind.value, decision=action.reason, **facts.evidence())
        logger.warning("decision: %s (%s)", action.kind.value, action.reason)
        if in_process:
            return self.coordinator.publish_round(
                wg.master_addr or "127.0.0.1", wg.master_port or 0, after[0][1],
                env={str(lr): env for lr, env in envs.items()}), {}
        self.agent.restart_in_round(action.reason)
        return None

    def _join_round_watching(self, wg: Any, pids: Mapping[int, int | None]) -> list[int]:
        """Joins the next round on a thread while this node's survivors are watched and the
        round's limit (the recovery's join limit) is kept (:func:`next_round.join_watching`);
        returns the local ranks that died meanwhile."""
        limit_s = self.coordinator.join_limit_s
        self._times["rendezvous_limit_s"] = limit_s
        attempt, round_ = self.agent.attempt(), self.agent.round() + 1
        ranks = {w.local_rank: w.global_rank for w in wg.workers}  # the round rewrites them
        self.events.emit("next_round", attempt=attempt, round=round_, limit_s=limit_s,
                         survivors=[ranks[lr] for lr in pids])

        def died(local_rank: int, waited_s: float) -> None:
            rank = ranks[local_rank]
            logger.warning("local rank %d (rank %d, pid %s) died while the next rendezvous "
                           "round waited (%.1f s): it is replaced there", local_rank, rank,
                           pids.get(local_rank), waited_s)
            self.events.emit("survivor_died_in_round", attempt=attempt, round=round_,
                             rank=rank, pid=pids.get(local_rank), waited_s=round(waited_s, 3))

        def overran(overrun: next_round.RoundOverrun) -> None:
            logger.warning("%s", overrun.reason)
            self.events.emit("round_overrun", attempt=attempt, round=round_,
                             reason=overrun.reason, **overrun.evidence)

        watch = next_round.join_watching(
            self.agent.rendezvous, [lr for lr, pid in pids.items() if pid is not None],
            self._dead_workers, limit_s=limit_s, interval_s=wg.spec.monitor_interval,
            on_death=died, on_overrun=overran)
        return sorted(watch.died)

    def _reshape_facts(self, pids: Mapping[int, int | None], before: list[tuple[int, int]],
                       after: list[tuple[int, int]], old_layout: Layout,
                       envs: Mapping[int, Mapping[str, str]]) -> reshape.ReshapeFacts:
        """What :func:`elasticft.inprocess.reshape.decide` sees of this round: the layouts
        before and after, the worlds, this node's ranks, and what the workers said when they
        armed (whether they follow a layout change, what their state is sharded over)."""
        records = [self.coordinator.armed_record(lr, pid) for lr, pid in pids.items()]
        try:
            new_layout: Layout | None = plan_worker.layout(next(iter(envs.values())))
        except PlanError:
            new_layout = None
        return reshape.ReshapeFacts(
            old=old_layout, new=new_layout, world_before=before[0][1],
            world_after=after[0][1], ranks_per_node=len(before),
            moves={b[0]: a[0] for b, a in zip(before, after, strict=True)},
            follows_layout=bool(records) and all(r.get("follows_layout") for r in records),
            sharded_over=frozenset(d for r in records for d in r.get("sharded_over", ())))
