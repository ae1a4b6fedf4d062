"""A diverged loss (NaN/inf or spike) restarts from the last snapshot, never a JIT checkpoint."""

from __future__ import annotations

from pathlib import Path

from elasticft.addon.api import Detection, GroupInfo, WorkerInfo
from elasticft.addon.classify import FailureClass
from elasticft.addon.policy import (
    ActionKind,
    CheckpointSource,
    FailureFacts,
    decide,
    is_node_offence,
)

GROUP = GroupInfo("job", "node-a", Path("/tmp"), 1, 0, 1, 0,
                  tuple(WorkerInfo(r, r, 2, 100 + r) for r in range(2)))


def _facts(cls: FailureClass) -> FailureFacts:
    detection = Detection(cls, (1,), "loss_nan", "nan loss on rank 1 at step 7: loss is nan")
    return FailureFacts(detection.as_failures(GROUP), restarts_used=0, max_restarts=3,
                        replicas_intact=True, jit_available=True, can_evict=True)


def test_a_nan_loss_restarts_in_place_from_the_snapshot():
    action = decide(_facts(FailureClass.NUMERIC))
    assert action.kind is ActionKind.RESTART_IN_PLACE
    assert action.checkpoint is CheckpointSource.SNAPSHOT
    # The same facts for a hang would ask a healthy replica just in time.
    assert decide(_facts(FailureClass.HANG)).checkpoint is CheckpointSource.JIT


def test_a_nan_loss_is_not_held_against_the_node():
    [failure] = _facts(FailureClass.NUMERIC).failures
    assert failure.failure_class is FailureClass.NUMERIC
    assert not is_node_offence(failure)


def test_a_nan_loss_without_restarts_left_stops():
    facts = _facts(FailureClass.NUMERIC)
    spent = FailureFacts(facts.failures, restarts_used=3, max_restarts=3)
    assert decide(spent).kind is ActionKind.STOP
