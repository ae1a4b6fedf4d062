"""The hang verdict: evidence about every rank weighed into frozen, stuck, working or healthy.

One clock cannot tell a hang from a pause: a stopped process is certain within a second, while a
rank computing for a minute outside any collective (an evaluation pass, a slow ``torch.save`` on
rank 0) is only busy. :func:`judge` is a pure function from a :class:`JobSnapshot` (each rank's
process state, CPU use, heartbeat, in-flight collectives and position on each communicator, GPU
completion progress, py-spy stacks when sampled, and the recent durations of collectives) to a
:class:`HangVerdict` that names the culprits and the evidence behind them. It is the only place that
judges a hang: the monitor gathers the evidence and acts on the verdict.

* **frozen**: a rank stopped (T), exited (Z, gone), or uninterruptible (D) using no CPU, with a
  stale heartbeat, while its peers wait in a collective: a hang at once.
* **working**: peers wait for a rank that is alive outside collectives (its CPU time advancing,
  its stack changing, its GPU kernels completing, or simply its recorder beating): never a hang
  until the generous ceiling (torch's process-group timeout by default).
* **stuck**: every rank is inside a collective and nothing progresses (no CPU in the waiting
  calls, no NCCL end event reached): a hang after ``max(floor, multiple x percentile)`` of the
  recent collective durations, or after the start-up timeout before that history exists.
* **healthy**: nobody waits, or a wait is still within its timeout.

A stuck job's culprits are, in this order of trust: ranks whose process stopped or exited, or
whose recorder stopped beating; ranks that never reached the call a peer waits in (their position
on its communicator is behind); else the ranks whose stack differs from the majority's
(ByteRobust's aggregation, :func:`group_stacks`). With none of these, no rank is named.

A rank that progresses but slower than its peers is the slow-rank detector's
(:func:`elasticft.diag.detectors.find_slow`), never a restart from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

from elasticft.diag.detectors import percentile
from elasticft.procs import (
    EXITED_STATES,
    STOPPED_STATES,
    UNINTERRUPTIBLE_STATE,
    UNRESPONSIVE_STATES,
)

Kind = Literal["healthy", "working", "frozen", "stuck", "busy_too_long"]


@dataclasses.dataclass(frozen=True)
class Call:
    """A rank's oldest unfinished collective."""

    op: str
    comm: int
    comm_seq: int
    age_s: float
    source: Literal["py", "nccl"] = "py"
    """py: a gloo/Python-side call (blocks the main thread); nccl: enqueued on a GPU stream, its
    end event not reached yet."""


@dataclasses.dataclass(frozen=True)
class RankEvidence:
    """What is known about one rank at one instant; None means not measured."""

    rank: int
    state: str | None
    """The kernel's state letter (R, S, D, T, Z); None when no process has the pid any more."""
    heartbeat_age_s: float | None = None
    cpu_fraction: float | None = None
    """CPU seconds per wall second over the last second or so (every thread of the process)."""
    stack_changed: bool | None = None
    gpu_completing: bool | None = None
    """An NCCL call of this rank reached its end event recently; None without a GPU ring."""
    call: Call | None = None
    stack_top: str = ""
    """The innermost frame of the main thread, when sampled (for ``elasticft status``)."""
    step_age_s: float | None = None
    """Seconds since this rank last completed a step (None before its first)."""
    in_flight: tuple[Call, ...] = ()
    """The oldest unfinished call on each communicator, which peers' positions are checked
    against; empty means just ``call`` (the oldest of all)."""
    comm_positions: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Communicator key -> number of the newest call this rank entered on it."""
    facts_age_s: float = 0.0
    """How old these facts are (another node's published view); a position older than a wait
    says nothing about it."""
    stack: str | None = None
    """The main thread's frames (:func:`elasticft.diag.stacks.stack_signature`) when py-spy was
    run: '' when it could not read them, None when not sampled."""


@dataclasses.dataclass(frozen=True)
class HangLimits:
    """The verdict's thresholds. Their values are the ``hang_*`` options' (defaults included:
    :func:`elasticft.diag.hangcheck.hang_limits` makes them), stated nowhere else."""

    heartbeat_stale_s: float
    """Seconds without a recorder heartbeat after which a rank's process counts as frozen."""
    busy_ceiling_s: float
    """Seconds peers may wait for ranks that are alive and busy before they count as hung."""
    collective_floor_s: float
    """The learned collective timeout's least value, in seconds."""
    multiple: float
    """The learned collective timeout is this multiple of ``percentile`` of recent durations."""
    percentile: float
    min_samples: int
    """Durations needed before the learned timeout replaces ``startup_s``."""
    startup_s: float
    """Seconds a collective may take before ``min_samples`` durations exist (first compile,
    warm-up)."""
    busy_cpu_fraction: float = 0.1
    """CPU use above this (of one core) is progress; the recorder's beat uses far less."""


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    ranks: tuple[RankEvidence, ...]
    collective_history: Sequence[float] = ()
    """Recent durations (seconds) of completed collectives."""


@dataclasses.dataclass(frozen=True)
class StackGroups:
    """The sampled ranks' stacks grouped (ByteRobust): the majority is taken as healthy."""

    healthy: tuple[int, ...]
    outliers: Mapping[int, str]
    """Rank -> its innermost frame (or why there is none), for ranks unlike the majority."""
    shared_comm: int | None
    """The smallest communicator all outliers belong to (the parallel group to isolate)."""
    unreadable: tuple[int, ...] = ()
    """Ranks whose stack py-spy could not read."""

    def to_json(self) -> dict[str, object]:
        return {"healthy": list(self.healthy),
                "outliers": {str(r): f for r, f in self.outliers.items()},
                "shared_comm": f"{self.shared_comm:x}" if self.shared_comm else None,
                "unreadable": list(self.unreadable)}


@dataclasses.dataclass(frozen=True)
class HangVerdict:
    """What :func:`judge` found: the kind of wait, whether it is a hang, who caused it, who waits
    on them, and the evidence for each rank."""

    kind: Kind
    hang: bool
    culprits: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    what: str = ""
    waited_s: float = 0.0
    timeout_s: float | None = None
    evidence: dict[int, str] = dataclasses.field(default_factory=dict)
    """Rank -> the facts that decided its part in the verdict."""
    stacks: StackGroups | None = None
    """The sampled stacks, grouped; None when none were sampled."""
    named_by_stacks: bool = False
    """The culprits are named by their stacks alone (unlike the majority's): the weakest
    evidence, which another node's newer facts may still overrule."""

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "hang": self.hang, "culprits": list(self.culprits),
                "waiting": list(self.waiting), "what": self.what,
                "waited_s": round(self.waited_s, 3),
                "timeout_s": None if self.timeout_s is None else round(self.timeout_s, 3),
                "evidence": {str(r): e for r, e in sorted(self.evidence.items())}}


def collective_timeout(history: Sequence[float], limits: HangLimits) -> float:
    """``max(floor, multiple x percentile)`` once enough durations exist, else the start-up one."""
    if len(history) < limits.min_samples:
        return limits.startup_s
    return max(limits.collective_floor_s,
               limits.multiple * percentile(history, limits.percentile))


def _describe(r: RankEvidence) -> str:
    parts = [f"state {r.state or 'gone'}"]
    if r.heartbeat_age_s is not None:
        parts.append(f"heartbeat {r.heartbeat_age_s:.1f} s old")
    if r.cpu_fraction is not None:
        parts.append(f"CPU {100 * r.cpu_fraction:.0f}%")
    if r.stack_changed is not None:
        parts.append("stack changing" if r.stack_changed else "stack unchanged")
    if r.gpu_completing is not None:
        parts.append("GPU kernels completing" if r.gpu_completing else "no GPU completion")
    if r.call is not None:
        parts.append(f"in {r.call.op} #{r.call.comm_seq} on comm {r.call.comm:x} for "
                     f"{r.call.age_s:.1f} s ({r.call.source})")
    else:
        parts.append("outside collectives")
    top = r.stack_top or (r.stack.splitlines()[0] if r.stack else "")
    if top:
        parts.append(f"at {top}")
    elif r.stack == "":
        parts.append("stack unreadable")
    return ", ".join(parts)


def frozen_reason(r: RankEvidence, limits: HangLimits) -> str | None:
    """Why this rank cannot be making progress, or None when it may be."""
    stale = r.heartbeat_age_s is None or r.heartbeat_age_s > limits.heartbeat_stale_s
    if r.state is None:
        return "its process is gone"
    if r.state in EXITED_STATES:
        return f"its process has exited (state {r.state})"
    if r.state in STOPPED_STATES and stale:
        return f"its process is stopped (state {r.state})"
    no_cpu = r.cpu_fraction is not None and r.cpu_fraction < limits.busy_cpu_fraction
    if r.state == UNINTERRUPTIBLE_STATE and stale and no_cpu:
        return "its process is in uninterruptible sleep (D) using no CPU"
    return None


def progressing(r: RankEvidence, limits: HangLimits) -> bool:
    """Positive evidence of work: CPU time, a changing stack, or GPU kernels completing.

    A call on a GPU stream says nothing through the CPU (a host waiting on the stream spins),
    so there only the NCCL end events count.
    """
    if r.gpu_completing:
        return True
    if r.call is not None and r.call.source == "nccl":
        return False
    return bool(r.stack_changed) or (r.cpu_fraction is not None
                                     and r.cpu_fraction >= limits.busy_cpu_fraction)


def group_stacks(signatures: Mapping[int, str],
                 comms_of: Mapping[int, Collection[int]] | None = None) -> StackGroups:
    """ByteRobust's aggregation: identical stacks form groups; the largest is taken as healthy.

    A rank whose stack could not be read (empty signature) is an outlier when others could be
    read; other ranks are outliers only when one group is strictly larger than every other.
    When no stack could be read at all (no py-spy, no permission) the stacks say nothing.
    ``comms_of`` (rank -> its communicators) finds the group the outliers share.
    """
    comms_of = comms_of or {}
    groups: dict[str, list[int]] = {}
    for rank, signature in signatures.items():
        if signature:
            groups.setdefault(signature, []).append(rank)
    unreadable = tuple(sorted(r for r, s in signatures.items() if not s))
    if not groups:
        return StackGroups((), {}, None, unreadable)
    outliers = {r: "<no Python stack could be read>" for r in unreadable}
    healthy: tuple[int, ...] = ()
    sizes = sorted((len(r) for r in groups.values()), reverse=True)
    majority = max(groups.values(), key=len)
    if len(sizes) == 1 or sizes[0] > sizes[1]:
        healthy = tuple(sorted(majority))
        for signature, ranks in groups.items():
            if ranks is not majority:
                top = signature.splitlines()[0]
                outliers.update({rank: top for rank in ranks})
    common: set[int] | None = None
    for rank in outliers:
        comms = set(comms_of.get(rank, ()))
        common = comms if common is None else common & comms
    shared = None
    if common:
        members = {c: sum(1 for comms in comms_of.values() if c in comms) for c in common}
        shared = min(members, key=lambda c: (members[c], c))
    return StackGroups(healthy, outliers, shared, unreadable)


def _calls(r: RankEvidence) -> tuple[Call, ...]:
    return r.in_flight or ((r.call,) if r.call is not None else ())


def stuck_culprits(ranks: Sequence[RankEvidence], limits: HangLimits) -> dict[int, str]:
    """Rank -> why it is a culprit of a stuck job by its process, its recorder or its position
    on a communicator; empty when these name nobody (the stacks may then: :func:`judge`)."""
    culprits: dict[int, str] = {}
    for r in ranks:
        if r.state in UNRESPONSIVE_STATES:
            culprits[r.rank] = (f"its process is in state {r.state} (stopped or exited) while "
                                "its peers wait")
        elif r.heartbeat_age_s is not None and r.heartbeat_age_s > limits.heartbeat_stale_s:
            culprits[r.rank] = (f"its recorder has not run for {r.heartbeat_age_s:.1f} s "
                                "(process frozen or holding the GIL)")
    # Ranks that never reached the call their peers wait in, communicator by communicator.
    members: dict[int, list[RankEvidence]] = {}
    for r in ranks:
        for comm in r.comm_positions:
            members.setdefault(comm, []).append(r)
    for r in ranks:
        for call in _calls(r):
            if call.comm_seq <= 0:
                continue
            for peer in members.get(call.comm, ()):
                if peer.rank in culprits or peer.rank == r.rank:
                    continue
                if peer.facts_age_s >= call.age_s:
                    continue  # facts from before this wait began say nothing about it
                reached = peer.comm_positions.get(call.comm, 0)
                if reached < call.comm_seq:
                    culprits[peer.rank] = (
                        f"never reached {call.op} #{call.comm_seq} on comm {call.comm:x} that "
                        f"rank {r.rank} waits in (its last call there is #{reached})")
    return dict(sorted(culprits.items()))


def judge(snapshot: JobSnapshot, limits: HangLimits) -> HangVerdict:
    """The verdict on the job as it stands; ``hang`` is true only when it should be recovered."""
    sampled = {r.rank: r.stack for r in snapshot.ranks if r.stack is not None}
    stacks = None
    if sampled:
        stacks = group_stacks(sampled, {r.rank: r.comm_positions.keys() for r in snapshot.ranks
                                        if r.rank in sampled})
    judged = _weigh(snapshot, limits, stacks)
    return dataclasses.replace(judged, stacks=stacks) if stacks is not None else judged


def stacks_wanted(snapshot: JobSnapshot, limits: HangLimits) -> frozenset[int]:
    """The ranks whose py-spy stacks are worth sampling before :func:`judge`: those taking part
    in a hang the cheaper evidence finds (its culprits and the ranks that wait), where a moving
    stack shows work and an outlier's stack names a culprit. Empty when it finds no hang: a
    healthy or working job is never sampled."""
    if not any(r.call is not None or frozen_reason(r, limits) for r in snapshot.ranks):
        return frozenset()  # nobody waits and nobody is frozen: no hang (the common case)
    cheap = _weigh(snapshot, limits, None, describe=lambda _: "")  # no words: only who
    return frozenset((*cheap.culprits, *cheap.waiting)) if cheap.hang else frozenset()


def _weigh(snapshot: JobSnapshot, limits: HangLimits, stacks: StackGroups | None,
           describe: Callable[[RankEvidence], str] = _describe) -> HangVerdict:
    ranks = snapshot.ranks
    evidence = {r.rank: describe(r) for r in ranks}
    waiting = tuple(sorted(r.rank for r in ranks if r.call is not None))
    frozen = {r.rank: why for r in ranks if (why := frozen_reason(r, limits)) is not None}
    # Peers blocked outside recorded collectives (a checkpoint barrier, a store wait) show it
    # by completing no step since the rank froze. Only for a process that is still there: at
    # the end of a run ranks exit one by one, and the agent sees an exit itself.
    stalled = [r.rank for r in ranks if r.rank not in frozen and r.call is None
               and r.step_age_s is not None and r.step_age_s > limits.heartbeat_stale_s]
    held = {rank: why for rank, why in frozen.items()
            if next(r for r in ranks if r.rank == rank).state not in (None, *EXITED_STATES)}
    if held and stalled and len(frozen) < len(ranks):
        for rank, why in held.items():
            evidence[rank] = f"{why}; {evidence[rank]}"
        what = "; ".join(f"rank {rank} frozen: {why}" for rank, why in sorted(held.items()))
        return HangVerdict("frozen", True, tuple(sorted(held)), tuple(stalled),
                       f"{what}; ranks {stalled} completed no step for more than "
                       f"{limits.heartbeat_stale_s:g} s", 0.0, limits.heartbeat_stale_s,
                       evidence)
    if not waiting:
        return HangVerdict("healthy", False, evidence=evidence)
    longest = max((r for r in ranks if r.call is not None), key=lambda r: r.call.age_s)  # type: ignore[union-attr]
    assert longest.call is not None
    waited = longest.call.age_s
    # Peers must already wait (past the heartbeat's staleness) for a frozen rank to matter: at
    # the end of a run ranks exit one by one, and the last may still finish a call.
    waited_on_frozen = [r.rank for r in ranks
                        if r.call is not None and r.rank not in frozen
                        and r.call.age_s > limits.heartbeat_stale_s]
    if frozen and waited_on_frozen:
        for rank, why in frozen.items():
            evidence[rank] = f"{why}; {evidence[rank]}"
        culprits = tuple(sorted(frozen))
        what = "; ".join(f"rank {rank} frozen: {why}" for rank, why in sorted(frozen.items()))
        return HangVerdict("frozen", True, culprits, tuple(waited_on_frozen),
                       f"{what}; ranks {list(waited_on_frozen)} wait in "
                       f"{longest.call.op} for {waited:.1f} s", waited,
                       limits.heartbeat_stale_s, evidence)
    outside = [r for r in ranks if r.call is None and r.rank not in frozen]
    if outside:
        # Peers wait for ranks that are alive and outside collectives: busy, not hung.
        names = ", ".join(f"rank {r.rank} ({evidence[r.rank]})" for r in outside)
        culprits = tuple(r.rank for r in outside)
        if waited > limits.busy_ceiling_s:
            return HangVerdict("busy_too_long", True, culprits, waiting,
                           f"ranks {list(waiting)} waited {waited:.1f} s (ceiling "
                           f"{limits.busy_ceiling_s:.0f} s) for {names}", waited,
                           limits.busy_ceiling_s, evidence)
        return HangVerdict("working", False, culprits, waiting,
                       f"ranks {list(waiting)} wait for {names}", waited,
                       limits.busy_ceiling_s, evidence)
    # Every live rank is inside a collective.
    moving = [r for r in ranks if r.call is not None and progressing(r, limits)]
    timeout = collective_timeout(snapshot.collective_history, limits)
    if moving:
        names = ", ".join(f"rank {r.rank} ({evidence[r.rank]})" for r in moving)
        if waited > limits.busy_ceiling_s:
            return HangVerdict("busy_too_long", True, tuple(r.rank for r in moving), waiting,
                           f"collectives in flight {waited:.1f} s (ceiling "
                           f"{limits.busy_ceiling_s:.0f} s) while {names} progress", waited,
                           limits.busy_ceiling_s, evidence)
        return HangVerdict("working", False, tuple(r.rank for r in moving), waiting,
                       f"every rank is in a collective, {names} still progressing", waited,
                       limits.busy_ceiling_s, evidence)
    calls = {(r.call.comm, r.call.comm_seq) for r in ranks if r.call is not None}
    same = "the same collective" if len(calls) == 1 else f"{len(calls)} different collectives"
    basis = (f"{limits.multiple:g} x p{limits.percentile:g} of {len(snapshot.collective_history)}"
             f" recent durations, floor {limits.collective_floor_s:g} s"
             if len(snapshot.collective_history) >= limits.min_samples
             else "start-up timeout, no history yet")
    what = (f"every rank in {same}, nothing completing: {longest.call.op} "
            f"#{longest.call.comm_seq} on comm {longest.call.comm:x} in flight {waited:.1f} s "
            f"(timeout {timeout:.1f} s: {basis})")
    if waited <= timeout:
        return HangVerdict("healthy", False, (), waiting, what, waited, timeout, evidence)
    culprits = stuck_culprits(ranks, limits)
    named_by_stacks = not culprits and stacks is not None and bool(stacks.outliers)
    if named_by_stacks:
        # The weakest evidence, used alone: a rank elsewhere than the majority.
        assert stacks is not None
        culprits = {rank: f"stack differs from the majority: {frame}"
                    for rank, frame in sorted(stacks.outliers.items())}
    for rank, why in culprits.items():
        evidence[rank] = f"{why}; {evidence[rank]}"
    return HangVerdict("stuck", True, tuple(culprits), waiting, what, waited, timeout, evidence,
                   named_by_stacks=named_by_stacks)
