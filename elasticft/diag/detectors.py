"""The detectors: pure functions from what the rings and the node show to findings.

Nothing here reads a clock, a file or a process; :mod:`elasticft.diag.hangcheck` gathers the
facts (:class:`RankView`) and :mod:`elasticft.diag.monitor` calls these, so every rule is
unit-tested with made-up facts.

* **Hang**: not decided here. :func:`elasticft.diag.verdict.judge` weighs each rank's evidence
  (process state, CPU use, heartbeat, in-flight call, GPU completions) into frozen, stuck,
  working or healthy; see docs/hang-detection.md. :class:`HangFinding` and :class:`Culprit`
  describe the hang it found in the event.
* **Culprits** (the ranks others wait for, when the verdict names none): a rank whose process
  is stopped or whose recorder stopped beating; a rank that never reached the collective its
  peers wait in (its count of calls on that communicator is behind theirs); stack outliers
  (ByteRobust's aggregation: the majority stack is healthy, the rest are suspects, with the
  parallel group they share).
* **Slow rank** (TRANSOM's neighbour comparison, made robust): each rank's *busy* time per step
  (step time minus time spent in collectives) against the median of its peers.
* **Loss**: NaN/inf, or a value ``spike_factor`` times the recent median (ByteRobust's x5).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence

from elasticft.procs import STOPPED_STATES


def percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    index = min(len(ordered) - 1, max(0, math.ceil(pct / 100.0 * len(ordered)) - 1))
    return ordered[index]


@dataclasses.dataclass(frozen=True)
class InFlight:
    """The oldest unfinished call of a rank on one communicator."""

    op: str
    comm: int
    comm_seq: int
    age_s: float
    source: str


@dataclasses.dataclass(frozen=True)
class RankView:
    """What the monitor knows about one rank at one instant."""

    rank: int
    node: str
    pid: int | None = None
    process_state: str | None = None
    """The kernel's state letter from /proc/<pid>/stat (R, S, D, T, Z...), None if unknown."""
    heartbeat_age_s: float | None = None
    in_flight: tuple[InFlight, ...] = ()
    comm_seqs: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Communicator key -> number of the newest call this rank entered on it."""
    steps: int = 0
    step_age_s: float = 0.0
    """Seconds since the last step mark (or since the recorder started, before the first)."""
    view_age_s: float = 0.0
    """How old these facts are: 0 for this node's ranks, the age of the summary another node
    published for its ranks (:mod:`elasticft.diag.exchange`). The ages above are as measured
    then."""


@dataclasses.dataclass(frozen=True)
class Culprit:
    rank: int
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class HangFinding:
    ranks_waiting: tuple[int, ...]
    what: str
    """e.g. 'all_reduce on comm 1a2b #41 in flight 7.3 s (timeout 5.0 s)'."""
    waited_s: float
    timeout_s: float


def localise(views: Sequence[RankView], heartbeat_stale_s: float) -> list[Culprit]:
    """The ranks the others wait for; empty when the evidence names nobody."""
    culprits: dict[int, Culprit] = {}
    for view in views:
        if view.process_state in STOPPED_STATES:
            culprits[view.rank] = Culprit(
                view.rank, view.node, f"process {view.pid} is in state {view.process_state} "
                "(stopped or dead) while its peers wait")
        elif view.heartbeat_age_s is not None and view.heartbeat_age_s > heartbeat_stale_s:
            culprits[view.rank] = Culprit(
                view.rank, view.node, f"its recorder has not run for {view.heartbeat_age_s:.1f} s "
                "(process frozen or holding the GIL)")
    # Ranks that never reached the call their peers wait in, communicator by communicator.
    members: dict[int, list[RankView]] = {}
    for view in views:
        for comm in view.comm_seqs:
            members.setdefault(comm, []).append(view)
    for view in views:
        for call in view.in_flight:
            if call.comm_seq <= 0:
                continue
            for peer in members.get(call.comm, ()):
                if peer.rank in culprits or peer.rank == view.rank:
                    continue
                if peer.view_age_s >= call.age_s:
                    continue  # facts from before this wait began say nothing about it
                reached = peer.comm_seqs.get(call.comm, 0)
                if reached < call.comm_seq:
                    culprits[peer.rank] = Culprit(
                        peer.rank, peer.node,
                        f"never reached {call.op} #{call.comm_seq} on comm {call.comm:x} that "
                        f"rank {view.rank} waits in (its last call there is #{reached})")
    return sorted(culprits.values(), key=lambda c: c.rank)


# -- stacks ------------------------------------------------------------------------------------

_LINE_NO = re.compile(r":\d+\)")


def stack_signature(dump: str, line_numbers: bool = False) -> str:
    """The main thread's frames from a ``py-spy dump``, without line numbers unless asked.

    The main thread is the one named "MainThread", else the first one listed. An empty
    signature means no stack could be read. With line numbers two samples of the same process
    tell whether its Python is moving.
    """
    blocks: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            blocks.append((line, []))
        elif blocks and line.startswith(" ") and line.strip():
            frame = line.strip()
            blocks[-1][1].append(frame if line_numbers else _LINE_NO.sub(")", frame))
    if not blocks:
        return ""
    main = next((b for b in blocks if '"MainThread"' in b[0]), blocks[0])
    return "\n".join(main[1])


@dataclasses.dataclass(frozen=True)
class StackGroups:
    healthy: tuple[int, ...]
    outliers: Mapping[int, str]
    """Rank -> its innermost frame (or why there is none), for ranks unlike the majority."""
    shared_comm: int | None
    """The smallest communicator all outliers belong to (the parallel group to isolate)."""


def group_stacks(signatures: Mapping[int, str], views: Sequence[RankView] = ()) -> StackGroups:
    """ByteRobust's aggregation: identical stacks form groups; the largest is taken as healthy.

    A rank whose stack could not be read (empty signature) is always an outlier; other ranks are
    outliers only when one group is strictly larger than every other.
    """
    groups: dict[str, list[int]] = {}
    for rank, signature in signatures.items():
        if signature:
            groups.setdefault(signature, []).append(rank)
    outliers = {r: "<no Python stack could be read>" for r, s in signatures.items() if not s}
    healthy: tuple[int, ...] = ()
    if groups:
        sizes = sorted((len(r) for r in groups.values()), reverse=True)
        majority = max(groups.values(), key=len)
        if len(sizes) == 1 or sizes[0] > sizes[1]:
            healthy = tuple(sorted(majority))
            for signature, ranks in groups.items():
                if ranks is not majority:
                    top = signature.splitlines()[0]
                    outliers.update({rank: top for rank in ranks})
    by_rank = {v.rank: v for v in views}
    common: set[int] | None = None
    for rank in outliers:
        comms = set(by_rank[rank].comm_seqs) if rank in by_rank else set()
        common = comms if common is None else common & comms
    shared = None
    if common:
        members = {c: sum(1 for v in views if c in v.comm_seqs) for c in common}
        shared = min(members, key=lambda c: (members[c], c))
    return StackGroups(healthy, outliers, shared)


# -- slow ranks --------------------------------------------------------------------------------


def busy_time(step_start_ns: int, step_end_ns: int,
              comm_spans: Iterable[tuple[int, int]]) -> float:
    """Seconds of one step not spent inside collectives (overlapping spans counted once)."""
    spans = sorted((max(s, step_start_ns), min(e, step_end_ns)) for s, e in comm_spans)
    waited, cursor = 0, step_start_ns
    for start, end in spans:
        start = max(start, cursor)
        if end > start:
            waited += end - start
            cursor = end
    return max(0.0, (step_end_ns - step_start_ns - waited) / 1e9)


@dataclasses.dataclass(frozen=True)
class SlowRank:
    rank: int
    busy_s: float
    peers_median_s: float
    ratio: float


def find_slow(busy: Mapping[int, float], ratio: float, min_excess_s: float) -> list[SlowRank]:
    """Ranks whose busy time exceeds ``ratio`` x the median of the others (needs >= 2 ranks)."""
    slow = []
    for rank, value in busy.items():
        others = [v for r, v in busy.items() if r != rank]
        if not others:
            continue
        median = statistics.median(others)
        if value > ratio * median and value - median > min_excess_s:
            slow.append(SlowRank(rank, value, median, value / median if median > 0 else math.inf))
    return sorted(slow, key=lambda s: -s.ratio)


@dataclasses.dataclass(frozen=True)
class BusyStats:
    """The middle of the job's busy times, for a view that lists only some ranks' values.

    ``window`` holds the sorted values at positions ``offset`` .. ``offset + len(window) - 1``
    of all ``count`` values: enough to compute the median of all values but one, whichever.
    """

    count: int
    offset: int
    window: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> BusyStats:
        ordered = sorted(values)
        count = len(ordered)
        low, high = max(0, (count - 2) // 2), min(count - 1, (count - 1) // 2 + 1)
        return cls(count, low, tuple(ordered[low:high + 1]))

    def median_without(self, value: float) -> float | None:
        """The median of all values but one copy of ``value`` (None when no other is left).

        Exact when ``value`` is one of them; else within one position of it.
        """
        remaining = self.count - 1
        if remaining <= 0 or not self.window:
            return None

        def at(position: int) -> float:
            index = min(max(position - self.offset, 0), len(self.window) - 1)
            return self.window[index]

        def kept(j: int) -> float:  # the j-th smallest value once ``value`` is removed
            return at(j) if at(j) < value else at(j + 1)

        return (kept((remaining - 1) // 2) + kept(remaining // 2)) / 2


def find_slow_among(busy: Mapping[int, float], stats: BusyStats, ratio: float,
                    min_excess_s: float) -> list[SlowRank]:
    """:func:`find_slow` for the ranks in ``busy``, each against the median of all the job's
    other ranks (``stats``), when only some ranks' values are at hand."""
    slow = []
    for rank, value in busy.items():
        median = stats.median_without(value)
        if median is None:
            continue
        if value > ratio * median and value - median > min_excess_s:
            slow.append(SlowRank(rank, value, median, value / median if median > 0 else math.inf))
    return sorted(slow, key=lambda s: -s.ratio)


# -- loss --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossFinding:
    kind: str
    """'nan' (NaN or inf) or 'spike'."""
    value: float
    baseline: float
    message: str


def check_loss(history: Sequence[float], spike_factor: float, min_history: int = 5
               ) -> LossFinding | None:
    """Looks at the newest loss against the ones before it."""
    if not history:
        return None
    value = history[-1]
    if not math.isfinite(value):
        return LossFinding("nan", value, math.nan, f"loss is {value}")
    previous = [v for v in history[:-1] if math.isfinite(v)]
    if len(previous) < min_history:
        return None
    baseline = statistics.median(previous)
    if baseline > 0 and value > spike_factor * baseline:
        return LossFinding("spike", value, baseline,
                           f"loss {value:.4g} is {value / baseline:.1f}x the recent median "
                           f"{baseline:.4g} (threshold x{spike_factor:g})")
    return None


# -- logs --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LogBurst:
    errors_in_window: int
    window_s: float
    first_node: str
    first_line: str
