"""The detectors: pure functions from what the rings and the node show to findings.

Nothing here reads a clock, a file or a process; :mod:`elasticft.diag.hangcheck` gathers the
facts (:class:`RankView`, one rank as the monitor and the other nodes see it) and
:mod:`elasticft.diag.monitor` calls these, so every rule is unit-tested with made-up facts.

* **Hang**: not decided here. :func:`elasticft.diag.verdict.judge` alone weighs each rank's
  evidence into frozen, stuck, working or healthy and names the culprits (process states,
  positions per communicator, stack outliers); see docs/hang-detection.md.
* **Slow rank** (TRANSOM's neighbour comparison, made robust): each rank's *busy* time per step
  (step time minus time spent in collectives) against the median of its peers.
* **Loss**: NaN/inf, or a value ``spike_factor`` times the recent median (ByteRobust's x5).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence


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
