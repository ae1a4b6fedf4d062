"""Time for a transient cause to clear: a communication fault that repeats identically before the
first step is restarted after a growing, capped, jittered wait (pure functions, by table); and
a failure that says the job cannot go on as launched stops at once, whatever restarts are left."""

from __future__ import annotations

import pytest

from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import (
    ActionKind,
    FailureFacts,
    FailureSignature,
    backoff_delay,
    comm_repeats,
    comm_signature,
    decide,
)


@pytest.mark.parametrize(
    ("repeats", "first", "cap", "jitter", "wait"),
    [
        (0, 1.0, 30.0, 0.0, 0.0),       # the first fault: restarted at once
        (1, 1.0, 30.0, 0.0, 1.0),       # its first repeat: the first wait
        (2, 1.0, 30.0, 0.0, 2.0),       # doubled at each further repeat
        (3, 1.0, 30.0, 0.0, 4.0),
        (5, 1.0, 30.0, 0.0, 16.0),
        (6, 1.0, 30.0, 0.0, 30.0),      # capped
        (1000, 1.0, 30.0, 0.0, 30.0),   # no overflow
        (1, 1.0, 30.0, 0.5, 0.875),     # the jitter takes off up to a quarter
        (1, 1.0, 30.0, 0.999999, 0.75000025),
        (6, 1.0, 30.0, 0.5, 26.25),     # of the capped wait too
        (2, 0.2, 5.0, 0.0, 0.4),
        (3, 1.0, 0.5, 0.0, 0.5),        # a cap below the first wait wins
        (3, 0.0, 30.0, 0.0, 0.0),       # --restart-backoff-s 0: no wait
        (3, 1.0, 0.0, 0.0, 0.0),
        (-1, 1.0, 30.0, 0.0, 0.0),
    ],
)
def test_backoff_delay(repeats: int, first: float, cap: float, jitter: float, wait: float
                       ) -> None:
    assert backoff_delay(repeats, first, cap, jitter) == pytest.approx(wait)


def test_each_wait_is_longer_than_the_one_before_below_the_cap_whatever_the_jitter() -> None:
    for repeats in range(1, 7):  # nominal 1, 2, ... 64, all below the cap
        longest_now = backoff_delay(repeats, 1.0, 100.0, 0.0)
        shortest_next = backoff_delay(repeats + 1, 1.0, 100.0, 0.9999999)
        assert shortest_next > longest_now


def comm(exception: str = "ConnectionResetError", frame: str = "/job/t.py:9 in load",
         cls: FailureClass = FailureClass.INFRASTRUCTURE) -> FailureRecord:
    return FailureRecord(rank=1, local_rank=1, pid=7, exitcode=1, failure_class=cls,
                         exception=exception, message="connection reset by peer",
                         location=frame, user_frame=frame)


RESET = comm_signature(comm())


@pytest.mark.parametrize(
    ("previous", "count", "failure", "stepped", "repeats"),
    [
        (None, 0, comm(), False, 0),                  # the first: not a repeat
        (RESET, 0, comm(), False, 1),                 # the same again before the first step
        (RESET, 3, comm(), False, 4),
        (RESET, 3, comm(), True, 0),                  # a step completed: reset
        (RESET, 3, comm(), None, 0),                  # unknown whether one did: no wait
        (RESET, 3, comm(frame="/job/t.py:10 in load"), False, 0),   # another place
        (RESET, 3, comm(exception="BrokenPipeError"), False, 0),    # another fault
        (RESET, 3, comm(cls=FailureClass.UNKNOWN), False, 0),       # not a communication fault
    ],
)
def test_comm_repeats(previous: FailureSignature | None, count: int, failure: FailureRecord,
                      stepped: bool | None, repeats: int) -> None:
    assert comm_repeats(previous, count, comm_signature(failure), stepped) == repeats


@pytest.mark.parametrize(("repeats", "used", "kind", "wait"), [
    (0, 0, ActionKind.RESTART_IN_PLACE, 0.0),
    (1, 1, ActionKind.RESTART_IN_PLACE, 0.5),
    (2, 2, ActionKind.RESTART_IN_PLACE, 1.0),
    (3, 3, ActionKind.STOP, 0.0),  # no restarts left: nothing to wait for
])
def test_a_repeated_communication_fault_is_restarted_after_a_wait(
        repeats: int, used: int, kind: ActionKind, wait: float) -> None:
    action = decide(FailureFacts((comm(),), restarts_used=used, max_restarts=3,
                                 step_completed=False, previous_failure=None,
                                 comm_repeats=repeats, backoff_first_s=0.5, backoff_max_s=10))
    assert action.kind is kind
    assert action.wait_s == pytest.approx(wait)
    assert (f"after a wait of {wait:.2f} s (the same communication fault before the first step "
            f"{repeats + 1} times in a row" in action.reason) == (wait > 0), action.reason


def test_only_a_communication_fault_waits() -> None:
    crash = FailureRecord(rank=0, local_rank=0, pid=1, exitcode=-9,
                          failure_class=FailureClass.SIGNAL_CRASH, signal="SIGKILL")
    action = decide(FailureFacts((crash,), restarts_used=0, max_restarts=3, comm_repeats=2))
    assert action.kind is ActionKind.RESTART_IN_PLACE and action.wait_s == 0


@pytest.mark.parametrize("allowed", [0, 3])
def test_a_checkpoint_that_does_not_fit_stops_at_once(allowed: int) -> None:
    mismatch = FailureRecord(
        rank=0, local_rank=0, pid=1, exitcode=1, failure_class=FailureClass.USER_CODE,
        exception="StateMismatch", message="run r: ... 'model.pos' ...; ... --fresh ...")
    action = decide(FailureFacts((mismatch,), restarts_used=0, max_restarts=3,
                                 restart_on_user_error=allowed))
    assert action.kind is ActionKind.STOP and action.exit_code == 1 and action.fails_again
    assert "3 of --max-restarts 3 left unused" in action.reason
    assert "'model.pos'" in action.reason and "--fresh" in action.reason
