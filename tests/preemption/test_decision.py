"""What a preemption notice does, decided from what the agent knows (a table of cases)."""

from __future__ import annotations

import pytest

from elasticft.preemption.decision import NoticeFacts, PlanAction, decide

T = "termination"


@pytest.mark.parametrize(
    ("facts", "action", "budget", "words"),
    [
        # Two minutes (AWS): the save may take 80 % of them.
        (NoticeFacts(T, 120.0, True, newest_step=40, durable_step=30, snapshot_age_s=0.2,
                     step_time_s=0.5), PlanAction.SAVE_AND_STOP, 96.0,
         "newest snapshot step 40 is 0.2 s old, within a step (0.50 s): persisting it"),
        # A snapshot older than a step: the workers complete their newest first.
        (NoticeFacts(T, 30.0, True, newest_step=40, durable_step=30, snapshot_age_s=9.0,
                     step_time_s=0.5), PlanAction.SAVE_AND_STOP, 24.0,
         "older than a step (0.50 s): the workers complete their newest first"),
        (NoticeFacts(T, 30.0, True), PlanAction.SAVE_AND_STOP, 24.0,
         "no snapshot held yet: the workers are asked for theirs"),
        # Short notice: the last EXIT_MARGIN_S seconds are kept for stopping and exiting.
        (NoticeFacts(T, 10.0, True, newest_step=3), PlanAction.SAVE_AND_STOP, 7.0,
         "newest snapshot step 3: persisting it"),
        (NoticeFacts(T, 30.0, False), PlanAction.SAVE_AND_STOP, 24.0,
         "a plain script: it is sent the signal, as torchrun does, and saves if it handles it"),
        # No time left to save anything.
        (NoticeFacts(T, 3.5, True, newest_step=40, durable_step=30), PlanAction.STOP, 0.0,
         "leave no time to save: stopping; a relaunch resumes from step 30"),
        (NoticeFacts(T, -5.0, True), PlanAction.STOP, 0.0, "resumes from the beginning"),
        (NoticeFacts(T, 60.0, True, newest_step=9, nodes=4), PlanAction.SAVE_AND_STOP, 48.0,
         "the other 3 node(s) are told"),
        # Another node's notice: go on without it when the rendezvous allows, else save too.
        (NoticeFacts(T, 60.0, True, newest_step=9, nodes=4, from_node="n2",
                     goes_on_without_it=True), PlanAction.CONTINUE, 0.0,
         "node n2 is preempted and the job can go on without it"),
        (NoticeFacts(T, 60.0, True, newest_step=9, nodes=4, from_node="n2"),
         PlanAction.SAVE_AND_STOP, 48.0, "cannot go on without it: all 4 nodes save and exit"),
        # A rebalance recommendation: a risk, no deadline.
        (NoticeFacts("rebalance", None, True, newest_step=40, durable_step=30),
         PlanAction.PERSIST_AND_CONTINUE, 60.0, "persisting step 40 and training on"),
        (NoticeFacts("rebalance", None, True, newest_step=30, durable_step=30),
         PlanAction.CONTINUE, 0.0, "nothing newer than the durable step"),
        (NoticeFacts("rebalance", None, False), PlanAction.CONTINUE, 0.0, "training on"),
    ],
)
def test_decide(facts: NoticeFacts, action: PlanAction, budget: float, words: str) -> None:
    plan = decide(facts)
    assert (plan.action, plan.save_budget_s) == (action, pytest.approx(budget))
    assert words in plan.reason
