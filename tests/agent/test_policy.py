"""The pure recovery policy, exhaustively over failure classes and budgets."""

from __future__ import annotations

import itertools

import pytest

from elasticft.agent.classify import FailureClass, FailureRecord
from elasticft.agent.policy import ActionKind, FailureFacts, decide, root_cause


def failure(rank: int, cls: FailureClass) -> FailureRecord:
    return FailureRecord(rank=rank, local_rank=rank, pid=100 + rank, exitcode=1, failure_class=cls)


RESTARTABLE = [c for c in FailureClass if c is not FailureClass.USER_CODE]


@pytest.mark.parametrize(
    ("cls", "used", "budget"),
    list(itertools.product(RESTARTABLE, range(3), range(3))),
)
def test_restartable_failures_restart_within_budget(cls: FailureClass, used: int, budget: int):
    action = decide(FailureFacts((failure(0, cls),), restarts_used=used, max_restarts=budget))
    if used < budget:
        assert action.kind is ActionKind.RESTART_IN_PLACE
        assert f"restart {used + 1} of --max-restarts {budget}" in action.reason
        assert action.exit_code == 0
    else:
        assert action.kind is ActionKind.STOP
        assert action.exit_code == 1
        assert "no restarts left" in action.reason
    assert cls.value in action.reason


@pytest.mark.parametrize(("used", "allowed"), list(itertools.product(range(3), range(3))))
def test_user_errors_stop_unless_allowed(used: int, allowed: int) -> None:
    facts = FailureFacts(
        (failure(1, FailureClass.USER_CODE),),
        restarts_used=0,
        max_restarts=5,
        user_error_restarts_used=used,
        restart_on_user_error=allowed,
    )
    action = decide(facts)
    if used < allowed:
        assert action.kind is ActionKind.RESTART_IN_PLACE
        assert action.consumes_user_error_restart
    else:
        assert action.kind is ActionKind.STOP
        assert action.exit_code == 1
        assert "user-code error, not restarted" in action.reason
        assert "rank 1" in action.reason


def test_user_error_is_root_cause_over_collateral_connection_errors() -> None:
    failures = (failure(0, FailureClass.INFRASTRUCTURE), failure(3, FailureClass.USER_CODE))
    assert root_cause(failures).rank == 3
    action = decide(FailureFacts(failures, restarts_used=0, max_restarts=3))
    assert action.kind is ActionKind.STOP


def test_suspect_node_is_evicted_when_others_can_go_on() -> None:
    facts = FailureFacts(
        (failure(0, FailureClass.HANG),), restarts_used=0, max_restarts=3,
        node_suspect=True, can_evict=True,
    )
    assert decide(facts).kind is ActionKind.EVICT_NODE
    alone = FailureFacts(
        (failure(0, FailureClass.HANG),), restarts_used=0, max_restarts=3, node_suspect=True,
    )
    assert decide(alone).kind is ActionKind.RESTART_IN_PLACE


def test_root_cause_needs_a_failure() -> None:
    with pytest.raises(ValueError):
        root_cause(())
