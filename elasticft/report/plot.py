"""The run's timeline as a PNG: progress and step rate over time, phases shaded, failures marked.

Top: the reference rank's step number against time (a rollback shows as the line dropping back);
bottom: steps per second of each step against the healthy rate. Both share the time axis,
seconds since the run started, with the TOR phases shaded behind them.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from elasticft.report.tor import Analysis

COLORS = {
    "healthy": "#d9f2d9",
    "slow_steps": "#fff2b3",
    "slow_recovery": "#ffd480",
    "checkpoint_stall": "#b3d9ff",
    "detection": "#ff9999",
    "repair": "#ff6666",
    "rollback": "#d9b3ff",
    "startup": "#e0e0e0",
    "shutdown": "#f0f0f0",
    "queued": "#ffffff",
}
# Phases worth shading; healthy and slow steps are the background.
SHADED = ("checkpoint_stall", "detection", "repair", "rollback", "startup", "slow_recovery",
          "shutdown", "queued")


def plot_timeline(a: Analysis, out: Path, title: str | None = None) -> Path:
    """Draws the timeline to ``out``; :class:`elasticft.extras.MissingExtra` without
    matplotlib."""
    import matplotlib.pyplot as plt

    fig = draw_timeline(a, title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def draw_timeline(a: Analysis, title: str | None = None) -> Any:
    """The timeline's matplotlib figure: its time axis spans the whole run, from the launch to
    the end of the shutdown."""
    from elasticft import extras

    (matplotlib,) = extras.require(extras.MATPLOTLIB, "the report's timeline plot", "report")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = a.start
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    used = set()
    for span in a.spans:
        if span.phase not in SHADED:
            continue
        used.add(span.phase)
        for axis in (top, bottom):
            axis.axvspan(span.start - t0, span.end - t0, facecolor=COLORS[span.phase], lw=0,
                         zorder=0, hatch="//" if span.phase == "queued" else None,
                         edgecolor="#bbbbbb")
    # Break the line where the run stopped (a restart, a requeue): no work happened there.
    gap = 10 * a.healthy_step_s
    times: list[float] = []
    step_numbers: list[float] = []
    for i, r in enumerate(a.steps):
        if i and (r.time - a.steps[i - 1].time > gap or r.step <= a.steps[i - 1].step):
            times.append(float("nan"))
            step_numbers.append(float("nan"))
        times.append(r.time - t0)
        step_numbers.append(r.step)
    top.plot(times, step_numbers, ".-", color="#1f4e79", ms=3, lw=1,
             label=f"step (rank {a.reference_rank})")
    rates_t, rates = [], []
    for prev, cur in itertools.pairwise(a.steps):
        dt = cur.time - prev.time
        if cur.step == prev.step + 1 and 0 < dt <= gap:
            rates_t.append(cur.time - t0)
            rates.append(1.0 / dt)
    bottom.plot(rates_t, rates, ".", color="#1f4e79", ms=3, label="steps/s")
    if a.healthy_step_s > 0:
        bottom.axhline(1.0 / a.healthy_step_s, color="#2e7d32", ls="--", lw=1,
                       label=f"healthy {1.0 / a.healthy_step_s:.2f} steps/s")
    for i, fault in enumerate(a.faults, 1):
        for axis in (top, bottom):
            axis.axvline(fault.time - t0, color="#c62828", lw=1.2)
        top.annotate(f"failure {i}: {fault.failure_class}", (fault.time - t0, a.last_step),
                     rotation=90, va="top", ha="right", fontsize=8, color="#c62828")
    bottom.set_ylim(bottom=0)
    bottom.set_xlim(0, a.end - t0)  # the whole run, its start-up and shutdown included
    top.set_ylabel("step")
    bottom.set_ylabel("steps / s")
    bottom.set_xlabel("seconds since the run started")
    top.set_title(title or (
        f"run {a.run_id}: TOR {a.tor:.3f}, ETTR {a.ettr:.3f}, {len(a.faults)} failure(s), "
        f"healthy step {a.healthy_step_s * 1000:.0f} ms"))
    handles = [Patch(facecolor=COLORS[p], edgecolor="#bbbbbb", hatch="//" if p == "queued"
                     else None, label=p.replace("_", " ") + (" (not counted)" if p == "queued"
                                                              else ""))
               for p in SHADED if p in used]
    top.legend(handles=top.get_legend_handles_labels()[0] + handles, loc="upper left",
               fontsize=8)
    bottom.legend(loc="lower right", fontsize=8)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    fig.tight_layout()
    return fig
