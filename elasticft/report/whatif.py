"""What-if: the TOR a system would get, and the checkpoint interval that maximises it.

The fail-stop equation of the TOR paper (Lu et al., "Training Overhead Ratio: A Practical
Reliability Metric for Large Language Model Training Systems", Eq. 4), for one failure-repair
period::

    TOR = (MTBF - T_sr (1 - R_sr) - T_rb - N_ckpt T_ckpt) / (MTBF + T_r)

MTBF is the running time between failures (repair excluded), ``T_ckpt`` the stall of one
checkpoint, ``T_r`` the repair (detection, restart, reload), ``T_sr``/``R_sr`` a slow recovery
phase and its relative speed, ``T_rb`` the work lost to the rollback. With a checkpoint every
``tau`` seconds of training, a period holds ``N_ckpt = MTBF / (tau + T_ckpt)`` checkpoints and a
failure, uniform in time, loses ``T_rb = (tau + T_ckpt) / 2`` on average. Setting
``dTOR/dtau = 0`` gives ``tau + T_ckpt = sqrt(2 MTBF T_ckpt)``: Young's interval (1974). Daly's
higher-order estimate (2006) is printed beside it; both assume ``T_ckpt << MTBF``.

The tests play the same model out with exponentially distributed failures to check where the
closed form holds (``tests/report/test_whatif.py``).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A system's failure and recovery figures, in the equation's terms."""

    mtbf_s: float
    """``MTBF``: seconds of running between failures, repair excluded."""
    ckpt_cost_s: float
    """``T_ckpt``: seconds training stalls for one checkpoint."""
    recovery_s: float
    """``T_r``: seconds of one repair (detection, restart, reload)."""
    slow_recovery_s: float = 0.0
    """``T_sr``: seconds of the slow phase after a repair."""
    slow_recovery_ratio: float = 1.0
    """``R_sr``: the speed during that phase, relative to full speed (0 to 1)."""

    def __post_init__(self) -> None:
        if self.mtbf_s <= 0:
            raise ValueError(f"MTBF {self.mtbf_s!r} must be positive; give seconds, e.g. 3600")
        if self.ckpt_cost_s < 0 or self.recovery_s < 0 or self.slow_recovery_s < 0:
            raise ValueError("checkpoint cost, recovery and slow recovery must be >= 0 seconds")
        if not 0.0 <= self.slow_recovery_ratio <= 1.0:
            raise ValueError(
                f"slow recovery ratio {self.slow_recovery_ratio!r} must be within [0, 1]"
            )


def lost_work(interval_s: float, ckpt_cost_s: float) -> float:
    """Expected rollback of a failure uniform in time: half a checkpoint period."""
    return (interval_s + ckpt_cost_s) / 2.0


def predicted_tor(s: Scenario, interval_s: float, lost_work_s: float | None = None) -> float:
    """Eq. 4 with ``N_ckpt`` and (unless given) ``T_rb`` from the checkpoint interval."""
    if interval_s <= 0:
        raise ValueError(f"checkpoint interval {interval_s!r} must be positive seconds")
    n_ckpt = s.mtbf_s / (interval_s + s.ckpt_cost_s)
    t_rb = lost_work(interval_s, s.ckpt_cost_s) if lost_work_s is None else lost_work_s
    useful = (s.mtbf_s - s.slow_recovery_s * (1 - s.slow_recovery_ratio) - t_rb
              - n_ckpt * s.ckpt_cost_s)
    return max(useful, 0.0) / (s.mtbf_s + s.recovery_s)


def optimal_interval(s: Scenario) -> float:
    """The interval maximising :func:`predicted_tor` (training seconds between checkpoints)."""
    return max(math.sqrt(2.0 * s.mtbf_s * s.ckpt_cost_s) - s.ckpt_cost_s, 1e-9)


def young_interval(s: Scenario) -> float:
    return math.sqrt(2.0 * s.ckpt_cost_s * s.mtbf_s)


def daly_interval(s: Scenario) -> float:
    """Daly's higher-order optimum (valid for T_ckpt < 2 MTBF; MTBF beyond)."""
    c, m = s.ckpt_cost_s, s.mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
