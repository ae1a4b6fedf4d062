"""The recovery policy: a pure function from the facts of a failure to one action.

Nothing here does I/O or reads a clock, so every branch is unit-tested and every decision comes
with a reason that the agent logs and writes to the event log. Later subsystems add facts
(suspect hardware, a blacklisted node, a Slurm time limit) and the actions that answer them.
"""

from __future__ import annotations

import dataclasses
import enum

from elasticft.agent.classify import FailureClass, FailureRecord


class ActionKind(str, enum.Enum):
    RESTART_IN_PLACE = "restart_in_place"
    """Stop this node's workers and start them again (a new rendezvous round)."""
    EVICT_NODE = "evict_node"
    """This node leaves the job (blacklisted); the others re-rendezvous without it."""
    STOP = "stop"
    """Stop the job; the launcher exits non-zero with the reason."""
    CHECKPOINT_AND_REQUEUE = "checkpoint_and_requeue"
    """Save now, hand the job back to the scheduler, exit."""


@dataclasses.dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str
    exit_code: int = 0
    """The launcher's exit code when the action ends the run."""
    consumes_user_error_restart: bool = False
    """A restart granted by --restart-on-user-error (not by --max-restarts)."""


@dataclasses.dataclass(frozen=True)
class FailureFacts:
    """What the agent knows when a worker group fails."""

    failures: tuple[FailureRecord, ...]
    restarts_used: int
    max_restarts: int
    user_error_restarts_used: int = 0
    restart_on_user_error: int = 0
    node_suspect: bool = False
    """Diagnostics found this node's hardware or host unhealthy."""
    can_evict: bool = False
    """Other nodes can carry on without this one (elastic min nodes allows it)."""


# When several ranks fail together, the root cause is the most specific class: a user bug in one
# rank makes its peers fail with connection errors, not the other way round.
_ROOT_CAUSE_ORDER = (
    FailureClass.USER_CODE,
    FailureClass.SIGNAL_CRASH,
    FailureClass.HANG,
    FailureClass.INFRASTRUCTURE,
    FailureClass.STOP_REQUESTED,
    FailureClass.UNKNOWN,
)


def root_cause(failures: tuple[FailureRecord, ...]) -> FailureRecord:
    """The failure that most likely caused the others (lowest rank breaks ties)."""
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    return min(failures, key=lambda f: (_ROOT_CAUSE_ORDER.index(f.failure_class), f.rank))


def decide(facts: FailureFacts) -> Action:
    cause = root_cause(facts.failures)
    what = cause.summary()
    if cause.failure_class is FailureClass.USER_CODE:
        if facts.user_error_restarts_used < facts.restart_on_user_error:
            return Action(
                ActionKind.RESTART_IN_PLACE,
                f"user-code error, restart {facts.user_error_restarts_used + 1} of "
                f"--restart-on-user-error {facts.restart_on_user_error}: {what}",
                consumes_user_error_restart=True,
            )
        return Action(
            ActionKind.STOP,
            f"user-code error, not restarted (a restart would fail the same way; "
            f"--restart-on-user-error allows it): {what}",
            exit_code=1,
        )
    if facts.node_suspect and facts.can_evict:
        return Action(ActionKind.EVICT_NODE, f"this node is suspect, evicting it: {what}",
                      exit_code=1)
    if facts.restarts_used >= facts.max_restarts:
        return Action(
            ActionKind.STOP,
            f"no restarts left ({facts.restarts_used} of --max-restarts {facts.max_restarts} "
            f"used): {what}",
            exit_code=1,
        )
    return Action(
        ActionKind.RESTART_IN_PLACE,
        f"{cause.failure_class.value}, restart {facts.restarts_used + 1} of "
        f"--max-restarts {facts.max_restarts}: {what}",
    )
