"""The what-if model (seeds/003 Eq. 4 with a checkpoint interval) against simulated runs."""

from __future__ import annotations

import json

import pytest

from elasticft.cli import main as cli_main
from elasticft.report import whatif
from elasticft.report.whatif import Scenario

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
        simulated = whatif.simulate(scenario, interval, work_s=scenario.mtbf_s * 150, seed=7,
                                    runs=4).tor
        # The closed form takes the rollback as half a period and the checkpoints of the
        # lost work as paid; exact for small interval/MTBF, 1-3% pessimistic here.
        assert abs(predicted - simulated) / simulated < 0.035, (interval, predicted, simulated)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_optimal_interval_is_the_simulated_optimum(scenario):
    best = whatif.optimal_interval(scenario)
    grid = [best * f for f in (0.25, 0.4, 0.6, 0.8, 1.0, 1.25, 1.6, 2.5, 4.0)]
    simulated = {t: whatif.simulate(scenario, t, work_s=scenario.mtbf_s * 150, seed=3,
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
    assert whatif.simulate(s, 100.0, work_s=10_000).tor == pytest.approx(1.0)
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
