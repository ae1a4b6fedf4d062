"""What a preemption notice does: a pure decision over what the agent knows, with its reason.

:func:`decide` takes :class:`NoticeFacts` (how long until the deadline, whether the workers
use the worker API, the newest snapshot they hold and how old it is, the step time, the
number of nodes) and returns a :class:`Plan`: its action, the longest the save may take, and
the reason, which goes to the event log with the facts.

* A **termination** with time to save: save and stop. A job on the worker API persists its
  newest complete snapshot through the checkpoint service's "checkpoint now" (its workers first
  finish the snapshot copy in flight, which is the just-in-time save when the newest held one
  is older than a step); a plain script is sent the signal and saves itself. The save may take
  :data:`SAVE_SHARE` of the time left, and never the last :data:`EXIT_MARGIN_S`, which are for
  stopping the workers and exiting.
* A termination with no time left: stop now; a relaunch resumes from the newest durable step.
* A **rebalance** recommendation (a risk, no deadline): persist the newest snapshot when it is
  newer than the durable one, and go on training.
* Another node's termination (it told the round): when the job can go on without that node
  (an elastic rendezvous keeps enough nodes), go on, and its departure is a node loss like any
  other; else save and stop too, so that every node saves its newest step before the deadline.
"""

from __future__ import annotations

import dataclasses
import enum

from elasticft.preemption.notices import Kind

SAVE_SHARE = 0.8
"""Share of the time left the save may take."""
EXIT_MARGIN_S = 3.0
"""Seconds kept before the deadline for stopping the workers and exiting."""
MIN_SAVE_S = 1.0
"""A save given less than this cannot finish; below it the run stops without one."""
REBALANCE_SAVE_S = 60.0
"""Longest a save on a rebalance recommendation (no deadline) may take."""


class PlanAction(enum.Enum):
    SAVE_AND_STOP = "save_and_stop"
    STOP = "stop"
    PERSIST_AND_CONTINUE = "persist_and_continue"
    CONTINUE = "continue"


@dataclasses.dataclass(frozen=True)
class NoticeFacts:
    kind: Kind
    seconds_left: float | None
    """Until the deadline (None: a notice without one)."""
    worker_api: bool
    """The checkpoint service holds the workers' snapshots (else a plain script)."""
    newest_step: int | None = None
    """Newest snapshot every local worker holds complete."""
    durable_step: int | None = None
    """Newest step persisted to disk."""
    snapshot_age_s: float | None = None
    step_time_s: float | None = None
    nodes: int = 1
    from_node: str = ""
    """Another node of the job is the one preempted ("": this node)."""
    goes_on_without_it: bool = False
    """The job can go on without that node (an elastic rendezvous keeps enough nodes)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    action: PlanAction
    save_budget_s: float
    reason: str


def _snapshot_words(facts: NoticeFacts) -> str:
    if not facts.worker_api:
        return "a plain script: it is sent the signal, as torchrun does, and saves if it handles it"
    if facts.newest_step is None:
        return "no snapshot held yet: the workers are asked for theirs"
    age, step = facts.snapshot_age_s, facts.step_time_s
    if age is None or step is None:
        return f"newest snapshot step {facts.newest_step}: persisting it"
    if age <= step:
        return (f"newest snapshot step {facts.newest_step} is {age:.1f} s old, within a step "
                f"({step:.2f} s): persisting it")
    return (f"newest snapshot step {facts.newest_step} is {age:.1f} s old, older than a step "
            f"({step:.2f} s): the workers complete their newest first, then it is persisted")


def decide(facts: NoticeFacts) -> Plan:
    """The plan for one notice (see the module docstring); pure and total."""
    if facts.kind == "rebalance":
        newer = facts.worker_api and facts.newest_step is not None and (
            facts.durable_step is None or facts.newest_step > facts.durable_step)
        if newer:
            return Plan(PlanAction.PERSIST_AND_CONTINUE, REBALANCE_SAVE_S,
                        f"rebalance recommendation (interruption risk, no deadline): "
                        f"persisting step {facts.newest_step} and training on")
        return Plan(PlanAction.CONTINUE, 0.0,
                    "rebalance recommendation (interruption risk, no deadline): nothing newer "
                    "than the durable step to persist; training on")
    left = facts.seconds_left
    if facts.from_node and facts.goes_on_without_it:
        return Plan(PlanAction.CONTINUE, 0.0,
                    f"node {facts.from_node} is preempted and the job can go on without it: "
                    "its departure is handled as a node loss; training on")
    if facts.from_node:
        nodes = (f"; node {facts.from_node} is preempted and the job cannot go on without it: "
                 f"all {facts.nodes} nodes save and exit")
    elif facts.nodes > 1:
        nodes = f"; the other {facts.nodes - 1} node(s) are told"
    else:
        nodes = ""
    budget = REBALANCE_SAVE_S if left is None else min(SAVE_SHARE * left, left - EXIT_MARGIN_S)
    if budget < MIN_SAVE_S:
        durable = (f"step {facts.durable_step}" if facts.durable_step is not None
                   else "the beginning")
        return Plan(PlanAction.STOP, 0.0,
                    f"{left:.1f} s to the deadline leave no time to save: stopping; a relaunch "
                    f"resumes from {durable}{nodes}")
    when = "no deadline given" if left is None else f"{left:.1f} s to the deadline"
    return Plan(PlanAction.SAVE_AND_STOP, budget,
                f"{when}, the save may take {budget:.1f} s; {_snapshot_words(facts)}; then "
                f"the workers stop and the launcher exits 'preempted'{nodes}")
