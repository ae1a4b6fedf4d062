"""A reshape: a rendezvous round that changes the world under running workers (a node lost with
no standby to take its place, so the job shrinks), and the judgement whether the new layout
holds every survivor's state; the policy (:func:`elasticft.addon.policy.decide_change`) turns
that into a regroup in process or a restart.

**When the survivors can stay.** The planner lays ranks out TP fastest, then DP
(:class:`elasticft.plan.api.Layout`), so a TP group is a run of consecutive ranks, and with
data parallelism every DP replica holds the whole training state. A lost node then takes whole
replicas with it only when the TP degree divides the ranks per node; the survivors are whole
TP groups, each a complete replica. A new round numbers the nodes again (global rank = node rank
x ranks per node + local rank), so each survivor keeps its place in its TP group, and with it
its TP shard and its optimizer state, unchanged. Nothing is resharded: the survivors renumber,
make their groups again in the new world, re-point their device meshes at the new layout's
shape (:meth:`elasticft.inprocess.meshes.KeptModules.reshape`) and keep the global batch with the
gradient accumulation the planner chose.

**When they cannot** (:func:`decide`, pure, with the reason in the event log's ``reshape``
event and in the policy's restart cause): the script does not re-read its layout at each entry
(``InProcess(follows_layout=True)``); the planner has no layout for what is left; the TP or
PP degree changes (each shard would have to be cut again: DCP does that, in new processes);
a TP group spans nodes (a lost node takes part of one, and the survivors would change places);
the state is sharded over DP (FSDP2: the lost replica's shards are held by no survivor); the new
layout leaves ranks idle; or its global batch differs.

Every agent of the round decides from the same facts (the layouts, the worlds, the ranks per node
and the script's declaration), so all nodes agree without asking each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from elasticft.plan.api import Layout


@dataclasses.dataclass(frozen=True)
class ReshapeFacts:
    """What the decision sees of a round that changed the world."""

    old: Layout | None
    """The layout the workers run in (None: the planner gave none)."""
    new: Layout | None
    """The planner's layout for the new round (None: none fits)."""
    world_before: int
    world_after: int
    ranks_per_node: int
    moves: Mapping[int, int]
    """This node's workers: old global rank -> new global rank."""
    follows_layout: bool
    """The script re-reads its layout at each entry (``InProcess(follows_layout=True)``)."""
    sharded_over: frozenset[str] = frozenset()
    """The mesh dimensions the workers' state is sharded over besides TP (``{"dp"}``: FSDP2)."""

    def evidence(self) -> dict[str, object]:
        """The facts as the event log records them."""
        return {
            "old": self.old.describe() if self.old else None,
            "new": self.new.describe() if self.new else None,
            "world": [self.world_before, self.world_after],
            "ranks_per_node": self.ranks_per_node,
            "moves": {str(k): v for k, v in sorted(self.moves.items())},
            "follows_layout": self.follows_layout,
            "sharded_over": sorted(self.sharded_over),
        }


@dataclasses.dataclass(frozen=True)
class ReshapeDecision:
    in_process: bool
    reason: str


def _restart(reason: str) -> ReshapeDecision:
    return ReshapeDecision(False, reason)


def decide(facts: ReshapeFacts) -> ReshapeDecision:
    """In process, or a restart with its reason (pure, total)."""
    old, new = facts.old, facts.new
    if not facts.follows_layout:
        return _restart("the script does not follow a layout change in process (it would need "
                        "InProcess(follows_layout=True) and elasticft.layout() read at each "
                        "entry)")
    if old is None or new is None:
        which = "the running workers" if old is None else "the new round"
        return _restart(f"the planner gave no layout for {which}")
    if new.gpus_used != facts.world_after:
        return _restart(f"{new.describe()} leaves {facts.world_after - new.gpus_used} of "
                        f"{facts.world_after} ranks idle")
    if new.pp != old.pp:
        return _restart(f"the pipeline degree changes from PP{old.pp} to PP{new.pp}: the "
                        "stages' layers move between ranks, which only a restart does")
    if new.tp != old.tp:
        return _restart(f"the TP degree changes from TP{old.tp} to TP{new.tp}: every tensor-"
                        "parallel shard would be cut again, which only a restart does (DCP)")
    if facts.ranks_per_node % old.tp:
        return _restart(f"a TP group spans nodes (TP{old.tp} over {facts.ranks_per_node} ranks "
                        "per node): a lost node took part of a TP group, whose shard no "
                        "survivor in its place holds")
    moved = {o: n for o, n in facts.moves.items() if o % old.tp != n % new.tp}
    if moved:
        o, n = next(iter(sorted(moved.items())))
        return _restart(f"rank {o} becomes rank {n}, another TP position: its shard does not "
                        "fit there")
    if "dp" in facts.sharded_over and new.dp != old.dp:
        return _restart(f"the state is sharded over DP (FSDP2): going from DP{old.dp} to "
                        f"DP{new.dp} cuts every shard again, and a lost replica's shards are "
                        "held by no survivor")
    others = sorted(facts.sharded_over - {"dp", "tp"})
    if others:
        return _restart(f"the state is sharded over {', '.join(others)}, which a reshape in "
                        "process does not follow")
    old_batch, new_batch = old.dp * old.grad_accum, new.dp * new.grad_accum
    if old_batch != new_batch:
        return _restart(f"the global batch changes (DP x accumulation {old_batch} -> "
                        f"{new_batch})")
    return ReshapeDecision(True, f"{old.describe()} -> {new.describe()}: every survivor keeps "
                                 "its TP shard (each DP replica holds the whole state) and the "
                                 "accumulation keeps the global batch")
