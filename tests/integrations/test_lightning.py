"""Lightning's ``trainer.fit`` recovered in process (``InProcessDDPStrategy``) under a real
``elasticft-run``: rank 1 SIGKILLed mid-training, rank 0 keeps its process, and the run ends
with an uninterrupted run's steps and parameters, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.jobs import assert_recovered_in_process, run_job

pytest.importorskip("lightning")

SCRIPT = "train_lightning_inprocess.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    reference = run_job(tmp_path, SCRIPT, "reference", job_env)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "4",
                  "--checkpoint-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    assert "Lightning entry 2 resumes from step 3" in run["text"]
    # Lightning's own checkpoints are written through the recovery as without it.
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == [
        "epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt",
        "epoch=1-step=9.ckpt"]
