"""The what-if model (Eq. 4 of the TOR paper, with a checkpoint interval) against simulated
runs."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from elasticft.cli import main as cli_main
from elasticft.report import whatif
from elasticft.report.whatif import Scenario


@dataclasses.dataclass(frozen=True)
class SimResult:
    tor: float
    failures: int
    observed_s: float


def simulate(
    s: Scenario, interval_s: float, work_s: float, *, seed: int = 0, runs: int = 1
) -> SimResult:
    """Trains ``work_s`` seconds of useful work under random failures; returns the mean TOR.

    Failures arrive as a Poisson process in running time (repair excluded, as MTBF is in the
    model). A failure loses everything since the last completed checkpoint (a failure during a
    checkpoint loses that checkpoint too), costs ``recovery_s``, and is followed by
    ``slow_recovery_s`` of running at ``slow_recovery_ratio`` speed.
    """
    rng = random.Random(seed)
    r = s.slow_recovery_ratio
    total_obs, total_failures = 0.0, 0
    for _ in range(runs):
        observed, committed, failures, slow_left = 0.0, 0.0, 0, 0.0
        next_failure = rng.expovariate(1.0 / s.mtbf_s)
        while committed < work_s:
            chunk = min(interval_s, work_s - committed)
            # Wall time for `chunk` of work: slow while slow_left lasts, then full speed.
            slow_capacity = slow_left * r
            if slow_left <= 0:
                wall = chunk
            elif chunk <= slow_capacity:
                wall = chunk / r
            else:
                wall = slow_left + (chunk - slow_capacity)
            if committed + chunk < work_s:
                wall += s.ckpt_cost_s  # the last chunk needs no checkpoint
            if next_failure < wall:
                observed += next_failure + s.recovery_s
                failures += 1
                slow_left = s.slow_recovery_s
                next_failure = rng.expovariate(1.0 / s.mtbf_s)
                continue
            next_failure -= wall
            observed += wall
            committed += chunk
            slow_left = max(slow_left - wall, 0.0)
        total_obs += observed
        total_failures += failures
    return SimResult(tor=runs * work_s / total_obs, failures=total_failures, observed_s=total_obs)


SCENARIOS = [
    Scenario(mtbf_s=3600, ckpt_cost_s=60, recovery_s=300),
    Scenario(mtbf_s=3600, ckpt_cost_s=30, recovery_s=120, slow_recovery_s=600,
             slow_recovery_ratio=0.5),
    Scenario(mtbf_s=1000, ckpt_cost_s=5, recovery_s=20),
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_predicted_tor_agrees_with_simulation(scenario):
    best = whatif.optimal_interval(scenario)
    for interval in (best / 3, best / 2, best):
        predicted = whatif.predicted_tor(scenario, interval)
        simulated = simulate(scenario, interval, work_s=scenario.mtbf_s * 150, seed=7,
                                    runs=4).tor
        # The closed form takes the rollback as half a period and the checkpoints of the
        # lost work as paid; exact for small interval/MTBF, 1-3% pessimistic here.
        assert abs(predicted - simulated) / simulated < 0.035, (interval, predicted, simulated)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_optimal_interval_is_the_simulated_optimum(scenario):
    best = whatif.optimal_interval(scenario)
    grid = [best * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)]
    simulated = {t: simulate(scenario, t, work_s=scenario.mtbf_s * 150, seed=3,
                                    runs=4).tor for t in grid}
    assert simulated[best] >= 0.99 * max(simulated.values()), simulated
    # ... and it is clearly better than checkpointing 4x too often or too rarely.
    assert simulated[best] > simulated[grid[0]] and simulated[best] > simulated[grid[-1]]
    # Young's and Daly's intervals sit next to it when checkpoints are cheap.
    assert whatif.young_interval(scenario) == pytest.approx(best + scenario.ckpt_cost_s)
    assert whatif.daly_interval(scenario) == pytest.approx(best, rel=0.1)


def test_no_failure_cost_limits():
    s = Scenario(mtbf_s=1e9, ckpt_cost_s=0.0, recovery_s=0.0)
    assert whatif.predicted_tor(s, 100.0) == pytest.approx(1.0, abs=1e-6)
    assert simulate(s, 100.0, work_s=10_000).tor == pytest.approx(1.0)
    with pytest.raises(ValueError, match="MTBF"):
        Scenario(mtbf_s=0, ckpt_cost_s=1, recovery_s=1)


def test_what_if_cli(capsys):
    args = ["report", "--what-if", "--mtbf", "3600", "--ckpt-cost", "30", "--recovery", "120"]
    assert cli_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    s = Scenario(3600, 30, 120)
    assert data["optimal_interval_s"] == pytest.approx(whatif.optimal_interval(s))
    assert data["predicted_tor"] == pytest.approx(whatif.predicted_tor(s, data["interval_s"]))
    assert cli_main([*args, "--interval", "60", "--lost-work", "10"]) == 0
    assert "predicted TOR" in capsys.readouterr().out
    assert cli_main(["report", "--what-if", "--mtbf", "10"]) == 2
    assert "--ckpt-cost" in capsys.readouterr().err
