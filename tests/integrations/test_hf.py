"""The Hugging Face Trainer's ``train()`` recovered in process (``elasticft.integrations.hf
.train``) under a real ``elasticft-run``: rank 1 SIGKILLed mid-training, rank 0 keeps its
process, and the run ends with an uninterrupted run's steps and parameters, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.jobs import assert_recovered_in_process, needs_modules, run_job

pytestmark = needs_modules("hf", "transformers", "accelerate")

SCRIPT = "train_hf_inprocess.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_costs_the_survivor_a_rollback_not_its_process(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    reference = run_job(tmp_path, SCRIPT, "reference", job_env)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "5", "--save-steps", "3",
                  "--output-dir", str(tmp_path / "own"))
    assert_recovered_in_process(run, reference)
    assert "Trainer entry 2 resumes from step 4" in run["text"]
    # The Trainer's own checkpoints are written through the recovery as without it.
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == [
        "checkpoint-12", "checkpoint-3", "checkpoint-6", "checkpoint-9"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_before_the_first_snapshot_rolls_the_survivor_back_to_the_start(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    """Killed after its first optimizer step, before that step's snapshot: the survivor's model
    had taken the step, and only the start's snapshot (step 0) puts it back."""
    reference = run_job(tmp_path, SCRIPT, "reference", job_env)
    run = run_job(tmp_path, SCRIPT, "fault", job_env, "--crash-at-step", "1")
    assert_recovered_in_process(run, reference)
    assert "resumed from step 0 in shared memory" in run["text"], run["text"][-5000:]
    assert "entry 2 resumes" not in run["text"]
