"""The recovery policy: a pure function from the facts of a failure to one action.

Nothing here does I/O or reads a clock, so every branch is unit-tested and every decision comes
with a reason that the agent logs and writes to the event log. Later subsystems add facts
(suspect hardware, a blacklisted node, a Slurm time limit) and the actions that answer them.

Recovery (:mod:`elasticft.recovery`) adds the facts of hierarchical recovery: how often this
node was the culprit (a repeat offender is suspect hardware), whether every data-parallel shard
still has a healthy replica (then the healthy replicas take a just-in-time checkpoint of the
state after the last completed step instead of falling back to the newest snapshot), and which
nodes left a round without a word (they are quarantined in the job).

A failure that repeats is not transient: when the previous attempt failed before its first step
and this one fails the same way (:class:`FailureSignature`: class, exception type and the
innermost frame of the user's code) before its first step too, a restart would only fail again,
so the run stops and says which restarts it leaves unused.

Nor is a hang that comes after an in-process recovery before the job passed the step of the
failure it answered (:func:`in_process_repeat`): the survivors kept something the
roll-back did not (a framework's callback, a counter of the script's), so the next recovery is a
restart of every rank, not another in-process try that would meet the same fault.

A communication fault is left out of that rule: its cause (a peer's network, a storage server,
a port still held) may clear by itself, but it needs time to. When one repeats identically
before the first step (:func:`comm_repeats`), the restart waits first (:func:`backoff_delay`:
growing, capped, jittered so that the nodes of a job do not retry in step). A fault after a
step resets the wait.

A failure that says the job cannot go on as launched (:data:`UNRESTARTABLE_EXCEPTIONS`: the
checkpoint does not fit the model) stops the run at once, whatever restarts are left.

The policy also says where the next attempt resumes from (:func:`checkpoint_source`): the
survivors of an in-process recovery keep their state and restore their own snapshot, anything
else takes a just-in-time checkpoint when every shard has a healthy replica to ask. The
checkpoint is taken after the decision, by what it says, never before it.

**Changes of membership** are not failures, and the same module decides them
(:func:`decide_change`, :class:`ChangeFacts`): a node asking to join the running workers, a
new rendezvous round that renumbers them (a *reshape*, whose layout either holds every
survivor's state or does not: :mod:`elasticft.inprocess.reshape` judges the layouts), and a
survivor that leaves while its recovery's group is still forming. Each is answered by a
regroup in process or a restart, with its reason; neither spends a restart (the action says so:
:attr:`Action.counted`), and the agent counts what it spends from the action alone.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from typing import Literal, TypedDict

from elasticft.addon.classify import (
    UNRESTARTABLE_EXCEPTIONS,
    FailureClass,
    FailureRecord,
    device_evidence,
)
from elasticft.decision import Decision


class CheckpointSource(str, enum.Enum):
    """What the next attempt resumes from."""

    JIT = "jit"
    """Healthy replicas save the state after the last completed step now (at most the step in
    flight is lost)."""
    SNAPSHOT = "snapshot"
    """The newest complete snapshot (memory, peer or disk), whatever step it holds."""


class ActionKind(str, enum.Enum):
    RESTART_IN_PLACE = "restart_in_place"
    """Stop this node's workers and start them again (a new rendezvous round)."""
    RECOVER_IN_PROCESS = "recover_in_process"
    """Replace only the failed workers; the others regroup and roll back in their processes
    (:mod:`elasticft.inprocess.agent_side`). Counted against --max-restarts like a restart."""
    EVICT_NODE = "evict_node"
    """This node leaves the job (blacklisted); the others re-rendezvous without it."""
    STOP = "stop"
    """Stop the job; the launcher exits non-zero with the reason."""
    REGROUP_IN_PROCESS = "regroup_in_process"
    """A change of membership the running workers absorb: they regroup in process with the
    nodes that join, renumber in a reshaped round, or take a leaver's replacement in the same
    generation (:func:`decide_change`)."""


@dataclasses.dataclass(frozen=True)
class Action(Decision[ActionKind]):
    exit_code: int = 0
    """The launcher's exit code when the action ends the run."""
    consumes_user_error_restart: bool = False
    """A restart granted by --restart-on-user-error (not by --max-restarts)."""
    checkpoint: CheckpointSource = CheckpointSource.SNAPSHOT
    """Where the next attempt resumes from (see :func:`checkpoint_source`)."""
    wait_s: float = 0.0
    """Seconds to wait before the restart (a communication fault that repeats, see
    :func:`backoff_delay`)."""
    fails_again: bool = False
    """A stop whose cause would come back on any new attempt (a user-code error, a failure that
    repeated before the first step): a scheduler must not resubmit it either."""
    counted: bool = True
    """A restart or in-process recovery spends one of the run's restarts (--max-restarts, or
    --restart-on-user-error with :attr:`consumes_user_error_restart`); a change of membership
    spends none."""

    @property
    def spends_restart(self) -> bool:
        """Whether the agent counts this action against a restart budget."""
        return self.counted and self.kind in (ActionKind.RESTART_IN_PLACE,
                                              ActionKind.RECOVER_IN_PROCESS)

    @property
    def takes_jit(self) -> bool:
        """Whether the healthy replicas take a just-in-time checkpoint now, before the next
        attempt (the action's :attr:`checkpoint`)."""
        return self.checkpoint is CheckpointSource.JIT


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
    suspect_evidence: str = ""
    """What was found against this node when it is suspect (empty: a failed health check);
    e.g. ``sdc: ...`` for silent data corruption, the reason its blacklist entry carries."""
    can_evict: bool = False
    """Other nodes can carry on without this one (elastic min nodes allows it)."""
    node_offences: int = 0
    """Failures this node's own ranks caused in this run, this one included."""
    repeat_offender_limit: int = 0
    """That many offences make the node suspect hardware (0: never)."""
    replicas_intact: bool = False
    """Every data-parallel shard still has a healthy replica."""
    jit_available: bool = False
    """A healthy replica can be asked for a just-in-time checkpoint (a checkpoint control
    channel exists)."""
    in_process: bool = False
    """The survivors can regroup in their processes (every worker runs under
    ``elasticft.inprocess.worker``, one node, no recovery already under way)."""
    nodes: int = 1
    """Nodes in the round."""
    offending_here: bool = False
    """A rank of this node caused this failure (:func:`is_node_offence`): across nodes its
    survivors' state is not all that is needed, so the node's replicas are asked for a
    just-in-time checkpoint even when the recovery is in process."""
    step_completed: bool | None = None
    """A training step completed in this attempt (None: unknown, no step records are kept)."""
    previous_failure: FailureSignature | None = None
    """The signature of the previous attempt's failure when that attempt completed no step
    (None otherwise, or when it ended without a failure)."""
    comm_repeats: int = 0
    """How many attempts in a row before this one failed with this communication fault before
    their first step (:func:`comm_repeats`); 0: not a repeat."""
    backoff_first_s: float = 1.0
    """The wait before the restart after the first repeat (``--restart-backoff-s``)."""
    backoff_max_s: float = 30.0
    """The longest wait (``restart_backoff_max_s``)."""
    jitter: float = 0.0
    """A number in [0, 1) drawn by the agent: its share of :data:`BACKOFF_JITTER`."""
    newest_step: int | None = None
    """The newest step in the workers' step records when this failure came (None: no records
    are kept)."""
    in_process_failed_at: int | None = None
    """When the attempt that failed is an in-process recovery's: the newest step of the
    failure that recovery answered (None: the attempt began with a start or a restart)."""


class KnownFacts(TypedDict, total=False):
    """The fields of :class:`FailureFacts` a collaborator of the agent may know about a failure
    (its ``failure_facts`` hook); the agent fills in the rest."""

    node_suspect: bool
    suspect_evidence: str
    can_evict: bool
    node_offences: int
    repeat_offender_limit: int
    replicas_intact: bool
    jit_available: bool
    offending_here: bool
    step_completed: bool | None
    newest_step: int | None


@dataclasses.dataclass(frozen=True)
class FailureSignature:
    """What makes two failures the same: class, exception type and the innermost frame of the
    user's code (the innermost frame when there is none)."""

    failure_class: FailureClass
    exception: str
    frame: str

    @classmethod
    def of(cls, failure: FailureRecord) -> FailureSignature | None:
        """The signature of ``failure``, or None when it cannot repeat in this sense: no
        exception and frame to compare, or a class whose cause lies outside the code (a
        communication fault, a stop request) and may clear by itself."""
        frame = failure.user_frame or failure.location
        if failure.exception is None or frame is None or \
                failure.failure_class not in _REPEATABLE:
            return None
        return cls(failure.failure_class, failure.exception, frame)

    def to_json(self) -> dict[str, str]:
        return {"failure_class": self.failure_class.value, "exception": self.exception,
                "frame": self.frame}


_REPEATABLE = frozenset({FailureClass.USER_CODE, FailureClass.ELASTICFT, FailureClass.UNKNOWN})
"""Classes whose repetition before the first step stops the run (user code only when
--restart-on-user-error grants it a restart)."""


# When several ranks fail together, the root cause is the most specific class: a user bug in one
# rank makes its peers fail with connection errors, not the other way round.
_ROOT_CAUSE_ORDER = (
    FailureClass.USER_CODE,
    FailureClass.SIGNAL_CRASH,
    FailureClass.ELASTICFT,
    FailureClass.HANG,
    FailureClass.SLOW,
    FailureClass.NUMERIC,
    FailureClass.INFRASTRUCTURE,
    FailureClass.STOP_REQUESTED,
    FailureClass.UNKNOWN,
)


# A collective's report that its peer went away: the peer's failure caused it, so within one
# class it ranks after any other failure (gloo's pair, NCCL's remote-error wording).
_PEER_GONE = re.compile(r"gloo/transport|pair\.cc|remote worker|remote process exited|"
                        r"NCCL.*remote", re.IGNORECASE)


def reports_a_peer_gone(failure: FailureRecord) -> bool:
    """Whether the failure is a collective's report that a peer went away (pure)."""
    return bool(failure.message and _PEER_GONE.search(failure.message))


def root_cause(failures: tuple[FailureRecord, ...]) -> FailureRecord:
    """The failure that most likely caused the others: the most specific class; within it, one
    that is not a collective's report of a peer gone; then the lowest rank. The order does not
    depend on which of them the agent happened to see first."""
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    return min(failures, key=lambda f: (_ROOT_CAUSE_ORDER.index(f.failure_class),
                                        reports_a_peer_gone(f), f.rank))


def is_node_offence(failure: FailureRecord) -> bool:
    """Whether ``failure`` counts against the node its rank ran on.

    A crash by signal (SIGKILL from the OOM killer, SIGSEGV, SIGBUS), a hang whose culprit this
    node's monitor named, a rank that stayed slower than its peers (the detector compares ranks
    of the same job, so the node is the odd one out), and a device error do; a user bug, a stop
    request, and a connection error (the usual echo of another rank's death) do not.
    """
    cls = failure.failure_class
    if cls is FailureClass.SIGNAL_CRASH or cls is FailureClass.SLOW:
        return True
    if cls is FailureClass.HANG:
        return "culprit: rank" in (failure.message or "")
    if cls is FailureClass.INFRASTRUCTURE:  # a device error, not a connection's
        return device_evidence(f"{failure.exception or ''} {failure.message or ''}")
    return False


def replicas_intact(
    world_size: int, lost_ranks: Iterable[int], layout: tuple[int, int, int] | None = None
) -> bool:
    """Whether every data-parallel shard still has a rank outside ``lost_ranks`` holding it.

    ``layout`` is (tp, pp, dp) with tensor parallel fastest, then data, then pipeline (the rank
    order :mod:`elasticft.ckpt.backup.peer` uses); None is pure data parallelism (every rank holds
    the whole model). A layout that does not match ``world_size`` is treated as having no replicas.
    """
    lost = {r for r in lost_ranks if 0 <= r < world_size}
    if world_size <= 0:
        return False
    tp, pp, dp = layout if layout is not None else (1, 1, world_size)
    if tp * pp * dp != world_size:
        return False
    for pp_index in range(pp):
        for tp_index in range(tp):
            holders = {pp_index * tp * dp + dp_index * tp + tp_index for dp_index in range(dp)}
            if holders <= lost:
                return False
    return True


def checkpoint_source(facts: FailureFacts,
                      kind: ActionKind = ActionKind.RESTART_IN_PLACE) -> CheckpointSource:
    """Just in time when a healthy replica of every shard can be asked, else the snapshot.

    Never just in time after a divergence: the replicas' weights hold the NaN too (DDP averaged
    it into every rank's gradients). Never for an in-process recovery (``kind``) on one node,
    or of another node's failure: the survivors keep their state and restore their own newest
    snapshot after the copy in flight, so there is nothing to ask them for.
    """
    if facts.failures and root_cause(facts.failures).failure_class is FailureClass.NUMERIC:
        return CheckpointSource.SNAPSHOT
    if kind is ActionKind.RECOVER_IN_PROCESS and (facts.nodes <= 1 or not facts.offending_here):
        return CheckpointSource.SNAPSHOT
    if facts.replicas_intact and facts.jit_available:
        return CheckpointSource.JIT
    return CheckpointSource.SNAPSHOT


def suspect_reason(facts: FailureFacts) -> str | None:
    """Why this node is suspect hardware, or None when it is not."""
    if facts.node_suspect:
        return facts.suspect_evidence or "failed health check"
    if 0 < facts.repeat_offender_limit <= facts.node_offences:
        return (f"repeat offender ({facts.node_offences} failures caused by its ranks, limit "
                f"{facts.repeat_offender_limit})")
    return None


IN_PROCESS_CLASSES = frozenset({FailureClass.SIGNAL_CRASH, FailureClass.HANG,
                                FailureClass.INFRASTRUCTURE, FailureClass.UNKNOWN})
"""Failures a replacement process repairs: not a bug (it would fail again), not a divergence
(every replica holds the NaN), not a stop request, not a slow rank (it would stay slow)."""


def in_process_repeat(facts: FailureFacts) -> str | None:
    """Why another in-process recovery would burn a restart on the same fault, or None.

    A failure that comes back after an in-process recovery without the job passing the step of
    the failure that recovery answered is not a new surprise: the survivors' state (a callback's,
    a framework's counter, anything the restore does not roll back) may be what brings it back,
    and another roll-back in the same processes would meet it again. A restart of every rank
    starts every process the same way; the run is not left to spend every restart on it.

    Only a hang counts: ranks that wait in different collectives, or one that never reaches
    its next, is what a state the roll-back did not restore makes. A crash by a signal (a
    process killed from outside, a node going) or a communication error (most often the echo of
    a peer's failure) right after the first is a second failure, which the survivors recover
    from in process again."""
    before, now = facts.in_process_failed_at, facts.newest_step
    if before is None or now is None or now > before or not facts.failures \
            or root_cause(facts.failures).failure_class is not FailureClass.HANG:
        return None
    return (f"the failure came again at step {now} after an in-process recovery from a failure "
            f"at step {before}")


def repeated(facts: FailureFacts) -> FailureSignature | None:
    """The signature of this failure when it repeats the previous attempt's, both before their
    first step; None otherwise (also when no step records say whether a step completed)."""
    if facts.step_completed is not False or facts.previous_failure is None or not facts.failures:
        return None
    signature = FailureSignature.of(root_cause(facts.failures))
    return signature if signature == facts.previous_failure else None


BACKOFF_JITTER = 0.25
"""The largest share of a wait the jitter takes off: waits are spread over (75 %, 100 %] of the
nominal one, so the nodes of a job do not retry in step, and each wait stays longer than the
one before while the doubled wait is below the cap (75 % of double is more than the whole)."""


def comm_signature(failure: FailureRecord) -> FailureSignature | None:
    """The signature of a communication fault (class, exception, innermost user frame), or None
    for any other failure."""
    frame = failure.user_frame or failure.location
    if failure.failure_class is not FailureClass.INFRASTRUCTURE or failure.exception is None \
            or frame is None:
        return None
    return FailureSignature(failure.failure_class, failure.exception, frame)


def comm_repeats(previous: FailureSignature | None, previous_repeats: int,
                 signature: FailureSignature | None, step_completed: bool | None) -> int:
    """How many attempts in a row before this one failed with the same communication fault
    before their first step: the count after ``previous_repeats`` once this attempt's
    ``signature`` is known. Any step completed (or unknown), or another fault, resets it."""
    if step_completed is not False or signature is None:
        return 0
    return previous_repeats + 1 if signature == previous else 0


def backoff_delay(repeats: int, first_s: float, max_s: float, jitter: float) -> float:
    """Seconds to wait before restarting after a communication fault repeated ``repeats`` times
    in a row before the first step: 0 for none, then ``first_s`` doubled for each further
    repeat, at most ``max_s``, less up to :data:`BACKOFF_JITTER` of it (``jitter`` in [0, 1))."""
    if repeats < 1 or first_s <= 0 or max_s <= 0:
        return 0.0
    nominal = min(max_s, first_s * 2.0 ** min(repeats - 1, 60))
    return nominal * (1.0 - BACKOFF_JITTER * min(max(jitter, 0.0), 1.0))


def decide(facts: FailureFacts) -> Action:
    action = _decide(facts)
    return dataclasses.replace(action, checkpoint=checkpoint_source(facts, action.kind))


def _decide(facts: FailureFacts) -> Action:
    cause = root_cause(facts.failures)
    what = cause.summary()
    same = repeated(facts) is not None
    if cause.exception in UNRESTARTABLE_EXCEPTIONS:
        return Action(
            ActionKind.STOP,
            f"cannot go on as launched, not restarted (a restart would fail the same way; "
            f"{facts.max_restarts - facts.restarts_used} of --max-restarts {facts.max_restarts} "
            f"left unused): {what}",
            exit_code=1,
            fails_again=True,
        )
    if cause.failure_class is FailureClass.USER_CODE:
        left = facts.restart_on_user_error - facts.user_error_restarts_used
        if left > 0 and same:
            return _repeat_stop(left, "--restart-on-user-error", facts.restart_on_user_error, what)
        if left > 0:
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
            fails_again=True,
        )
    suspect = suspect_reason(facts)
    if suspect is not None and facts.can_evict:
        # Evidence with a name of its own (``sdc: ...``) leads the reason: the blacklist
        # entry carries it.
        said = (f"{suspect}; evicting this node: {what}" if facts.suspect_evidence else
                f"this node is suspect hardware ({suspect}), evicting it: {what}")
        return Action(ActionKind.EVICT_NODE, said, exit_code=1)
    if same and facts.restarts_used < facts.max_restarts:
        return _repeat_stop(facts.max_restarts - facts.restarts_used, "--max-restarts",
                            facts.max_restarts, what)
    if facts.restarts_used >= facts.max_restarts:
        return Action(
            ActionKind.STOP,
            f"no restarts left ({facts.restarts_used} of --max-restarts {facts.max_restarts} "
            f"used): {what}",
            exit_code=1,
        )
    again = in_process_repeat(facts)
    if facts.in_process and cause.failure_class in IN_PROCESS_CLASSES and again is None:
        return Action(
            ActionKind.RECOVER_IN_PROCESS,
            f"{cause.failure_class.value}, in-process recovery {facts.restarts_used + 1} of "
            f"--max-restarts {facts.max_restarts}: {what}",
        )
    wait = 0.0
    if cause.failure_class is FailureClass.INFRASTRUCTURE:
        wait = backoff_delay(facts.comm_repeats, facts.backoff_first_s, facts.backoff_max_s,
                             facts.jitter)
    waiting = (f" after a wait of {wait:.2f} s (the same communication fault before the first "
               f"step {facts.comm_repeats + 1} times in a row: time for its cause to clear)"
               if wait > 0 else "")
    if facts.in_process and cause.failure_class in IN_PROCESS_CLASSES and again is not None:
        waiting = f" of every rank, not in process ({again}){waiting}"
    return Action(
        ActionKind.RESTART_IN_PLACE,
        f"{cause.failure_class.value}, restart {facts.restarts_used + 1} of "
        f"--max-restarts {facts.max_restarts}{waiting}: {what}",
        wait_s=wait,
    )


def _repeat_stop(left: int, flag: str, budget: int, what: str) -> Action:
    return Action(
        ActionKind.STOP,
        f"the same failure before the first step of two attempts in a row, not restarted (a "
        f"restart would fail the same way; {left} of {flag} {budget} left unused): {what}",
        exit_code=1,
        fails_again=True,
    )


Change = Literal["join", "reshape", "leaver"]
"""A change of membership under running workers: nodes wait to join the running group (a
standby came back); a new rendezvous round gives this node's running workers other ranks or
another world (a reshape); a survivor exited while its recovery's new group was still forming
(a leaver)."""


@dataclasses.dataclass(frozen=True)
class ChangeFacts:
    """What the agent knows when the membership changes under running workers."""

    change: Change
    what: str
    """The change in words (``2 node(s) waiting``, the ranks before and after, who left)."""
    in_process: bool
    """The workers can absorb it in their processes: for a join, every worker is armed and
    follows a layout change with no recovery under way; for a reshape, the new layout holds
    every survivor's state; for a leaver, its replacement can still join the forming group."""
    why_not: str = ""
    """Why they cannot (when ``in_process`` is False); for a reshape, the layouts' verdict
    either way."""


def decide_change(facts: ChangeFacts) -> Action:
    """A regroup in process, or a restart, for a change of membership (pure). Neither spends a
    restart: a join or a reshape is no failure, and a leaver's replacement belongs to the
    recovery already counted. A leaver that cannot be replaced is a failure of that recovery:
    the answer is a restart, which the failure decision (:func:`decide`) then counts, or
    turns into a stop."""
    if facts.change == "join":
        if facts.in_process:
            return Action(ActionKind.REGROUP_IN_PROCESS,
                          f"membership change: {facts.what}; the workers regroup in process "
                          "with the new node(s)", counted=False)
        return Action(ActionKind.RESTART_IN_PLACE,
                      f"membership change: {facts.what}"
                      + (f"; no regroup in process ({facts.why_not})" if facts.why_not else ""),
                      counted=False)
    if facts.change == "reshape":
        if facts.in_process:
            return Action(ActionKind.REGROUP_IN_PROCESS,
                          f"reshape in process: {facts.what}: {facts.why_not}", counted=False)
        return Action(ActionKind.RESTART_IN_PLACE,
                      f"{facts.what}: they restart ({facts.why_not})", counted=False)
    if facts.in_process:
        return Action(ActionKind.REGROUP_IN_PROCESS,
                      f"{facts.what}; its replacement joins the same generation", counted=False)
    return Action(ActionKind.RESTART_IN_PLACE,
                  f"{facts.what}; no replacement in the same generation ({facts.why_not}): "
                  "a failure of the recovery under way")


@dataclasses.dataclass(frozen=True)
class DepartedNode:
    """A node of the previous round that is not in the new one."""

    node_id: str
    alive: bool
    """Its agent still holds its membership record (it is alive and only late)."""
    blacklisted: bool
    """Already on the blacklist (it evicted itself, or an operator put it there) or in this
    job's quarantine."""


@dataclasses.dataclass(frozen=True)
class Eviction:
    node_id: str
    reason: str


def judge_departed(departed: Iterable[DepartedNode], previous_round: int) -> tuple[Eviction, ...]:
    """The leader's verdict on nodes that left: one that vanished (its agent's membership lease
    ended: dead, or cut off from the job) is quarantined in the job; one that is alive and only
    late, or already blacklisted or quarantined, is not."""
    return tuple(
        Eviction(node.node_id,
                 f"node disappeared: in round {previous_round}, then no keep-alive and no "
                 "membership record (agent dead or unreachable)")
        for node in sorted(departed, key=lambda n: n.node_id)
        if not node.alive and not node.blacklisted
    )
